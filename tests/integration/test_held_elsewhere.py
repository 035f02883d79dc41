"""Issue 38, P2: the memory budget bounds memory, not only what the service holds. An engine that released its
lease (closed its attachment) still maps the slab through its tensors; a slab the service then shelves keeps its
memory until that mapping goes. The service counts it against the budget (``held_elsewhere_bytes``) until the
kernel reports the memfd freed (inotify ``IN_IGNORED``): before, the next load allocated again (30 such slabs
took the node's shared memory 2.34 GB past a 280 MB budget while ``status`` said 272 MB)."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from attackers import SERVICE_UID  # noqa: E402
from service_harness import make_config, poll_until, record_figures  # noqa: E402
from checkpoints import compare_bytes, one_tensor_checkpoint, ONE_TENSOR_N, ONE_TENSOR_SLAB, read_checkpoint  # noqa: E402
from weightcache import attach  # noqa: E402
from weightcache.errors import InsufficientMemory  # noqa: E402

pytestmark = pytest.mark.timeout(180)

N, SLAB = ONE_TENSOR_N, ONE_TENSOR_SLAB


def _ckpt(dest, seed: int):
    return one_tensor_checkpoint(dest, seed)


def test_a_released_slab_still_mapped_counts_against_the_budget_until_unmapped(daemon, tmp_path):
    cks = {n: _ckpt(tmp_path / n, i) for i, n in enumerate("abc")}
    svc = daemon(make_config({"a": cks["a"], "b": {"path": cks["b"], "preload": "disk"},
                              "c": {"path": cks["c"], "preload": "disk"}},
                             memory_budget_bytes=SLAB + SLAB // 2), run_as=SERVICE_UID)
    svc.wait_settled()

    def attach_(m):
        return attach(m, socket_dir=svc.socket_dir, fallback=False, timeout=30)

    w = attach_("a")
    kept = w.tensors  # the engine keeps its views: the mapping outlives the lease
    w.close()
    poll_until(lambda: not svc.slab("a")["leases"], "a's lease to end")
    with attach_("b") as wb:  # a is shelved for b: its memory stays, mapped here
        compare_bytes(wb.tensors, read_checkpoint(cks["b"]))
    poll_until(lambda: not svc.slab("b")["leases"], "b's lease to end")
    mem = svc.status()["memory"]
    assert svc.slab("a")["state"] == "on_disk" and mem["held_elsewhere_bytes"] == SLAB, mem
    with pytest.raises(InsufficientMemory) as e:  # b could go, but a's pages are still the node's
        attach_("c")
    assert e.value.details["held_elsewhere_bytes"] == SLAB
    compare_bytes(kept, read_checkpoint(cks["a"]))  # the engine's view is intact
    del kept, w
    gc.collect()  # the engine unmaps: the kernel frees the memfd, the service hears of it
    poll_until(lambda: svc.status()["memory"]["held_elsewhere_bytes"] == 0, "the service to see a freed")
    with attach_("c") as wc:
        compared = compare_bytes(wc.tensors, read_checkpoint(cks["c"]))
    record_figures("attack.held_elsewhere", "an engine keeps a released slab mapped while the service shelves it",
                   "service as uid 64000; status memory.held_elsewhere_bytes = the slab; the next load that needs "
                   "its room insufficient_memory (held_elsewhere_bytes); once the engine unmaps, the kernel frees "
                   "the memfd (inotify IN_IGNORED) and the load proceeds", clients=2, faults_injected=1,
                   bytes_compared=compared, held_elsewhere_bytes=SLAB)
