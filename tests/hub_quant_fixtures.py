"""Small random quantized Llama checkpoints written as the hubs ship them (issue 35), no quantizer needed.

Each is a LlamaForCausalLM (hidden 256, 4 heads of 64, 2 KV heads,
intermediate 512, 2 layers, vocab 256, untied ``lm_head``) whose seven
linears per layer are quantized; embeddings, norms and ``lm_head`` are
``F16`` (``BF16`` for compressed-tensors FP8). The bytes are random, the
layout is the exporter's:

- ``ct_fp8`` (llm-compressor's "FP8-dynamic": ``compressed-tensors``,
  ``float-quantized``): ``M.weight`` ``F8_E4M3 [N, K]``, ``M.weight_scale``
  ``F32 [N, 1]`` (per output channel), dynamic per-token activations; the
  config in ``config.json`` → ``quantization_config``
  (``where="compression_config"``: under that key, as older exports).
- ``awq`` (AutoAWQ GEMM, 4 bit, group 64, zero point): ``M.qweight``
  ``I32 [K, N / 8]``, ``M.qzeros`` ``I32 [K / 64, N / 8]``, ``M.scales``
  ``F16 [K / 64, N]``; ``quantization_config`` with ``quant_method: "awq"``
  (``where="quant_config.json"``: only AutoAWQ's own file).
- ``gptq`` (AutoGPTQ, 4 bit, group 64, symmetric, no act-order):
  ``M.qweight`` ``I32 [K / 8, N]``, ``M.qzeros`` ``I32 [K / 64, N / 8]``,
  ``M.scales`` ``F16 [K / 64, N]``, ``M.g_idx`` ``I32 [K]``;
  ``quantization_config`` with ``quant_method: "gptq"``
  (``where="quantize_config.json"``: only AutoGPTQ's own file).
- ``fp8_block`` (DeepSeek-V3 / Qwen3-FP8 style ``quant_method: "fp8"``,
  ``weight_block_size [128, 128]``): ``M.weight`` ``F8_E4M3 [N, K]``,
  ``M.weight_scale_inv`` ``F32 [ceil(N / 128), ceil(K / 128)]``.

Each scheme draws its own random model, and the quantized layers' scales are
large enough that they decide the greedy tokens (the schemes' tokens differ).
Everything is deterministic for a given ``seed``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS, VOCAB = 256, 4, 2, 512, 2, 256
GROUP = 64
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SCHEMES = ("ct_fp8", "awq", "gptq", "fp8_block")
#: The quantization config's ``quant_method`` of each scheme (what a ``fallback: false`` error names).
QUANT_METHOD = {"ct_fp8": "compressed-tensors", "awq": "awq", "gptq": "gptq", "fp8_block": "fp8"}


def _shapes() -> dict[str, tuple[int, int]]:
    """``(N, K)`` of each linear of one layer (checkpoint naming)."""
    hd = HIDDEN // HEADS
    return {"self_attn.q_proj": (HEADS * hd, HIDDEN), "self_attn.k_proj": (KV_HEADS * hd, HIDDEN),
            "self_attn.v_proj": (KV_HEADS * hd, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS * hd),
            "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN), "mlp.down_proj": (HIDDEN, INTER)}


def _config(dtype: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
            "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "head_dim": HIDDEN // HEADS, "vocab_size": VOCAB,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2}


def _ct_fp8_config() -> dict:
    def args(strategy: str, dynamic: bool, observer: str | None) -> dict:
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
                "group_size": None, "block_structure": None, "actorder": None, "observer": observer,
                "observer_kwargs": {}}

    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args("channel", False, "minmax"),
                                          "input_activations": args("token", True, None),
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None,
            "sparsity_config": {}, "transform_config": {}, "version": "0.10.2"}


def _awq_config() -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def _gptq_config() -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "checkpoint_format": "gptq",
            "model_name_or_path": None, "model_file_base_name": None}


def _fp8_block_config() -> dict:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def _int32(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)


def _fp8(g: torch.Generator, n: int, k: int) -> torch.Tensor:
    return (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)


def _linear(scheme: str, g: torch.Generator, n: int, k: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized ``[N, K]`` linear, by suffix."""
    if scheme == "ct_fp8":
        return {"weight": _fp8(g, n, k), "weight_scale": torch.rand(n, 1, generator=g) * 2e-3 + 2e-3}
    if scheme == "fp8_block":
        return {"weight": _fp8(g, n, k),
                "weight_scale_inv": torch.rand(-(-n // 128), -(-k // 128), generator=g) * 2e-3 + 2e-3}
    scales = (torch.rand(k // GROUP, n, generator=g) * 2e-2 + 2e-2).to(torch.float16)
    if scheme == "awq":
        return {"qweight": _int32(g, k, n // 8), "qzeros": _int32(g, k // GROUP, n // 8), "scales": scales}
    if scheme == "gptq":
        return {"qweight": _int32(g, k // 8, n), "qzeros": _int32(g, k // GROUP, n // 8), "scales": scales,
                "g_idx": (torch.arange(k) // GROUP).to(torch.int32)}
    raise ValueError(f"unknown scheme {scheme!r}; one of {SCHEMES}")


#: ``where`` values: ``config.json`` → ``quantization_config`` (every scheme), or another place vLLM reads.
WHERE = {"ct_fp8": ("quantization_config", "compression_config"), "awq": ("quantization_config", "quant_config.json"),
         "gptq": ("quantization_config", "quantize_config.json"), "fp8_block": ("quantization_config",)}


def write_hub_checkpoint(dest: str | Path, scheme: str, *, where: str = "quantization_config",
                         seed: int = 0) -> Path:
    """Writes a random ``scheme`` checkpoint (see the module docstring) to ``dest``; returns ``dest``.

    Args:
        scheme (`str`): one of :data:`SCHEMES`.
        where (`str`, *optional*, defaults to ``"quantization_config"``): where its quantization config
            goes (:data:`WHERE`): ``config.json``'s ``quantization_config``, ``compression_config``, or a
            file of the exporter's own (``quantize_config.json``, ``quant_config.json``) with no
            ``quantization_config`` in ``config.json``.
    """
    from safetensors.torch import save_file

    if where not in WHERE.get(scheme, ()):
        raise ValueError(f"scheme {scheme!r}: where must be one of {WHERE.get(scheme)}, got {where!r}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed * len(SCHEMES) + SCHEMES.index(scheme))  # each scheme its own model
    plain = torch.bfloat16 if scheme in ("ct_fp8", "fp8_block") else torch.float16
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (torch.randn(VOCAB, HIDDEN, generator=g) * 0.5).to(plain),
        "model.norm.weight": (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(plain),
        "lm_head.weight": (torch.randn(VOCAB, HIDDEN, generator=g) * 0.1).to(plain)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(plain)
        t[p + "post_attention_layernorm.weight"] = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(plain)
        for lin, (n, k) in _shapes().items():
            for suffix, tensor in _linear(scheme, g, n, k).items():
                t[f"{p}{lin}.{suffix}"] = tensor
    save_file({n: v.contiguous() for n, v in sorted(t.items())}, str(dest / "model.safetensors"),
              metadata={"format": "pt"})
    quant = {"ct_fp8": _ct_fp8_config, "awq": _awq_config, "gptq": _gptq_config,
             "fp8_block": _fp8_block_config}[scheme]()
    config = _config("bfloat16" if plain is torch.bfloat16 else "float16")
    if where in ("quantization_config", "compression_config"):
        config[where] = quant
    else:
        # The exporters' own files: AutoAWQ's keys; AutoGPTQ's without quant_method (older releases).
        own = ({"zero_point": True, "q_group_size": GROUP, "w_bit": 4, "version": "GEMM"} if scheme == "awq"
               else {k: v for k, v in quant.items() if k not in ("quant_method", "checkpoint_format")})
        (dest / where).write_text(json.dumps(own, indent=2))
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest
