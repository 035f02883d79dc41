"""Issue 35 part 4: quantization configs are read where vLLM reads them, so no quantized checkpoint is
planned as unquantized.

vLLM (0.32 to 0.34) reads ``config.json``'s ``quantization_config``, else ``hf_quant_config.json``, else
``text_config.quantization_config``, else ``compression_config`` (older compressed-tensors exports), and with
``--quantization gptq|awq`` the exporter's own ``quantize_config.json`` / ``quant_config.json``. The service read
only the first two: a compressed-tensors checkpoint under ``compression_config`` and a GPTQ checkpoint with only
``quantize_config.json`` were planned as ``quant=none``, slabs no engine can use. Each checkpoint here is written
as the hubs ship it (tests/hub_quant_fixtures.py); the service's own plan (``pipeline.plan``) must refuse it
with ``unsupported_quantization`` naming the scheme, before any weight byte is read.
"""

from __future__ import annotations

import json

import pytest
import torch

import hub_quant_fixtures as hub
from checkpoints import llama_checkpoint, write_checkpoint
from weightcache import pipeline, quant
from weightcache.checkpoint import Checkpoint
from weightcache.config import ModelConfig, Placement
from weightcache.errors import UnsupportedQuantization

DEVICE = {"backend": "host", "gpu_uuid": "", "compute_capability": ""}

CASES = [(scheme, where) for scheme, wheres in hub.WHERE.items() for where in wheres]


@pytest.mark.parametrize("scheme,where", CASES, ids=[f"{s}-{w}" for s, w in CASES])
def test_every_place_vllm_reads_is_read(tmp_path, scheme, where):
    ck = Checkpoint(hub.write_hub_checkpoint(tmp_path / "ck", scheme, where=where), validate=False)
    qc = quant.read_config(ck)
    assert qc is not None and qc.method == hub.QUANT_METHOD[scheme], qc
    assert qc.file.endswith(where if where.endswith(".json") else "config.json")


@pytest.mark.parametrize("scheme,where", CASES, ids=[f"{s}-{w}" for s, w in CASES])
def test_the_service_plan_refuses_instead_of_planning_unquantized(tmp_path, scheme, where):
    path = hub.write_hub_checkpoint(tmp_path / "ck", scheme, where=where)
    for tp_size, naming in ((1, "hf"), (2, "vllm")):
        rank = Placement(ModelConfig("m", str(path), naming=naming), tp_size, 0, 0)
        with pytest.raises(UnsupportedQuantization) as ei:
            pipeline.plan(rank, DEVICE)
        assert ei.value.code == "unsupported_quantization"
        assert hub.QUANT_METHOD[scheme] in ei.value.details["scheme"], ei.value.details


def test_text_config_quantization_config_is_read(tmp_path):
    path = llama_checkpoint(tmp_path / "ck", files=1)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"] = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64}}
    (path / "config.json").write_text(json.dumps(cfg))
    qc = quant.read_config(Checkpoint(path, validate=False))
    assert qc is not None and qc.method == "awq" and qc.file.endswith("config.json")


def test_toolchain_file_method_guess(tmp_path):
    """AutoGPTQ's quantize_config.json (``bits``, ``desc_act``, no quant_method) is GPTQ; AutoAWQ's keys are
    AWQ; a ``quant_method`` in the file wins."""
    path = llama_checkpoint(tmp_path / "ck", files=1)
    for body, method in (({"bits": 4, "group_size": 64, "desc_act": False}, "gptq"),
                         ({"w_bit": 4, "q_group_size": 64, "zero_point": True}, "awq"),
                         ({"bits": 4, "quant_method": "AWQ"}, "awq")):
        (path / "quantize_config.json").write_text(json.dumps(body))
        assert quant.read_config(Checkpoint(path, validate=False)).method == method, body


def test_quantized_tensors_without_any_config_are_refused(tmp_path):
    """No config anywhere, yet GPTQ tensors: not planned as unquantized."""
    path = hub.write_hub_checkpoint(tmp_path / "ck", "gptq", where="quantize_config.json")
    (path / "quantize_config.json").unlink()
    with pytest.raises(UnsupportedQuantization) as ei:
        quant.detect(Checkpoint(path, validate=False))
    assert ei.value.details["scheme"] == "unknown"
    assert ei.value.details["tensor"] == "model.layers.0.mlp.down_proj.g_idx"
    # ModelOpt-style F8_E4M3 weights with scales and no config stay plain tensors, as vLLM loads them.
    fp8 = write_checkpoint(tmp_path / "f8", {"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2).to(
        torch.float8_e4m3fn), "model.layers.0.mlp.up_proj.weight_scale": torch.ones(())},
        {"architectures": ["LlamaForCausalLM"]})
    assert quant.detect(Checkpoint(fp8, validate=False)) is None


def test_an_unquantized_checkpoint_is_still_unquantized(tmp_path):
    path = llama_checkpoint(tmp_path / "ck", files=1)
    assert quant.read_config(Checkpoint(path, validate=False)) is None
    assert quant.detect(Checkpoint(path, validate=False)) is None


def test_the_unquantized_check_of_an_indexed_checkpoint_reads_no_header(tmp_path):
    """An engine's pre-check of a sharded, unquantized checkpoint takes the tensor names from the index: every
    shard's data may be unreadable (a header read would fail) and the answer is still "unquantized"; the same
    check of a sharded GPTQ checkpoint without its config still names the quantized tensor."""
    path = llama_checkpoint(tmp_path / "ck", files=2)
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) == 2 and (path / "model.safetensors.index.json").exists()
    for f in shards:  # a header read now fails: zeroed files have an 0-byte header and no JSON
        f.write_bytes(b"\0" * f.stat().st_size)
    ck = Checkpoint(path, validate=False)
    assert quant.read_config(ck) is None
    with pytest.raises(Exception, match="safetensors|header|corrupt"):  # the headers were really unreadable
        ck.tensors  # noqa: B018
    gptq = hub.write_hub_checkpoint(tmp_path / "q", "gptq", where="quantize_config.json")
    (gptq / "quantize_config.json").unlink()
    names = list(Checkpoint(gptq, validate=False).tensors)
    index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}
    (gptq / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedQuantization) as ei:
        quant.read_config(Checkpoint(gptq, validate=False))
    assert ei.value.details["tensor"] == "model.layers.0.mlp.down_proj.g_idx"
