"""Guards of the memory budget's policy and of the access checks' refusals (issue 40; survivors of
`make mutate` on daemon/budget.py and daemon/access.py)."""

from __future__ import annotations

import pytest

from weightcache.config import ModelConfig, Placement
from weightcache.daemon import access
from weightcache.daemon.budget import Holding, _HostTier, fit_host, make_room
from weightcache.daemon.state import Peer, Slot
from weightcache.errors import AccessDenied

# --- the host tier's room for a demoted slab -------------------------------------------------------------------


def test_a_victims_kept_host_copy_becomes_the_demoted_slab_in_its_place():
    """Invariant: a GPU slab whose bytes the host tier kept (``host_copy``) takes its own copy's place and
    nothing else's; no other holding moves."""
    b, copy = Holding("b", 4, priority=9), Holding("a", 4)
    victim = Holding("a", 4, host_copy=True, last_used=5.0)
    tier = _HostTier(8, [b, copy])
    assert tier.take(victim) is True
    assert tier.held == [b, victim] and tier.dropped == []


def test_the_host_tier_drops_only_what_ranks_below_the_victim_and_only_what_is_needed():
    """Invariant: room for a demoted slab is made by dropping movable host-tier slabs in eviction order, only
    those ranking below it, and no more than needed; a tier with enough free room drops nothing."""
    low, mid, high = Holding("low", 1, priority=0), Holding("mid", 1, priority=1), Holding("high", 1, priority=9)
    tier = _HostTier(3, [high, mid, low])  # not in eviction order
    assert tier.take(Holding("v", 2, priority=5)) is True
    assert tier.dropped == ["low", "mid"] and tier.held == [high, Holding("v", 2, priority=5)]
    tier = _HostTier(2, [low])  # exactly the victim's size free: nothing dropped
    assert tier.take(Holding("v", 1, priority=5)) is True
    assert tier.dropped == [] and [h.label for h in tier.held] == ["low", "v"]
    tier = _HostTier(3, [low])  # 2 free, 3 needed: low is dropped and the freed bytes add up
    assert tier.take(Holding("v", 3, priority=5)) is True
    assert tier.dropped == ["low"]
    tier = _HostTier(3, [high])  # what ranks above it stays: no room
    assert tier.take(Holding("v", 3, priority=5)) is False
    assert tier.held == [high] and tier.dropped == []


def test_without_a_host_tier_victims_are_dropped_and_free_bytes_are_reported():
    """``host_tier_bytes`` defaults to 0 (no host tier: every victim is dropped to disk); ``free_bytes`` is the
    budget's free bytes before any move, whether or not moves are needed."""
    a = Holding("a", 1)
    room = make_room(1, 1, [a])
    assert (room.demote, room.drop, room.free_bytes, room.short_bytes) == ((), ("a",), 0, 0)
    assert make_room(2, 5, [a]).free_bytes == 4  # fits without moves
    assert make_room(3, 5, [a, Holding("b", 2)]).free_bytes == 2
    assert make_room(3, 4, [a, Holding("b", 2)], evict=False).free_bytes == 1


def test_fit_host_drops_until_the_tier_is_not_over_by_a_single_byte():
    assert fit_host(1, [Holding("a", 2)]) == (("a",), 0)
    assert fit_host(2, [Holding("a", 2)]) == ((), 0)
    assert fit_host(1, [Holding("a", 2, pinned=True)]) == ((), 1)


# --- what a refusal tells the refused client -------------------------------------------------------------------

STRANGER = 54321


def _slot(name: str = "m", **model) -> Slot:
    return Slot(Placement(ModelConfig(name, "/srv/m", **model), 1, 0, 0))


def test_an_attach_refusal_names_the_model_uid_and_request():
    """Invariant: access_denied for a peer on no allow list carries ``model``, ``uid`` and ``request`` (what
    the client's error and the journal's refusal line are built from)."""
    policy = access.Policy(service_uid=999)
    with pytest.raises(AccessDenied) as e:
        access.check_attach(Peer(1, STRANGER, STRANGER), _slot(allow_users=("nobody-here",)), policy, "preload")
    assert (e.value.code, e.value.details) == ("access_denied", {"model": "m", "uid": STRANGER, "request": "preload"})


def test_an_operator_refusal_names_the_model_cut_to_200_characters():
    policy = access.Policy(service_uid=999)
    long = "x" * 300
    with pytest.raises(AccessDenied) as e:
        access.check_operator(Peer(1, STRANGER, STRANGER), policy, "evict", long)
    assert e.value.details == {"model": "x" * 200, "uid": STRANGER, "request": "evict"}
    with pytest.raises(AccessDenied) as e:
        access.check_operator(Peer(1, STRANGER, STRANGER), policy, "verify", "m")
    assert e.value.details == {"model": "m", "uid": STRANGER, "request": "verify"}
