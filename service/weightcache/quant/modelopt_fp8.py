"""NVIDIA ModelOpt FP8 checkpoints, pre-processed for the CUTLASS / cuBLASLt scaled-mm layout.

Format read (DESIGN §6.1; exported by nvidia-modelopt's
``export_hf_checkpoint``):

- ``hf_quant_config.json``::

      {"producer": {"name": "modelopt", "version": "..."},
       "quantization": {"quant_algo": "FP8" | "FP8_PER_CHANNEL_PER_TOKEN",
                        "kv_cache_quant_algo": "FP8" | null,
                        "exclude_modules": ["lm_head", ...]}}

- or ``config.json`` → ``quantization_config`` with ``quant_method:
  "modelopt"``, ``quant_algo``, ``ignore`` (or ``exclude_modules``) and
  ``kv_cache_scheme`` / ``kv_cache_quant_algo``. When both exist,
  ``config.json`` wins, as in vLLM (``get_quant_config`` reads
  ``hf_config.quantization_config`` first).

Per quantized linear ``M``: ``M.weight`` ``F8_E4M3`` ``[N, K]``;
``M.weight_scale`` ``F32`` 0-d (``FP8``) or ``[N]`` (per channel);
``M.input_scale`` ``F32`` 0-d (``FP8`` only, static activation scale);
``k_proj.k_scale`` / ``v_proj.v_scale`` when ``kv_cache_quant_algo`` is FP8.

Exclusion (``exclude_modules`` / ``ignore``) follows vLLM's
``ModelOptQuantConfigBase.is_layer_excluded``: exact name (a fused layer's
parts must agree), then substring, then ``fnmatch`` wildcard. It is applied to
checkpoint module names (``q_proj``, not ``qkv_proj``).

Processing rules: see ``docs/quantization.md`` and :func:`process_specs`.
The family's entry in the scheme registry is :data:`RULES` (capability rows,
side-tensor shard rules, ops, the inverse for engines); the layout records are
in :mod:`weightcache.quant.fp8_layout`.

Forbidden imports: torch at module level, socket, weightcache.daemon,
weightcache.client, weightcache.sharding, weightcache.pipeline.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Mapping

from ..checkpoint import Checkpoint
from ..errors import UnsupportedQuantization
from ..sizes import round_up
from ..tensor_spec import SourceRef, TensorSpec
from .capabilities import Capability
from .quant_config import exclude_list, is_excluded, kv_algo, natural_key, QuantConfig
from .fp8_layout import (OP_INPUT_SCALE, OP_WEIGHT, OP_WEIGHT_SCALE, SCALE_PAD_VALUE, SCHEMES, Fp8ScaleLayout,
                         Fp8WeightLayout, layout_of)
from . import modelopt_fp8_placement
from .registry import SchemeRules, SideTensor

log = logging.getLogger(__name__)

#: Largest finite float8_e4m3fn value.
FP8_E4M3_MAX = 448.0
#: CUTLASS / cuBLASLt scaled-mm needs K and N to be multiples of this.
ALIGN_ELEMENTS = 16
QUANT_FILE = "hf_quant_config.json"


#: This family's capability rows: ``(quant_method, QUANT_ALGO)`` -> capability.
CAPABILITIES: dict[tuple[str, str], Capability] = {
    ("modelopt", "FP8"): Capability(SCHEMES[0], "tensor", "static_tensor", ("cutlass",)),
    ("modelopt", "FP8_PER_CHANNEL_PER_TOKEN"): Capability(SCHEMES[1], "channel", "dynamic_token", ("cutlass",)),
}

#: Shard rules of the side tensors (``docs/sharding.md``): per-tensor scales are replicated,
#: per-channel ``weight_scale`` follows the weight's output rows, KV-cache scales take vLLM's names.
SIDE_TENSORS = (
    SideTensor("weight_scale", "output"),
    SideTensor("input_scale", "scalar"),
    SideTensor("k_scale", "scalar", fuse=False, vllm_name="attn.{param}"),
    SideTensor("v_scale", "scalar", fuse=False, vllm_name="attn.{param}"),
)


def read_hf_quant_config(ck: Checkpoint) -> QuantConfig | None:
    """ModelOpt's ``hf_quant_config.json`` → ``quantization``, or ``None`` when the file is absent.

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): not an object with a
            ``quantization`` object, or ``exclude_modules`` not a list of strings.
    """
    from ..errors import CheckpointCorrupt

    hq = ck.extra_json(QUANT_FILE)
    if hq is None:
        return None
    file = str(ck.path / QUANT_FILE)
    q = hq.get("quantization") if isinstance(hq, dict) else None
    if not isinstance(q, dict):
        raise CheckpointCorrupt(
            f"{file}: expected an object with a \"quantization\" object (ModelOpt export format), got {hq!r:.200}",
            file=file,
        )
    producer = hq.get("producer", {}).get("name", "modelopt") if isinstance(hq.get("producer"), dict) else "modelopt"
    method = "modelopt" if str(producer).lower().startswith("modelopt") else str(producer).lower()
    return QuantConfig(file, method, str(q.get("quant_algo") or "").upper(), kv_algo(q.get("kv_cache_quant_algo")),
                       exclude_list(q.get("exclude_modules"), file, "quantization.exclude_modules"), hq)


def _ceil(n: int, m: int = ALIGN_ELEMENTS) -> int:
    return round_up(n, m)


def check_layers(ck: Checkpoint, qc: QuantConfig, cap: Capability) -> set[str]:
    """Validates every quantized linear from the safetensors headers.

    Returns:
        `set[str]`: module names of the quantized linears.

    Raises:
        UnsupportedQuantization (`unsupported_quantization`): an ``F8_E4M3``
            weight without ``weight_scale`` (or the reverse), a layer both
            excluded and quantized, a non-2-D weight, scales of the wrong shape
            (block-wise: ``details["scheme"] == "block-wise FP8"``), a missing
            ``input_scale`` for ``FP8``.
    """
    quantized: set[str] = set()
    for name, info in ck.tensors.items():
        if info.dtype == "F8_E4M3" and name.endswith(".weight"):
            m = name[:-7]
            if f"{m}.weight_scale" not in ck.tensors:
                raise UnsupportedQuantization(
                    f"{ck.path}: layer {m!r} ({cap.scheme}): {name} is F8_E4M3 but {m}.weight_scale is missing; "
                    f"re-export the checkpoint with nvidia-modelopt",
                    scheme=cap.scheme, layer=m, tensor=name,
                )
            quantized.add(m)
    for name in ck.tensors:
        if name.endswith(".weight_scale") and name[:-13] not in quantized:
            m = name[:-13]
            w = ck.tensors.get(f"{m}.weight")
            raise UnsupportedQuantization(
                f"{ck.path}: layer {m!r}: has {name} but its weight is "
                f"{w.dtype if w else 'missing'}, expected F8_E4M3 for {cap.scheme}",
                scheme=cap.scheme, layer=m, tensor=name,
            )
    for m in sorted(quantized, key=natural_key):
        w = ck.tensors[f"{m}.weight"]
        s = ck.tensors[f"{m}.weight_scale"]
        if is_excluded(m, qc.exclude):
            raise UnsupportedQuantization(
                f"{qc.file}: layer {m!r} is excluded from quantization (exclude_modules/ignore) but "
                f"{m}.weight is F8_E4M3 with a weight_scale; the checkpoint and its config disagree",
                scheme=cap.scheme, layer=m,
            )
        if len(w.shape) != 2:
            raise UnsupportedQuantization(
                f"{ck.path}: layer {m!r}: {m}.weight has shape {list(w.shape)}, expected [N, K] "
                f"(fused MoE experts are not supported by {cap.scheme})",
                scheme=cap.scheme, layer=m, tensor=f"{m}.weight",
            )
        n = w.shape[0]
        numel = 1
        for d in s.shape:
            numel *= d
        if s.dtype not in ("F32", "BF16", "F16"):
            raise UnsupportedQuantization(
                f"{ck.path}: layer {m!r}: {m}.weight_scale has dtype {s.dtype}, expected F32",
                scheme=cap.scheme, layer=m, tensor=f"{m}.weight_scale",
            )
        if cap.weight_granularity == "tensor":
            ok = numel == 1 and len(s.shape) <= 1
        else:
            ok = tuple(s.shape) in ((n,), (n, 1))
        if not ok:
            kind = "block-wise FP8" if len(s.shape) >= 2 and numel > 1 and s.shape[-1] != 1 else "unexpected"
            raise UnsupportedQuantization(
                f"{ck.path}: layer {m!r}: {m}.weight_scale has shape {list(s.shape)} ({kind} scales); "
                f"{cap.scheme} expects "
                f"{'a 0-d scale' if cap.weight_granularity == 'tensor' else f'[{n}] per-channel scales'}",
                scheme=kind if kind == "block-wise FP8" else cap.scheme, layer=m, tensor=f"{m}.weight_scale",
            )
        if cap.activation == "static_tensor":
            i = ck.tensors.get(f"{m}.input_scale")
            if i is None:
                raise UnsupportedQuantization(
                    f"{ck.path}: layer {m!r} ({cap.scheme}): {m}.input_scale is missing; static per-tensor "
                    f"activation scales are required by quant_algo FP8",
                    scheme=cap.scheme, layer=m, tensor=f"{m}.input_scale",
                )
            if len(i.shape) > 1 or (i.shape and i.shape[0] != 1):
                raise UnsupportedQuantization(
                    f"{ck.path}: layer {m!r}: {m}.input_scale has shape {list(i.shape)}, expected 0-d",
                    scheme=cap.scheme, layer=m, tensor=f"{m}.input_scale",
                )
    return quantized


def _scale_source(ref: SourceRef, scale: str, granularity: str) -> SourceRef:
    # Per-channel scales follow the weight's row slice (column-parallel
    # shards); row-parallel shards (dim 1) and per-tensor scales are whole.
    if granularity == "channel" and ref.dim == 0:
        return SourceRef(scale, 0, ref.start, ref.stop)
    return SourceRef(scale)


def _rewrite_weight(ck: Checkpoint, spec: TensorSpec, modules: list[str], cap: Capability,
                    kernel: str) -> list[TensorSpec]:
    if not spec.name.endswith(".weight"):
        raise UnsupportedQuantization(
            f"{ck.path}: tensor {spec.name!r} ({cap.scheme}) is an FP8 weight under a name not ending in "
            f"'.weight'; the sharding rule and {cap.scheme} disagree",
            scheme=cap.scheme, layer=modules[0],
        )
    if len(spec.stored_shape) != 2 or (len(spec.sources) > 1 and spec.cat_dim != 0):
        raise UnsupportedQuantization(
            f"{ck.path}: layer {modules[0]!r} ({cap.scheme}): spec {spec.name!r} has shape "
            f"{list(spec.stored_shape)} cat_dim {spec.cat_dim}; only [N, K] weights fused along N are supported",
            scheme=cap.scheme, layer=modules[0],
        )
    base = spec.name[: -len(".weight")]
    n, k = spec.stored_shape
    n_pad, k_pad = _ceil(n), _ceil(k)
    gran = cap.weight_granularity
    scale_names = [f"{m}.weight_scale" for m in modules]
    rows = []
    for ref in spec.sources:
        rows.append(ref.stop - ref.start if ref.dim == 0 else ck.tensors[ref.name].shape[0])
    if sum(rows) != n:
        raise UnsupportedQuantization(
            f"{ck.path}: spec {spec.name!r}: parts have {sum(rows)} rows, stored_shape says {n}",
            scheme=cap.scheme, layer=modules[0],
        )
    # The sharding layout's logical_shape (the checkpoint tensor's whole
    # shape) wins; without one (TP = 1, or a fused spec) it is [N, K].
    record = Fp8WeightLayout(cap.scheme, kernel, (n, k), (n_pad, k_pad), gran, cap.activation,
                             f"{base}.weight_scale",
                             f"{base}.input_scale" if cap.activation == "static_tensor" else None,
                             "max" if gran == "tensor" and len(modules) > 1 else None,
                             tuple(spec.layout.get("logical_shape") or (n, k)))
    out = [
        replace(
            spec,
            dtype="F8_E4M3",
            stored_shape=(n_pad, k_pad),
            cat_dim=0,
            op=OP_WEIGHT,
            op_args={"granularity": gran, "weight_scales": scale_names, "n": n, "k": k},
            view_shape=record.view_shape,
            view_stride=record.view_stride,
            layout=record.merged(spec.layout),
        )
    ]
    if gran == "tensor":
        scale = Fp8ScaleLayout(cap.scheme, kernel, "weight_scale", spec.name, gran, n)
        out.append(TensorSpec(f"{base}.weight_scale", "F32", (), tuple(SourceRef(s) for s in scale_names), 0,
                              OP_WEIGHT_SCALE, {"granularity": gran}, layout=scale.to_json()))
    else:
        scale = Fp8ScaleLayout(cap.scheme, kernel, "weight_scale", spec.name, gran, n, n_pad - n, SCALE_PAD_VALUE)
        srcs = tuple(_scale_source(ref, f"{ref.name[:-7]}.weight_scale", gran) for ref in spec.sources)
        out.append(TensorSpec(f"{base}.weight_scale", "F32", (1, n_pad), srcs, 0, OP_WEIGHT_SCALE,
                              {"granularity": gran, "n": n, "n_padded": n_pad}, layout=scale.to_json()))
    if cap.activation == "static_tensor":
        scale = Fp8ScaleLayout(cap.scheme, kernel, "input_scale", spec.name, "tensor")
        out.append(TensorSpec(f"{base}.input_scale", "F32", (), tuple(SourceRef(f"{m}.input_scale") for m in modules),
                              0, OP_INPUT_SCALE, {}, layout=scale.to_json()))
    return out


def process_specs(ck: Checkpoint, specs: list[TensorSpec], kernel: str, cap: Capability,
                  quantized: frozenset[str] | set[str]) -> list[TensorSpec]:
    """Rewrites the sharded specs of a ModelOpt FP8 checkpoint for ``kernel`` (headers only).

    For every spec whose sources are all quantized ``*.weight`` tensors (one,
    or the parts of a fused projection concatenated along dim 0):

    - the weight becomes ``F8_E4M3``, stored ``[N_pad, K_pad]`` row-major
      (``N``/``K`` rounded up to multiples of 16, zero-filled), exposed as the
      ``[K_pad, N_pad]`` view with strides ``(1, K_pad)``; per-tensor parts
      with unequal scales are requantized to the largest (op
      ``modelopt_fp8_weight``);
    - ``<base>.weight_scale``: ``F32`` 0-d (max over parts) or ``[1, N_pad]``
      (parts' per-channel scales concatenated, tail filled with
      :data:`SCALE_PAD_VALUE`);
    - ``<base>.input_scale``: ``F32`` 0-d, max over parts (``FP8`` only).

    The checkpoint's own ``*.weight_scale`` / ``*.input_scale`` specs are
    dropped (the per-channel ``FP8_PER_CHANNEL_PER_TOKEN`` variant has no input
    scale). Other ``*_scale`` tensors (``k_scale``, ``v_scale``) pass through,
    kept in their stored dtype (``F32``). Everything else is unchanged.

    Args:
        ck (`Checkpoint`): the checkpoint (headers).
        specs (`list[TensorSpec]`): the sharded specs.
        kernel (`str`): the kernel layout target (``cutlass``).
        cap (`Capability`): the scheme's capability entry.
        quantized (`frozenset[str]`): the quantized modules, from
            :func:`check_layers` (run once, by ``quant.detect``).

    Raises:
        UnsupportedQuantization (`unsupported_quantization`): a fused layer
            mixing FP8 and unquantized parts, or a spec mixing scales with
            other tensors (per-layer checks are :func:`check_layers`'s).
    """
    drop = {f"{m}.weight_scale" for m in quantized} | {f"{m}.input_scale" for m in quantized}
    weights = {f"{m}.weight" for m in quantized}
    out: list[TensorSpec] = []
    seen: set[str] = set()
    for spec in specs:
        if spec.alias_of is not None:
            out.append(spec)
            continue
        names = [r.name for r in spec.sources]
        nset = set(names)
        if nset and nset <= drop:
            continue
        if nset & drop:
            raise UnsupportedQuantization(
                f"{ck.path}: spec {spec.name!r} mixes quantization scales with other tensors {sorted(nset)}",
                scheme=cap.scheme, layer=sorted(nset & drop)[0].rsplit(".", 1)[0],
            )
        qw = [n for n in names if n in weights]
        if qw:
            if len(qw) != len(names):
                other = [n for n in names if n not in weights]
                raise UnsupportedQuantization(
                    f"{ck.path}: fused layer {spec.name!r} mixes FP8 parts {qw} with unquantized parts {other}; "
                    f"all parts of a fused layer must have the same precision ({cap.scheme})",
                    scheme=cap.scheme, layer=qw[0][:-7],
                )
            modules = [n[:-7] for n in names]
            new = _rewrite_weight(ck, spec, modules, cap, kernel)
            out.extend(new)
            seen.update(s.name for s in new)
            continue
        if nset and all(n.endswith("_scale") and ck.tensors[n].dtype == "F32" for n in nset):
            out.append(replace(spec, dtype="F32"))
            continue
        out.append(spec)
    names_out = [s.name for s in out]
    if len(set(names_out)) != len(names_out):
        dup = sorted({n for n in names_out if names_out.count(n) > 1})
        raise UnsupportedQuantization(
            f"{ck.path}: processing produced duplicate tensor names {dup[:5]}; a checkpoint tensor "
            f"collides with a processed scale name",
            scheme=cap.scheme, layer=dup[0],
        )
    log.debug("processed specs checkpoint=%s scheme=%s kernel=%s quantized_layers=%d",
              ck.path, cap.scheme, kernel, len(quantized))
    return out


# --- ops (run by weightcache.pipeline.execute) ----------------------------------


def requantize(part, scale, new_scale):
    """Requantizes one FP8 part from ``scale`` to ``new_scale``.

    ``(part.float() * scale) / new_scale``, clamped to ±448, converted with
    ``.to(torch.float8_e4m3fn)`` (round to nearest even), all in float32.

    Args:
        part (`torch.Tensor`): ``F8_E4M3`` ``[rows, K]``.
        scale (`torch.Tensor`), new_scale (`torch.Tensor`): ``F32`` 0-d.

    Returns:
        `torch.Tensor`: ``F8_E4M3`` ``[rows, K]``.
    """
    import torch

    dq = part.to(torch.float32) * scale.to(torch.float32)
    q = (dq / new_scale.to(torch.float32)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn)


def _scalar(t):
    import torch

    return t.reshape(-1)[0].to(torch.float32)


def op_weight(spec: TensorSpec, parts: list, fetch) -> Any:
    """Fuses, requantizes (per-tensor, unequal scales) and pads FP8 weight parts.

    Args:
        spec (`TensorSpec`): ``op_args``: ``granularity``, ``weight_scales``
            (checkpoint names, one per part), ``n``, ``k``.
        parts (`list[torch.Tensor]`): ``F8_E4M3`` ``[rows_i, K]`` slices.
        fetch: ``fetch(name)`` → whole checkpoint tensor.

    Returns:
        `torch.Tensor`: ``F8_E4M3`` ``spec.stored_shape`` ``[N_pad, K_pad]``, zeros in the padding.
    """
    import torch

    a = spec.op_args
    parts = [p.to(torch.float8_e4m3fn) if p.dtype != torch.float8_e4m3fn else p for p in parts]
    if a["granularity"] == "tensor" and len(parts) > 1:
        scales = [_scalar(fetch(n)) for n in a["weight_scales"]]
        smax = torch.stack(scales).max()
        parts = [p if bool(s == smax) else requantize(p, s, smax) for p, s in zip(parts, scales)]
    w = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    n_pad, k_pad = spec.stored_shape
    out = torch.zeros((n_pad, k_pad), dtype=torch.uint8, device=w.device)
    out[: a["n"], : a["k"]] = w.view(torch.uint8)
    return out.view(torch.float8_e4m3fn)


def op_weight_scale(spec: TensorSpec, parts: list, fetch) -> Any:
    """Fused ``weight_scale``: max of per-tensor parts (0-d), or per-channel
    parts concatenated and padded with :data:`SCALE_PAD_VALUE` to ``[1, N_pad]``; ``F32``."""
    import torch

    if spec.op_args["granularity"] == "tensor":
        return torch.stack([_scalar(p) for p in parts]).max()
    flat = torch.cat([p.reshape(-1).to(torch.float32) for p in parts])
    out = torch.full((1, spec.op_args["n_padded"]), SCALE_PAD_VALUE, dtype=torch.float32, device=flat.device)
    out[0, : spec.op_args["n"]] = flat
    return out


def op_input_scale(spec: TensorSpec, parts: list, fetch) -> Any:
    """Fused ``input_scale``: the max over the parts' 0-d scales, ``F32`` 0-d."""
    import torch

    return torch.stack([_scalar(p) for p in parts]).max()


OPS = {OP_WEIGHT: op_weight, OP_WEIGHT_SCALE: op_weight_scale, OP_INPUT_SCALE: op_input_scale}


class ModelOptFp8(SchemeRules):
    """The ModelOpt FP8 family (``modelopt_fp8``, ``modelopt_fp8_per_channel``) in the scheme registry."""

    family = "modelopt_fp8"
    capabilities = CAPABILITIES
    side_tensors = SIDE_TENSORS
    ops = OPS
    placers = {OP_WEIGHT: modelopt_fp8_placement.place_weight, OP_WEIGHT_SCALE: modelopt_fp8_placement.place_scale,
               OP_INPUT_SCALE: modelopt_fp8_placement.place_scale}

    def read_config(self, ck: Checkpoint) -> QuantConfig | None:
        """``hf_quant_config.json`` (:func:`read_hf_quant_config`)."""
        return read_hf_quant_config(ck)

    def check_layers(self, ck: Checkpoint, qc: QuantConfig, cap: Capability) -> set[str]:
        """:func:`check_layers`."""
        return check_layers(ck, qc, cap)

    def process_specs(self, ck: Checkpoint, specs: list[TensorSpec], kernel: str, scheme: Any) -> list[TensorSpec]:
        """:func:`process_specs` with the scheme's capability and quantized layers."""
        return process_specs(ck, specs, kernel, scheme.capability, scheme.quantized)

    def checkpoint_form(self, tensor: Any, layout: Mapping[str, Any]) -> Any:
        """Undoes the kernel layout (a view, no copy).

        A weight (:class:`Fp8WeightLayout`: ``F8_E4M3`` ``[N_pad, K_pad]``
        exposed as the ``[K_pad, N_pad]`` view) becomes its transpose cut to
        ``logical_shape`` ``[N, K]``; a per-channel ``weight_scale``
        (``F32`` ``[1, N_pad]``) its first ``logical_output_width`` values.
        Anything else (0-d scales) is returned as is.

        Raises:
            ManifestInvalid (`manifest_invalid`): a malformed FP8 layout.
        """
        record = layout_of(layout)
        if isinstance(record, Fp8WeightLayout):
            n, k = record.logical_shape
            return tensor.t()[:n, :k]
        if isinstance(record, Fp8ScaleLayout) and record.role == "weight_scale" and tensor.dim() == 2:
            return tensor[0, : record.logical_output_width]
        return tensor


#: The registered instance (``weightcache.quant`` registers it at import).
RULES = ModelOptFp8()
