"""Small NVIDIA ModelOpt FP8 checkpoints for tests, built from a tiny transformers Llama.

The checkpoints follow what ``nvidia-modelopt``'s ``export_hf_checkpoint``
writes (``modelopt/torch/export/unified_export_hf.py`` and
``convert_hf_config.py``):

- ``model.safetensors``: every quantized linear ``M`` as ``M.weight``
  ``F8_E4M3 [N, K]``, ``M.weight_scale`` ``F32`` (0-d for ``FP8``, ``[N]``
  for ``FP8_PER_CHANNEL_PER_TOKEN``), ``M.input_scale`` ``F32`` 0-d
  (``FP8`` only); ``k_proj.k_scale`` / ``v_proj.v_scale`` ``F32`` 0-d when
  the KV cache is FP8; everything else (embeddings, norms, ``lm_head``) in
  ``BF16``.
- ``hf_quant_config.json``: ``{"producer": {...}, "quantization":
  {"quant_algo", "kv_cache_quant_algo", "exclude_modules"}}``.
- ``config.json`` with ``quantization_config`` (``quant_method:
  "modelopt"``, ``quant_algo``, ``ignore``, ``kv_cache_scheme``,
  ``config_groups``, ``producer``).

Model: hidden 64, 4 heads of 16 (2 KV heads), intermediate 40 (so
``gate_proj``/``up_proj`` have N = 40, not a multiple of 16, and
``down_proj`` has K = 40), 2 layers, vocab 128, untied ``lm_head``. Weight
scales are ``amax / 448`` per weight (per-tensor) or per row
(per-channel); ``k_proj``/``v_proj``/``up_proj`` are rescaled before
quantization so fused parts have clearly unequal per-tensor scales. Input and
KV scales come from a calibration forward pass (``amax / 448``). Everything is
deterministic for a given ``seed``.

Reuse: :func:`write_fp8_checkpoint` (any variant), or the shorthands
:func:`write_fp8_per_tensor` and :func:`write_fp8_per_channel`;
:func:`dequantized_linears` gives the checkpoint's dequantized weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FP8_MAX = 448.0
PER_TENSOR = "FP8"
PER_CHANNEL = "FP8_PER_CHANNEL_PER_TOKEN"
#: Modules left in BF16 (ModelOpt's exclude list for a Llama, plus the embedding).
EXCLUDE = ["lm_head", "model.embed_tokens"]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
#: Multipliers applied to the float weights before quantization so per-tensor
#: scales of fused parts differ (q|k|v, gate|up).
RESCALE = {"self_attn.k_proj": 1.7, "self_attn.v_proj": 0.45, "mlp.up_proj": 1.9}
CALIBRATION_IDS = [[3, 17, 42, 99, 5, 64, 21, 7, 120, 33, 8, 71]]


def tiny_llama_config(intermediate_size: int = 40, num_hidden_layers: int = 2, vocab_size: int = 128):
    """The tiny ``LlamaConfig`` of the fixtures (hidden 64, heads 4x16, 2 KV heads)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.08,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )


def build_llama(seed: int = 0, intermediate_size: int = 40):
    """A deterministic tiny ``LlamaForCausalLM`` in float32 (weights of fused parts rescaled)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(intermediate_size)).eval()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for name, f in RESCALE.items():
                mod = layer.get_submodule(name)
                mod.weight.mul_(f)
            # Norm weights away from 1.0 so they matter.
            layer.input_layernorm.weight.uniform_(0.8, 1.2)
            layer.post_attention_layernorm.weight.uniform_(0.8, 1.2)
    return model


def _calibrate(model) -> dict[str, float]:
    """amax of each linear's input, and of k_proj/v_proj outputs, over the calibration batch."""
    amax: dict[str, float] = {}
    hooks = []
    for lname, layer in enumerate(model.model.layers):
        for name in LINEARS:
            full = f"model.layers.{lname}.{name}"
            mod = layer.get_submodule(name)

            def hook(m, inp, out, full=full):
                amax[full + ".in"] = max(amax.get(full + ".in", 0.0), inp[0].detach().abs().max().item())
                amax[full + ".out"] = max(amax.get(full + ".out", 0.0), out.detach().abs().max().item())

            hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        model(torch.tensor(CALIBRATION_IDS))
    for h in hooks:
        h.remove()
    return amax


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F8_E4M3 [N, K], F32 0-d scale)`` with ``scale = amax / 448``."""
    scale = (w.abs().max().float() / FP8_MAX).clamp(min=1e-12)
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.reshape(())


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F8_E4M3 [N, K], F32 [N] scales)`` with one ``amax / 448`` per output row."""
    scale = (w.abs().amax(dim=1).float() / FP8_MAX).clamp(min=1e-12)
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _hf_quant_config(algo: str, kv: str | None, exclude: list[str]) -> dict:
    return {
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {"quant_algo": algo, "kv_cache_quant_algo": kv, "exclude_modules": list(exclude)},
    }


def _config_json_quant(algo: str, kv: str | None, exclude: list[str]) -> dict:
    if algo == PER_CHANNEL:
        group = {
            "input_activations": {"dynamic": True, "num_bits": 8, "type": "float", "strategy": "token"},
            "weights": {"dynamic": False, "num_bits": 8, "type": "float", "strategy": "channel"},
            "targets": ["Linear"],
        }
    else:
        group = {
            "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
            "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
            "targets": ["Linear"],
        }
    out = {
        "config_groups": {"group_0": group},
        "ignore": list(exclude),
        "quant_algo": algo,
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quant_method": "modelopt",
    }
    if kv:
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    return out


def write_fp8_checkpoint(
    path: str | Path,
    algo: str = PER_TENSOR,
    config_style: str = "both",
    seed: int = 0,
    kv_cache: bool | None = None,
    exclude: list[str] | None = None,
    intermediate_size: int = 40,
) -> Path:
    """Writes a ModelOpt FP8 checkpoint directory and returns its path.

    Args:
        path: directory to create (may exist).
        algo (`str`): ``"FP8"`` (per-tensor weight + static input scales) or
            ``"FP8_PER_CHANNEL_PER_TOKEN"`` (per-row weight scales, no input scales).
        config_style (`str`): ``"both"`` (``hf_quant_config.json`` and
            ``config.json`` ``quantization_config``, as recent ModelOpt
            exports), ``"hf_quant_config"`` (only the former, as older
            exports) or ``"config_json"`` (only the latter).
        seed (`int`): model seed.
        kv_cache (`bool`, *optional*): write ``k_scale``/``v_scale`` and set
            ``kv_cache_quant_algo`` FP8; defaults to ``True`` for ``FP8`` and
            ``False`` for per-channel.
        exclude (`list[str]`, *optional*): exclude list; defaults to :data:`EXCLUDE`.
        intermediate_size (`int`): MLP width (40: not a multiple of 16).

    Returns:
        `Path` of the checkpoint directory.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if kv_cache is None:
        kv_cache = algo == PER_TENSOR
    exclude = list(EXCLUDE if exclude is None else exclude)
    model = build_llama(seed, intermediate_size)
    amax = _calibrate(model)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        module = name.rsplit(".", 1)[0]
        is_linear = any(module.endswith(l) for l in LINEARS)
        if is_linear and name.endswith(".weight"):
            if algo == PER_CHANNEL:
                q, s = quantize_per_channel(t)
            else:
                q, s = quantize_per_tensor(t)
            tensors[name] = q.contiguous()
            tensors[f"{module}.weight_scale"] = s.contiguous()
            if algo == PER_TENSOR:
                tensors[f"{module}.input_scale"] = torch.tensor(max(amax[module + ".in"], 1e-6) / FP8_MAX,
                                                                dtype=torch.float32)
            if kv_cache and module.endswith("k_proj"):
                tensors[f"{module}.k_scale"] = torch.tensor(amax[module + ".out"] / FP8_MAX, dtype=torch.float32)
            if kv_cache and module.endswith("v_proj"):
                tensors[f"{module}.v_scale"] = torch.tensor(amax[module + ".out"] / FP8_MAX, dtype=torch.float32)
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = "bfloat16"
    kv = "FP8" if kv_cache else None
    if config_style in ("both", "config_json"):
        cfg["quantization_config"] = _config_json_quant(algo, kv, exclude)
    if config_style in ("both", "hf_quant_config"):
        (path / "hf_quant_config.json").write_text(json.dumps(_hf_quant_config(algo, kv, exclude), indent=2))
    elif (path / "hf_quant_config.json").exists():
        (path / "hf_quant_config.json").unlink()
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
    return path


def write_fp8_per_tensor(path: str | Path, **kw) -> Path:
    """:func:`write_fp8_checkpoint` with ``algo="FP8"``."""
    return write_fp8_checkpoint(path, PER_TENSOR, **kw)


def write_fp8_per_channel(path: str | Path, **kw) -> Path:
    """:func:`write_fp8_checkpoint` with ``algo="FP8_PER_CHANNEL_PER_TOKEN"``."""
    return write_fp8_checkpoint(path, PER_CHANNEL, **kw)


def set_quant_config(path: str | Path, hf_quant_config: dict | None = None,
                     quantization_config: dict | None = None) -> None:
    """Replaces the checkpoint's quantization config(s) (for rejection tests).

    ``hf_quant_config`` replaces ``hf_quant_config.json``; ``quantization_config``
    replaces ``config.json``'s entry. ``None`` removes that one.
    """
    path = Path(path)
    hq = path / "hf_quant_config.json"
    if hf_quant_config is None:
        if hq.exists():
            hq.unlink()
    else:
        hq.write_text(json.dumps(hf_quant_config))
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(cfg, sort_keys=True))


def dequantized_linears(path: str | Path) -> dict[str, torch.Tensor]:
    """``{module: float32 [N, K]}``: ``weight.float() * weight_scale`` of every FP8 linear."""
    from safetensors.torch import load_file

    sd = load_file(str(Path(path) / "model.safetensors"))
    out = {}
    for name, t in sd.items():
        if name.endswith(".weight") and t.dtype == torch.float8_e4m3fn:
            m = name[:-7]
            s = sd[f"{m}.weight_scale"].float()
            out[m] = t.float() * (s.reshape(-1, 1) if s.dim() else s)
    return out


# --- the four loads, shared by the host and the cuda service tests ---------------------------

#: Prompts of the greedy-token comparison (2 prompts x 16 tokens).
PROMPTS = [[1, 5, 9, 33], [7, 7, 100, 2, 64]]


def fp8_service_models(cks: dict[str, Path]) -> dict[str, dict]:
    """Config ``[models]`` for each checkpoint of ``cks`` (algo -> path): ``<algo>_hf`` at TP 1 and
    ``<algo>_vllm`` at TP 2, both ranks on GPU 0."""
    models = {}
    for algo, path in cks.items():
        models[f"{algo.lower()}_hf"] = {"path": str(path), "naming": "hf", "layouts": [{"tp": 1, "gpus": [0]}]}
        models[f"{algo.lower()}_vllm"] = {"path": str(path), "naming": "vllm", "layouts": [{"tp": 2, "gpus": [0, 0]}]}
    return models


def check_four_loads(path: Path, algo: str, tp: int, naming: str, device: str, svc) -> None:
    """Ordinary load, missing-service fallback, attach and a second attach agree bit for bit.

    For every rank of ``tp``: the pipeline into private memory on ``device``,
    ``attach`` with no service (``fallback=True``), and two ``attach`` calls to
    ``svc`` (``fallback=False``) give the same names, dtypes, shapes, strides,
    bytes and layouts, all on ``device``; the reference engine generates the
    same greedy tokens from each; ``verify`` of the served slabs is clean.
    """
    from reference_engine import ReferenceLlama
    from weightcache import attach, protocol
    from weightcache.client import load_from_disk
    from weightcache.config import ModelConfig
    from weightcache.spec import RankRequest
    from weightcache.manifest import build_views

    dev_type = torch.device(device).type
    kw = dict(tp_size=tp, naming=naming, device=device)
    loads = {"ordinary": [], "fallback": [], "attach": [], "attach2": []}
    keep = []
    try:
        for rank in range(tp):
            man, slab = load_from_disk(RankRequest(ModelConfig("m", str(path), naming=naming), tp, rank), device)
            loads["ordinary"].append((build_views(slab, man), {r.name: r.layout for r in man.tensors}))
            fb = attach(str(path), tp_rank=rank, socket_dir="/nonexistent-wc", fallback=True, **kw)
            assert fb.source == "disk" and fb.fallback_reason.startswith("daemon_unavailable")
            loads["fallback"].append((fb.tensors, fb.layouts))
            for key in ("attach", "attach2"):
                w = attach(str(path), tp_rank=rank, socket_dir=svc.socket_dir, fallback=False, **kw)
                assert w.source == "daemon", w.fallback_reason
                keep.append(w)
                loads[key].append((w.tensors, w.layouts))
        for key in ("fallback", "attach", "attach2"):
            for (t_ref, l_ref), (t, lay) in zip(loads["ordinary"], loads[key]):
                assert set(t) == set(t_ref), key
                for name in t_ref:
                    a, b = t_ref[name], t[name]
                    assert b.device.type == dev_type, (key, name)
                    assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), (key, name)
                    fp8 = a.dtype == torch.float8_e4m3fn
                    assert torch.equal(a.view(torch.uint8) if fp8 else a, b.view(torch.uint8) if fp8 else b), \
                        (key, name)
                assert lay == l_ref
        cfg = json.loads((path / "config.json").read_text())
        tokens = {k: [ReferenceLlama(cfg, [t for t, _ in r], [lay for _, lay in r]).generate(p, 16)
                      for p in PROMPTS] for k, r in loads.items()}
        assert all(len(t) == 16 for t in tokens["ordinary"])
        assert tokens["fallback"] == tokens["attach"] == tokens["attach2"] == tokens["ordinary"], tokens
        # Both attachments read the same memory and left it unchanged.
        res = svc.request(protocol.Verify(f"{algo.lower()}_{naming}")).results
        assert res and all(r["mismatched"] == [] and r["state"] == "ready" for r in res), res
    finally:
        for w in keep:
            w.close()
