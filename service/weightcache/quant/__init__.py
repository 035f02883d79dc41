"""Pre-processing of quantized checkpoints into the layout their kernel consumes.

Every scheme is a family of the literal table :data:`FAMILIES`; :data:`REGISTRY`
(:class:`weightcache.quant.registry.Registry`) derives the lookup tables from it once:
:func:`detect` reads the checkpoint's quantization config
(:func:`weightcache.quant.quant_config.read_config`), finds its capability row
(:mod:`weightcache.quant.capabilities`) and the family that owns it, and runs
that family's layer checks; :func:`process_specs` hands the sharded specs to
the family; :func:`op` finds a processing op the pipeline runs;
:func:`checkpoint_form` is the inverse engine integrations call. Unquantized
checkpoints pass through unchanged. Detection and spec rewriting read headers
and JSON only, so an unsupported scheme or kernel target is rejected at plan
time, before any weight byte is read.

In :data:`FAMILIES`: ModelOpt ``FP8`` (``modelopt_fp8``) and
``FP8_PER_CHANNEL_PER_TOKEN`` (``modelopt_fp8_per_channel``), kernel target
``cutlass`` (:mod:`weightcache.quant.modelopt_fp8`; rules in ``docs/quantization.md``).

Forbidden imports: torch at module level, socket, weightcache.daemon, weightcache.client,
weightcache.sharding, weightcache.pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..checkpoint import Checkpoint
from ..spec import DETECT
from ..tensor_spec import TensorSpec
from . import capabilities, modelopt_fp8, registry
from .capabilities import Capability
from .quant_config import QuantConfig, capability, config_hash, read_config
from .registry import Registry, SchemeRules, SideTensor

__all__ = ["FAMILIES", "REGISTRY", "Registry", "Scheme", "SchemeRules", "SideTensor", "QuantConfig", "detect",
           "process_specs", "op", "placer", "checkpoint_form", "read_config", "capabilities", "registry"]

#: Every quantization scheme family weightcache processes, in the order config detection asks them.
FAMILIES: tuple[SchemeRules, ...] = (modelopt_fp8.RULES,)
#: The tables derived from :data:`FAMILIES`, once (a test passes a ``Registry`` of its own where it needs one).
REGISTRY = Registry(FAMILIES)


@dataclass(frozen=True)
class Scheme:
    """A detected quantization scheme.

    Attributes:
        name (`str`): the capability's scheme name (``modelopt_fp8``,
            ``modelopt_fp8_per_channel``; cache key ``quant_scheme``).
        config (`dict`): the quantization config object as read (the whole
            ``hf_quant_config.json``, or ``config.json``'s ``quantization_config``).
        config_hash (`str`): blake2b-128 of its sorted JSON (cache key
            ``quant_config_blake2b``).
        source (`str`): file the config came from.
        capability (`Capability | None`): the capability table entry.
        quant_config (`QuantConfig`): the parsed config.
        quantized (`frozenset[str]`): the quantized linear modules, as the
            family's ``check_layers`` found them from the headers (checked once per plan).
        rules (`SchemeRules | None`): the registered family that processes it.
    """

    name: str
    config: dict
    config_hash: str
    source: str = ""
    capability: Capability | None = None
    quant_config: Any = None
    quantized: frozenset[str] = frozenset()
    rules: SchemeRules | None = None




def detect(ck: Checkpoint, kernel: str | None = None, registry: Registry = REGISTRY) -> Scheme | None:
    """The checkpoint's quantization scheme, or ``None`` when unquantized.

    Args:
        ck (`Checkpoint`): opened from headers; no tensor data is read.
        kernel (`str`, *optional*): kernel layout target to check; ``None`` skips that check.
        registry (`Registry`, *optional*): the families to detect among; :data:`REGISTRY` by default.

    Returns:
        `Scheme | None`.

    Raises:
        UnsupportedQuantization (`unsupported_quantization`): a scheme no
            registered family processes (block-wise FP8, NVFP4, MXFP8, W4A8,
            any other ModelOpt algo or ``quant_method``); ``details`` name the
            ``scheme``, the first affected ``layer`` and the ``file``.
            Also raised for a quantized layer that does not fit the scheme
            (block-wise or missing scales, excluded yet stored as FP8), checked
            from the safetensors headers.
        CheckpointCorrupt (`checkpoint_corrupt`): a malformed quantization config.
    """
    qc = read_config(ck, registry.families)
    if qc is None:
        return None
    cap = capability(ck, qc, registry.capabilities, kernel)
    rules = registry.for_scheme(cap.scheme)
    quantized = frozenset(rules.check_layers(ck, qc, cap))
    return Scheme(cap.scheme, qc.raw, config_hash(qc.raw), qc.file, cap, qc, quantized, rules)


def process_specs(ck: Checkpoint, specs: list[TensorSpec], kernel: str, scheme: Any = DETECT) -> list[TensorSpec]:
    """Rewrites the specs of quantized layers for ``kernel``; identity when unquantized.

    Args:
        ck (`Checkpoint`): the checkpoint.
        specs (`list[TensorSpec]`): from :func:`weightcache.sharding.shard_specs`.
        kernel (`str`): kernel layout target (``cutlass``).
        scheme (`Scheme | None`, *optional*): from :func:`detect` with the same
            ``kernel`` (``None``: unquantized); detected here when not given.

    Returns:
        `list[TensorSpec]`: the family's rewrite (ModelOpt FP8:
        :func:`weightcache.quant.modelopt_fp8.process_specs`).

    Raises:
        UnsupportedQuantization (`unsupported_quantization`): unsupported
            scheme, kernel target the scheme has no rule for, or a layer that
            does not fit the scheme; raised before any weight is read.
    """
    if scheme is DETECT:
        scheme = detect(ck, kernel)
    if scheme is None:
        return specs
    return scheme.rules.process_specs(ck, specs, kernel, scheme)


def op(name: str) -> registry.Op | None:
    """The processing op ``name`` (a spec's ``op``) of :data:`REGISTRY`, or ``None``."""
    return REGISTRY.op(name)


def placer(name: str) -> Callable[..., Any] | None:
    """The torch-free placement of op ``name`` (:attr:`SchemeRules.placers`) of :data:`REGISTRY`, or ``None``."""
    return REGISTRY.placer(name)


def checkpoint_form(tensor: Any, layout: Mapping[str, Any], registry: Registry = REGISTRY) -> Any:
    """A processed tensor given back in the form its checkpoint stores (a view, no copy).

    Dispatches on ``layout["scheme"]`` to the family that processed it
    (:meth:`SchemeRules.checkpoint_form`); a tensor of no registered scheme is
    returned as is.

    Args:
        tensor (`torch.Tensor`): the attached tensor.
        layout (`Mapping`): its manifest layout (``Attachment.layouts[name]``).
        registry (`Registry`, *optional*): the families to dispatch to; :data:`REGISTRY` by default.

    Returns:
        `torch.Tensor`: the same elements as the checkpoint tensor, possibly
        in another shape of equal size (the caller reshapes to the header's shape).

    Raises:
        ManifestInvalid (`manifest_invalid`): the layout names a registered scheme but is malformed.
    """
    scheme = layout.get("scheme")
    rules = registry.for_scheme(scheme) if isinstance(scheme, str) else None
    return tensor if rules is None else rules.checkpoint_form(tensor, layout)
