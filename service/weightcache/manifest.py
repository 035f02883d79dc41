"""Tensor records inside a slab, and the views built from them.

A *manifest* describes one slab: which tensor lives at which byte offset, with
which dtype, engine-facing shape and stride, and the layout metadata of any
processing (fused parts, FP8 transposed view, padding). It is plain JSON so it
travels on the wire and into systemd's fd store unchanged.

Forbidden imports: socket, selectors, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# safetensors dtype code -> (torch dtype attribute name, item size in bytes).
# Source: safetensors `Dtype` enum (safetensors/src/tensor.rs).
DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}

#: Every tensor starts at a multiple of this many bytes inside its slab.
ALIGNMENT_BYTES = 256


def itemsize(dtype: str) -> int:
    """Returns the size in bytes of one element of safetensors dtype ``dtype``."""
    return DTYPES[dtype][1]


def torch_dtype(dtype: str):
    """Returns the ``torch.dtype`` for safetensors dtype code ``dtype`` (e.g. ``BF16``)."""
    import torch

    return getattr(torch, DTYPES[dtype][0])


def dtype_code(torch_dt) -> str:
    """Returns the safetensors dtype code for a ``torch.dtype``."""
    name = str(torch_dt).removeprefix("torch.")
    for code, (tname, _) in DTYPES.items():
        if tname == name:
            return code
    raise ValueError(f"dtype {torch_dt} has no safetensors code")


def align(n: int, alignment: int = ALIGNMENT_BYTES) -> int:
    """Rounds ``n`` bytes up to a multiple of ``alignment`` bytes."""
    return (n + alignment - 1) // alignment * alignment


def contiguous_stride(shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Row-major strides, in elements, of a tensor of ``shape``."""
    stride, acc = [], 1
    for d in reversed(list(shape)):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


@dataclass(frozen=True)
class TensorRecord:
    """One tensor in a slab.

    Attributes:
        name (`str`): engine-facing parameter name (HF name, or a vLLM fused
            name such as ``model.layers.0.self_attn.qkv_proj.weight``).
        dtype (`str`): safetensors dtype code of the stored bytes (``BF16``).
        shape (`tuple[int]`): engine-facing shape of the view.
        stride (`tuple[int]`): engine-facing strides of the view, in elements
            (``(1, K)`` for a column-major ``[K, N]`` FP8 weight).
        offset_bytes (`int`): start of the stored bytes in the slab, a multiple
            of :data:`ALIGNMENT_BYTES`.
        size_bytes (`int`): length of the stored bytes.
        digest (`str`): blake2b-128 hex digest of the stored bytes, recorded at load.
        layout (`dict`): processing metadata (``fused_parts``, ``logical_shape``,
            ``stored_shape``, ``scale_granularity``, ``kernel``, ``tp_dim``...).
        alias_of (`str | None`): for a tied weight, the record whose bytes it shares.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset_bytes: int
    size_bytes: int
    digest: str = ""
    layout: dict[str, Any] = field(default_factory=dict)
    alias_of: str | None = None


@dataclass(frozen=True)
class Manifest:
    """Everything an engine needs to use one slab.

    Attributes:
        model (`str`): model name from the config.
        tp_size (`int`), tp_rank (`int`): the layout and rank of this slab.
        key (`dict`): the cache key (DESIGN §5), compared field by field.
        slab_size_bytes (`int`): size of the slab mapping, in bytes.
        tensors (`tuple[TensorRecord]`): records in slab order.
    """

    model: str
    tp_size: int
    tp_rank: int
    key: dict[str, Any]
    slab_size_bytes: int
    tensors: tuple[TensorRecord, ...]

    def to_json(self) -> dict[str, Any]:
        """The manifest as JSON-able data; ``tensors`` is *columnar*.

        ``tensors`` maps each :class:`TensorRecord` field to a list with one
        entry per tensor, in slab order (``{"name": [...], "dtype": [...],
        "shape": [[...], ...], ...}``): the same information as a list of
        records at about half the bytes, and twice as fast to decode, which
        matters on every attach (see docs/protocol.md).
        """
        ts = self.tensors
        return {
            "model": self.model,
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "key": self.key,
            "slab_size_bytes": self.slab_size_bytes,
            "tensors": {
                "name": [t.name for t in ts],
                "dtype": [t.dtype for t in ts],
                "shape": [list(t.shape) for t in ts],
                "stride": [list(t.stride) for t in ts],
                "offset_bytes": [t.offset_bytes for t in ts],
                "size_bytes": [t.size_bytes for t in ts],
                "digest": [t.digest for t in ts],
                "layout": [_plain_copy(t.layout) for t in ts],
                "alias_of": [t.alias_of for t in ts],
            },
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Manifest":
        """Rebuilds a manifest from :meth:`to_json` output (columnar ``tensors``)."""
        c = d["tensors"]
        n = len(c["name"])
        recs = []
        for name, dtype, shape, stride, off, size, dig, lay, alias in zip(
                c["name"], c["dtype"], c["shape"], c["stride"], c["offset_bytes"], c["size_bytes"],
                c.get("digest") or [""] * n, c.get("layout") or [{}] * n, c.get("alias_of") or [None] * n,
                strict=True):
            # Same values as TensorRecord(...), without the frozen dataclass
            # __init__ (one object.__setattr__ per field): once per tensor per attach.
            rec = _new(TensorRecord)
            rec.__dict__.update(name=name, dtype=dtype, shape=tuple(shape), stride=tuple(stride),
                                offset_bytes=int(off), size_bytes=int(size), digest=dig, layout=dict(lay),
                                alias_of=alias)
            recs.append(rec)
        return cls(
            model=d["model"],
            tp_size=int(d["tp_size"]),
            tp_rank=int(d["tp_rank"]),
            key=dict(d["key"]),
            slab_size_bytes=int(d["slab_size_bytes"]),
            tensors=tuple(recs),
        )

    def record(self, name: str) -> TensorRecord:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


_new = object.__new__


def _plain_copy(v: Any) -> Any:
    """Deep copy of JSON-like data (dicts, lists, tuples, scalars), like ``dataclasses.asdict``."""
    if isinstance(v, dict):
        return {k: _plain_copy(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_plain_copy(x) for x in v)
    return v


def build_views(slab, manifest: Manifest) -> dict[str, Any]:
    """Builds the engine-facing tensors of ``manifest`` over ``slab``.

    Args:
        slab (`torch.Tensor`): the whole slab as a 1-D ``uint8`` tensor of
            ``manifest.slab_size_bytes`` bytes (host or CUDA, read-only or private).

    Returns:
        `dict[str, torch.Tensor]`: name -> view, with each record's dtype, shape
        and stride. Views share the slab's memory and stay valid as long as the
        slab's mapping does (for an attach: until the session is closed). Tied
        aliases map to the very same tensor object as their target.
    """
    # One as_strided per tensor over a whole-slab view per dtype (instead of
    # slice + view + as_strided): the per-tensor Python/dispatcher cost is what
    # an attach of hundreds of tensors pays.
    out: dict[str, Any] = {}
    typed: dict[str, tuple[Any, int, int]] = {}
    aliases = []
    n_bytes = slab.numel()
    for rec in manifest.tensors:
        if rec.alias_of is not None:
            aliases.append(rec)
            continue
        t = typed.get(rec.dtype)
        if t is None:
            size = DTYPES[rec.dtype][1]
            flat = slab[: n_bytes - n_bytes % size].view(torch_dtype(rec.dtype))
            t = typed[rec.dtype] = (flat, size, flat.storage_offset())
        flat, size, base = t
        if rec.offset_bytes % size:
            raw = slab[rec.offset_bytes : rec.offset_bytes + rec.size_bytes]
            out[rec.name] = raw.view(torch_dtype(rec.dtype)).as_strided(rec.shape, rec.stride)
        else:
            out[rec.name] = flat.as_strided(rec.shape, rec.stride, base + rec.offset_bytes // size)
    for rec in aliases:
        out[rec.name] = out[rec.alias_of]
    return out
