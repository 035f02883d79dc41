"""``publish`` and ``attach_published`` in-process (issue 35): the handlers with real memfds, no socket.

A publisher's memfd and manifest file are made by hand (the client's packing is tested in
tests/integration/test_publish.py); the handler seals the memfd, records digests, keys the slab by the engine's
fields plus the checkpoint identity computed from the files, and keeps it as a slot; identical publications end
in one slab; trust decides who may publish and whose publication an engine attaches.
"""

from __future__ import annotations

import fcntl
import mmap
import os

import pytest
import torch

from daemon_helpers import Clock, close_slabs
from checkpoints import write_checkpoint
from weightcache import digest, identity, protocol
from weightcache.config import AccountNames, ModelConfig, Placement
from weightcache.daemon import access, handlers, publish
from weightcache.daemon.effects import Context, StoreSlab
from weightcache.daemon.state import Peer, ServiceState
from weightcache.manifest import Manifest, TensorRecord, pack_file, read_file
from weightcache.memory.host import F_GET_SEALS, SLAB_SEALS, HostBackend, HostSealedSlab, sealed_memfd
from weightcache.wire import SlotState

#: Neither root nor the service: an ordinary engine's uid.
ENGINE = 54321
OTHER = 54322
KEY = {"engine": "e", "engine_version": "1", "architecture": "A", "dtype": "float32",
       "quantization": {"method": "", "config_blake2b": ""},
       "parallel": {"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "dp_size": 1, "dp_rank": 0,
                    "ep_size": 1, "ep_rank": 0},
       "draft": "", "kernels": {}, "compute_capability": ""}
#: What the engine processed: 16 float32 (a [4, 4] weight at 0, its transpose at 0, a bias at 256).
BYTES = torch.cat([torch.arange(16, dtype=torch.float32), torch.zeros(48), torch.arange(4, dtype=torch.float32)])


@pytest.fixture
def svc(tmp_path):
    ck = write_checkpoint(tmp_path / "ck", {"w": torch.ones(2, 2)})
    models = [ModelConfig("m", str(ck)), ModelConfig("strict", str(ck), publishers=(str(ENGINE),))]
    st = ServiceState(0, "host", HostBackend().device_info(), [Placement(m, 1, 0, 0) for m in models],
                      service_uid=os.getuid() + 1)
    ctx = Context(st, lambda: (1 << 30, 1 << 30), monotonic=Clock(), wall=lambda: 1.7e9, pid=1,
                  policy=access.Policy(st.service_uid, (), AccountNames()),
                  adopt_publication=HostBackend().adopt_publication)
    yield ctx, st, ck
    close_slabs(st)


def _memfd(mapped: bool = False):
    fd = os.memfd_create("pub", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, BYTES.numpy().tobytes())
    os.ftruncate(fd, 4096)
    mm = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) if mapped else None
    return fd, mm


def _manifest_fd() -> tuple[int, int]:
    recs = [TensorRecord("w", "F32", (4, 4), (4, 1), 0, 64), TensorRecord("w_t", "F32", (4, 4), (1, 4), 0, 64),
            TensorRecord("b", "F32", (4,), (1,), 256, 16), TensorRecord("tied", "F32", (4,), (1,), 256, 16,
                                                                        alias_of="b")]
    data = pack_file(Manifest("m", 1, 0, {}, 272, recs))
    return sealed_memfd(data, "man"), len(data)


def _finish(ctx, peer, out, pending: bool = True):
    """What the serving loop does with a :class:`StartPublish`: the worker's part here, then the commit."""
    (eff,) = [e for e in out.effects if isinstance(e, publish.StartPublish)] or [None]
    if eff is None:
        return out
    assert out.replies == () and (not pending or (eff.slot.state is SlotState.PENDING and eff.slot in ctx.state.slots))
    try:
        prepared, error = publish.prepare(eff, ctx.state.device, ctx.state.backend), None
    except Exception as e:  # noqa: BLE001 - answered by commit, as the loop does
        prepared, error = None, e
    return handlers.finish_publish(ctx, peer, eff, prepared, error)


def _publish(ctx, uid: int, model: str = "m", key=None, mapped: bool = False, manifest=None):
    fd, mm = _memfd(mapped)
    mfd, n = manifest or _manifest_fd()
    peer = Peer(1, uid, uid)
    try:
        out = handlers.handle(ctx, peer, protocol.Publish(model, 1, 0, key or KEY, 4096, n), (fd, mfd))
    finally:
        if mm is not None:
            mm.close()
        os.close(mfd)
    return _finish(ctx, peer, out), fd


def test_publish_seals_digests_and_keys_the_slab(svc):
    ctx, st, ck = svc
    out, fd = _publish(ctx, ENGINE)
    try:
        (reply,) = out.replies
        assert type(reply.msg) is protocol.PublishReply and reply.msg.created, reply.msg
        assert fcntl.fcntl(fd, F_GET_SEALS) & SLAB_SEALS == SLAB_SEALS  # the publisher's fd is sealed too
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
    finally:
        os.close(fd)
    (slot,) = [s for s in st.slots if s.publication is not None]
    assert out.effects == (StoreSlab(slot),) and slot.state is SlotState.READY
    assert slot.label == f"m/tp1/rank0+pub:{identity.engine_key_blake2b(KEY)[:8]}:uid{ENGINE}"
    m = slot.manifest
    assert m.key["checkpoint"] == identity.Checkpoint(str(ck), validate=False).identity()  # computed from the files
    assert {k: v for k, v in m.key.items() if k not in ("checkpoint", "device")} == KEY
    recs = {t.name: t for t in m.tensors}
    buf = BYTES.numpy().tobytes()
    assert recs["w"].digest == digest.xxh3_buffer(buf[:64]) and recs["b"].digest == digest.xxh3_buffer(buf[256:272])
    assert recs["tied"].alias_of == "b" and recs["w_t"].stride == (1, 4)
    # the manifest file sent with every attach says the same, and records the publication
    mf = read_file(slot.manifest_file.fd)
    assert mf.fields["publication"]["publisher_uid"] == ENGINE and mf.manifest.key == m.key
    # attach by the engine key: the service's own sealed fd and manifest file
    att = handlers.handle(ctx, Peer(2, ENGINE, ENGINE), protocol.AttachPublished("m", 1, 0, KEY))
    (r,) = att.replies
    assert type(r.msg) is protocol.AttachReply and r.fds == (slot.sealed.fd, slot.manifest_file.fd)


def test_identical_publications_end_with_one_slab(svc):
    ctx, st, _ = svc
    first, fd1 = _publish(ctx, ENGINE)
    second, fd2 = _publish(ctx, ENGINE)
    os.close(fd1)
    os.close(fd2)
    assert first.replies[0].msg.created and not second.replies[0].msg.created and second.effects == ()
    assert first.replies[0].msg.label == second.replies[0].msg.label
    assert len([s for s in st.slots if s.publication is not None]) == 1


def test_a_writable_mapping_is_refused_and_nothing_is_kept(svc):
    ctx, st, _ = svc
    out, fd = _publish(ctx, ENGINE, mapped=True)
    os.close(fd)
    assert out.replies[0].msg.code == "slab_still_mapped" and out.effects == ()
    assert all(s.publication is None for s in st.slots)


def test_trust_private_publications_and_publishers(svc):
    ctx, st, _ = svc
    out, fd = _publish(ctx, ENGINE)
    os.close(fd)
    assert out.replies[0].msg.created
    # another uid's engine never attaches a private publication: for it, none is held
    att = handlers.handle(ctx, Peer(3, OTHER, OTHER), protocol.AttachPublished("m", 1, 0, KEY))
    assert att.replies[0].msg.code == "model_not_found" and att.replies[0].msg.details["publication"] == "none"
    # with publishers set, a uid it does not name is refused and nothing changes
    before = list(st.slots)
    out, fd = _publish(ctx, OTHER, model="strict")
    os.close(fd)
    assert out.replies[0].msg.code == "access_denied" and st.slots == before
    # the named publisher's publication is shared: another uid's engine attaches it
    out, fd = _publish(ctx, ENGINE, model="strict")
    os.close(fd)
    assert out.replies[0].msg.created and "uid" not in out.replies[0].msg.label.split("+pub:")[1]
    att = handlers.handle(ctx, Peer(3, OTHER, OTHER), protocol.AttachPublished("strict", 1, 0, KEY))
    assert type(att.replies[0].msg) is protocol.AttachReply


def test_a_differing_key_is_cache_key_mismatch_naming_the_fields(svc):
    ctx, _, _ = svc
    _, fd = _publish(ctx, ENGINE)
    os.close(fd)
    other = {**KEY, "dtype": "bfloat16", "quantization": {"method": "fp8", "config_blake2b": "ab"}}
    att = handlers.handle(ctx, Peer(2, ENGINE, ENGINE), protocol.AttachPublished("m", 1, 0, other))
    err = att.replies[0].msg
    assert err.code == "cache_key_mismatch"
    assert sorted(err.details["fields"]) == ["dtype", "quantization.config_blake2b", "quantization.method"]


@pytest.mark.parametrize("field,value", [("parallel", {"tp_size": 1}), ("engine", ""), ("checkpoint", {}),
                                         ("kernels", {"attention": 3})])
def test_an_invalid_engine_key_is_publication_invalid(svc, field, value):
    ctx, st, _ = svc
    out, fd = _publish(ctx, ENGINE, key={**KEY, field: value})
    os.close(fd)
    assert out.replies[0].msg.code == "publication_invalid" and all(s.publication is None for s in st.slots)


def _open_fds() -> set[str]:
    """What this process's fds point to (the service under test runs in it): a slab or manifest file the service
    did not close stays here."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # the listing's own fd
            pass
    return out


@pytest.mark.parametrize("uid", [ENGINE, 0])  # a private publication (free room only), a shared one (room made)
def test_a_publication_over_the_budget_is_refused(svc, uid):
    ctx, st, _ = svc
    ctx.tiers.budget_bytes = 1024
    before = _open_fds()
    out, fd = _publish(ctx, uid)
    os.close(fd)
    assert out.replies[0].msg.code == "insufficient_memory" and all(s.publication is None for s in st.slots)
    assert _open_fds() == before  # the service's sealed copy closed


def test_a_manifest_outside_the_memfd_is_refused_after_the_worker_and_nothing_is_kept(svc):
    """The worker's checks fail: the PENDING slot goes, its slab is closed, the publisher hears why."""
    ctx, st, _ = svc
    before = _open_fds()  # another test's objects may still hold fds of their own until collected
    data = pack_file(Manifest("m", 1, 0, {}, 8192, [TensorRecord("w", "F32", (4,), (1,), 0, 16)]))
    out, fd = _publish(ctx, ENGINE, manifest=(sealed_memfd(data, "man"), len(data)))
    os.close(fd)
    assert out.replies[0].msg.code == "publication_invalid" and out.replies[0].msg.details["reason"] == "manifest"
    assert all(s.publication is None for s in st.slots)
    assert not [f for f in set(_open_fds()) - set(before) if "memfd:pub" in f or "manifest" in f]  # closed


def test_an_identical_publication_under_way_is_answered_created_false(svc):
    ctx, st, _ = svc
    fd, _ = _memfd()
    mfd, n = _manifest_fd()
    peer = Peer(1, ENGINE, ENGINE)
    first = handlers.handle(ctx, peer, protocol.Publish("m", 1, 0, KEY, 4096, n), (fd, mfd))
    (pending,) = [s for s in st.slots if s.publication is not None]
    assert pending.state is SlotState.PENDING and pending.gpu_bytes == 4096  # counted in the budget meanwhile
    second, fd2 = _publish(ctx, ENGINE)
    assert not second.replies[0].msg.created and second.replies[0].msg.label == pending.label
    assert _finish(ctx, peer, first).replies[0].msg.created and pending.state is SlotState.READY
    for f in (fd, fd2, mfd):
        os.close(f)


def _config(*models):
    from weightcache.config import Config, ServiceConfig

    return Config(ServiceConfig(), {m.name: m for m in models}, ("/etc/weightcache/weightcache.toml",))


def test_a_reload_keeps_a_publication_while_its_model_keeps_its_path(svc):
    """A reload applies new allow lists and publishers to a publication and keeps it (slab, state, fd store
    entry); a model removed, or given another path, drops it (its fd store entry removed, its slab freed)."""
    from weightcache.config import ServiceConfig
    from weightcache.daemon import reload

    ctx, st, ck = svc
    _, fd = _publish(ctx, ENGINE)
    os.close(fd)
    (pub,) = [s for s in st.slots if s.publication is not None]
    sid, sealed = pub.store_id, pub.sealed
    same = _config(ModelConfig("m", str(ck), publishers=("alice",)), ModelConfig("strict", str(ck)))
    plan = reload.plan(st.slots, same.placements(0), ServiceConfig(), same.service)
    done = reload.apply(st, plan, same)
    assert pub in st.slots and pub.state is SlotState.READY and pub.sealed is sealed and pub.store_id == sid
    assert pub.placement.model.publishers == ("alice",) and not done.free
    gone = _config(ModelConfig("strict", str(ck)))
    done = reload.apply(st, reload.plan(st.slots, gone.placements(0), ServiceConfig(), gone.service), gone)
    assert pub not in st.slots and pub.state is SlotState.DROPPED
    assert [f[0] for f in done.free] == [sid] and done.free[0][1] is sealed
    sealed.close()
    done.free[0][2].close()


def test_a_reload_that_removes_the_model_while_a_publication_is_checked_refuses_it(svc):
    """The worker's result comes back for a slot a reload dropped meanwhile: the publisher hears model_not_found,
    the slab is closed, nothing is kept (and the loader is asked to cancel nothing: no load ran)."""
    from weightcache.config import ServiceConfig
    from weightcache.daemon import reload

    ctx, st, ck = svc
    before = _open_fds()  # another test's objects may still hold fds of their own until collected
    fd, _ = _memfd()
    mfd, n = _manifest_fd()
    peer = Peer(1, ENGINE, ENGINE)
    started = handlers.handle(ctx, peer, protocol.Publish("m", 1, 0, KEY, 4096, n), (fd, mfd))
    gone = _config(ModelConfig("strict", str(ck)))
    done = reload.apply(st, reload.plan(st.slots, gone.placements(0), ServiceConfig(), gone.service), gone)
    assert all(s.publication is None for s in done.cancel) and all(s.publication is None for s in st.slots)
    out = _finish(ctx, peer, started, pending=False)
    assert out.replies[0].msg.code == "model_not_found" and out.effects == ()
    for f in (fd, mfd):
        os.close(f)
    assert not [f for f in set(_open_fds()) - set(before) if "memfd:pub" in f or "manifest" in f]  # closed


@pytest.mark.parametrize("says,refused", [(0, None), (10, "holds {n} bytes, the request says {m}"),
                                          (64 * 1024 * 1024 + 1, "table of {m} bytes is larger than 67108864")])
def test_the_cuda_ipc_table_is_read_from_its_memfd_at_the_size_the_request_says(says, refused):
    # the service reads the table a publish_cuda_ipc sent (its first fd) at table_size_bytes: a memfd shorter
    # than that, or a size over the cap, is publication_invalid (reason ipc) before anything is opened
    from weightcache.errors import PublicationInvalid
    from weightcache.memory.cuda_publish import IpcSource

    table = IpcSource((bytes(range(64)),), ((0, 256, 0, 4096),))
    data = table.to_json()
    n, m = len(data), len(data) + says if says < 1024 else says
    msg = protocol.PublishCudaIpc("m", 1, 0, {}, 2 << 20, 100, m)
    fd = sealed_memfd(data, "test-ipc-table")
    try:
        if refused is None:
            assert publish._ipc_source(msg, fd) == table
        else:
            with pytest.raises(PublicationInvalid, match=refused.format(n=n, m=m)) as e:
                publish._ipc_source(msg, fd)
            assert e.value.details["reason"] == "ipc"
    finally:
        os.close(fd)


class _CopyingAdoption:
    """What the cuda backend's Adoption does, on the host: ``run`` copies the publisher's bytes into a slab of
    the service's own (a new sealed memfd) and returns it with the ``sum64`` digests the copy computed; ``close``
    closes the publisher's side. Records what happened to it."""

    def __init__(self, source) -> None:
        self.source, self.size_bytes = source, source.size_bytes
        self.made: list = []
        self.closed = False

    def run(self, ranges):
        data = bytes(self.source.buffer)
        made = HostSealedSlab(sealed_memfd(data, "test-service-copy"), len(data))
        self.made.append(made)
        return made, {name: digest.sum64_buffer(data[off:off + n]) for name, off, n in ranges}

    def close(self) -> None:
        self.closed = True


def _start_with_adoption(ctx):
    """A publication's StartPublish as the cuda backend makes it: no sealed slab, an adoption that makes one."""
    import dataclasses

    fd, _ = _memfd()
    mfd, n = _manifest_fd()
    peer = Peer(1, ENGINE, ENGINE)
    try:
        out = handlers.handle(ctx, peer, protocol.Publish("m", 1, 0, KEY, 4096, n), (fd, mfd))
    finally:
        os.close(mfd)
        os.close(fd)
    (eff,) = [e for e in out.effects if isinstance(e, publish.StartPublish)]
    adoption = _CopyingAdoption(eff.sealed)
    return peer, dataclasses.replace(eff, sealed=None, adoption=adoption), adoption


def test_a_copying_publication_keeps_the_copys_slab_and_its_digests(svc):
    # the cuda path: prepare runs the adoption's copy (on a thread, while it works out the checkpoint's key) and
    # the manifest carries the digests the copy computed, of the slab the copy made
    ctx, st, ck = svc
    peer, eff, adoption = _start_with_adoption(ctx)
    try:
        prepared = publish.prepare(eff, ctx.state.device, ctx.state.backend)
        (made,) = adoption.made
        assert prepared.sealed is made and made.fd >= 0
        buf = BYTES.numpy().tobytes()
        recs = {t.name: t for t in prepared.manifest.tensors}
        assert recs["w"].digest == recs["w_t"].digest == digest.sum64_buffer(buf[:64])
        assert recs["b"].digest == recs["tied"].digest == digest.sum64_buffer(buf[256:272])
        assert prepared.manifest.key["checkpoint"] == identity.Checkpoint(str(ck), validate=False).identity()
        out = handlers.finish_publish(ctx, peer, eff, prepared, None)
        assert out.replies[0].msg.created
        (slot,) = [s for s in st.slots if s.publication is not None]
        assert slot.sealed is made and slot.manifest.tensors == prepared.manifest.tensors
    finally:
        adoption.source.close()


def test_a_checkpoint_gone_before_the_copy_makes_no_slab_and_closes_the_adoption(svc):
    # the checkpoint's key fails (the files are gone): prepare makes no copy (the key comes first) and closes the
    # adoption (the publisher's staging fd); the publisher is answered with the error and no slot is kept
    import shutil

    from weightcache.errors import WeightcacheError

    ctx, st, ck = svc
    peer, eff, adoption = _start_with_adoption(ctx)
    shutil.rmtree(ck)
    try:
        with pytest.raises(WeightcacheError) as e:
            publish.prepare(eff, ctx.state.device, ctx.state.backend)
        assert adoption.made == [] and adoption.closed  # no slab was made, the staging fd is closed
        out = handlers.finish_publish(ctx, peer, eff, None, e.value)
        assert type(out.replies[0].msg) is not protocol.PublishReply
        assert not [s for s in st.slots if s.publication is not None]
    finally:
        adoption.source.close()


class _FailingAdoption(_CopyingAdoption):
    """An adoption whose copy finds no room on the device for the service's slab."""

    def run(self, ranges):
        from weightcache.errors import OutOfMemory

        raise OutOfMemory("cuMemCreate: no room for the service's copy of 4096 bytes", gpu=0)


def test_the_copys_own_error_is_what_the_publication_answers(svc):
    # the copy runs on a thread of its own: what it raised is raised again by prepare, as it is (out_of_memory,
    # retryable), not a stand-in error; the adoption is closed and the slot dropped
    import dataclasses

    from weightcache.errors import OutOfMemory

    ctx, st, _ = svc
    peer, eff, copying = _start_with_adoption(ctx)
    failing = _FailingAdoption(copying.source)
    eff = dataclasses.replace(eff, adoption=failing)
    try:
        with pytest.raises(OutOfMemory, match="no room for the service's copy") as e:
            publish.prepare(eff, ctx.state.device, ctx.state.backend)
        assert failing.closed and not failing.made
        out = handlers.finish_publish(ctx, peer, eff, None, e.value)
        (reply,) = out.replies
        assert getattr(reply.msg, "code", None) == "out_of_memory", reply.msg
        assert not [s for s in st.slots if s.publication is not None]
    finally:
        copying.source.close()
