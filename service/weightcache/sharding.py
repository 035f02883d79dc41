"""Tensor-parallel partition rules: checkpoint tensors -> per-rank slab specs.

TP = 1 is generic: every tensor is kept whole under its checkpoint name (cast
to the model's dtype when one is configured). TP > 1 needs rules for the
architecture family (see :data:`FAMILIES`).

Forbidden imports: torch at module level, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

from .checkpoint import Checkpoint
from .errors import UnsupportedArchitecture
from .spec import SourceRef, TensorSpec

#: Architecture families with TP rules (filled by the TP issue).
FAMILIES: dict[str, object] = {}


def _target_dtype(stored: str, target: str | None) -> str:
    # Only floating-point tensors follow the configured dtype; ints, bools and
    # FP8 keep theirs (FP8 is handled by weightcache.quant).
    if target is None or stored not in ("F16", "BF16", "F32", "F64"):
        return stored
    return target


def shard_specs(ck: Checkpoint, tp_size: int, tp_rank: int, naming: str, dtype: str | None) -> list[TensorSpec]:
    """Specs of the rank's slab.

    Args:
        ck (`Checkpoint`): opened checkpoint.
        tp_size (`int`), tp_rank (`int`): layout and rank, ``0 <= tp_rank < tp_size``.
        naming (`str`): ``hf`` or ``vllm``.
        dtype (`str | None`): safetensors code floating-point tensors are cast
            to, or ``None`` to keep the stored dtype.

    Raises:
        UnsupportedArchitecture (`unsupported_architecture`): TP > 1 or
            ``naming = "vllm"`` for an architecture without rules.
    """
    if tp_size == 1 and naming == "hf":
        return [
            TensorSpec(name, _target_dtype(info.dtype, dtype), info.shape, (SourceRef(name),))
            for name, info in sorted(ck.tensors.items())
        ]
    arch = (ck.config.get("architectures") or [ck.config.get("model_type", "?")])[0]
    raise UnsupportedArchitecture(
        f"checkpoint {ck.path}: architecture {arch!r} has no tensor-parallel rules "
        f"(tp_size={tp_size}, naming={naming!r}); supported families: {', '.join(sorted(FAMILIES)) or 'none'}",
        architecture=arch,
    )
