"""One tensor of a slab as the planning stages describe it: :class:`TensorSpec` and its :class:`SourceRef` slices.

``sharding`` builds them, ``quant`` rewrites those of quantized layers,
``placement``/``pipeline`` place and execute them. Apart from
:mod:`weightcache.spec`, which an engine's attach imports without these.

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SourceRef:
    """A slice of one checkpoint tensor.

    Attributes:
        name (`str`): checkpoint tensor name (a key of the safetensors header).
        dim (`int | None`): dimension sliced, or ``None`` for the whole tensor.
        start (`int`), stop (`int`): half-open element range along ``dim``.
    """

    name: str
    dim: int | None = None
    start: int = 0
    stop: int = 0


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the slab.

    Attributes:
        name (`str`): engine-facing name.
        dtype (`str`): safetensors dtype code of the stored bytes.
        stored_shape (`tuple[int]`): shape of the stored, row-major contiguous bytes.
        sources (`tuple[SourceRef]`): slices concatenated along ``cat_dim``
            (one entry for a plain shard).
        cat_dim (`int`): concatenation dimension of ``sources``.
        op (`str`): processing op (``copy``: cast to ``dtype`` only); see
            ``weightcache.pipeline.OPS``.
        op_args (`dict`): JSON-able arguments of ``op`` (may name further
            checkpoint tensors, e.g. the parts' ``weight_scale``).
        view_shape (`tuple[int] | None`), view_stride (`tuple[int] | None`):
            engine-facing view over the stored bytes; ``None`` means the stored
            shape, contiguous.
        layout (`dict`): metadata copied into the manifest record.
        alias_of (`str | None`): tied weight; no bytes of its own.
    """

    name: str
    dtype: str
    stored_shape: tuple[int, ...]
    sources: tuple[SourceRef, ...] = ()
    cat_dim: int = 0
    op: str = "copy"
    op_args: dict[str, Any] = field(default_factory=dict)
    view_shape: tuple[int, ...] | None = None
    view_stride: tuple[int, ...] | None = None
    layout: dict[str, Any] = field(default_factory=dict)
    alias_of: str | None = None
