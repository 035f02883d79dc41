"""The service's handlers in-process: state + request in, replies + effects out; no socket, no thread.

A real two-tensor checkpoint is loaded through the loader's own code (run in
the test's thread) into a host slab; attach replies are decoded and mapped,
and their bytes compared with the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest
import torch

from daemon_helpers import Clock, close_slabs
from checkpoints import compare_bytes, read_checkpoint, write_checkpoint
from weightcache import identity, protocol
from weightcache.config import AccountNames
from weightcache.config import ModelConfig, Placement
from weightcache.daemon import access, handlers, load_results, loads
from weightcache.daemon.effects import Context, FreeSlab, Outcome, Refuse, StartLoad, StartVerify
from weightcache.daemon.state import IllegalTransition, Peer, ServiceState, SlotEvent
from weightcache.wire import SlotState
from weightcache.reader import LoaderOptions
from weightcache.manifest import _file as manifest_module
from weightcache.manifest import build_views
from weightcache.manifest import unpack_file
from weightcache.memory.host import HostBackend
from weightcache.spec import DTYPE_NAMES

TENSORS = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.arange(5, dtype=torch.int64)}


#: A uid and gid that is neither root, nor the service, nor on any allow list.
STRANGER = 54321


@pytest.fixture
def svc(tmp_path):
    """A service state with model ``m`` (open) and ``locked`` (allow list without us), and a load runner."""
    ck = write_checkpoint(tmp_path / "ck", TENSORS)
    backend = HostBackend()
    models = [ModelConfig("m", str(ck)), ModelConfig("locked", str(ck), allow_users=("nobody-here",))]
    st = ServiceState(0, "host", backend.device_info(), [Placement(m, 1, 0, 0) for m in models],
                      service_uid=os.getuid() + 1)
    clock = Clock()
    ctx = Context(st, lambda: (111, 222), monotonic=clock, wall=lambda: 1.7e9, pid=4242)
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    loader = loads.Loader(loads.LoadSettings(backend, st.device, 60.0, LoaderOptions(threads=1), "test.toml"), w)

    def load(slot):
        final = loader._supervise(slot)  # the loader thread's body, run here
        for result in loader.results() + [final]:
            load_results.apply(st, result)

    yield ctx, st, load, backend, ck, clock
    close_slabs(st)
    os.close(r)
    os.close(w)


def _error(out) -> protocol.Error:
    (reply,) = out.replies
    assert isinstance(reply.msg, protocol.Error), reply
    return reply.msg


def _views(backend, reply):
    slab_fd, manifest_fd = reply.fds
    assert os.fstat(manifest_fd).st_size == reply.msg.manifest_size_bytes
    fields, manifest = unpack_file(os.pread(manifest_fd, reply.msg.manifest_size_bytes, 0))
    placement = Placement.from_json(fields.pop("placement"))  # what a service with a broken config serves it as
    assert (placement.model.path, placement.tp_size, placement.tp_rank) == (reply.msg.checkpoint_path, 1, 0)
    assert fields == {"format": "weightcache-manifest-1", "backend": "host", "size_bytes": os.fstat(slab_fd).st_size,
                      "checkpoint_path": reply.msg.checkpoint_path, "dtypes_served": ["auto", "float32"]}
    imported = backend.import_fd(slab_fd, manifest.slab_size_bytes)
    return build_views(imported.tensor, manifest)


def test_hello_version(svc):
    ctx, *_ = svc
    (reply,) = handlers.handle(ctx, Peer(1, 2, 3), protocol.Hello(protocol.PROTOCOL_VERSION)).replies
    assert (reply.msg.protocol_version, reply.msg.backend, reply.fds) == (protocol.PROTOCOL_VERSION, "host", ())
    out = handlers.handle(ctx, Peer(1, 2, 3), protocol.Hello(protocol.PROTOCOL_VERSION + 1))
    assert out.replies == () and isinstance(out.effects[0], Refuse)
    assert out.effects[0].error.code == "protocol_violation"


def test_attach_loading_parks_then_answers_with_the_bytes(svc):
    ctx, st, load, backend, ck, clock = svc
    peer = Peer(10, os.getuid(), os.getgid())
    (reply,) = handlers.handle(ctx, peer, protocol.Attach("m")).replies
    assert reply.msg == protocol.Loading("m", 0, 0, "pending")
    assert handlers.handle(ctx, peer, protocol.Attach("m", wait_ms=5000)) == Outcome()
    assert len(peer.waiting) == 1 and handlers.service_waiting(ctx, peer).replies == ()
    load(st.slots[0])
    assert st.slots[0].state is SlotState.READY and st.loads_done == 1
    (reply,) = handlers.service_waiting(ctx, peer).replies
    assert isinstance(reply.msg, protocol.AttachReply)
    assert reply.fds == (st.slots[0].sealed.fd, st.slots[0].manifest_file.fd)
    assert peer.waiting == [] and list(peer.leases) == [reply.msg.lease_id]
    assert st.slots[0].leases[reply.msg.lease_id].pid == 10
    compare_bytes(_views(backend, reply), read_checkpoint(ck))


def test_parked_attach_times_out_with_loading(svc):
    ctx, st, load, *_, clock = svc
    peer = Peer(10, os.getuid(), os.getgid())
    handlers.handle(ctx, peer, protocol.Attach("m", wait_ms=1000))
    clock.t += 1.5
    (reply,) = handlers.service_waiting(ctx, peer).replies
    assert reply.msg == protocol.Loading("m", 0, 0, "pending") and peer.waiting == []


def test_failed_load_answers_model_load_failed_with_cause(svc, tmp_path):
    ctx, st, load, *_ = svc
    os.remove(tmp_path / "ck" / "model.safetensors")
    load(st.slots[0])
    assert st.slots[0].state is SlotState.FAILED
    err = _error(handlers.handle(ctx, Peer(1, os.getuid(), 0), protocol.Attach("m")))
    assert err.code == "model_load_failed" and err.details["cause"] == st.slots[0].error.code


def test_attach_dtype_is_matched_from_the_plan_without_reading_headers(svc, monkeypatch):
    """No header is read on the serving loop (issue 25, attack 4): before a slot is planned, an attach with a
    dtype is "not planned yet" (``loading``, or parked with wait_ms); the plan's figures then answer it (here
    model_not_found for bfloat16, which this float32 checkpoint does not give) and every later attach."""
    ctx, st, load, backend, ck, clock = svc
    slot, locked = st.slots  # both configured auto on one checkpoint whose cast tensor is stored float32
    peer = Peer(10, os.getuid(), os.getgid())

    def no_header(*a, **k):
        raise AssertionError("the serving loop read a checkpoint header")

    monkeypatch.setattr(identity, "Checkpoint", no_header)
    (reply,) = handlers.handle(ctx, peer, protocol.Attach("m", dtype="bfloat16")).replies
    assert isinstance(reply.msg, protocol.Loading) and reply.msg.state == "pending"  # not planned yet
    assert handlers.handle(ctx, peer, protocol.Attach("m", dtype="bfloat16", wait_ms=60_000)).replies == ()
    assert locked.dtype_served == {} and len(peer.waiting) == 1
    monkeypatch.undo()
    load(slot)
    expected = {r: identity.dtype_matches(slot.placement, r) for r in DTYPE_NAMES}
    assert slot.dtype_served == expected == {"auto": True, "bfloat16": False, "float16": False, "float32": True}
    monkeypatch.setattr(identity, "Checkpoint", no_header)
    (parked,) = handlers.service_waiting(ctx, peer).replies
    assert (parked.msg.code, parked.msg.details["dtype"]) == ("model_not_found", "bfloat16")
    for _ in range(2):  # by name: by path, the unplanned ``locked`` (same checkpoint) would match provisionally
        assert _error(handlers.handle(ctx, peer, protocol.Attach("m", dtype="bfloat16"))).code == "model_not_found"
    (reply,) = handlers.handle(ctx, peer, protocol.Attach("m", dtype="float32")).replies
    assert isinstance(reply.msg, protocol.AttachReply)
    compare_bytes(_views(backend, reply), read_checkpoint(ck))


def test_access_denied_off_the_allow_list(svc):
    ctx, *_ = svc
    err = _error(handlers.handle(ctx, Peer(1, STRANGER, STRANGER), protocol.Attach("locked")))
    assert (err.code, err.details["model"]) == ("access_denied", "locked")


def test_release_status_evict_preload(svc):
    ctx, st, load, backend, ck, clock = svc
    peer = Peer(10, os.getuid(), os.getgid())
    load(st.slots[0])
    (att,) = handlers.handle(ctx, peer, protocol.Attach("m", mode="copy")).replies
    lease_id = att.msg.lease_id

    status = handlers.handle(ctx, peer, protocol.Status()).replies[0].msg.typed()
    m = status.slabs[0]
    assert (status.pid, status.free_bytes, status.total_bytes, m.state, m.tensors) == (4242, 111, 222, "ready", 2)
    assert m.leases == (protocol.LeaseInfo(lease_id, 10, os.getuid(), os.getgid(), 1.7e9, "copy"),)
    assert protocol.ServiceStatus.from_json(status.to_json()) == status

    assert _error(handlers.handle(ctx, peer, protocol.Evict("m"))).code == "lease_busy"
    assert _error(handlers.handle(ctx, peer, protocol.Release(lease_id + 1))).code == "protocol_violation"
    (rel,) = handlers.handle(ctx, peer, protocol.Release(lease_id)).replies
    assert rel.msg == protocol.ReleaseReply(lease_id) and not peer.leases and not st.slots[0].leases

    sealed, mf = st.slots[0].sealed, st.slots[0].manifest_file
    out = handlers.handle(ctx, peer, protocol.Evict("m"))
    assert out.replies[0].msg == protocol.EvictReply(["m/tp1/rank0"])
    assert out.effects == (FreeSlab(st.slots[0].store_id, sealed, mf),) and st.slots[0].state is SlotState.EVICTED
    sealed.close()
    mf.close()
    assert _error(handlers.handle(ctx, peer, protocol.Attach("m"))).details["cause"] == "evicted"

    out = handlers.handle(ctx, peer, protocol.Preload("m"))
    assert out.replies[0].msg == protocol.PreloadReply(["m/tp1/rank0"]) and out.effects == (StartLoad(st.slots[0]),)
    assert st.slots[0].state is SlotState.PENDING


def test_evict_of_an_adopted_slab_needs_force(svc):
    """After a restart, leases of engines that attached before it are unknown: evict refuses without --force."""
    ctx, st, load, *_ = svc
    peer = Peer(10, os.getuid(), os.getgid())
    load(st.slots[0])
    st.slots[0].adopted = True  # as Slot.adopt leaves it (the fd-store path)
    err = _error(handlers.handle(ctx, peer, protocol.Evict("m")))
    assert err.code == "lease_busy" and err.details == {"model": "m", "leases": "unknown"}, err
    assert "after the service restarted" in err.message and "--force" in err.message
    assert st.slots[0].state is SlotState.READY
    out = handlers.handle(ctx, peer, protocol.Evict("m", True))
    assert out.replies[0].msg == protocol.EvictReply(["m/tp1/rank0"]) and st.slots[0].state is SlotState.EVICTED
    for e in out.effects:
        e.sealed.close()
        e.manifest_file.close()


def _verify(ctx, peer, model):
    """``verify`` as the loop carries it out: the handler's StartVerify, then verify_reply (on a thread there)."""
    out = handlers.handle(ctx, peer, protocol.Verify(model))
    if out.replies:  # refused before any hashing
        return out
    assert not out.replies and [type(e) for e in out.effects] == [StartVerify]
    return handlers.verify_reply(peer, out.effects[0])


def test_verify_reports_a_changed_tensor(svc):
    """An unchanged slab verifies with no mismatch; once a byte of tensor ``w`` differs from what was loaded (the
    slot's slab swapped for a copy with one bit flipped), verify names ``w`` and only ``w``; a slot not loaded is
    reported in its state, unhashed. (More cases: tests/unit/test_guards_identity.py.)"""
    from weightcache.memory.host import HostWritableSlab

    ctx, st, load, *_ = svc
    slot = st.slots[0]
    load(slot)
    (reply,) = _verify(ctx, Peer(1, 0, 0), "m").replies
    assert [(r.state, r.tensors, r.mismatched) for r in reply.msg.typed()] == [("ready", 2, [])]
    (w,) = [r for r in slot.manifest.tensors if r.name == "w"]
    copy = HostWritableSlab(slot.sealed.size_bytes, "flipped")
    copy.buffer[:] = os.pread(slot.sealed.fd, slot.sealed.size_bytes, 0)
    copy.buffer[w.offset_bytes] ^= 0x80
    slot.sealed.close()
    slot.sealed = copy.seal()
    (reply,) = _verify(ctx, Peer(1, 0, 0), "m").replies
    assert [(r.state, r.tensors, r.mismatched) for r in reply.msg.typed()] == [("ready", 2, ["w"])]
    (reply,) = _verify(ctx, Peer(1, 0, 0), "locked").replies
    assert [(r.state, r.mismatched) for r in reply.msg.typed()] == [("pending", [])]


@pytest.mark.parametrize("request_", [protocol.Evict("m", force=True), protocol.Preload("m"), protocol.Verify("m")])
def test_evict_preload_verify_need_an_operator(svc, request_):
    """A client that may attach ``m`` but is not root, the service user or in operator_groups: access_denied,
    and nothing changes; a member of operator_groups (by its SO_PEERGROUPS gids) is served."""
    ctx, st, load, *_ = svc
    load(st.slots[0])
    err = _error(handlers.handle(ctx, Peer(1, STRANGER, STRANGER), request_))
    assert (err.code, err.details["request"], err.details["uid"]) == ("access_denied", request_.tag(), STRANGER)
    assert st.slots[0].state is SlotState.READY
    ctx.policy = access.Policy(st.service_uid, operator_groups=(str(STRANGER + 1),))
    out = handlers.handle(ctx, Peer(1, STRANGER, STRANGER, groups=(STRANGER + 1,)), request_)
    assert not any(isinstance(r.msg, protocol.Error) for r in out.replies) and (out.replies or out.effects)


def test_operator_off_the_allow_list_is_refused(svc):
    """Being an operator does not open a restricted model: evict of ``locked`` is access_denied."""
    ctx, st, *_ = svc
    ctx.policy = access.Policy(st.service_uid, operator_groups=(str(STRANGER + 1),))
    err = _error(handlers.handle(ctx, Peer(1, STRANGER, STRANGER, groups=(STRANGER + 1,)), protocol.Evict("locked")))
    assert (err.code, err.details["model"]) == ("access_denied", "locked")


def test_status_and_list_show_only_what_the_caller_may_attach(svc):
    """A non-operator sees the open model, other uids' leases without their holders; the locked model, its
    path and leases stay hidden. An operator (here root) sees both slabs and every lease."""
    ctx, st, load, *_ = svc
    load(st.slots[0])
    other = Peer(2, STRANGER + 7, STRANGER + 7)
    handlers.handle(ctx, other, protocol.Attach("m"))
    me = Peer(1, STRANGER, STRANGER)
    mine = handlers.handle(ctx, me, protocol.Attach("m")).replies[0].msg.lease_id
    status = handlers.handle(ctx, me, protocol.Status()).replies[0].msg.typed()
    assert [s.model for s in status.slabs] == ["m"]
    assert sorted((x.lease_id == mine, x.pid, x.uid, x.gid) for x in status.slabs[0].leases) == [
        (False, -1, -1, -1), (True, 1, STRANGER, STRANGER)]  # the other holder is hidden, its lease counted
    listed = handlers.handle(ctx, me, protocol.List()).replies[0].msg.models
    assert [s["model"] for s in listed] == ["m"]
    root = handlers.handle(ctx, Peer(3, 0, 0), protocol.Status()).replies[0].msg.typed()
    assert [(s.model, len(s.leases)) for s in root.slabs] == [("m", 2), ("locked", 0)]


def test_status_prints_a_hidden_holder_as_another_user(svc, capsys):
    """``weightcache status`` of a non-operator: another uid's lease, whose holder the service hid
    (:data:`~weightcache.protocol.HIDDEN_ID`), reads ``held by another user``, not ``pid=-1 uid=-1``; the
    caller's own lease keeps its pid and uid."""
    from weightcache.cli.status import print_status

    ctx, st, load, *_ = svc
    load(st.slots[0])
    theirs = handlers.handle(ctx, Peer(2, STRANGER + 7, STRANGER + 7), protocol.Attach("m")).replies[0].msg.lease_id
    me = Peer(1, STRANGER, STRANGER)
    mine = handlers.handle(ctx, me, protocol.Attach("m")).replies[0].msg.lease_id
    status = handlers.handle(ctx, me, protocol.Status()).replies[0].msg.typed()
    assert protocol.HIDDEN_ID == handlers.HIDDEN_ID == -1
    print_status(status, now=1.7e9)
    leases = [ln.strip() for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("lease ")]
    assert sorted(ln.split(" since ")[0] for ln in leases) == sorted([
        f"lease {theirs}: held by another user mode=zero_copy",
        f"lease {mine}: pid=1 uid={STRANGER} mode=zero_copy"])


def test_model_longer_than_path_max_is_refused_without_resolving(svc, monkeypatch):
    """A 1.2 MB path is a protocol_violation naming the field; os.path.realpath is never called on it."""
    ctx, *_ = svc
    monkeypatch.setattr(os.path, "realpath", lambda p: pytest.fail("realpath of a client string"))
    err = _error(handlers.handle(ctx, Peer(1, 0, 0), protocol.Attach("/a" * 600_000)))
    assert (err.code, err.details["field"]) == ("protocol_violation", "model")
    at_limit = "/" + "a/" * 2047
    assert _error(handlers.handle(ctx, Peer(1, 0, 0), protocol.Attach(at_limit))).code == "model_not_found"


def test_unexpected_exception_is_that_clients_internal_error(svc, monkeypatch, caplog):
    ctx, st, load, *_ = svc
    load(st.slots[0])

    def broken(manifest, slab):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(handlers.pipeline, "verify", broken)
    with caplog.at_level(logging.CRITICAL, logger="weightcache.daemon.handlers"):
        err = _error(_verify(ctx, Peer(1, 0, 0), "m"))
    assert (err.code, err.details["request"]) == ("internal_error", "verify")
    assert any(r.levelno == logging.CRITICAL and "ZeroDivisionError" in r.getMessage() for r in caplog.records)
    assert st.slots[0].state is SlotState.READY  # the service goes on


def test_broken_invariant_is_not_caught(svc, monkeypatch):
    ctx, st, *_ = svc

    def corrupt(ctx, peer, msg):
        st.slots[0].move(SlotEvent.LOADED)  # PENDING has no LOADED move

    monkeypatch.setitem(handlers.HANDLERS, protocol.List, corrupt)
    with pytest.raises(IllegalTransition):
        handlers.handle(ctx, Peer(1, 0, 0), protocol.List())


def test_a_manifest_over_the_limit_fails_the_load_by_name(svc, monkeypatch):
    """A slab no engine could read is never READY: the load fails with manifest_too_large, attaches say so."""
    ctx, st, load, *_ = svc
    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", 100)
    load(st.slots[0])
    slot = st.slots[0]
    assert slot.state is SlotState.FAILED and slot.sealed is None and slot.manifest_file is None
    assert (slot.error.code, slot.error.details["limit_bytes"]) == ("manifest_too_large", 100)
    err = _error(handlers.handle(ctx, Peer(1, os.getuid(), 0), protocol.Attach("m")))
    assert (err.code, err.details["cause"]) == ("model_load_failed", "manifest_too_large")


def test_metrics_shows_the_endpoint_every_slab_with_holders_hidden(svc):
    """The packaged metrics user counts every slab (restricted ones too, as ``restricted-N``: no name, path or
    error of a model it may not attach, issue 25) and sees no lease holder; a plain client's metrics are
    filtered like its status; the endpoint is still no operator."""
    ctx, st, load, *_ = svc
    load(st.slots[0])
    load(st.slots[1])
    holder = Peer(2, 0, 0)  # root may attach the locked model
    handlers.handle(ctx, holder, protocol.Attach("locked"))
    endpoint = Peer(3, STRANGER + 3, STRANGER + 3)
    # The metrics user's uid as resolved where the configuration was read (Config.names), not asked of NSS here.
    ctx.policy = access.Policy(st.service_uid, names=AccountNames(uids={access.METRICS_USER: STRANGER + 3}))
    seen = protocol.ServiceStatus.from_json(
        handlers.handle(ctx, endpoint, protocol.Metrics()).replies[0].msg.status)
    assert [(s.model, [(x.pid, x.uid, x.gid) for x in s.leases]) for s in seen.slabs] == [
        ("m", []), ("restricted-0", [(-1, -1, -1)])]
    assert seen.slabs[1].path == "" and seen.slabs[1].resident_bytes == st.slots[1].sealed.size_bytes
    from weightcache.daemon.metrics import Counters

    ctx.counters = Counters([s.placement for s in st.slots], 0.0)  # counts of both models, the locked one's too
    for s in st.slots:
        ctx.counters.load_settled(s.placement, None)
        ctx.counters.publication_dropped(s.placement, "budget")
    counters = protocol.ServiceCounters.from_json(
        handlers.handle(ctx, endpoint, protocol.Metrics()).replies[0].msg.counters)
    assert "locked" not in json.dumps(counters.to_json()) and "locked" not in json.dumps(seen.to_json())
    assert sorted(d.model for d in counters.publications_dropped) == ["m", "restricted-0"]  # counted, renamed
    assert sorted(x.model for x in counters.loads) == ["m", "restricted-0"]
    mine = protocol.ServiceCounters.from_json(
        handlers.handle(ctx, Peer(4, STRANGER, STRANGER), protocol.Metrics()).replies[0].msg.counters)
    assert [d.model for d in mine.publications_dropped] == ["m"] and [x.model for x in mine.loads] == ["m"]
    plain = protocol.ServiceStatus.from_json(
        handlers.handle(ctx, Peer(4, STRANGER, STRANGER), protocol.Metrics()).replies[0].msg.status)
    assert [s.model for s in plain.slabs] == ["m"]
    assert _error(handlers.handle(ctx, endpoint, protocol.Evict("m"))).code == "access_denied"


def test_every_per_model_counter_table_is_filtered():
    """Each tuple field of the ``metrics`` reply's counters names a model per entry; :func:`handlers._counters_for`
    filters exactly those (a new table left out would show restricted models' names: ``publishes`` once did)."""
    tables = {f.name for f in dataclasses.fields(protocol.ServiceCounters)
              if isinstance(getattr(protocol.ServiceCounters("v", 0.0), f.name), tuple)}
    assert set(handlers.PER_MODEL_COUNTERS) == tables


def test_fd_store_entries_without_the_service_seals_are_not_adopted(svc):
    """Issue 25: an fd-store slab without the seals the service sets (someone else's memfd, writable) is
    dropped, not served; the same bytes with the seals are adopted."""
    from weightcache.daemon.fdstore import FdStore

    ctx, st, load, backend, *_ = svc
    slot = st.slots[0]
    load(slot)
    store = FdStore(backend, st.device)
    fresh = ServiceState(0, "host", st.device, [slot.placement], service_uid=os.getuid() + 1)
    size = os.fstat(slot.sealed.fd).st_size
    unsealed = os.memfd_create("not-ours", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(unsealed, os.pread(slot.sealed.fd, size, 0))
    sid = fresh.slots[0].store_id
    got = store.adopt({f"slab-{sid}": [unsealed], f"manifest-{sid}": [os.dup(slot.manifest_file.fd)]}, fresh.slots)
    assert got == {}  # dropped (and its fds closed)
    got = store.adopt({f"slab-{sid}": [os.dup(slot.sealed.fd)], f"manifest-{sid}": [os.dup(slot.manifest_file.fd)]},
                      fresh.slots)
    assert list(got) == fresh.slots
    adopted = got[fresh.slots[0]]
    adopted.sealed.close()
    adopted.manifest_file.close()


def test_a_parked_attach_is_checked_against_the_allow_lists_again(svc):
    """Issue 25: an attach parked while its model loads, whose peer a reload then took off the allow list, is
    answered access_denied, not with the slab."""
    ctx, st, load, *_ = svc
    slot = st.slots[0]
    peer = Peer(10, STRANGER, STRANGER)
    assert handlers.handle(ctx, peer, protocol.Attach("m", wait_ms=60_000)).replies == ()  # parked
    slot.placement = dataclasses.replace(slot.placement, model=dataclasses.replace(
        slot.placement.model, allow_users=("nobody-here",)))  # what reload.apply does to a kept slot
    load(slot)
    (reply,) = handlers.service_waiting(ctx, peer).replies
    assert reply.msg.code == "access_denied" and not peer.leases


def test_an_attach_records_who_received_a_slab_that_keeps_receivers(svc):
    """Issue 38, P2 on CUDA: a slab with ``receivers`` (the cuda backend's) learns the pid of every attach reply
    that carries its fd; once freed it counts until they have exited (tiers.HeldByReceivers)."""
    ctx, st, load, *_ = svc
    load(st.slots[0])
    st.slots[0].sealed.receivers = set()  # as CudaSealedSlab has; the host slab has none (inotify does its part)
    for pid in (10, 11, 10):
        (reply,) = handlers.handle(ctx, Peer(pid, os.getuid(), os.getgid()), protocol.Attach("m")).replies
        assert isinstance(reply.msg, protocol.AttachReply)
    assert st.slots[0].sealed.receivers == {10, 11}
    err = _error(handlers.handle(ctx, Peer(12, STRANGER, STRANGER), protocol.Attach("locked")))
    assert err.code in ("access_denied", "model_not_found") and st.slots[0].sealed.receivers == {10, 11}
