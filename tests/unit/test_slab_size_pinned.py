"""A checkpoint's writer cannot grow a model past the size of its first load (issue 38, P6): a sparse file of
240 MB of holes (4 KB on disk) filled the budget in 0.39 s. The slot keeps its first plan's slab size; a later
load planning more fails that model with ``checkpoint_corrupt`` (cause ``grew``) until a reload (the operator)
takes the new size."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from daemon_helpers import close_slabs  # noqa: E402
from checkpoints import write_checkpoint  # noqa: E402
from weightcache.config import ModelConfig, Placement  # noqa: E402
from weightcache.daemon import load_results, loads, tiers  # noqa: E402
from weightcache.daemon.state import ServiceState  # noqa: E402
from weightcache.wire import SlotState  # noqa: E402
from weightcache.reader import LoaderOptions  # noqa: E402
from weightcache.memory.host import HostBackend  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_a_checkpoint_grown_since_the_first_load_fails_until_a_reload(tmp_path):
    ck = write_checkpoint(tmp_path / "ck", {"w": torch.zeros(64, dtype=torch.float32)})
    backend = HostBackend()
    st = ServiceState(0, "host", backend.device_info(), [Placement(ModelConfig("m", str(ck)), 1, 0, 0)])
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    loader = loads.Loader(loads.LoadSettings(backend, st.device, 60.0, LoaderOptions(threads=1), "t.toml"), w)

    def load(slot):
        final = loader._supervise(slot)
        for result in loader.results() + [final]:
            load_results.apply(st, result)

    try:
        (slot,) = st.slots
        load(slot)
        assert slot.state is SlotState.READY and slot.first_slab_bytes == 256  # the plan's size (backend-rounded: 4096)
        first = slot.first_slab_bytes
        moved = tiers.Tiers(1 << 30).shelve(st, slot, "test")  # evicted to disk, as the budget or `evict` does
        for f in moved.close:
            f.close()
        assert tiers.demand(slot, 0.0)  # an attach loads it again
        write_checkpoint(ck, {"w": torch.zeros(64, dtype=torch.float32),
                              "holes": torch.zeros(2 * 1024 * 1024, dtype=torch.float32)})  # 8 MB more
        load(slot)
        assert slot.state is SlotState.FAILED, slot.state
        d = slot.error.details
        assert (slot.error.code, d["cause"], d["first_size_bytes"]) == ("checkpoint_corrupt", "grew", first)
        assert d["size_bytes"] > first
        # The same size loads again (a checkpoint rewritten in place, no larger).
        write_checkpoint(ck, {"w": torch.ones(64, dtype=torch.float32)})
        slot.requeue()  # FAILED: preload
        load(slot)
        assert slot.state is SlotState.READY
    finally:
        close_slabs(st)
        os.close(r)
        os.close(w)
