"""Pre-processing of quantized checkpoints into the layout their kernel consumes.

:func:`detect` reads the scheme from ``hf_quant_config.json`` or
``config.json``'s ``quantization_config``; :func:`process_specs` rewrites the
sharded specs of quantized layers; :data:`OPS` holds the processing ops the
pipeline runs. Unquantized checkpoints pass through unchanged.

Forbidden imports: socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ..checkpoint import Checkpoint
from ..errors import UnsupportedQuantization
from ..spec import TensorSpec

OPS: dict = {}


@dataclass(frozen=True)
class Scheme:
    """A detected quantization scheme.

    Attributes:
        name (`str`): e.g. ``modelopt_fp8`` / ``modelopt_fp8_per_channel``.
        config (`dict`): the quantization config as read.
        config_hash (`str`): blake2b of its sorted JSON (part of the cache key).
    """

    name: str
    config: dict
    config_hash: str


def _hash(cfg: dict) -> str:
    return hashlib.blake2b(json.dumps(cfg, sort_keys=True).encode(), digest_size=16).hexdigest()


def detect(ck: Checkpoint) -> Scheme | None:
    """The checkpoint's quantization scheme, or ``None`` when unquantized.

    Raises:
        UnsupportedQuantization (`unsupported_quantization`): any scheme this
            version cannot process.
    """
    cfg = ck.extra_json("hf_quant_config.json") or ck.config.get("quantization_config")
    if not cfg:
        return None
    raise UnsupportedQuantization(
        f"checkpoint {ck.path}: quantization {json.dumps(cfg, sort_keys=True)[:200]} is not supported",
        checkpoint=str(ck.path),
    )


def process_specs(ck: Checkpoint, specs: list[TensorSpec], kernel: str) -> list[TensorSpec]:
    """Rewrites the specs of quantized layers for ``kernel``; identity when unquantized."""
    if detect(ck) is None:
        return specs
    raise UnsupportedQuantization(f"checkpoint {ck.path}: no processing for kernel {kernel!r}", kernel=kernel)
