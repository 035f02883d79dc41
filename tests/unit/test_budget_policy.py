"""The memory budget's policy on who may displace whom (issue 38, P4 and P6), as a table: each row is one request
for room, what the GPU (and host tier) hold, and what moves. docs/design.md ("Memory budget: who may displace
whom") has the same table in words; the budget module is pure (:func:`weightcache.daemon.budget.make_room`).

Before: any socket-group member's attach displaced any unleased slab, of any priority and of models it may not
attach (a priority -1000 model evicted priority 0, 500 and 1000 slabs; three ``wait_ms=0`` attaches shelved a
restricted model, its owner's attach 0.001 -> 0.136 s median under thrash)."""

from __future__ import annotations

import pytest

from weightcache.config import ModelConfig, Placement
from weightcache.daemon import access, budget, tiers
from weightcache.daemon.budget import ANYONE, Holding, Requester, make_room
from weightcache.daemon.state import Peer, ServiceState, SlotState

H = Holding
OPEN_A, OPEN_B, SECRET = H("a", 6, last_used=1.0), H("b", 6, last_used=2.0), H("secret", 6, last_used=0.5)
ALL = frozenset({"a", "b", "secret"})
NOT_SECRET = frozenset({"a", "b"})

#: (row, need_bytes, budget_bytes, GPU holdings, host tier bytes, host holdings, requester,
#:  expected (demote, drop, drop_host, short_bytes))
TABLE = [
    ("free room: nothing moves", 6, 18, [OPEN_A, OPEN_B], 0, [], Requester(0, NOT_SECRET), ((), (), (), 0)),
    ("least recently used first, same priority", 6, 12, [OPEN_A, OPEN_B], 0, [], Requester(0, NOT_SECRET),
     ((), ("a",), (), 0)),
    ("lower priority first", 6, 12, [OPEN_A, H("b", 6, priority=-5, last_used=9.0)], 0, [],
     Requester(0, NOT_SECRET), ((), ("b",), (), 0)),
    ("never a higher priority than the requester's model (P6)", 6, 12,
     [H("a", 6, priority=1000), H("b", 6, priority=500)], 0, [], Requester(-1000, None), ((), (), (), 6)),
    ("equal priority may go", 6, 12, [H("a", 6, priority=500), H("b", 6, priority=1000)], 0, [],
     Requester(500, None), ((), ("a",), (), 0)),
    ("a restricted model is never moved for a uid off its allow lists (P4)", 6, 12, [SECRET, OPEN_A], 0, [],
     Requester(0, NOT_SECRET), ((), ("a",), (), 0)),
    ("... even when it is all there is", 6, 6, [SECRET], 0, [], Requester(0, NOT_SECRET), ((), (), (), 6)),
    ("... and even of a lower priority", 6, 6, [H("secret", 6, priority=-100)], 0, [], Requester(0, NOT_SECRET),
     ((), (), (), 6)),
    ("its owner (on the allow list) may move it", 6, 6, [SECRET], 0, [], Requester(0, ALL), ((), ("secret",), (), 0)),
    ("root and the service user: every slab they may attach (all), priority still holds", 6, 6,
     [H("secret", 6, priority=10)], 0, [], Requester(0, None), ((), (), (), 6)),
    ("leased, pinned and busy slabs never move", 6, 18,
     [H("l", 6, leases=1), H("p", 6, pinned=True), H("x", 6, busy=True)], 0, [], Requester(0, None),
     ((), (), (), 6)),
    ("a uid past its displacing loads takes free room only", 6, 12, [OPEN_A, OPEN_B], 0, [],
     Requester(0, frozenset()), ((), (), (), 6)),
    ("the host tier: a restricted host copy is not dropped for another uid; the victim goes to disk", 6, 12,
     [OPEN_A, OPEN_B], 6, [H("secret", 6, last_used=0.1)], Requester(0, NOT_SECRET), ((), ("a",), (), 0)),
    ("... its owner's load drops it from the host tier to demote the victim", 6, 12,
     [OPEN_A, OPEN_B], 6, [H("secret", 6, last_used=0.1)], Requester(0, ALL), (("a",), (), ("secret",), 0)),
    ("a reload lowering the budget (ANYONE) moves any movable slab", 0, 6, [SECRET, OPEN_A], 0, [], ANYONE,
     ((), ("secret",), (), 0)),
    ("the room of a restricted model waiting off the GPU is held back from a uid off its lists (P3)", 6, 12,
     [H("a", 6, leases=1)], 0, [], Requester(0, NOT_SECRET, reserved_bytes=6), ((), (), (), 6)),
    ("... and what it may displace still makes room", 6, 18, [H("a", 6, leases=1), OPEN_B], 0, [],
     Requester(0, NOT_SECRET, reserved_bytes=6), ((), ("b",), (), 0)),
]


@pytest.mark.parametrize("row,need,budget_bytes,gpu,host_bytes,host,requester,want", TABLE,
                         ids=[r[0] for r in TABLE])
def test_policy_table(row, need, budget_bytes, gpu, host_bytes, host, requester, want):
    room = make_room(need, budget_bytes, gpu, host_bytes, host, True, requester)
    assert (room.demote, room.drop, room.drop_host, room.short_bytes) == want, row


def _state():
    models = [ModelConfig("secret", "/m/secret", allow_users=("3000",)), ModelConfig("open", "/m/open"),
              ModelConfig("mine", "/m/mine", priority=-1000)]
    st = ServiceState(0, "cuda", {}, [Placement(m, 1, 0, 0) for m in models], service_uid=999)

    class Fake:
        size_bytes = 6

        def close(self) -> None:
            pass

    for s in st.slots[:2]:
        s.state, s.sealed, s.manifest_file = SlotState.READY, Fake(), Fake()
    st.slots[2].state = SlotState.LOADING
    return st


def test_requester_of_a_peer_and_the_rate_limit():
    st = _state()
    mine = st.slots[2]
    policy = access.Policy(service_uid=999)
    stranger = Peer(7, 2000, 2000)
    r = tiers.requester_of(st, mine, lambda s: access.may_attach(stranger, s, policy), 0)
    assert r == Requester(-1000, frozenset({"open/tp1/rank0", "mine/tp1/rank0"}))  # secret is on the GPU
    secret = st.slots[0]
    secret.first_slab_bytes, secret.state = 6, SlotState.ON_DISK  # shelved: its room is held back
    r = tiers.requester_of(st, mine, lambda s: access.may_attach(stranger, s, policy), 0)
    assert r.reserved_bytes == 6
    owner = Peer(8, 3000, 3000)
    assert tiers.requester_of(st, mine, lambda s: access.may_attach(owner, s, policy), 0).reserved_bytes == 0
    secret.state = SlotState.READY
    assert tiers.requester_of(st, mine, lambda s: True, tiers.DISPLACING_LOADS_PER_UID) == Requester(-1000,
                                                                                                   frozenset())
    assert tiers.requester_of(st, mine, None, 99) == Requester(-1000, None)


def test_a_stranger_low_priority_load_moves_nothing_it_may_not_and_is_refused():
    """A priority -1000 model of an open allow list, attached by a uid off ``secret``'s list: the budget holds
    ``secret`` and ``open`` (priority 0): nothing moves, the load is refused ``insufficient_memory``."""
    st = _state()
    mine = st.slots[2]
    policy = access.Policy(service_uid=999)
    stranger = Peer(7, 2000, 2000)
    t = tiers.Tiers(12, 0)
    moves, refusal = t.admit(st, mine, 6, True,
                             tiers.requester_of(st, mine, lambda s: access.may_attach(stranger, s, policy), 0))
    assert moves == [] and refusal.code == "insufficient_memory"
    assert [s.state for s in st.slots[:2]] == [SlotState.READY, SlotState.READY]
    mine.placement = Placement(ModelConfig("mine", "/m/mine", priority=0), 1, 0, 0)
    moves, refusal = t.admit(st, mine, 6, True,
                             tiers.requester_of(st, mine, lambda s: access.may_attach(stranger, s, policy), 0))
    assert refusal is None and [m.slot.label for m in moves] == ["open/tp1/rank0"]  # not secret's
    assert st.slots[0].state is SlotState.READY


def test_the_default_requester_is_the_old_policy():
    a, b = Holding("a", 6, last_used=1.0), Holding("b", 6, last_used=2.0)
    assert make_room(6, 12, [a, b]).drop == ("a",)
    assert budget.ANYONE.allows(Holding("x", 1, priority=1000))


@pytest.mark.parametrize("state,first,restricted,published,want", [
    (SlotState.ON_DISK, 0, True, False, True),  # preload = "disk", never planned: sized by a plan alone
    (SlotState.HOSTED, 0, True, False, True),  # adopted into the host tier, never planned here
    (SlotState.ON_DISK, 6, True, False, False),  # its last plan's size holds its room already
    (SlotState.PENDING, 0, True, False, False),  # its own load plans it
    (SlotState.READY, 0, True, False, False),  # on the GPU: nothing to hold back
    (SlotState.ON_DISK, 0, False, False, False),  # open: anyone may attach it, nobody is kept out
    (SlotState.ON_DISK, 0, True, True, False),  # a publication: nothing to plan it from
])
def test_the_restricted_models_a_plan_alone_sizes(state, first, restricted, published, want):
    """P3 for a model never planned: which slots the serving loop has the loader plan without loading."""
    from weightcache.daemon.state import Publication

    m = ModelConfig("secret", "/m/secret", allow_users=("3000",) if restricted else ())
    st = ServiceState(0, "cuda", {}, [Placement(m, 1, 0, 0)], service_uid=999)
    s = st.slots[0]
    s.state, s.first_slab_bytes = state, first
    if published:
        s.publication = Publication({}, "k", 3000, False)
    assert tiers.unsized_restricted(st.slots) == ([s] if want else [])
