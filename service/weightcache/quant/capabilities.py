"""Capability table: which quantization schemes and kernel targets weightcache processes.

One place answers "can this checkpoint be served, and how?". A scheme is keyed
by ``(quant_method, quant_algo)`` as read from the checkpoint
(``hf_quant_config.json`` → ``quantization.quant_algo``, or ``config.json`` →
``quantization_config.quant_method`` / ``quant_algo``). Everything not in
the scheme registry's rows (``Registry.capabilities``, each family's own) is rejected with
:class:`~weightcache.errors.UnsupportedQuantization` at plan time, before any
weight byte is read; :data:`KNOWN_UNSUPPORTED` only gives the rejection a
better name.

Sources of the algo names: nvidia-modelopt ``modelopt/torch/export``
(``QUANTIZATION_*`` constants) and vLLM
``vllm/model_executor/layers/quantization/modelopt.py`` (``QUANT_ALGOS``).

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..errors import UnsupportedQuantization


@dataclass(frozen=True)
class Capability:
    """A scheme weightcache can pre-process.

    Attributes:
        scheme (`str`): weightcache's scheme name (cache key ``quant_scheme``).
        weight_granularity (`str`): ``tensor`` (one ``F32`` scale per weight)
            or ``channel`` (one ``F32`` scale per output row).
        activation (`str`): ``static_tensor`` (checkpoint ``input_scale``) or
            ``dynamic_token`` (the engine computes one scale per token).
        kernels (`tuple[str]`): kernel layout targets with a processing rule.
    """

    scheme: str
    weight_granularity: str
    activation: str
    kernels: tuple[str, ...]


#: KV-cache quantization algos whose scales (``k_scale``/``v_scale``) are
#: passed through unchanged. ``None``: no KV-cache quantization.
SUPPORTED_KV_CACHE: tuple[str | None, ...] = (None, "FP8")

#: Schemes known to exist and rejected on purpose, with a human name.
KNOWN_UNSUPPORTED: dict[tuple[str, str], str] = {
    ("modelopt", "FP8_PB_WO"): "block-wise FP8 (per-128x128-block weight scales, weight-only)",
    ("modelopt", "FP8_PB"): "block-wise FP8 (per-block weight scales)",
    ("modelopt", "FP8_BLOCKWISE"): "block-wise FP8",
    ("modelopt", "NVFP4"): "NVFP4 (4-bit float weights and activations, 16-element block scales)",
    ("modelopt", "NVFP4_AWQ"): "NVFP4 with AWQ",
    ("modelopt", "W4A16_NVFP4"): "NVFP4 weight-only (W4A16)",
    ("modelopt", "MXFP8"): "MXFP8 (32-element block scales, E8M0)",
    ("modelopt", "MXFP4"): "MXFP4",
    ("modelopt", "W4A8_AWQ"): "W4A8 (INT4 AWQ weights, FP8 activations)",
    ("modelopt", "W4A8_NVFP4_FP8"): "W4A8 (NVFP4 weights, FP8 activations)",
    ("modelopt", "W4A8_MXFP4_FP8"): "W4A8 (MXFP4 weights, FP8 activations)",
    ("modelopt", "W4A16_AWQ"): "INT4 AWQ weight-only",
    ("modelopt", "INT4_AWQ"): "INT4 AWQ weight-only",
    ("modelopt", "INT8_SQ"): "INT8 SmoothQuant",
    ("modelopt", "INT8_WO"): "INT8 weight-only",
    ("modelopt", "INT4_WO"): "INT4 weight-only",
    ("modelopt", "MIXED_PRECISION"): "mixed-precision ModelOpt (per-layer algos)",
}

#: ``quant_method`` values of other toolchains, rejected as a whole.
OTHER_METHODS: dict[str, str] = {
    "fp8": "FP8 (vLLM/transformers fp8 config; block-wise when weight_block_size is set)",
    "compressed-tensors": "compressed-tensors",
    "gptq": "GPTQ",
    "awq": "AWQ",
    "bitsandbytes": "bitsandbytes",
    "gguf": "GGUF",
    "fbgemm_fp8": "FBGEMM FP8",
    "mxfp4": "MXFP4",
    "torchao": "torchao",
}


def scheme_label(method: str, algo: str, supported: Mapping[tuple[str, str], Capability]) -> str:
    """Human-readable name of ``(method, algo)`` for error messages (``supported``: the registry's rows)."""
    if (method, algo) in supported:
        return supported[(method, algo)].scheme
    if (method, algo) in KNOWN_UNSUPPORTED:
        return f"{method} {algo}: {KNOWN_UNSUPPORTED[(method, algo)]}"
    if method in OTHER_METHODS:
        return f"quant_method {method!r} ({OTHER_METHODS[method]}){' ' + algo if algo else ''}"
    return f"quant_method {method!r} quant_algo {algo!r}"


def lookup(method: str, algo: str, supported: Mapping[tuple[str, str], Capability], *, where: str, layer: str,
           kernel: str | None = None) -> Capability:
    """The capability of ``(method, algo)`` for ``kernel``, or a typed rejection.

    Args:
        method (`str`): ``quant_method`` (``modelopt`` for ``hf_quant_config.json``).
        algo (`str`): ``quant_algo``, upper-cased (``""`` when absent).
        supported (`Mapping`): ``(quant_method, QUANT_ALGO)`` -> capability: the registry's rows
            (:attr:`weightcache.quant.registry.Registry.capabilities`).
        where (`str`): the file the config came from (named in the message).
        layer (`str`): first affected layer (module name), named in the message.
        kernel (`str`, *optional*): kernel layout target; ``None`` skips that check.

    Returns:
        `Capability`.

    Raises:
        UnsupportedQuantization (`unsupported_quantization`): the scheme or the
            kernel target has no processing rule. ``details`` carry
            ``scheme``, ``layer``, ``file`` and (for kernels) ``kernel``.
    """
    cap = supported.get((method, algo))
    if cap is None:
        label = scheme_label(method, algo, supported)
        rows = ", ".join(f"{m} {a}" for m, a in supported)
        raise UnsupportedQuantization(
            f"{where}: layer {layer!r} uses {label}, which weightcache cannot pre-process; "
            f"supported: {rows or 'none'}. Serve this model without weightcache or re-export it "
            f"in a supported scheme",
            scheme=label,
            layer=layer,
            file=where,
        )
    if kernel is not None and kernel not in cap.kernels:
        raise UnsupportedQuantization(
            f"{where}: layer {layer!r} ({cap.scheme}): kernel target {kernel!r} has no processing rule; "
            f"supported kernel targets: {', '.join(cap.kernels)}. "
            f"Set kernel = \"{cap.kernels[0]}\" in the model's config",
            scheme=cap.scheme,
            layer=layer,
            file=where,
            kernel=kernel,
        )
    return cap
