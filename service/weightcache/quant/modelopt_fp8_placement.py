"""Torch-free placements of the ModelOpt FP8 ops (``quant.registry.SchemeRules.placers``).

Each function gives the :class:`weightcache.placement.Placement` that writes
the bytes its op (:mod:`weightcache.quant.modelopt_fp8`) computes:

- ``modelopt_fp8_weight``: each part's rows read at the padded pitch
  ``K_pad`` over a zeroed record (``N``/``K`` padding); a fused per-tensor part
  whose scale is not the parts' maximum is then mapped in place through the
  256-byte requantisation table (:mod:`weightcache.quant.fp8_codes`);
- ``modelopt_fp8_weight_scale``: the max of per-tensor scales, or the
  per-channel parts concatenated with the ``SCALE_PAD_VALUE`` tail, on the host;
- ``modelopt_fp8_input_scale``: the max of the parts' scales, on the host.

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

from typing import Callable

from ..checkpoint import Checkpoint
from ..manifest import TensorRecord
from ..placement import Placement, source_task
from ..tensor_spec import TensorSpec
from . import fp8_codes
from .fp8_layout import OP_INPUT_SCALE, SCALE_PAD_VALUE


def _f32_bytes(values) -> bytes:
    import numpy as np

    return np.asarray(values, dtype=np.float32).tobytes()


def place_weight(spec: TensorSpec, rec: TensorRecord, ck: Checkpoint):
    """The placement of an FP8 weight (see the module docstring), or ``None``."""
    a = spec.op_args
    n, k = a["n"], a["k"]
    n_pad, k_pad = spec.stored_shape
    out = Placement()
    if k_pad != k:
        out.zeros.append((rec.offset_bytes, rec.size_bytes))
    elif n_pad != n:
        out.zeros.append((rec.offset_bytes + n * k_pad, (n_pad - n) * k_pad))
    row0 = 0
    parts: list[tuple[int, int]] = []  # (first row, rows) of each part
    for ref in spec.sources:
        info = ck.tensors.get(ref.name)
        if info is None or info.dtype != "F8_E4M3":
            return None
        got = source_task(ck, ref, rec.offset_bytes + row0 * k_pad, k_pad, spec.name)
        if got is None:
            return None
        task, rows, row = got
        if row != k:
            return None
        out.reads.append(task)
        parts.append((row0, rows))
        row0 += rows
    if row0 != n:
        return None
    if a["granularity"] == "tensor" and len(spec.sources) > 1:
        names = list(a["weight_scales"])
        out.scalars.update(names)
        for (first, rows), mine in zip(parts, names):
            base = rec.offset_bytes + first * k_pad
            spans = ([(base, rows * k_pad)] if k_pad == k else
                     [(base + r * k_pad, k) for r in range(rows)])
            out.luts.append((spans, _requant(mine, names)))
    return out


def _requant(mine: str, names: list[str]) -> Callable:
    def table(values) -> bytes | None:
        scales = [float(values(x)[0]) for x in names]
        s, smax = float(values(mine)[0]), max(scales)
        return None if s == smax else fp8_codes.requant_table(s, smax)

    return table


def place_scale(spec: TensorSpec, rec: TensorRecord, ck: Checkpoint):
    """The placement of a fused ``weight_scale`` / ``input_scale`` (host-computed bytes), or ``None``."""
    names = [r.name for r in spec.sources]
    if any(n not in ck.tensors for n in names):
        return None
    out = Placement(scalars=set(names))
    if spec.op in (OP_INPUT_SCALE,) or spec.op_args.get("granularity") == "tensor":
        out.small.append((rec.offset_bytes, lambda values: _f32_bytes(max(float(values(x)[0]) for x in names))))
        return out
    refs = list(spec.sources)
    n, n_pad = spec.op_args["n"], spec.op_args["n_padded"]

    def channels(values) -> bytes:
        import numpy as np

        flat = np.concatenate([values(r.name)[r.start : r.stop] if r.dim == 0 else values(r.name) for r in refs])
        return np.concatenate([flat, np.full(n_pad - n, SCALE_PAD_VALUE, np.float32)]).tobytes()

    out.small.append((rec.offset_bytes, channels))
    return out
