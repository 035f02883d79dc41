"""Placements: how each planned tensor's slab bytes come from checkpoint byte ranges, without torch.

Most of what the vLLM layout asks is placement, not computation. A fused
``qkv_proj``/``gate_up_proj`` is its parts' byte ranges written one after the
other; a column-parallel shard (dim 0) is one range; a row-parallel shard
(dim 1, ``o_proj``/``down_proj`` at TP > 1) is a strided set of rows; vocab
padding is zero fill; an FP8 weight padded to multiples of 16 is its rows
written at the padded pitch over zeros. :func:`place` turns one
:class:`~weightcache.spec.TensorSpec` and its record into a
:class:`Placement`:

- ``reads``: :class:`~weightcache.reader.ReadTask` s (contiguous or strided),
  run by the parallel reader like any other tensor
  (:func:`weightcache.reader.read_direct`, host and CUDA backends);
- ``zeros``: ``(slab_offset, size_bytes)`` ranges set to zero before the reads;
- ``small``: tensors computed on the host from a few scalars (a fused
  per-tensor scale is the max of its parts', per-channel scales are
  concatenated and padded with 1.0): ``(slab_offset, fn(values) -> bytes)``;
- ``luts``: in-place byte maps applied after the reads, on the GPU for a
  CUDA slab (the FP8 requantisation of a fused part whose per-tensor scale is
  not the fused maximum: :func:`weightcache.quant.fp8_codes.requant_table`).

Op ``copy`` is placed here (:data:`PLACERS`); a quantization scheme's ops by
its registry entry (``quant.registry.SchemeRules.placers``; ModelOpt FP8:
:mod:`weightcache.quant.modelopt_fp8_placement`).

A spec that needs anything else (a dtype cast) has no placement (``None``):
the pipeline then runs the torch path (:func:`weightcache.pipeline.execute`),
which stays the reference the tests compare every placement with.

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from .checkpoint import Checkpoint
from .manifest import TensorRecord, itemsize
from .reader import ReadTask
from .tensor_spec import SourceRef, TensorSpec

#: ``fn(values) -> bytes``: ``values(name)`` is a checkpoint tensor as a 1-D ``float32`` numpy array.
Compute = Callable[[Callable[[str], object]], bytes]


@dataclass
class Placement:
    """How one or more records are filled (see the module docstring).

    Attributes:
        reads (`list[ReadTask]`): byte ranges read into the slab.
        zeros (`list[tuple[int, int]]`): ``(slab_offset, size_bytes)`` zeroed first.
        small (`list[tuple[int, Compute]]`): ``(slab_offset, fn)`` host-computed bytes.
        luts (`list[tuple[list[tuple[int, int]], Callable]]`): ``(ranges, fn(values) -> table | None)``:
            256-byte maps applied in place after the reads (``None``: the part is kept as read).
        scalars (`set[str]`): checkpoint tensors ``small``/``luts`` read (scales).
    """

    reads: list[ReadTask] = field(default_factory=list)
    zeros: list[tuple[int, int]] = field(default_factory=list)
    small: list[tuple[int, Compute]] = field(default_factory=list)
    luts: list[tuple[list[tuple[int, int]], Callable]] = field(default_factory=list)
    scalars: set[str] = field(default_factory=set)

    def extend(self, other: "Placement") -> None:
        """Adds ``other``'s pieces to this placement (one placement per plan)."""
        self.reads += other.reads
        self.zeros += other.zeros
        self.small += other.small
        self.luts += other.luts
        self.scalars |= other.scalars


def source_task(ck: Checkpoint, ref: SourceRef, slab_offset: int, dst_pitch: int | None,
                 tensor: str) -> tuple[ReadTask, int, int] | None:
    """The read of one source slice to ``slab_offset``: ``(task, rows, row_bytes)``.

    The slice is ``rows`` rows of ``row_bytes`` (a 2-D tensor's rows; for a
    slice along ``dim > 0``, the runs of bytes it takes from each index of the
    dimensions before it), landing ``dst_pitch`` apart (packed when ``None``).
    ``None`` when the tensor is missing.
    """
    info = ck.tensors.get(ref.name)
    if info is None:
        return None
    shape = info.shape if info.shape else (1,)
    dim, start, n = (0, 0, shape[0]) if ref.dim is None else (ref.dim, ref.start, ref.stop - ref.start)
    inner = itemsize(info.dtype) * math.prod(shape[dim + 1 :])
    outer = math.prod(shape[:dim])
    begin = info.offset_bytes + start * inner
    if outer == 1:  # a range of the file: n rows of `inner` bytes
        rows, row, src_pitch = n, inner, inner
    else:  # outer rows, each a run of n * inner bytes, shape[dim] * inner apart
        rows, row, src_pitch = outer, n * inner, shape[dim] * inner
    task = _pitched(ck.file_path(info.file), begin, row, rows, src_pitch, slab_offset,
                    row if dst_pitch is None else dst_pitch, tensor)
    return task, rows, row


def _pitched(path: str, start: int, row: int, rows: int, src_pitch: int, slab_offset: int, dst_pitch: int,
             tensor: str) -> ReadTask:
    if rows == 1 or (src_pitch == row and dst_pitch == row):
        return ReadTask(path, start, row * rows, slab_offset, tensor)
    return ReadTask(path, start, row, slab_offset, tensor, rows, src_pitch, dst_pitch)


def _place_copy(spec: TensorSpec, rec: TensorRecord, ck: Checkpoint) -> Placement | None:
    if any(k != "pad_rows" for k in spec.op_args):
        return None
    if len(spec.sources) > 1 and spec.cat_dim != 0:
        return None
    out = Placement()
    off = rec.offset_bytes
    for ref in spec.sources:
        info = ck.tensors.get(ref.name)
        if info is None or info.dtype != spec.dtype:
            return None  # a cast: computed (torch path)
        got = source_task(ck, ref, off, None, spec.name)
        if got is None:
            return None
        task, _, _ = got
        out.reads.append(task)
        off += task.nbytes
    pad = rec.offset_bytes + rec.size_bytes - off
    if pad < 0:
        return None
    if pad:
        if not spec.op_args.get("pad_rows"):
            return None  # sizes disagree: let the torch path raise its shape error
        out.zeros.append((off, pad))
    return out


#: Placements of the pipeline's own ops; schemes register theirs (``quant.registry.SchemeRules.placers``).
PLACERS: dict[str, Callable[[TensorSpec, TensorRecord, Checkpoint], Placement | None]] = {"copy": _place_copy}


#: A lookup of the placers of ops this module does not own: op name -> placer, or ``None``.
PlacerLookup = Callable[[str], Callable[..., Any] | None]


def _no_placer(op: str) -> None:
    return None


def place(spec: TensorSpec, rec: TensorRecord, ck: Checkpoint, placers: PlacerLookup = _no_placer) -> Placement | None:
    """The placement of one planned tensor, or ``None`` when it needs the torch path (a dtype cast).

    Args:
        spec (`TensorSpec`), rec (`TensorRecord`): from :func:`weightcache.pipeline.plan` (not an alias).
        ck (`Checkpoint`): the plan's checkpoint (headers).
        placers (`callable`, *optional*): the placers of the scheme ops (``weightcache.quant.placer``; the
            pipeline passes it, so this module never imports ``quant``); by default only :data:`PLACERS`.
    """
    fn = PLACERS.get(spec.op) or placers(spec.op)
    return None if fn is None else fn(spec, rec, ck)


def place_all(specs: list[TensorSpec], records: list[TensorRecord], ck: Checkpoint,
              placers: PlacerLookup = _no_placer) -> Placement | None:
    """The placement of every stored tensor of a plan, or ``None`` when one of them has none (``placers``: as
    :func:`place`)."""
    out = Placement()
    for spec, rec in zip(specs, records):
        if spec.alias_of is not None:
            continue
        p = place(spec, rec, ck, placers)
        if p is None:
            return None
        out.extend(p)
    return out


def scalar_values(ck: Checkpoint, names: set[str]) -> Callable[[str], object]:
    """``values(name)``: the named (small) checkpoint tensors as 1-D ``float32`` numpy arrays, read once each.

    ``F32``, ``F16`` and ``BF16`` are converted exactly (as torch's ``.to(torch.float32)``).

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): a file ended early.
        ValueError: a tensor of another dtype.
    """
    import numpy as np

    got: dict[str, object] = {}
    for name in sorted(names):
        info = ck.tensors[name]
        raw = np.empty(info.size_bytes, np.uint8)
        if info.size_bytes:
            ck.read_into(info, raw)
        if info.dtype == "F32":
            v = raw.view(np.float32)
        elif info.dtype == "F16":
            v = raw.view(np.float16).astype(np.float32)
        elif info.dtype == "BF16":
            v = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"checkpoint {ck.path}: scale {name!r} has dtype {info.dtype}, expected F32/F16/BF16")
        got[name] = v.reshape(-1).astype(np.float32)
    return got.__getitem__
