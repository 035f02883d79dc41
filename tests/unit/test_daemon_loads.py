"""The loader thread's timeout holds whatever the read does: a blocked read fails that model alone.

The checkpoint read is made to block the way a hung NFS read does (the reading
thread sleeps in a call that does not return) by replacing
``pipeline.fill`` with one that waits on an event. The loader must post
``Failed(cause=timeout)`` for that slot within ``load_timeout_s`` (plus its 1 s
grace), load the next slot, and, once the stuck read returns, abort the
partial slab and post nothing more.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from daemon_helpers import close_slabs
from service_harness import poll_until
from checkpoints import write_checkpoint
from weightcache.config import ModelConfig, Placement
from weightcache.daemon import load_results, loads
from weightcache.daemon.state import ServiceState
from weightcache.wire import SlotState
from weightcache.reader import LoaderOptions
from weightcache.memory.host import HostBackend

pytestmark = pytest.mark.timeout(60)


class CountingBackend(HostBackend):
    """The host backend, counting the partial slabs it aborted."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted = 0

    def allocate(self, size_bytes, label):
        w = super().allocate(size_bytes, label)
        backend, abort = self, w.abort

        def counted_abort():
            backend.aborted += 1
            abort()

        w.abort = counted_abort
        return w


def test_blocked_read_fails_with_timeout_and_the_next_model_loads(tmp_path, monkeypatch):
    ck = write_checkpoint(tmp_path / "ck", {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    models = [ModelConfig("stuck", str(ck)), ModelConfig("next", str(ck))]
    backend = CountingBackend()
    st = ServiceState(0, "host", backend.device_info(), [Placement(m, 1, 0, 0) for m in models])
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    loader = loads.Loader(loads.LoadSettings(backend, st.device, 0.5, LoaderOptions(threads=1), "test.toml"), w)
    unblock = threading.Event()
    real_fill = loads.pipeline.fill

    def fill(plan, writable, *args, **kw):
        if plan.model.name == "stuck":
            unblock.wait()  # a read that does not return (no progress() call either)
        return real_fill(plan, writable, *args, **kw)

    monkeypatch.setattr(loads.pipeline, "fill", fill)
    loader.start()
    try:
        for s in st.slots:
            loader.submit(s)
        seen: list = []

        def loaded() -> bool:
            for res in loader.results():
                load_results.apply(st, res)
                seen.append(res)
            return bool(seen) and isinstance(seen[-1], load_results.Loaded)

        poll_until(loaded, "the next slab to load", 20, 0.01, detail=lambda: repr(seen))
        stuck, nxt = st.slots
        assert stuck.state is SlotState.FAILED
        assert (stuck.error.code, stuck.error.details["cause"]) == ("model_load_failed", "timeout")
        assert nxt.state is SlotState.READY
        assert [type(x).__name__ for x in seen if x.slot is stuck][-1] == "Failed"
        # The stuck read returns: its partial slab is aborted and nothing more reaches the state.
        unblock.set()
        poll_until(lambda: backend.aborted >= 1, "the abandoned load to abort its slab", 10, 0.01)
        assert loader.results() == []
        assert stuck.state is SlotState.FAILED
    finally:
        unblock.set()
        loader.stop()
        close_slabs(st)
        os.close(r)
        os.close(w)


def test_a_probe_plans_without_loading_and_a_failed_one_posts_nothing(tmp_path):
    """P3 for a model never planned: ``Loader.probe`` sizes a slot (``Planned`` with the slab size, which
    becomes its ``first_slab_bytes``) and allocates nothing; a checkpoint it cannot plan, or one over the
    model's ``max_slab_bytes``, posts nothing (that model keeps no room, and its load fails as before)."""
    ck = write_checkpoint(tmp_path / "ck", {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    models = [ModelConfig("gone", str(tmp_path / "missing"), allow_users=("1",)),
              ModelConfig("capped", str(ck), allow_users=("1",), max_slab_bytes=1),
              ModelConfig("secret", str(ck), allow_users=("1",))]
    backend = CountingBackend()
    st = ServiceState(0, "host", backend.device_info(), [Placement(m, 1, 0, 0) for m in models])
    allocated = []
    real_allocate = backend.allocate
    backend.allocate = lambda size, label: allocated.append(label) or real_allocate(size, label)
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    loader = loads.Loader(loads.LoadSettings(backend, st.device, 30, LoaderOptions(threads=1), "test.toml"), w)
    try:
        for s in st.slots:  # in order: the last one's result comes after the others'
            s.shelve()
            loader.probe(s)
        seen: list = []

        def sized() -> bool:
            seen.extend(loader.results())
            return bool(seen)

        poll_until(sized, "the probe of secret", 20, 0.01)
        loader.stop()
        assert [type(x).__name__ for x in seen] == ["Planned"] and seen[0].slot is st.slots[2], seen
        load_results.apply(st, seen[0])
        gone, capped, secret = st.slots
        # 24 bytes of payload in a slab of one 256-byte alignment unit, as its load would plan it
        assert (secret.first_slab_bytes, secret.total_bytes) == (256, 24)
        assert (gone.first_slab_bytes, capped.first_slab_bytes) == (0, 0)
        assert secret.state is SlotState.ON_DISK and secret.planned_checkpoint is None and not allocated
    finally:
        os.close(r)
        os.close(w)
