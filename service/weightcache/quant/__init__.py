"""Pre-processing of quantized checkpoints into the layout their kernel consumes.

:func:`detect` reads the scheme from ``config.json``'s ``quantization_config``
or ``hf_quant_config.json`` and checks it against the capability table
(:mod:`weightcache.quant.capabilities`); :func:`process_specs` rewrites the
sharded specs of quantized layers; :data:`OPS` holds the processing ops the
pipeline runs. Unquantized checkpoints pass through unchanged. Both functions
read headers and JSON only, so an unsupported scheme or kernel target is
rejected at plan time, before any weight byte is read.

Schemes: ModelOpt ``FP8`` (``modelopt_fp8``) and ``FP8_PER_CHANNEL_PER_TOKEN``
(``modelopt_fp8_per_channel``), kernel target ``cutlass``
(:mod:`weightcache.quant.modelopt_fp8`; rules in ``docs/quantization.md``).

Forbidden imports: torch at module level, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checkpoint import Checkpoint
from ..spec import TensorSpec
from . import capabilities, modelopt_fp8
from .capabilities import Capability

__all__ = ["Scheme", "detect", "process_specs", "OPS", "capabilities"]

#: Processing ops: name -> fn(spec, parts, fetch) -> tensor (see weightcache.pipeline).
OPS: dict = dict(modelopt_fp8.OPS)


@dataclass(frozen=True)
class Scheme:
    """A detected quantization scheme.

    Attributes:
        name (`str`): ``modelopt_fp8`` or ``modelopt_fp8_per_channel``.
        config (`dict`): the quantization config object as read (the whole
            ``hf_quant_config.json``, or ``config.json``'s ``quantization_config``).
        config_hash (`str`): blake2b-128 of its sorted JSON (cache key
            ``quant_config_blake2b``).
        source (`str`): file the config came from.
        capability (`Capability | None`): the capability table entry.
        quant_config: the parsed ``modelopt_fp8.QuantConfig``.
        quantized (`frozenset[str]`): the quantized linear modules, as
            ``check_layers`` found them from the headers (checked once per plan).
    """

    name: str
    config: dict
    config_hash: str
    source: str = ""
    capability: Capability | None = None
    quant_config: Any = None
    quantized: frozenset[str] = frozenset()


#: Default of the ``scheme`` arguments below: detect it from the checkpoint.
DETECT: Any = object()


def detect(ck: Checkpoint, kernel: str | None = None) -> Scheme | None:
    """The checkpoint's quantization scheme, or ``None`` when unquantized.

    Args:
        ck (`Checkpoint`): opened from headers; no tensor data is read.

    Returns:
        `Scheme | None`.

    Raises:
        UnsupportedQuantization (`unsupported_quantization`): a scheme this
            version cannot process (block-wise FP8, NVFP4, MXFP8, W4A8, any
            other ModelOpt algo or ``quant_method``); ``details`` name the
            ``scheme``, the first affected ``layer`` and the ``file``.
            Also raised for a quantized layer that does not fit the scheme
            (block-wise or missing scales, excluded yet stored as FP8), checked
            from the safetensors headers.
        CheckpointCorrupt (`checkpoint_corrupt`): a malformed quantization config.
    """
    qc = modelopt_fp8.read_config(ck)
    if qc is None:
        return None
    cap = modelopt_fp8.capability(ck, qc, kernel)
    quantized = frozenset(modelopt_fp8.check_layers(ck, qc, cap))
    return Scheme(cap.scheme, qc.raw, modelopt_fp8.config_hash(qc.raw), qc.file, cap, qc, quantized)


def process_specs(ck: Checkpoint, specs: list[TensorSpec], kernel: str, scheme: Any = DETECT) -> list[TensorSpec]:
    """Rewrites the specs of quantized layers for ``kernel``; identity when unquantized.

    Args:
        ck (`Checkpoint`): the checkpoint.
        specs (`list[TensorSpec]`): from :func:`weightcache.sharding.shard_specs`.
        kernel (`str`): kernel layout target (``cutlass``).
        scheme (`Scheme | None`, *optional*): from :func:`detect` with the same
            ``kernel`` (``None``: unquantized); detected here when not given.

    Returns:
        `list[TensorSpec]`: see :func:`weightcache.quant.modelopt_fp8.process_specs`.

    Raises:
        UnsupportedQuantization (`unsupported_quantization`): unsupported
            scheme, kernel target other than ``cutlass``, or a layer that does
            not fit the scheme; raised before any weight is read.
    """
    if scheme is DETECT:
        scheme = detect(ck, kernel)
    if scheme is None:
        return specs
    return modelopt_fp8.process_specs(ck, specs, kernel, scheme.capability, scheme.quantized)
