"""The slot transition table, exhaustively: every state x event, in-process (no socket, no thread)."""

from __future__ import annotations

import itertools

import pytest

from weightcache.config import ModelConfig, Placement
from weightcache.daemon.state import TRANSITIONS, IllegalTransition, ServiceState, Slot, SlotEvent
from weightcache.wire import SlotState
from weightcache.errors import ModelNotFound

S, E = SlotState, SlotEvent

#: The table written out again by hand: a change to state.TRANSITIONS must change this too.
EXPECTED = {
    (S.PENDING, E.START): S.LOADING,
    (S.PENDING, E.ADOPT): S.READY,
    (S.LOADING, E.LOADED): S.READY,
    (S.LOADING, E.FAIL): S.FAILED,
    (S.READY, E.EVICT): S.EVICTED,
    (S.FAILED, E.REQUEUE): S.PENDING,
    (S.EVICTED, E.REQUEUE): S.PENDING,
    # reload: a slot the new config no longer holds as it is
    (S.PENDING, E.DROP): S.DROPPED,
    (S.LOADING, E.DROP): S.DROPPED,
    (S.READY, E.DROP): S.DROPPED,
    (S.FAILED, E.DROP): S.DROPPED,
    (S.EVICTED, E.DROP): S.DROPPED,
    (S.READY, E.RETIRE): S.RETIRED,
    (S.RETIRED, E.DROP): S.DROPPED,
    # tiers: the memory budget, demand loads, evict --to
    (S.READY, E.DEMOTE): S.HOSTED,
    (S.READY, E.SHELVE): S.ON_DISK,
    (S.HOSTED, E.SHELVE): S.ON_DISK,
    (S.PENDING, E.SHELVE): S.ON_DISK,
    (S.LOADING, E.SHELVE): S.ON_DISK,
    (S.PENDING, E.STASH): S.HOSTED,
    (S.LOADING, E.STASH): S.HOSTED,
    (S.HOSTED, E.REQUEUE): S.PENDING,
    (S.ON_DISK, E.REQUEUE): S.PENDING,
    (S.HOSTED, E.EVICT): S.EVICTED,
    (S.ON_DISK, E.EVICT): S.EVICTED,
    (S.HOSTED, E.DROP): S.DROPPED,
    (S.ON_DISK, E.DROP): S.DROPPED,
    (S.PENDING, E.PUBLISH): S.READY,
    (S.LOADING, E.AWAIT_ENGINE): S.WAITING_FOR_ENGINE,
    (S.WAITING_FOR_ENGINE, E.REQUEUE): S.PENDING,
    (S.WAITING_FOR_ENGINE, E.DROP): S.DROPPED,
}


def _slot(name: str = "m", tp_size: int = 1, tp_rank: int = 0) -> Slot:
    return Slot(Placement(ModelConfig(name, f"/srv/{name}"), tp_size, tp_rank, 0))


def test_table_is_the_documented_one():
    assert {(t.source, t.event): t.target for t in TRANSITIONS} == EXPECTED
    assert len(TRANSITIONS) == len(EXPECTED)  # no (source, event) twice


@pytest.mark.parametrize("state,ev", list(itertools.product(SlotState, SlotEvent)),
                         ids=lambda v: v.value)
def test_every_state_and_event(state, ev):
    slot = _slot()
    slot.state = state
    if (state, ev) in EXPECTED:
        assert slot.move(ev) is EXPECTED[(state, ev)]
        assert slot.state is EXPECTED[(state, ev)]
        assert slot.counts == {(state, ev, EXPECTED[(state, ev)]): 1}
    else:
        with pytest.raises(IllegalTransition) as ei:
            slot.move(ev)
        assert (ei.value.source, ei.value.event, ei.value.label) == (state, ev, "m/tp1/rank0")
        assert slot.state is state and not slot.counts  # a refused move changes nothing


def test_every_state_reachable_from_pending():
    seen, frontier = {S.PENDING}, [S.PENDING]
    while frontier:
        src = frontier.pop()
        for (s, _), t in EXPECTED.items():
            if s is src and t not in seen:
                seen.add(t)
                frontier.append(t)
    assert seen == set(SlotState)


def test_helpers_move_through_the_table_and_set_their_fields():
    slot = _slot()
    slot.start(5.0)
    assert (slot.state, slot.started_at, slot.done_bytes, slot.total_bytes) == (S.LOADING, 5.0, 0, 0)
    slot.total_bytes = 100
    slot.loaded("MANIFEST", "SEALED", "FILE")  # state holds them opaquely
    assert (slot.state, slot.manifest, slot.sealed, slot.manifest_file, slot.done_bytes) == (
        S.READY, "MANIFEST", "SEALED", "FILE", 100)
    assert slot.evict() == ("SEALED", "FILE")
    assert (slot.state, slot.sealed, slot.manifest, slot.manifest_file) == (S.EVICTED, None, None, None)
    slot.requeue()
    assert slot.state is S.PENDING
    with pytest.raises(IllegalTransition):
        slot.evict()  # a pending slot has no slab to evict
    assert slot.state is S.PENDING


def test_service_state_counts_every_slots_moves_and_leases():
    st = ServiceState(0, "host", {}, [Placement(ModelConfig("a", "/srv/a"), 1, 0, 0),
                                      Placement(ModelConfig("b", "/srv/b"), 1, 0, 0)])
    a, b = st.slots
    a.start(0.0)
    b.start(0.0)
    a.fail(ModelNotFound("x"))
    assert st.transition_counts == {(S.PENDING, E.START, S.LOADING): 2, (S.LOADING, E.FAIL, S.FAILED): 1}
    assert not st.settled
    b.loaded(None, None, None)
    assert st.settled and st.status_line(1.0) == "ready: 1/2 slabs resident; failed: a/tp1/rank0 (model_not_found)"


def test_find_slots_by_name_path_and_layout(tmp_path):
    (tmp_path / "ck").mkdir()
    st = ServiceState(3, "host", {}, [Placement(ModelConfig("a", str(tmp_path / "ck")), 2, r, 3) for r in (0, 1)])
    assert [s.placement.tp_rank for s in st.find_slots("a")] == [0, 1]
    assert [s.placement.tp_rank for s in st.find_slots(str(tmp_path / "ck") + "/", 2, 1)] == [1]
    for bad in (("b",), ("a", 4), ("a\0",)):
        with pytest.raises(ModelNotFound) as ei:
            st.find_slots(*bad)
        assert ei.value.code == "model_not_found" and ei.value.details["gpu"] == 3


def test_find_slots_names_the_values_a_held_checkpoint_has_when_only_they_differ(tmp_path):
    """An engine asking by name for ``naming=hf dtype=bfloat16`` where the operator configured the checkpoint as
    ``vllm``/``float32`` hears which values the slab has, not only "it holds: llama/tp1/rank0"."""
    (tmp_path / "ck").mkdir()
    st = ServiceState(0, "host", {}, [
        Placement(ModelConfig("llama", str(tmp_path / "ck"), dtype="float32", naming="vllm"), 1, 0, 0),
        Placement(ModelConfig("other", "/srv/other"), 1, 0, 0)])
    with pytest.raises(ModelNotFound) as ei:
        st.find_slots("llama", 1, 0, dtype="bfloat16", naming="hf")
    msg = ei.value.message
    assert msg.startswith("GPU 0 has no model 'llama' with tp_size=1 tp_rank=0 dtype=bfloat16 naming=hf; it holds: "
                          "llama/tp1/rank0, other/tp1/rank0; this checkpoint is held here with other values: "
                          "llama/tp1/rank0 (dtype=float32, naming=vllm): ask for those"), msg
    assert ei.value.details["held_otherwise"] == [{"slab": "llama/tp1/rank0", "dtype": "float32", "naming": "vllm"}]
    with pytest.raises(ModelNotFound) as ei:  # by path, another layout: only the field that differs
        st.find_slots(str(tmp_path / "ck"), 2, 0)
    assert ei.value.details["held_otherwise"] == [{"slab": "llama/tp1/rank0", "tp_size": 1}]
    assert "llama/tp1/rank0 (tp_size=1)" in ei.value.message
    with pytest.raises(ModelNotFound) as ei:  # a model this GPU does not hold at all: no such hint
        st.find_slots("absent")
    assert "held_otherwise" not in ei.value.details and "other values" not in ei.value.message
