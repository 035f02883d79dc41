"""The budget's eviction policy (weightcache.daemon.budget), table by table."""

from __future__ import annotations

import pytest

from weightcache.daemon.budget import Holding, eviction_key, fit_host, make_room

H = Holding


# (case, need, budget, gpu, host_tier_bytes, host, expected (demote, drop, drop_host, short))
CASES = [
    ("fits without moving anything", 4, 10, [H("a", 6)], 0, [], ((), (), (), 0)),
    ("exactly fits", 4, 10, [H("a", 6)], 0, [], ((), (), (), 0)),
    ("LRU leaves first (no host tier: dropped)", 6, 12,
     [H("a", 6, last_used=2.0), H("b", 6, last_used=1.0)], 0, [], ((), ("b",), (), 0)),
    ("lowest priority leaves before a less recently used higher one", 6, 12,
     [H("a", 6, priority=0, last_used=9.0), H("b", 6, priority=5, last_used=1.0)], 0, [], ((), ("a",), (), 0)),
    ("pinned never leaves", 6, 12,
     [H("a", 6, pinned=True, last_used=0.0), H("b", 6, last_used=5.0)], 0, [], ((), ("b",), (), 0)),
    ("leased never leaves", 6, 12,
     [H("a", 6, leases=1, last_used=0.0), H("b", 6, last_used=5.0)], 0, [], ((), ("b",), (), 0)),
    ("busy (loading) never leaves", 6, 12,
     [H("a", 6, busy=True), H("b", 6, last_used=5.0)], 0, [], ((), ("b",), (), 0)),
    ("leased and pinned: no room, short named", 6, 12,
     [H("a", 6, leases=2), H("b", 6, pinned=True)], 0, [], ((), (), (), 6)),
    ("more than the budget can ever hold", 20, 12, [], 0, [], ((), (), (), 8)),
    ("several victims until it fits", 10, 12,
     [H("a", 4, last_used=1.0), H("b", 4, last_used=2.0), H("c", 4, last_used=3.0)], 0, [],
     ((), ("a", "b", "c"), (), 0)),
    ("stops as soon as it fits", 4, 12,
     [H("a", 4, last_used=1.0), H("b", 4, last_used=2.0), H("c", 4, last_used=3.0)], 0, [],
     ((), ("a",), (), 0)),
    ("host tier with room: demoted", 6, 12,
     [H("a", 6, last_used=1.0), H("b", 6, last_used=2.0)], 6, [], (("a",), (), (), 0)),
    ("host tier too small: dropped", 6, 12,
     [H("a", 6, last_used=1.0), H("b", 6, last_used=2.0)], 5, [], ((), ("a",), (), 0)),
    ("host tier full of lower-ranked slabs: they make room", 6, 12,
     [H("a", 6, priority=3, last_used=1.0), H("b", 6, priority=3, last_used=2.0)], 6, [H("h", 6, priority=0)],
     (("a",), (), ("h",), 0)),
    ("host tier full of higher-ranked slabs: the victim is dropped", 6, 12,
     [H("a", 6, priority=0, last_used=1.0), H("b", 6, last_used=2.0)], 6, [H("h", 6, priority=9)],
     ((), ("a",), (), 0)),
    ("a pinned host-tier slab stays", 6, 12,
     [H("a", 6, priority=3, last_used=1.0), H("b", 6, priority=3, last_used=2.0)], 6, [H("h", 6, pinned=True)],
     ((), ("a",), (), 0)),
    ("a victim displaced from the host tier by a later, higher-ranked one goes to disk", 0, 6,
     [H("a", 6, last_used=1.0), H("b", 6, last_used=2.0), H("c", 6, leases=1)], 6, [],
     (("b",), ("a",), (), 0)),
    ("need 0 under a lowered budget: back under it", 0, 8,
     [H("a", 6, last_used=1.0), H("b", 6, last_used=2.0)], 0, [], ((), ("a",), (), 0)),
    ("need 0, leased slabs over a lowered budget: they stay, short named", 0, 4,
     [H("a", 6, leases=1), H("b", 6, last_used=2.0)], 0, [], ((), ("b",), (), 2)),
]


@pytest.mark.parametrize("case,need,budget,gpu,host_bytes,host,expected", CASES, ids=[c[0] for c in CASES])
def test_make_room(case, need, budget, gpu, host_bytes, host, expected):
    r = make_room(need, budget, gpu, host_bytes, host)
    assert (r.demote, r.drop, r.drop_host, r.short_bytes) == expected
    assert r.fits == (expected[3] == 0)


def test_make_room_without_evicting_moves_nothing():
    r = make_room(6, 12, [H("a", 6), H("b", 4)], evict=False)
    assert (r.demote, r.drop, r.short_bytes, r.free_bytes) == ((), (), 4, 2)
    assert make_room(2, 12, [H("a", 6), H("b", 4)], evict=False).fits


def test_eviction_key_orders_priority_then_lru_then_label():
    hs = [H("c", 1, priority=1, last_used=0.0), H("b", 1, last_used=5.0), H("a", 1, last_used=5.0),
          H("d", 1, last_used=1.0)]
    assert [h.label for h in sorted(hs, key=eviction_key)] == ["d", "a", "b", "c"]


@pytest.mark.parametrize("size,host,expected", [
    (12, [H("a", 6), H("b", 6)], ((), 0)),
    (6, [H("a", 6, last_used=2.0), H("b", 6, last_used=1.0)], (("b",), 0)),
    (0, [H("a", 6, pinned=True), H("b", 6)], (("b",), 6)),
])
def test_fit_host(size, host, expected):
    assert fit_host(size, host) == expected


def test_a_victim_whose_bytes_the_host_tier_kept_is_demoted_without_more_room():
    # a was promoted earlier and its host copy kept (ranked lowest in the host tier); the tier is full with it.
    gpu = [H("a", 6, last_used=1.0, host_copy=True), H("b", 6, last_used=2.0)]
    host = [H("a", 6, priority=-10**9)]
    r = make_room(6, 12, gpu, 6, host)
    assert (r.demote, r.drop, r.drop_host, r.short_bytes) == (("a",), (), (), 0)
    # b has no copy: demoting it needs room, and a's kept copy (ranked lowest) makes it.
    gpu = [H("a", 6, last_used=3.0, host_copy=True), H("b", 6, last_used=2.0)]
    r = make_room(6, 12, gpu, 6, host)
    assert (r.demote, r.drop, r.drop_host, r.short_bytes) == (("b",), (), ("a",), 0)
