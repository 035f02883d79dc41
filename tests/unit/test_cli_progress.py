"""The progress text of a loading slab (``weightcache status``, ``wait`` without a terminal): issue 26 saw
``0 B/0 B 0.00 GB/s`` while a load was still planning."""

from __future__ import annotations

from weightcache import protocol
from weightcache.cli.status import progress_text
from weightcache.wire import SlotState


def _loading(done: int, total: int, rate: int) -> protocol.SlabInfo:
    return protocol.SlabInfo(model="m", path="/ck/m", tp_size=1, tp_rank=0, state=SlotState.LOADING, done_bytes=done,
                             total_bytes=total, rate_bytes_per_s=rate, resident_bytes=0, adopted=False, dtype="auto",
                             naming="hf", tensors=0)


def test_planning_says_so_instead_of_zero_bytes():
    assert progress_text(_loading(0, 0, 0)) == "planning (reading the checkpoint's headers)"


def test_no_rate_before_one_is_measured():
    assert progress_text(_loading(0, 2 * 2**30, 0)) == "0 B/2.0 GiB (0%)"


def test_progress_with_rate_and_time_left():
    assert progress_text(_loading(2**30, 2 * 2**30, 2 * 10**9)) == "1.0 GiB/2.0 GiB (50%) 2.00 GB/s, ~1s left"


def test_a_slab_being_demoted_says_so_and_the_flag_survives_the_wire():
    """Issue 24's leftover: a slab whose demotion copy is under way showed as plain ``ready``."""
    from dataclasses import replace

    from weightcache.cli.status import state_text

    ready = replace(_loading(10, 10, 0), state=SlotState.READY, resident_bytes=10)
    assert state_text(ready) == "ready"
    moving = replace(ready, demoting=True)
    assert state_text(moving).startswith("ready (being demoted: copying to the host tier")
    assert protocol.SlabInfo.from_json(moving.to_json()).demoting is True
    old = {k: v for k, v in ready.to_json().items() if k != "demoting"}  # a service from before the field
    assert protocol.SlabInfo.from_json(old).demoting is False
