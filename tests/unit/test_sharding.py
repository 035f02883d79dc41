"""Tensor-parallel sharding: rules, fused names, tied aliases, errors; shards reassemble byte for byte."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoints import write_checkpoint  # noqa: E402
from tiny_models import (  # noqa: E402
    checkpoint_tensors,
    load_rank,
    reassemble,
    tiny_llama,  # noqa: F401  (fixture)
    tiny_mistral,  # noqa: F401
    tiny_qwen2,  # noqa: F401
)

from weightcache import sharding  # noqa: E402
from weightcache.checkpoint import Checkpoint  # noqa: E402
from weightcache.errors import ConfigError, ShapeMismatch, UnsupportedArchitecture  # noqa: E402
from weightcache.tensor_spec import SourceRef  # noqa: E402

FAMILIES = ("tiny_llama", "tiny_qwen2", "tiny_mistral")


def _record(manifest, name):
    """The manifest's record of tensor ``name``."""
    return next(t for t in manifest.tensors if t.name == name)


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _load_all(path: Path, tp: int, naming: str, dtype: str = "auto"):
    return [load_rank(path, tp, r, naming, dtype) for r in range(tp)]


def _close(ranks) -> None:
    # Close the fds only: the views keep their mmap objects alive and the
    # mappings go with the last view (HostSealedSlab.close() would unmap under
    # live views, which a failing assertion's report may still print).
    for _, _, slab in ranks:
        os.close(slab.fd)
        slab.fd = -1


@pytest.mark.parametrize("naming", ["hf", "vllm"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_shards_reassemble_to_checkpoint_bytes(family, tp, naming, request):
    path = request.getfixturevalue(family)
    ck = checkpoint_tensors(path)
    config = json.loads((path / "config.json").read_text())
    ranks = _load_all(path, tp, naming)
    try:
        full = reassemble([(m, v) for m, v, _ in ranks])
        tied = config["tie_word_embeddings"]
        expected = set(ck) - ({"lm_head.weight"} if tied else set())
        assert set(full) == expected
        for name in expected:
            assert _bytes_equal(full[name], ck[name]), name
        for manifest, views, _ in ranks:
            assert manifest.tp_size == tp
            emb = _record(manifest, "model.embed_tokens.weight")
            assert emb.layout["logical_vocab_size"] == config["vocab_size"]
            padded = -(-config["vocab_size"] // 64) * 64 if (tp > 1 or naming == "vllm") else config["vocab_size"]
            assert emb.layout["padded_vocab_size"] == padded
            assert emb.shape == (padded // tp, config["hidden_size"])
            lm = _record(manifest, "lm_head.weight")
            if tied:
                assert lm.alias_of == "model.embed_tokens.weight"
                assert lm.layout["tied_to"] == "model.embed_tokens.weight"
                assert lm.offset_bytes == emb.offset_bytes
                assert views["lm_head.weight"] is views["model.embed_tokens.weight"]
            else:
                assert lm.alias_of is None
            names = {r.name for r in manifest.tensors}
            if naming == "vllm":
                assert "model.layers.0.self_attn.qkv_proj.weight" in names
                assert "model.layers.0.mlp.gate_up_proj.weight" in names
                assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)
            else:
                assert names == set(ck) | {"lm_head.weight"}
    finally:
        _close(ranks)


def test_qwen2_tp4_gqa_kv_heads_replicated_as_vllm(tiny_qwen2):
    # 8 heads, 2 KV heads, head_dim 8, TP 4: vLLM gives every rank 1 KV head,
    # replicated on 4 // 2 = 2 ranks; rank r takes KV head r // 2.
    ck = Checkpoint(tiny_qwen2)
    for rank, kv_head in enumerate([0, 0, 1, 1]):
        specs = {s.name: s for s in sharding.shard_specs(ck, 4, rank, "hf", None)}
        k = specs["model.layers.0.self_attn.k_proj.weight"]
        assert k.sources == (SourceRef("model.layers.0.self_attn.k_proj.weight", 0, kv_head * 8, kv_head * 8 + 8),)
        assert k.stored_shape == (8, 64)
        assert k.layout == {"tp_dim": 0, "tp_size": 4, "tp_rank": rank, "logical_shape": [16, 64],
                            "shard_start": kv_head * 8, "shard_size": 8, "kv_head_replicas": 2}
        kb = specs["model.layers.0.self_attn.k_proj.bias"]
        assert kb.sources == (SourceRef("model.layers.0.self_attn.k_proj.bias", 0, kv_head * 8, kv_head * 8 + 8),)
        q = specs["model.layers.0.self_attn.q_proj.bias"]
        assert q.sources == (SourceRef("model.layers.0.self_attn.q_proj.bias", 0, rank * 16, rank * 16 + 16),)
        o = specs["model.layers.0.self_attn.o_proj.weight"]
        assert o.sources == (SourceRef("model.layers.0.self_attn.o_proj.weight", 1, rank * 16, rank * 16 + 16),)
        assert o.stored_shape == (64, 16)
        assert specs["model.norm.weight"].layout == {"tp_dim": None}
        assert specs["model.norm.weight"].sources == (SourceRef("model.norm.weight"),)


def test_qwen2_vllm_fused_qkv_parts(tiny_qwen2):
    ck = Checkpoint(tiny_qwen2)
    specs = {s.name: s for s in sharding.shard_specs(ck, 4, 3, "vllm", None)}
    qkv = specs["model.layers.1.self_attn.qkv_proj.weight"]
    p = "model.layers.1.self_attn."
    assert qkv.stored_shape == (32, 64) and qkv.cat_dim == 0
    assert qkv.sources == (SourceRef(p + "q_proj.weight", 0, 48, 64), SourceRef(p + "k_proj.weight", 0, 8, 16),
                           SourceRef(p + "v_proj.weight", 0, 8, 16))
    parts = qkv.layout["fused_parts"]
    assert [(x["name"], x["source"], x["offset"], x["size"]) for x in parts] == [
        ("q_proj", p + "q_proj.weight", 0, 16), ("k_proj", p + "k_proj.weight", 16, 8),
        ("v_proj", p + "v_proj.weight", 24, 8)]
    assert qkv.layout["tp_dim"] == 0
    bias = specs["model.layers.1.self_attn.qkv_proj.bias"]
    assert bias.stored_shape == (32,)
    gate_up = specs["model.layers.1.mlp.gate_up_proj.weight"]
    assert gate_up.stored_shape == (48, 64)  # intermediate 96 / 4 = 24 rows of gate, then 24 of up
    assert [(x["name"], x["offset"], x["size"]) for x in gate_up.layout["fused_parts"]] == [
        ("gate_proj", 0, 24), ("up_proj", 24, 24)]


def test_llama_vocab_padding_rows(tiny_llama):
    # vocab 130 -> padded to 192 (multiple of 64); TP 4: 48 rows per rank.
    ck = Checkpoint(tiny_llama)
    got = []
    for rank in range(4):
        s = {x.name: x for x in sharding.shard_specs(ck, 4, rank, "hf", None)}["lm_head.weight"]
        got.append((s.sources[0].start, s.sources[0].stop, s.op_args.get("pad_rows", 0), s.stored_shape))
    assert got == [(0, 48, 0, (48, 64)), (48, 96, 0, (48, 64)), (96, 130, 14, (48, 64)), (130, 130, 48, (48, 64))]


def test_padding_with_dtype_cast_is_zeros(tiny_llama):
    ck = checkpoint_tensors(tiny_llama)
    ranks = _load_all(tiny_llama, 2, "vllm", dtype="bfloat16")
    try:
        emb = [v["model.embed_tokens.weight"] for _, v, _ in ranks]
        assert all(e.dtype == torch.bfloat16 and e.shape == (96, 64) for e in emb)
        want = ck["model.embed_tokens.weight"].to(torch.bfloat16)
        assert _bytes_equal(emb[0], want[:96])
        assert _bytes_equal(emb[1][:34], want[96:])
        assert not emb[1][34:].view(torch.uint8).any()
    finally:
        _close(ranks)


def _tiny_config(**kw):
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8, intermediate_size=16,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=70,
               tie_word_embeddings=False, rms_norm_eps=1e-6)
    cfg.update(kw)
    return cfg


def _tiny_tensors(cfg, dtype=torch.float32):
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {
        "model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,),
        "model.layers.0.input_layernorm.weight": (h,), "model.layers.0.post_attention_layernorm.weight": (h,),
        "model.layers.0.self_attn.q_proj.weight": (q, h), "model.layers.0.self_attn.k_proj.weight": (kv, h),
        "model.layers.0.self_attn.v_proj.weight": (kv, h), "model.layers.0.self_attn.o_proj.weight": (h, q),
        "model.layers.0.mlp.gate_proj.weight": (i, h), "model.layers.0.mlp.up_proj.weight": (i, h),
        "model.layers.0.mlp.down_proj.weight": (h, i),
    }
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}


def test_tied_checkpoint_with_lm_head_still_aliases(tmp_path):
    cfg = _tiny_config(tie_word_embeddings=True)
    tensors = _tiny_tensors(cfg)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    path = write_checkpoint(tmp_path / "tied", tensors, cfg, files=2)
    for naming in ("hf", "vllm"):
        ranks = _load_all(path, 2, naming)
        try:
            for manifest, views, _ in ranks:
                lm = _record(manifest, "lm_head.weight")
                assert lm.alias_of == "model.embed_tokens.weight"
                assert views["lm_head.weight"] is views["model.embed_tokens.weight"]
                assert sum(1 for r in manifest.tensors if r.offset_bytes == lm.offset_bytes) == 2
            full = reassemble([(m, v) for m, v, _ in ranks])
            assert "lm_head.weight" not in full
            assert _bytes_equal(full["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
        finally:
            _close(ranks)


def test_unknown_architecture_tp1_hf_generic(tmp_path):
    cfg = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}
    tensors = {"gpt_neox.embed_in.weight": torch.arange(12.0).reshape(4, 3), "gpt_neox.ln.bias": torch.ones(3)}
    ck = Checkpoint(write_checkpoint(tmp_path / "neox", tensors, cfg, files=2))
    specs = sharding.shard_specs(ck, 1, 0, "hf", "BF16")
    assert [(s.name, s.dtype, s.stored_shape, s.sources) for s in specs] == [
        ("gpt_neox.embed_in.weight", "BF16", (4, 3), (SourceRef("gpt_neox.embed_in.weight"),)),
        ("gpt_neox.ln.bias", "BF16", (3,), (SourceRef("gpt_neox.ln.bias"),)),
    ]
    sharding.check_supported(cfg, 1, "hf")
    for tp, naming in ((2, "hf"), (1, "vllm"), (4, "vllm")):
        with pytest.raises(UnsupportedArchitecture) as e:
            sharding.shard_specs(ck, tp, 0, naming, None)
        assert e.value.code == "unsupported_architecture"
        assert e.value.details["supported"] == ["llama", "mistral", "qwen2"]
        # the advice fits the naming: naming = "vllm" is the engine's to lay out (the service shows it
        # waiting_for_engine), not a reason to switch to naming = "hf"
        advice = ("a vLLM engine started with --load-format weightcache lays it out and publishes it"
                  if naming == "vllm" else 'use tp = 1 with naming = "hf" for this model')
        assert advice in e.value.message and ("naming = \"hf\"" in e.value.message) == (naming == "hf")
        with pytest.raises(UnsupportedArchitecture):
            sharding.check_supported(cfg, tp, naming)


@pytest.mark.parametrize("overrides,tp,field", [
    (dict(num_attention_heads=8, num_key_value_heads=8, hidden_size=64), 3, "num_attention_heads"),
    (dict(num_attention_heads=12, num_key_value_heads=6, hidden_size=96), 4, "num_key_value_heads"),  # 6 % 4
    (dict(num_attention_heads=12, num_key_value_heads=3, hidden_size=96), 4, "num_key_value_heads"),  # 4 % 3
    (dict(intermediate_size=100, num_attention_heads=8, num_key_value_heads=8, hidden_size=64), 8,
     "intermediate_size"),
    (dict(vocab_size=100, num_attention_heads=256, num_key_value_heads=256, hidden_size=256,
          intermediate_size=256), 256, "vocab_size"),  # padded 128 % 256
])
def test_check_supported_divisibility(overrides, tp, field):
    with pytest.raises(ShapeMismatch) as e:
        sharding.check_supported(_tiny_config(**overrides), tp, "hf")
    assert e.value.code == "shape_mismatch"
    assert e.value.details["field"] == field


def test_check_supported_accepts_replicated_kv():
    sharding.check_supported(_tiny_config(num_attention_heads=8, num_key_value_heads=2, hidden_size=64), 8, "vllm")
    sharding.check_supported({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                              "num_key_value_heads": 4, "intermediate_size": 64, "vocab_size": 10}, 2, "vllm")


def test_tensor_disagreeing_with_config_names_file_and_tensor(tmp_path):
    tensors = _tiny_tensors(_tiny_config())
    bad = _tiny_config(num_key_value_heads=1)  # k_proj/v_proj on disk have 2 heads
    ck = Checkpoint(write_checkpoint(tmp_path / "bad", tensors, bad, files=2))
    with pytest.raises(ShapeMismatch) as e:
        sharding.shard_specs(ck, 2, 0, "hf", None)
    assert e.value.code == "shape_mismatch"
    assert e.value.details["tensor"] == "model.layers.0.self_attn.k_proj.weight"
    assert e.value.details["file"] == ck.tensors["model.layers.0.self_attn.k_proj.weight"].file
    assert e.value.details["expected"] == [4, 8] and e.value.details["actual"] == [8, 8]


def test_unknown_2d_tensor_needs_rule_at_tp2(tmp_path):
    cfg = _tiny_config()
    tensors = _tiny_tensors(cfg)
    tensors["model.layers.0.extra.weight"] = torch.zeros(4, 4)
    tensors["model.layers.0.extra.bias"] = torch.zeros(4)
    ck = Checkpoint(write_checkpoint(tmp_path / "extra", tensors, cfg, files=2))
    with pytest.raises(UnsupportedArchitecture) as e:
        sharding.shard_specs(ck, 2, 0, "hf", None)
    assert e.value.details["tensor"] == "model.layers.0.extra.weight"
    specs = {s.name: s for s in sharding.shard_specs(ck, 1, 0, "vllm", None)}
    assert specs["model.layers.0.extra.weight"].layout == {"tp_dim": None}


@pytest.mark.parametrize("tp,rank,naming", [(0, 0, "hf"), (2, 2, "hf"), (2, -1, "hf"), (2, 0, "megatron")])
def test_bad_layout_arguments(tiny_llama, tp, rank, naming):
    with pytest.raises(ConfigError) as e:
        sharding.shard_specs(Checkpoint(tiny_llama), tp, rank, naming, None)
    assert e.value.code == "config_invalid"


def _fp8_checkpoint(tmp_path, per_channel: bool):
    """ModelOpt-style FP8 layers: F8_E4M3 weights, F32 scales (shapes only matter to sharding)."""
    cfg = _tiny_config(num_attention_heads=4, num_key_value_heads=2, hidden_size=16, intermediate_size=32)
    tensors = _tiny_tensors(cfg)
    for name in list(tensors):
        if ".layers." in name and name.endswith("proj.weight"):
            w = tensors[name].to(torch.float8_e4m3fn)
            tensors[name] = w
            rows = w.shape[0]
            tensors[name[:-7] + ".weight_scale"] = (torch.arange(1, rows + 1, dtype=torch.float32) / 64
                                                     if per_channel else torch.tensor(0.5 + rows / 64))
            if not per_channel:
                tensors[name[:-7] + ".input_scale"] = torch.tensor(0.25 + rows / 128)
    tensors["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(1.5)
    tensors["model.layers.0.self_attn.v_proj.v_scale"] = torch.tensor(2.5)
    return write_checkpoint(tmp_path / ("fp8c" if per_channel else "fp8t"), tensors, cfg, files=3), tensors


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_scales_follow_their_weights(tmp_path, per_channel):
    path, tensors = _fp8_checkpoint(tmp_path, per_channel)
    ck = Checkpoint(path)
    p = "model.layers.0."
    hf = {s.name: s for s in sharding.shard_specs(ck, 4, 3, "hf", "BF16")}
    assert hf[p + "self_attn.q_proj.weight"].dtype == "F8_E4M3"
    assert hf[p + "mlp.down_proj.weight_scale"].layout == {"tp_dim": None}
    assert hf[p + "self_attn.k_proj.k_scale"].dtype == "F32"
    qs = hf[p + "self_attn.q_proj.weight_scale"]
    assert qs.dtype == "F32"  # scales keep F32 whatever the model dtype
    if per_channel:
        # q: 4 heads * 4 = 16 rows, rank 3 of 4 -> rows 12..16; k: 2 KV heads, replicas 2, rank 3 -> head 1
        assert qs.sources == (SourceRef(p + "self_attn.q_proj.weight_scale", 0, 12, 16),)
        assert hf[p + "self_attn.k_proj.weight_scale"].sources == (
            SourceRef(p + "self_attn.k_proj.weight_scale", 0, 4, 8),)
    else:
        assert qs.layout == {"tp_dim": None} and qs.stored_shape == ()
        assert hf[p + "self_attn.q_proj.input_scale"].layout == {"tp_dim": None}
    vl = {s.name: s for s in sharding.shard_specs(ck, 4, 3, "vllm", "BF16")}
    fs = vl[p + "self_attn.qkv_proj.weight_scale"]
    assert [x["source"] for x in fs.layout["fused_parts"]] == [
        p + "self_attn.q_proj.weight_scale", p + "self_attn.k_proj.weight_scale", p + "self_attn.v_proj.weight_scale"]
    assert fs.dtype == "F32"
    assert fs.stored_shape == ((4 + 4 + 4,) if per_channel else (3,))
    assert vl[p + "mlp.gate_up_proj.weight_scale"].stored_shape == ((16,) if per_channel else (2,))
    assert vl[p + "self_attn.attn.k_scale"].layout["source"] == p + "self_attn.k_proj.k_scale"
    if not per_channel:
        assert vl[p + "self_attn.qkv_proj.input_scale"].stored_shape == (3,)
    # And the bytes round-trip through the pipeline (no quant config on disk: plain copies).
    for naming in ("hf", "vllm"):
        ranks = _load_all(path, 2, naming, dtype="bfloat16")
        try:
            full = reassemble([(m, v) for m, v, _ in ranks])
            for name, t in tensors.items():
                if t.dtype == torch.float32 and t.dim() == 2:
                    t = t.to(torch.bfloat16)  # unquantized 2-D weights follow the model dtype
                elif t.dim() == 1 and not name.endswith("_scale"):
                    t = t.to(torch.bfloat16)
                assert _bytes_equal(full[name], t), name
        finally:
            _close(ranks)
