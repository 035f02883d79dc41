"""What goes into a slab, decided from headers alone before any byte is read.

The planning stages speak in :class:`TensorSpec`: an output tensor of the slab,
built from slices of checkpoint tensors (:class:`SourceRef`), concatenated
along ``cat_dim`` and then passed through a named processing ``op``.

- ``sharding`` turns checkpoint tensors into per-rank specs (op ``copy``,
  fused names, tied aliases);
- ``quant`` rewrites specs of quantized layers (ops such as ``fp8_fuse``);
- ``pipeline`` assigns offsets, then executes each spec into the slab.

Forbidden imports: torch at module level, socket, weightcache.daemon,
weightcache.client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .wire import DEFAULT_DTYPE, DEFAULT_KERNEL, DEFAULT_NAMING


#: ``dtype`` names -> safetensors dtype code of the slab (``auto``: the checkpoint's own).
DTYPE_NAMES = {"auto": None, "bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@dataclass(frozen=True)
class LoadRequest:
    """What the pipeline needs to know about one model: where it is and how to lay it out.

    The operator's :class:`weightcache.config.ModelConfig` is one (it adds
    allow lists, layouts and its source file); an engine's ``attach()``
    builds one from its arguments. Both feed :func:`weightcache.pipeline.plan`
    and the cache key.

    Attributes:
        name (`str`): the model's name (the manifest's ``model``).
        path (`str`): checkpoint directory.
        dtype (`str`, *optional*, defaults to ``"auto"``): a key of :data:`DTYPE_NAMES`.
        naming (`str`, *optional*, defaults to ``"hf"``): ``hf`` or ``vllm`` (fused names).
        kernel (`str`, *optional*, defaults to ``"cutlass"``): layout target of quantized weights.
        revision (`str`, *optional*): the operator's label, part of the cache key.
    """

    name: str
    path: str
    dtype: str = DEFAULT_DTYPE
    naming: str = DEFAULT_NAMING
    kernel: str = DEFAULT_KERNEL
    revision: str = ""


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
