"""Tiers applied to a service state (weightcache.daemon.tiers) with a backend that copies, as CUDA's does:
demotions copy once, a promoted slab's kept host copy makes the next demotion free, a failed copy drops
the slab to disk instead, a leased slab is never touched; off the serving loop, a demotion grants room only
once its copy is done, and a lease taken meanwhile abandons it."""

from __future__ import annotations

import pytest

from weightcache.config import ModelConfig, Placement
from weightcache.daemon.state import Lease, ServiceState
from weightcache.wire import SlotState
from weightcache.daemon.tiers import Moved, Tiers
from weightcache.errors import OutOfMemory


class Fake:
    """A slab, host copy or manifest file: ``size_bytes`` and ``close()``."""

    def __init__(self, size_bytes: int, kind: str) -> None:
        self.size_bytes, self.kind, self.closed = size_bytes, kind, False

    def close(self) -> None:
        self.closed = True


def _state(*names: str) -> ServiceState:
    st = ServiceState(0, "cuda", {}, [Placement(ModelConfig(n, f"/m/{n}"), 1, 0, 0) for n in names])
    for i, s in enumerate(st.slots):
        s.state, s.sealed, s.manifest_file, s.last_used = SlotState.READY, Fake(6, "gpu"), Fake(1, "mf"), float(i)
    return st


@pytest.fixture
def copies():
    made = []

    def to_host(sealed, label):
        made.append(label)
        return Fake(sealed.size_bytes, "host")

    return made, to_host


def _loading(st: ServiceState, name: str):
    slot = st.slots[[s.placement.model.name for s in st.slots].index(name)]
    slot.state, slot.sealed, slot.manifest_file = SlotState.LOADING, None, None
    return slot


def test_admit_demotes_the_lru_slab_with_one_copy(copies):
    made, to_host = copies
    st = _state("a", "b", "c")
    c = _loading(st, "c")
    t = Tiers(12, 12, to_host)
    a_gpu = st.slots[0].sealed
    moves, refusal = t.admit(st, c, 6, evict=True)
    assert refusal is None and made == ["a/tp1/rank0"]
    assert [(m.slot.label, m.tier, m.close) for m in moves] == [("a/tp1/rank0", "host", (a_gpu,))]
    a = st.slots[0]
    assert (a.state, a.tier, a.hosted.kind, c.reserved_bytes, c.tier) == (SlotState.HOSTED, "host", "host", 6, "gpu")
    assert t.gpu_used(st) == 12 and t.host_used(st) == 6


def test_a_kept_host_copy_makes_the_demotion_free(copies):
    made, to_host = copies
    st = _state("a", "b", "c")
    kept = st.slots[0].hosted = Fake(6, "host")  # a was promoted from the host tier and kept its copy
    c = _loading(st, "c")
    moves, refusal = Tiers(12, 6, to_host).admit(st, c, 6, evict=True)  # the host tier is full with that copy
    assert refusal is None and made == []  # nothing copied
    assert st.slots[0].state is SlotState.HOSTED and st.slots[0].hosted is kept and moves[0].tier == "host"


def test_a_failed_copy_drops_the_slab_to_disk_instead():
    def to_host(sealed, label):
        raise OutOfMemory("no host RAM", size_bytes=sealed.size_bytes)

    st = _state("a", "b", "c")
    a_gpu, a_mf = st.slots[0].sealed, st.slots[0].manifest_file
    moves, refusal = Tiers(12, 12, to_host).admit(st, _loading(st, "c"), 6, evict=True)
    assert refusal is None and st.slots[0].state is SlotState.ON_DISK
    assert [(m.tier, m.close) for m in moves] == [("disk", (a_gpu, a_mf))]


def test_a_leased_slab_is_never_touched_and_the_refusal_names_the_lease(copies):
    made, to_host = copies
    st = _state("a", "b")
    a = st.slots[0]
    a.leases[7] = Lease(7, a, 4242, 1000, 1000, 0.0, "zero_copy")
    b = _loading(st, "b")
    moves, refusal = Tiers(8, 12, to_host).admit(st, b, 6, evict=True)
    assert moves == [] and made == [] and a.state is SlotState.READY and b.reserved_bytes == 0
    assert refusal.code == "insufficient_memory"
    assert refusal.details["leases"] == [{"slab": "a/tp1/rank0", "lease_id": 7, "pid": 4242, "uid": 1000}]
    assert refusal.details["budget_bytes"] == 8 and refusal.details["need_bytes"] == 6


def test_enforce_after_a_lowered_budget_and_host_tier(copies):
    made, to_host = copies
    st = _state("a", "b", "c")
    st.slots[2].leases[1] = Lease(1, st.slots[2], 1, 1, 1, 0.0, "zero_copy")
    t = Tiers(6, 6, to_host)
    moves = t.enforce(st, "reload")
    # a and b leave; the host tier holds one: b (used more recently) goes there, a to disk; c (leased) stays.
    assert [(m.slot.label, m.tier) for m in moves] == [("b/tp1/rank0", "host"), ("a/tp1/rank0", "disk")]
    assert [s.state for s in st.slots] == [SlotState.ON_DISK, SlotState.HOSTED, SlotState.READY]
    assert made == ["b/tp1/rank0"]  # a was not copied only to be dropped
    t.host_tier_bytes = 0
    assert [(m.slot.label, m.tier) for m in t.enforce(st, "reload")] == [("b/tp1/rank0", "disk")]
    assert isinstance(moves[0], Moved)


def test_start_order_and_placement_follow_pin_priority_and_preload():
    from weightcache.daemon.tiers import start_order, start_placement

    models = [ModelConfig("late", "/m/late"), ModelConfig("hi", "/m/hi", priority=5),
              ModelConfig("pinned", "/m/p", pin=True, priority=-3), ModelConfig("cold", "/m/c", preload="disk"),
              ModelConfig("warm", "/m/w", preload="host")]
    st = ServiceState(0, "cuda", {}, [Placement(m, 1, 0, 0) for m in models])
    assert [s.placement.model.name for s in start_order(st.slots)] == ["pinned", "hi", "late", "cold", "warm"]
    queued = {s.placement.model.name: start_placement(s) for s in st.slots}
    assert queued == {"late": True, "hi": True, "pinned": True, "cold": False, "warm": True}
    by = {s.placement.model.name: s for s in st.slots}
    assert by["cold"].state is SlotState.ON_DISK and by["cold"].tier == "disk"
    assert (by["warm"].target, by["late"].target) == ("host", "gpu")


def test_off_the_loop_a_demotion_grants_room_only_once_its_copy_is_done(copies):
    from weightcache.daemon.tiers import Demoting

    made, to_host = copies
    st = _state("a", "b", "c")
    a, c = st.slots[0], _loading(st, "c")
    a_gpu = a.sealed
    t = Tiers(12, 12, to_host, off_loop=True)
    moves, refusal = t.admit(st, c, 6, evict=True)
    assert refusal is None and made == [] and [type(m) for m in moves] == [Demoting]
    # Under way: a stays READY (attachable) and busy, its GPU bytes counted, its copy counted in the host tier;
    # c is granted nothing yet, so the GPU never holds more than the budget.
    assert (a.state, a.demoting, c.reserved_bytes) == (SlotState.READY, a_gpu, 0)
    assert t.gpu_used(st) == 12 and t.host_used(st) == 6
    assert not Tiers._gpu_holding(a).movable  # the budget never picks it again
    moved, close = t.finish_demote(st, moves[0], *t.copy(moves[0]))
    assert made == ["a/tp1/rank0"]
    assert close == () and moved.tier == "host" and moved.close == (a_gpu,)
    assert (a.state, a.demoting, a.hosted.kind) == (SlotState.HOSTED, None, "host")
    assert t.admit(st, c, 6, evict=True) == ([], None) and c.reserved_bytes == 6  # the room is there now


def test_a_lease_taken_during_the_copy_abandons_the_demotion(copies):
    made, to_host = copies
    st = _state("a", "b", "c")
    a = st.slots[0]
    t = Tiers(12, 12, to_host, off_loop=True)
    (eff,), _ = t.admit(st, _loading(st, "c"), 6, evict=True)
    a.leases[3] = Lease(3, a, 1, 1, 1, 0.0, "zero_copy")  # an engine attached while the copy ran
    copy, error = t.copy(eff)
    moved, close = t.finish_demote(st, eff, copy, error)
    assert moved is None and close == (copy,) and a.state is SlotState.READY and a.demoting is None
    assert t.host_used(st) == 0


def test_a_slab_adopted_after_a_restart_counts_as_leased(copies):
    """Issue 39: after a restart, adopted slabs have unknown leases (engines that attached before may still
    map them). evict refused them without --force, but the budget demoted them to make room, which on CUDA
    frees nothing an engine still maps. The budget now moves the other slab, or refuses naming the unknown
    leases and the way out; once an operator has evicted it with --force the room is there."""
    made, to_host = copies
    st = _state("a", "b", "c")
    st.slots[0].adopted = True  # a: least recently used, the one that was demoted
    moves, refusal = Tiers(12, 12, to_host).admit(st, _loading(st, "c"), 6, evict=True)
    assert refusal is None and made == ["b/tp1/rank0"] and st.slots[0].state is SlotState.READY
    st = _state("a", "b", "c")
    st.slots[0].adopted = st.slots[1].adopted = True
    moves, refusal = Tiers(12, 12, to_host).admit(st, _loading(st, "c"), 6, evict=True)
    assert moves == [] and refusal.code == "insufficient_memory" and made == ["b/tp1/rank0"]
    assert "unknown ones: adopted after a restart" in refusal.message and "evict --force" in refusal.message
    st.slots[0].adopted = False  # what evict --force leaves behind: the slab is known and movable again
    moves, refusal = Tiers(12, 12, to_host).admit(st, _loading(st, "c"), 6, evict=True)
    assert refusal is None and [m.slot.label for m in moves] == ["a/tp1/rank0"]
