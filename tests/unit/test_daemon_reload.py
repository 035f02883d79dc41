"""Reload in-process: the plan (pure), its application through the transition table, the ``reload``
handler, the last release of a retired slab, the loader's cancellation and the notifications.

No socket, no thread: slabs are stand-ins whose ``close()`` is counted (the state holds them
opaquely); the config loader is a function the test swaps.
"""

from __future__ import annotations

import os

import pytest

from weightcache import protocol
from weightcache.config import Config, Layout, ModelConfig, Placement, ServiceConfig
from weightcache.daemon import handlers, load_results, loads, reload
from weightcache.daemon.effects import CancelLoad, Context, FreeSlab, Reconfigure
from weightcache.daemon.state import Peer, ServiceState
from weightcache.wire import SlotState
from weightcache.daemon.ticker import Ticker
from weightcache.errors import ConfigError
from weightcache.reader import LoaderOptions

S = SlotState
ME = Peer(10, os.getuid(), os.getgid())


class Sealed:
    """A stand-in SealedSlab: counts ``close()``; ``fd`` is a number an attach reply carries, never used."""

    size_bytes = 64
    _next_fd = 1000

    def __init__(self) -> None:
        self.closed = 0
        Sealed._next_fd += 1
        self.fd = Sealed._next_fd

    def close(self) -> None:
        self.closed += 1


def _model(name: str, path: str, **kw) -> ModelConfig:
    return ModelConfig(name, path, source="/etc/weightcache/weightcache.toml", **kw)


def _config(*models: ModelConfig, **service) -> Config:
    return Config(ServiceConfig(**service), {m.name: m for m in models}, ("/etc/weightcache/weightcache.toml",))


def _state(tmp_path, *models: ModelConfig) -> ServiceState:
    return ServiceState(0, "host", {}, _config(*models).placements(0), service_uid=os.getuid())


class _Manifest:
    """A stand-in manifest: only its key's checkpoint identity is read."""

    def __init__(self, tag: str) -> None:
        self.key = {"checkpoint": {"files": {}, "tag": tag}}


def _ready(slot) -> Sealed:
    """Moves ``slot`` to READY with a stand-in slab (returned) and manifest file (``slot.manifest_file``)."""
    sealed = Sealed()
    slot.start(1.0)
    slot.loaded(None, sealed, Sealed())
    return sealed


@pytest.fixture
def paths(tmp_path):
    out = {}
    for n in ("a", "b", "c", "d", "e"):
        (tmp_path / n).mkdir()
        out[n] = str(tmp_path / n)
    return out


# -- the plan: pure ---------------------------------------------------------------------------------


def test_plan_replaces_a_slab_whose_checkpoint_changed_but_not_on_a_stale_check(paths):
    """``changed`` (what the reload's worker found on disk) makes a kept slot a changed one, as a new path
    would: dropped (or retired while leased) and loaded again. A check made against another manifest (the
    slab was evicted and loaded again while the worker ran) changes nothing."""
    a, b, c = (_model(n, paths[n]) for n in "abc")
    st = _state(None, a, b, c)
    sa, sb, sc = st.slots
    ma, mb, mc = (_Manifest(n) for n in "abc")
    for s, m in ((sa, ma), (sb, mb), (sc, mc)):
        _ready(s)
        s.manifest = m  # plan compares it by identity only
    st.lease(ME, sb, "zero_copy", 0.0)
    assert reload.recorded_checkpoints(st.slots) == [
        (reload.identity(s.placement), s.placement.model.path, m, m.key["checkpoint"])
        for s, m in ((sa, ma), (sb, mb), (sc, mc))]
    cfg = _config(a, b, c)
    changed = {reload.identity(sa.placement): (ma, ("files.model.safetensors.inode",)),
               reload.identity(sb.placement): (mb, ("files.model.safetensors.inode",)),
               reload.identity(sc.placement): (_Manifest("older"), ("files.model.safetensors.inode",))}
    p = reload.plan(st.slots, cfg.placements(0), ServiceConfig(), cfg.service, changed=changed)
    assert [s for s, _ in p.keep] == [sc] and [pl.model.name for pl in p.add] == ["a", "b"]
    assert p.drop == (sa,) and p.retire == (sb,)
    p = reload.plan(st.slots, cfg.placements(0), ServiceConfig(), cfg.service)  # nothing found on disk
    assert [s for s, _ in p.keep] == [sa, sb, sc] and p.add == ()


def test_a_load_under_way_is_checked_against_the_identity_it_planned_from(paths):
    """A checkpoint replaced while its load runs: the load reads the files it opened (the old ones) and would end
    ``ready`` with bytes every engine refuses. The reload that finds the files changed since the load's plan
    discards that load and loads them again, also when the load has ended by the time the reload applies; it
    used to keep the slot ("1 unchanged") and the slab stayed stale until a second reload."""
    a, b = _model("a", paths["a"]), _model("b", paths["b"])
    st = _state(None, a, b)
    sa, sb = st.slots
    planned_a, planned_b = {"files": {}, "tag": "a"}, {"files": {}, "tag": "b"}
    for s, planned in ((sa, planned_a), (sb, planned_b)):
        s.start(1.0)
        load_results.Planned(s, 64, None, planned).apply(st)
    assert sa.state is S.LOADING and sa.planned_checkpoint is planned_a
    assert reload.recorded_checkpoints(st.slots) == [
        (reload.identity(s.placement), s.placement.model.path, planned, planned)
        for s, planned in ((sa, planned_a), (sb, planned_b))]
    cfg = _config(a, b)
    changed = {reload.identity(sa.placement): (planned_a, ("files.model.safetensors.inode",))}
    p = reload.plan(st.slots, cfg.placements(0), ServiceConfig(), cfg.service, changed=changed)
    assert [s for s, _ in p.keep] == [sb] and [pl.model.name for pl in p.add] == ["a"] and p.drop == (sa,)
    # The load ended (READY) between the worker's check and the plan: its slab is still the stale one.
    sa.loaded(_Manifest("a"), Sealed(), Sealed())
    p = reload.plan(st.slots, cfg.placements(0), ServiceConfig(), cfg.service, changed=changed)
    assert [pl.model.name for pl in p.add] == ["a"] and p.drop == (sa,)


def test_plan_keeps_adds_drops_and_retires(paths):
    a, b, c, d, e = (_model(n, paths[n]) for n in "abcde")
    st = _state(None, a, b, c, d)
    sa, sb, sc, sd = st.slots
    _ready(sa), _ready(sb), _ready(sc)
    st.lease(ME, sb, "zero_copy", 0.0)  # b is leased, c is not, d never loaded (PENDING)
    new = _config(a, e)
    p = reload.plan(st.slots, new.placements(0), ServiceConfig(), new.service)
    assert [s for s, _ in p.keep] == [sa] and [pl.model.name for pl in p.add] == ["e"]
    assert p.retire == (sb,) and set(p.drop) == {sc, sd} and p.restart_keys == ()
    assert [s.state for s in st.slots] == [S.READY, S.READY, S.READY, S.PENDING]  # nothing moved


@pytest.mark.parametrize("change", [dict(dtype="float16"), dict(naming="vllm"), dict(revision="2"),
                                    dict(kernel="other")])
def test_a_changed_slab_field_replaces_the_slot(paths, change):
    st = _state(None, _model("a", paths["a"]))
    _ready(st.slots[0])
    new = _config(_model("a", paths["a"], **change))
    p = reload.plan(st.slots, new.placements(0), ServiceConfig(), new.service)
    assert p.keep == () and p.drop == (st.slots[0],) and [pl.model for pl in p.add] == [new.models["a"]]


def test_allow_lists_and_source_change_in_place(paths):
    st = _state(None, _model("a", paths["a"]))
    sealed = _ready(st.slots[0])
    new = _config(ModelConfig("a", paths["a"], allow_users=("alice",), source="/etc/weightcache/conf.d/a.toml"))
    done = reload.apply(st, reload.plan(st.slots, new.placements(0), ServiceConfig(), new.service), new)
    assert done.kept == ("a/tp1/rank0",) and done.free == () and done.load == ()
    assert st.slots[0].sealed is sealed and st.slots[0].placement.model.allow_users == ("alice",)


def test_a_retargeted_path_replaces_the_slot(paths):
    st = _state(None, _model("a", paths["a"]))
    new = _config(_model("a", paths["a"]))
    moved = {paths["a"]: paths["b"]}
    p = reload.plan(st.slots, new.placements(0), ServiceConfig(), new.service,
                    realpath=lambda x: moved.get(x, x))
    assert p.keep == () and p.drop == (st.slots[0],) and len(p.add) == 1


def test_another_layout_is_another_slot(paths):
    st = _state(None, _model("a", paths["a"]))
    new = _config(_model("a", paths["a"], layouts=(Layout(1, (0,)), Layout(2, (0, 0)))))
    p = reload.plan(st.slots, new.placements(0), ServiceConfig(), new.service)
    assert len(p.keep) == 1 and [(pl.tp_size, pl.tp_rank) for pl in p.add] == [(2, 0), (2, 1)]


def test_service_keys_that_need_a_restart(paths):
    p = reload.plan([], [], ServiceConfig(), ServiceConfig(backend="host", socket_dir="/run/x", read_threads=2))
    assert p.restart_keys == ("backend", "socket_dir")
    # the seeding keys are read at the start only (the seeder and its listener): a reload says so, as the docs do
    seeding = ServiceConfig(peers=("10.0.0.2:9670",), seed_listen="0.0.0.0:9670", seed_samples=2,
                            seed_secret_file="/etc/weightcache/other.secret")
    p = reload.plan([], [], ServiceConfig(), seeding)
    assert p.restart_keys == ("peers", "seed_secret_file", "seed_listen", "seed_samples")


def test_a_backend_the_running_one_satisfies_needs_no_restart():
    """Issue 26: after a start with rejected files the old backend is that of the kept slabs ("host"); the
    fixed file saying "auto" or "host" changes nothing and must not ask for a restart; "cuda" does."""
    kept = ServiceConfig(backend="host")
    for new, keys in (("auto", ()), ("host", ()), ("cuda", ("backend",))):
        p = reload.plan([], [], kept, ServiceConfig(backend=new), running_backend="host")
        assert p.restart_keys == keys, new


# -- applying it ------------------------------------------------------------------------------------


def test_apply_moves_slots_and_returns_what_to_free_cancel_and_load(paths):
    a, b, c, d, e = (_model(n, paths[n]) for n in "abcde")
    st = _state(None, a, b, c, d, e)
    sa, sb, sc, sd, se = st.slots
    sealed_a, sealed_b, sealed_c = _ready(sa), _ready(sb), _ready(sc)
    mf_c = sc.manifest_file
    sd.start(1.0)  # loading
    se.start(1.0)
    se.fail(ConfigError("x", file="f", key="k"))  # failed: retried when kept
    st.lease(ME, sb, "zero_copy", 0.0)
    new = _config(e, a, _model("n", paths["c"]))
    done = reload.apply(st, reload.plan(st.slots, new.placements(0), ServiceConfig(), new.service), new)

    assert (sa.state, sb.state, sc.state, sd.state, se.state) == (S.READY, S.RETIRED, S.DROPPED, S.DROPPED,
                                                                   S.PENDING)
    assert done.cancel == (sd,) and set(done.free) == {(sb.store_id, None, None), (sc.store_id, sealed_c, mf_c)}
    added = st.slots[2]
    assert st.slots == [se, sa, added, sb]  # config order, then the retired
    assert done.load == (se, added) and added.state is S.PENDING and added.placement.model.name == "n"
    assert (done.added, done.retired, done.kept) == (("n/tp1/rank0",), ("b/tp1/rank0",),
                                                     ("e/tp1/rank0", "a/tp1/rank0"))
    assert set(done.dropped) == {"c/tp1/rank0", "d/tp1/rank0"}
    assert sa.sealed is sealed_a and sb.sealed is sealed_b and sealed_a.closed == sealed_b.closed == 0
    assert st.find_slots("a") == [sa]
    with pytest.raises(Exception) as ei:
        st.find_slots("b")  # retired: attachable by nobody new
    assert ei.value.code == "model_not_found"
    assert st.find_slots("b", retired=True) == [sb]


# -- the handler ------------------------------------------------------------------------------------


@pytest.fixture
def ctx(paths):
    st = _state(None, _model("a", paths["a"]), _model("b", paths["b"]))
    holder = {"config": _config(_model("a", paths["a"]))}

    def load_config():
        if isinstance(holder["config"], Exception):
            raise holder["config"]
        return holder["config"]

    c = Context(st, lambda: (1, 2), load_config, ServiceConfig())
    c.holder = holder
    return c


def test_reload_handler_replies_and_returns_effects(ctx):
    st = ctx.state
    sa, sb = st.slots
    sealed_b = _ready(sb)
    mf_b = sb.manifest_file
    out = handlers.handle(ctx, ME, protocol.Reload())
    (reply,) = out.replies
    assert reply.msg == protocol.ReloadReply([], ["b/tp1/rank0"], [], ["a/tp1/rank0"], [],
                                             ["/etc/weightcache/weightcache.toml"])
    assert out.effects == (FreeSlab(sb.store_id, sealed_b, mf_b), Reconfigure(ctx.holder["config"]))
    assert st.slots == [sa] and st.config_error is None


def test_a_pending_slot_dropped_by_reload_is_cancelled_and_its_parked_attach_answered(ctx):
    st = ctx.state
    sa, sb = st.slots
    ctx.holder["config"] = _config(_model("a", ctx.state.slots[0].placement.model.path))
    handlers.handle(ctx, ME, protocol.Attach("b", wait_ms=60_000))  # parked: b is pending
    out = handlers.handle(ctx, ME, protocol.Reload())
    assert CancelLoad(sb) in out.effects and sb.state is S.DROPPED
    (reply,) = handlers.service_waiting(ctx, ME).replies
    assert reply.msg.code == "model_not_found" and not ME.waiting


def test_a_parked_attach_whose_slot_a_reload_replaced_waits_for_the_new_one(ctx, paths):
    """The load an engine waits for is discarded by a reload that replaces it (checkpoint files replaced, a
    retargeted path): the engine used to hear ``model_not_found`` ("removed from the configuration") for a
    model still in it; it now waits for the new slot's load and gets its slab."""
    st = ctx.state
    sa, sb = st.slots
    ctx.holder["config"] = _config(_model("a", paths["a"]), _model("b", paths["c"]))  # b's path changed
    handlers.handle(ctx, ME, protocol.Attach("b", wait_ms=60_000))  # parked: b is pending
    handlers.handle(ctx, ME, protocol.Reload())
    new_b = st.slots[-1]
    assert sb.state is S.DROPPED and new_b is not sb and new_b.placement.model.name == "b"
    assert handlers.service_waiting(ctx, ME).replies == () and ME.waiting[0][1] is new_b and new_b.demand
    sealed = _ready(new_b)
    (reply,) = handlers.service_waiting(ctx, ME).replies
    assert isinstance(reply.msg, protocol.AttachReply) and reply.fds[0] == sealed.fd and not ME.waiting


def test_refused_reload_changes_nothing_and_is_reported(ctx):
    st = ctx.state
    before = list(st.slots)
    ctx.holder["config"] = ConfigError("/etc/weightcache/weightcache.toml: service.bakend: unknown key",
                                       file="/etc/weightcache/weightcache.toml", key="service.bakend", line=3)
    out = handlers.handle(ctx, ME, protocol.Reload())
    (reply,) = out.replies
    assert (reply.msg.code, reply.msg.details["line"], out.effects) == ("config_invalid", 3, ())
    assert st.slots == before and [s.state for s in st.slots] == [S.PENDING, S.PENDING]
    assert st.status_line(0.0).endswith(
        "; configuration rejected, /etc/weightcache/weightcache.toml:3: service.bakend: unknown key")
    status = handlers.status(ctx)
    assert status.config_error.details["key"] == "service.bakend"
    assert protocol.ServiceStatus.from_json(status.to_json()) == status
    ctx.holder["config"] = _config(*(s.placement.model for s in before))
    handlers.handle(ctx, ME, protocol.Reload())
    assert st.config_error is None and handlers.status(ctx).config_error is None


def test_only_root_and_the_service_user_may_reload(ctx):
    out = handlers.handle(ctx, Peer(1, os.getuid() + 1, 0), protocol.Reload())
    assert out.replies[0].msg.code == "access_denied" and out.effects == ()


def test_the_last_release_of_a_retired_slab_frees_it(ctx):
    st = ctx.state
    sa, sb = st.slots
    sealed_b = _ready(sb)
    mf_b = sb.manifest_file
    lease = st.lease(ME, sb, "zero_copy", 0.0)
    out = handlers.handle(ctx, ME, protocol.Reload())
    assert out.replies[0].msg.retired == ["b/tp1/rank0"] and FreeSlab(sb.store_id, None, None) in out.effects
    # Not "removed from the config": a slab replaced because its checkpoint files were (or its path now
    # resolves elsewhere) is retired too, its model still in the config.
    assert "; replaced or removed by a reload, kept while leased: b/tp1/rank0" in st.status_line(0.0)
    out = handlers.handle(ctx, ME, protocol.Release(lease.lease_id))
    assert out.effects == (FreeSlab(None, sealed_b, mf_b),) and sb.state is S.DROPPED and st.slots == [sa]


def test_evict_force_frees_a_retired_slab(ctx):
    st = ctx.state
    sa, sb = st.slots
    sealed_b = _ready(sb)
    mf_b = sb.manifest_file
    st.lease(ME, sb, "zero_copy", 0.0)
    handlers.handle(ctx, ME, protocol.Reload())
    assert handlers.handle(ctx, ME, protocol.Evict("b")).replies[0].msg.code == "lease_busy"
    out = handlers.handle(ctx, ME, protocol.Evict("b", force=True))
    assert out.replies[0].msg.evicted == ["b/tp1/rank0"] and out.effects == (FreeSlab(None, sealed_b, mf_b),)
    assert st.slots == [sa]


# -- the loader and the notifications ---------------------------------------------------------------


def test_a_cancelled_slot_is_skipped_by_the_loader(paths):
    st = _state(None, _model("a", paths["a"]))
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        loader = loads.Loader(loads.LoadSettings(None, {}, 60.0, LoaderOptions(threads=1), "t.toml"), w)
        loader.submit(st.slots[0])
        loader.cancel(st.slots[0])
        loader.stop()
        loader._run()  # the thread's body: returns at the stop
        assert loader.results() == []
    finally:
        os.close(r)
        os.close(w)


def test_discard_closes_a_slab_loaded_for_a_dropped_slot(paths):
    st = _state(None, _model("a", paths["a"]))
    slot = st.slots[0]
    slot.drop()
    sealed, manifest_file = Sealed(), Sealed()
    load_results.discard(load_results.Loaded(slot, None, sealed, manifest_file, 1.0))
    load_results.discard(load_results.Started(slot, 1.0))
    assert sealed.closed == manifest_file.closed == 1 and slot.state is S.DROPPED


def test_reload_notifications():
    st = ServiceState(0, "host", {}, [])
    sent = []
    t = Ticker(st, send=sent.append, watchdog_s=None)
    t.reloading()
    t.reloaded(0.0)
    assert sent == ["STATUS=ready: 0/0 slabs resident"]  # before the first READY=1: status only
    sent.clear()
    t.tick(0.0)
    sent.clear()
    t.reloading()
    t.reloaded(0.0)
    head, usec, status = sent[0].split("\n")
    assert head == "RELOADING=1" and usec.startswith("MONOTONIC_USEC=") and int(usec.split("=")[1]) > 0
    assert status == "STATUS=reloading the configuration"
    assert sent[1] == "READY=1\nSTATUS=ready: 0/0 slabs resident"


def test_a_load_cancelled_midway_stops_and_frees_its_partial_slab(tmp_path, monkeypatch):
    """The progress report after the cancel ends the load: the writable slab is aborted, nothing sealed."""
    import torch

    from checkpoints import write_checkpoint
    from weightcache.memory.host import HostBackend

    ck = write_checkpoint(tmp_path / "ck", {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)})
    st = _state(None, _model("a", str(ck)))
    backend = HostBackend()
    aborted = []
    real_allocate = backend.allocate

    def allocate(*a, **kw):
        w = real_allocate(*a, **kw)
        real_abort = w.abort
        w.abort = lambda: (aborted.append(True), real_abort())
        return w

    monkeypatch.setattr(backend, "allocate", allocate)
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        loader = loads.Loader(loads.LoadSettings(backend, {}, 60.0, LoaderOptions(threads=1), "t.toml"), w)
        loader.cancel(st.slots[0])
        result = loader._supervise(st.slots[0])  # the loader thread's body for one slot (a worker runs it)
        assert isinstance(result, load_results.Failed) and result.error.details["cause"] == "cancelled"
        assert aborted == [True]
    finally:
        os.close(r)
        os.close(w)


def test_a_placement_round_trips_through_json(paths):
    """The manifest file keeps the slot's placement (fdstore.stored_placements reads it back)."""
    m = ModelConfig("a", paths["a"], dtype="bfloat16", naming="vllm", revision="r2", allow_users=("alice",),
                    allow_groups=("ml",), layouts=(Layout(1, (0,)), Layout(2, (0, 1))), source="/etc/x.toml")
    p = Placement(m, 2, 1, 1)
    assert Placement.from_json(p.to_json()) == p
    with pytest.raises(ValueError):
        Placement.from_json({"model": {"name": "a"}, "tp_size": 1, "tp_rank": 0, "gpu": 0})


# -- checkpoint paths resolved where the files are read, never on the serving loop (issue 25) ---------


def test_checkpoint_paths_are_resolved_where_the_files_are_read_not_on_the_serving_loop(tmp_path, monkeypatch):
    """``os.path.realpath`` lstat-s every component (a hung mount would freeze the loop): the config read
    (at start; on the reload worker thread) resolves each checkpoint path, and the loop's code (making the
    state's slots, the ``reload`` handler's plan and new slots) only looks the resolution up."""
    from weightcache.config import load_config

    for name in ("one", "two", "three"):
        (tmp_path / name).mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "one")
    (tmp_path / "new").symlink_to(tmp_path / "three")
    main = tmp_path / "weightcache.toml"

    def write(*models: str) -> None:
        main.write_text("".join(f'[models.{m}]\npath = "{tmp_path / p}"\nlayouts = [{{ tp = 1, gpus = [0] }}]\n'
                                for m, p in models))

    write(("a", "link"), ("b", "two"))
    first = load_config(main)  # at start, before serving
    assert first.realpaths == {str(tmp_path / "link"): str(tmp_path / "one"),
                               str(tmp_path / "two"): str(tmp_path / "two")}
    (tmp_path / "link").unlink()
    (tmp_path / "link").symlink_to(tmp_path / "two")  # retargeted: the reload's read sees it
    write(("a", "link"), ("b", "two"), ("c", "new"))
    second = load_config(main)  # what the reload worker thread reads
    assert second.realpath_of(str(tmp_path / "link")) == str(tmp_path / "two")

    calls = []
    monkeypatch.setattr(os.path, "realpath", lambda p, *a, **k: calls.append(p) or pytest.fail(f"realpath({p})"))
    st = ServiceState(0, "host", {}, first.placements(0), service_uid=os.getuid(), realpaths=first.realpaths)
    sa, sb = st.slots
    assert (sa.realpath, sb.realpath) == (str(tmp_path / "one"), str(tmp_path / "two"))
    c = Context(st, lambda: (1, 2), lambda: second, first.service)
    out = handlers.handle(c, ME, protocol.Reload())
    (reply,) = out.replies
    assert isinstance(reply.msg, protocol.ReloadReply), reply.msg
    assert calls == []
    # a: its checkpoint now resolves elsewhere, replaced; b kept; c added, with the reload's resolutions
    assert reply.msg.kept == ["b/tp1/rank0"] and sorted(reply.msg.added) == ["a/tp1/rank0", "c/tp1/rank0"]
    by_name = {s.placement.model.name: s for s in st.slots}
    assert by_name["b"] is sb
    assert by_name["a"].realpath == str(tmp_path / "two") and by_name["c"].realpath == str(tmp_path / "three")
