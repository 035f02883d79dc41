"""Issue 35: the advice of ``model_not_found`` when the checkpoint is held with other values is one that works.

A checkpoint configured with ``naming = "vllm"`` whose architecture has no vLLM naming rules fails to load
(``unsupported_architecture``); an engine that then asks for ``naming=hf`` was told "this checkpoint is held
here with other values: qwen3/tp1/rank0 (naming=vllm): ask for those", which fails the same way. A failed slab
is not offered: the advice is to give the entry the values asked for, then reload the service.
"""

from __future__ import annotations

import pytest

from weightcache.config import ModelConfig, Placement
from weightcache.daemon.state import ServiceState
from weightcache.errors import ModelNotFound, UnsupportedArchitecture


def _state(tmp_path, fail: bool) -> ServiceState:
    (tmp_path / "ck").mkdir()
    st = ServiceState(0, "host", {}, [Placement(ModelConfig("qwen3", str(tmp_path / "ck"), naming="vllm"), 1, 0, 0)])
    if fail:
        (slot,) = st.slots
        slot.start(0.0)
        slot.fail(UnsupportedArchitecture("no vLLM naming rules for Qwen3ForCausalLM", architecture="Qwen3"))
    return st


def test_a_failed_slab_is_not_offered_and_the_advice_is_the_entry_and_a_reload(tmp_path):
    st = _state(tmp_path, fail=True)
    with pytest.raises(ModelNotFound) as ei:
        st.find_slots(str(tmp_path / "ck"), 1, 0, naming="hf")
    msg = ei.value.message
    assert ei.value.code == "model_not_found"
    assert "ask for those" not in msg, msg
    assert ("this checkpoint's entry with other values failed to load: qwen3/tp1/rank0 (naming=vllm; "
            "unsupported_architecture): give the model's entry in the configuration the values asked for "
            "(naming=hf) and run `systemctl reload weightcache@0`") in msg, msg
    assert ei.value.details["held_otherwise"] == [{"slab": "qwen3/tp1/rank0", "naming": "vllm"}]


def test_a_slab_that_can_be_attached_is_still_offered(tmp_path):
    st = _state(tmp_path, fail=False)
    with pytest.raises(ModelNotFound) as ei:
        st.find_slots(str(tmp_path / "ck"), 1, 0, naming="hf")
    assert "qwen3/tp1/rank0 (naming=vllm): ask for those" in ei.value.message
    assert "failed to load" not in ei.value.message


def test_a_slab_waiting_for_its_engine_is_not_offered_and_the_advice_is_the_publication(tmp_path):
    """Issue 35: ``naming = "vllm"`` the service cannot lay out waits for its engine (not ``failed``); an engine that
    asks ``naming=hf`` is told how that model is served: an engine in zero-copy mode publishes it."""
    (tmp_path / "ck").mkdir()
    st = ServiceState(0, "host", {}, [Placement(ModelConfig("qwen3", str(tmp_path / "ck"), naming="vllm"), 1, 0, 0)])
    (slot,) = st.slots
    slot.start(0.0)
    slot.await_engine(UnsupportedArchitecture("no vLLM naming rules for Qwen3ForCausalLM", architecture="Qwen3"))
    assert slot.state.value == "waiting_for_engine" and st.settled
    with pytest.raises(ModelNotFound) as ei:
        st.find_slots(str(tmp_path / "ck"), 1, 0, naming="hf")
    msg = ei.value.message
    assert "ask for those" not in msg and "failed to load" not in msg, msg
    assert ("this checkpoint's entry with other values waits for its engine: qwen3/tp1/rank0 (naming=vllm): the "
            "service cannot lay it out itself; start the engine with --load-format weightcache (mode zero_copy, "
            "the default), which publishes it") in msg, msg
    assert "waiting for its engine to publish: qwen3/tp1/rank0" in st.status_line(0.0)
