"""The load pipeline, one straight line shared by the service and the disk fallback.

::

    plan(model, layout, rank)  headers only: specs, offsets, slab size, cache key
      -> read                  checkpoint byte ranges (os.preadv)
      -> shard                 slices of the rank (sharding.shard_specs)
      -> process               quantized layers (quant.OPS), dtype casts
      -> pack                  bytes written at their planned offsets in the slab
      -> seal                  backend makes the slab read-only   (caller)
      -> publish               manifest + fd                        (caller)

:func:`plan` reads no tensor data; :func:`execute` fills a writable slab and
returns the :class:`~weightcache.manifest.Manifest` with a content digest of
every tensor. The daemon seals and publishes; the client's disk fallback wraps
the filled private buffer directly, so both sides produce bit-identical bytes.

Forbidden imports: socket, selectors, weightcache.config, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from . import digest, placement, quant, sharding
from .checkpoint import Checkpoint
from .errors import ShapeMismatch, WeightcacheError
from .loader import LoaderOptions, direct_task, read_direct, read_into_slab
from .manifest import ALIGNMENT_BYTES, Manifest, TensorRecord, align, contiguous_stride, itemsize, torch_dtype
from .spec import DTYPE_NAMES, LoadRequest, SourceRef, TensorSpec

log = logging.getLogger(__name__)

#: Bumped whenever the bytes produced for the same inputs change.
PIPELINE_VERSION = 1

#: Processing ops: name -> fn(spec, parts, fetch) -> tensor of spec.stored_shape
#: and spec.dtype. ``parts`` are the spec's sources, already sliced;
#: ``fetch(name)`` returns any other whole checkpoint tensor (e.g. a scale).
Op = Callable[[TensorSpec, list, Callable[[str], Any]], Any]


def _op_copy(spec: TensorSpec, parts: list, fetch) -> Any:
    """Concatenates the parts (0-d parts as one element each), casts to
    ``spec.dtype``, then appends ``op_args["pad_rows"]`` zero rows on dim 0
    (vocab padding, see ``weightcache.sharding``)."""
    import torch

    if len(parts) > 1:
        parts = [p.reshape(1) if p.dim() == 0 else p for p in parts]
    t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.cat_dim)
    t = t.to(torch_dtype(spec.dtype))
    pad = int(spec.op_args.get("pad_rows", 0))
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))], dim=0)
    return t


OPS: dict[str, Op] = {"copy": _op_copy}
OPS.update(quant.OPS)


@dataclass
class Plan:
    """Everything decided before the first byte is read.

    Attributes:
        model (`LoadRequest`), tp_size (`int`), tp_rank (`int`): what is loaded.
        checkpoint (`Checkpoint`): opened from headers.
        specs (`list[TensorSpec]`): output tensors, in slab order.
        records (`list[TensorRecord]`): their records, offsets assigned, no digests yet.
        slab_size_bytes (`int`): bytes needed (before backend rounding).
        key (`dict`): the cache key (DESIGN §5).
    """

    model: LoadRequest
    tp_size: int
    tp_rank: int
    checkpoint: Checkpoint
    specs: list[TensorSpec]
    records: list[TensorRecord]
    slab_size_bytes: int
    key: dict[str, Any]

    @property
    def payload_bytes(self) -> int:
        return sum(r.size_bytes for r in self.records if r.alias_of is None)


def cache_key(model: LoadRequest, tp_size: int, tp_rank: int, ck: Checkpoint, device: dict[str, Any],
              scheme: Any = quant.DETECT, cast_specs: list[TensorSpec] | None = None) -> dict[str, Any]:
    """The cache key of DESIGN §5, as a nested JSON-able dict.

    Args:
        device (`dict`): ``{backend, gpu_uuid, compute_capability}`` of the slab's device.
        scheme (`quant.Scheme | None`, *optional*): the checkpoint's scheme if
            already detected (``None``: unquantized); detected here otherwise.
        cast_specs (`list[TensorSpec]`, *optional*): this rank's
            :func:`weightcache.sharding.shard_specs` with ``model.dtype``'s cast,
            if already computed (see :func:`effective_dtype`).
    """
    return {"checkpoint": ck.identity(), **key_fields(model, tp_size, tp_rank, ck, device, scheme, cast_specs)}


def key_fields(model: LoadRequest, tp_size: int, tp_rank: int, ck: Checkpoint, device: dict[str, Any],
               scheme: Any = quant.DETECT, cast_specs: list[TensorSpec] | None = None) -> dict[str, Any]:
    """Every field of :func:`cache_key` but ``checkpoint`` (reads ``config.json``, no safetensors header
    unless the checkpoint is quantized or ``model.dtype`` is not ``auto``)."""
    if scheme is quant.DETECT:
        scheme = quant.detect(ck)
    return {
        "revision": model.revision,
        "architecture": (ck.config.get("architectures") or [ck.config.get("model_type", "")])[0],
        "dtype": effective_dtype(ck, tp_size, tp_rank, model.naming, model.dtype, cast_specs),
        "naming": model.naming,
        "tp_size": tp_size,
        "tp_rank": tp_rank,
        "quant_scheme": scheme.name if scheme else "",
        "quant_config_blake2b": scheme.config_hash if scheme else "",
        "kernel": model.kernel if scheme else "",
        "pipeline_version": PIPELINE_VERSION,
        "device": dict(device),
    }


def effective_dtype(ck: Checkpoint, tp_size: int, tp_rank: int, naming: str, dtype: str,
                    cast_specs: list[TensorSpec] | None = None) -> str:
    """The dtype the cache key carries: ``dtype``, or ``"auto"`` when casting to it changes nothing here.

    A configured dtype that every cast tensor of this rank is already stored in
    gives the same bytes as ``auto`` (as stored), so both are one key: an
    engine attaching with ``dtype="auto"`` gets the slab configured
    ``dtype = "float32"`` for a float32 checkpoint, and the reverse. ``auto``
    itself needs no header; an explicit dtype compares the rank's tensor specs
    with and without the cast (:func:`weightcache.sharding.shard_specs`,
    headers only).

    Args:
        ck (`Checkpoint`): the checkpoint (its headers are read for an explicit dtype).
        tp_size, tp_rank (`int`), naming (`str`): the slab's layout, rank and naming.
        dtype (`str`): ``auto``, ``bfloat16``, ``float16`` or ``float32``.
        cast_specs (`list[TensorSpec]`, *optional*): the rank's specs with
            ``dtype``'s cast when the caller has them (:func:`plan` does).

    Returns:
        `str`: ``"auto"`` or ``dtype``.

    Raises:
        The errors of :func:`weightcache.sharding.shard_specs` (which :func:`plan` raises first).
    """
    if dtype == "auto":
        return "auto"
    as_stored = sharding.shard_specs(ck, tp_size, tp_rank, naming, None)
    cast = cast_specs if cast_specs is not None else sharding.shard_specs(ck, tp_size, tp_rank, naming,
                                                                           DTYPE_NAMES[dtype])
    return "auto" if [s.dtype for s in as_stored] == [s.dtype for s in cast] else dtype


def dtype_matches(model: LoadRequest, tp_size: int, tp_rank: int, requested: str,
                  key: dict[str, Any] | None = None) -> bool:
    """Whether a slab configured with ``model.dtype`` serves an engine asking for ``requested``.

    True when both name the same dtype or give the same bytes (see
    :func:`effective_dtype`). ``key`` is the slab's cache key when it is
    loaded (its ``dtype`` is already effective); otherwise the checkpoint's
    headers are read. A checkpoint that cannot be read matches, so that the
    engine hears the slab's own error rather than ``model_not_found``.
    """
    if requested == model.dtype:
        return True
    if requested not in DTYPE_NAMES:
        return False
    try:
        ck = None if requested == "auto" and key is not None else Checkpoint(model.path, validate=False)
        have = key["dtype"] if key is not None else effective_dtype(ck, tp_size, tp_rank, model.naming, model.dtype)
        want = "auto" if requested == "auto" else effective_dtype(ck, tp_size, tp_rank, model.naming, requested)
    except WeightcacheError:
        return True
    return have == want


def check_key(fields: dict[str, Any], ck: Checkpoint, key: dict[str, Any]) -> list[str]:
    """Fields in which a service's cache ``key`` differs from this engine's view.

    Args:
        fields (`dict`): :func:`key_fields` computed here.
        ck (`Checkpoint`): the checkpoint as it is now; its identity is checked
            with :meth:`Checkpoint.identity_diff` (``stat()`` only).
        key (`dict`): the key from the service's manifest.

    Returns:
        `list[str]`: dotted field paths, empty on a match.
    """
    diff = diff_keys(fields, {k: v for k, v in key.items() if k != "checkpoint"})
    return diff + ["checkpoint." + d for d in ck.identity_diff(key.get("checkpoint") or {})]


def diff_keys(expected: Any, actual: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the fields that differ between two cache keys.

    Example:
        >>> diff_keys({"a": 1, "b": {"c": 2}}, {"a": 1, "b": {"c": 3}})
        ['b.c']
    """
    if expected == actual:  # the usual case, compared in C
        return []
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = []
        for k in sorted(set(expected) | set(actual), key=str):
            p = f"{prefix}.{k}" if prefix else str(k)
            if k not in expected or k not in actual:
                out.append(p)
            else:
                out.extend(diff_keys(expected[k], actual[k], p))
        return out
    return [] if expected == actual else [prefix or "<key>"]


def plan(model: LoadRequest, tp_size: int, tp_rank: int, device: dict[str, Any], checkpoint: Checkpoint | None = None) -> Plan:
    """Plans one slab from the checkpoint's headers alone.

    Raises:
        CheckpointNotFound, CheckpointCorrupt: from opening the checkpoint.
        UnsupportedQuantization (`unsupported_quantization`): before any read.
        UnsupportedArchitecture (`unsupported_architecture`): TP > 1 without rules.
        ShapeMismatch (`shape_mismatch`): a tensor disagrees with ``config.json``.
    """
    ck = checkpoint or Checkpoint(model.path)
    # Once, first: UnsupportedQuantization wins over sharding's shape errors, before any read.
    scheme = quant.detect(ck, model.kernel)
    target_dtype = DTYPE_NAMES[model.dtype]
    cast_specs = sharding.shard_specs(ck, tp_size, tp_rank, model.naming, target_dtype)
    specs = quant.process_specs(ck, cast_specs, model.kernel, scheme)
    records, offset = [], 0
    by_name: dict[str, TensorRecord] = {}
    for s in specs:
        if s.alias_of is not None:
            continue
        size = itemsize(s.dtype)
        for d in s.stored_shape:
            size *= d
        shape = s.view_shape if s.view_shape is not None else s.stored_shape
        stride = s.view_stride if s.view_stride is not None else contiguous_stride(s.stored_shape)
        rec = TensorRecord(s.name, s.dtype, tuple(shape), tuple(stride), offset, size, layout=dict(s.layout))
        by_name[s.name] = rec
        offset = align(offset + size, ALIGNMENT_BYTES)
    for s in specs:
        if s.alias_of is None:
            records.append(by_name[s.name])
        else:
            tgt = by_name[s.alias_of]
            records.append(TensorRecord(s.name, tgt.dtype, tgt.shape, tgt.stride, tgt.offset_bytes, tgt.size_bytes,
                                        layout=dict(s.layout), alias_of=s.alias_of))
    return Plan(model, tp_size, tp_rank, ck, specs, records, max(offset, ALIGNMENT_BYTES),
                cache_key(model, tp_size, tp_rank, ck, device, scheme, cast_specs))


@dataclass(frozen=True)
class Filled:
    """What :func:`fill` did.

    Attributes:
        manifest (`Manifest`): of the filled slab, digests included.
        torch_free (`bool`): the slab was filled without importing torch
            (every tensor a placement, :mod:`weightcache.placement`).
        read_s (`float`): wall time reading (and processing) the tensors, seconds.
        digest_s (`float`): wall time of the digests after the read, seconds.
        bytes_read (`int`): payload bytes written.
    """

    manifest: Manifest
    torch_free: bool
    read_s: float
    digest_s: float
    bytes_read: int


def may_need_torch(model: LoadRequest) -> bool:
    """Whether loading ``model`` may need torch: a dtype to cast to.

    Everything else, ModelOpt FP8 included, is placed by the reader
    (:mod:`weightcache.placement`). ``True`` is a hint: a configured dtype the
    checkpoint is already stored in needs no cast, and :func:`fill` finds that
    out; a CUDA slab without NVRTC falls back to torch on its own.
    """
    return model.dtype != "auto"


def _counter(total: int, progress: Callable[[int, int], None] | None) -> tuple[Callable[[int], None], list[int]]:
    """``(advance, done)``: ``advance(n)`` adds ``n`` written bytes to ``done[0]`` (thread-safe) and reports
    ``progress(done, total)``."""
    done = [0]
    lock = threading.Lock()

    def advance(n: int) -> None:
        with lock:
            done[0] += n
            d = done[0]
        if progress is not None:
            progress(d, total)

    return advance, done


def _split_specs(p: Plan) -> tuple[list, list]:
    """The plan's stored tensors: ``(direct read tasks, [(spec, record)] that need processing)``."""
    tasks, computed = [], []
    for spec, rec in zip(p.specs, p.records):
        if spec.alias_of is not None:
            continue
        task = direct_task(spec, rec, p.checkpoint)
        if task is not None:
            tasks.append(task)
        else:
            computed.append((spec, rec))
    return tasks, computed


def fill(p: Plan, slab, progress: Callable[[int, int], None] | None = None,
         options: LoaderOptions | None = None) -> Filled:
    """Fills a backend's writable slab with the tensors of ``p``; without torch unless a tensor needs a cast.

    Every tensor that is a placement of checkpoint byte ranges (whole
    tensors, TP shards along any dimension, fused ``qkv_proj``/``gate_up_proj``,
    vocab padding, ModelOpt FP8 weights padded to the kernel's multiples, their
    fused scales and the requantisation of fused per-tensor parts) is filled
    by the parallel reader (:mod:`weightcache.placement`,
    :func:`weightcache.loader.read_direct`) when the slab offers torch-free
    access (a host memfd's ``buffer``; a CUDA slab's ``stager()`` with its
    NVRTC kernels, :mod:`weightcache.memory.kernels`). Otherwise (a dtype cast,
    or no NVRTC) this is :func:`execute` on ``slab.tensor``. Both give the same
    bytes and records; the digests are the backend's family either way
    (host ``xxh3_128``, CUDA ``sum64``), which :func:`verify` checks.

    Args:
        p (`Plan`): from :func:`plan`.
        slab (`WritableSlab`): from the backend's ``allocate``.
        progress (`callable`, *optional*): called as ``progress(done_bytes, total_bytes)``.
        options (`LoaderOptions`, *optional*): reader threads, staging bytes, O_DIRECT.

    Returns:
        `Filled`.

    Raises:
        The errors of :func:`execute`.
    """
    opts = options or LoaderOptions()
    placed = _placement(p, slab)
    if placed is None:
        timings: dict[str, float] = {}
        manifest = execute(p, slab.tensor, progress, opts, timings=timings)
        return Filled(manifest, False, timings["read_s"], timings["digest_s"], p.payload_bytes)
    try:
        return _fill_placed(p, placed, slab, opts, progress)
    except Exception as e:
        from .memory.kernels import KernelError

        if not isinstance(e, KernelError):
            raise
        # NVRTC loaded but refused the program (an unknown GPU, a driver too old): the torch path rewrites every byte.
        log.warning("GPU kernels unavailable, the torch pipeline fills checkpoint=%s error=%s", p.checkpoint.path, e)
        timings: dict[str, float] = {}
        manifest = execute(p, slab.tensor, progress, opts, timings=timings)
        return Filled(manifest, False, timings["read_s"], timings["digest_s"], p.payload_bytes)


def _placement(p: Plan, slab) -> placement.Placement | None:
    """The plan's placement when ``slab`` can take it without torch, else ``None``."""
    host = getattr(slab, "buffer", None) is not None
    if not host and not hasattr(slab, "stager"):
        return None
    placed = placement.place_all(p.specs, p.records, p.checkpoint)
    if placed is None:
        return None
    if not host and hasattr(slab, "prepare_kernels"):
        from .memory import kernels

        if not kernels.available():
            log.warning("NVRTC unavailable, the torch pipeline fills checkpoint=%s", p.checkpoint.path)
            return None
        slab.prepare_kernels()  # compiles while the reads run
    return placed


def _fill_placed(p: Plan, placed: placement.Placement, slab, opts: LoaderOptions,
                 progress: Callable[[int, int], None] | None) -> Filled:
    """Zero fill, host-computed scales, the parallel read, in-place byte maps, then the digests."""
    import numpy as np

    advance, _ = _counter(p.payload_bytes, progress)
    t0 = time.monotonic()
    host = getattr(slab, "buffer", None)
    values = placement.scalar_values(p.checkpoint, placed.scalars)
    if placed.zeros:
        if host is not None:
            for off, n in placed.zeros:
                host[off : off + n] = bytes(n)
        else:
            slab.zero(placed.zeros)
        advance(sum(n for _, n in placed.zeros))
    for off, fn in placed.small:
        data = fn(values)
        if host is not None:
            host[off : off + len(data)] = data
        else:
            slab.write(off, data)
        advance(len(data))
    read_direct(placed.reads, slab, opts, advance, with_digests=False)
    for spans, fn in placed.luts:
        table = fn(values)
        if table is None:
            continue
        if host is not None:
            lut = np.frombuffer(table, np.uint8)
            for off, n in spans:
                a = np.ndarray((n,), np.uint8, host, off)
                a[...] = lut[a]
                del a
        else:
            slab.apply_lut(spans, table)
    t_read = time.monotonic()
    stored = [(r.name, r.offset_bytes, r.size_bytes) for r in p.records if r.alias_of is None]
    sums = digest.slab_digests(slab, stored, opts.threads)
    t_end = time.monotonic()
    log.debug("placed checkpoint=%s reads=%d zeros=%d small=%d luts=%d read_ms=%.1f digest_ms=%.1f",
              p.checkpoint.path, len(placed.reads), len(placed.zeros), len(placed.small), len(placed.luts),
              (t_read - t0) * 1e3, (t_end - t_read) * 1e3)
    return Filled(_manifest(p, sums), True, t_read - t0, t_end - t_read, p.payload_bytes)


def _manifest(p: Plan, sums: dict[str, str]) -> Manifest:
    """The plan's records with their digests (aliases take their target's)."""
    records = []
    for rec in p.records:
        d = sums.get(rec.alias_of or rec.name, "")
        records.append(TensorRecord(rec.name, rec.dtype, rec.shape, rec.stride, rec.offset_bytes, rec.size_bytes,
                                    d, rec.layout, rec.alias_of))
    return Manifest(p.model.name, p.tp_size, p.tp_rank, p.key, p.slab_size_bytes, tuple(records))


class _Reader:
    """Reads whole checkpoint tensors, caching within one spec.

    With ``device`` (the CUDA slab's device) each tensor is copied there right
    after the read, so slicing, concatenation, casts and FP8 processing run on
    the GPU; the ops are element-wise IEEE operations, so their bytes equal the
    CPU's.
    """

    def __init__(self, ck: Checkpoint, device: Any = None) -> None:
        self.ck = ck
        self.device = device
        self.bytes_read = 0
        self._cache: dict[str, Any] = {}

    def tensor(self, name: str):
        import torch

        t = self._cache.get(name)
        if t is None:
            info = self.ck.tensors.get(name)
            if info is None:
                raise ShapeMismatch(f"checkpoint {self.ck.path} has no tensor {name!r}", tensor=name)
            buf = torch.empty(info.size_bytes, dtype=torch.uint8)
            if info.size_bytes:
                self.ck.read_into(info, buf.numpy())
            self.bytes_read += info.size_bytes
            if self.device is not None:
                buf = buf.to(self.device)
            t = buf.view(torch_dtype(info.dtype)).reshape(info.shape)
            self._cache[name] = t
        return t

    def slice(self, ref: SourceRef):
        t = self.tensor(ref.name)
        if ref.dim is None:
            return t
        return t.narrow(ref.dim, ref.start, ref.stop - ref.start)

    def clear(self) -> None:
        self._cache.clear()


def execute(p: Plan, slab, progress: Callable[[int, int], None] | None = None,
            options: LoaderOptions | None = None, with_digests: bool = True,
            timings: dict[str, float] | None = None) -> Manifest:
    """Reads, shards, processes and packs every tensor of ``p`` into ``slab``.

    Tensors that are a contiguous byte range of a file (whole tensors, dim-0
    shards, no dtype change) are read by the parallel loader straight to their
    offsets (:mod:`weightcache.loader`); the others are read, sliced,
    concatenated and processed (``OPS``) and then packed. Finally a content
    digest of every stored tensor is taken from the slab (:mod:`weightcache.digest`).

    Args:
        p (`Plan`): from :func:`plan`.
        slab (`torch.Tensor`): writable 1-D ``uint8`` tensor of at least
            ``p.slab_size_bytes`` bytes (host or CUDA).
        progress (`callable`, *optional*): called as ``progress(done_bytes, total_bytes)``.
        options (`LoaderOptions`, *optional*): reader threads, staging bytes, O_DIRECT.
        with_digests (`bool`, *optional*, defaults to `True`): record digests
            (the client's disk fallback skips them).
        timings (`dict`, *optional*): receives ``read_s`` and ``digest_s`` (seconds).

    Returns:
        `Manifest` of the filled slab.

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): a file ended early.
        ShapeMismatch (`shape_mismatch`): a processed tensor's shape differs from the plan.
    """
    import torch

    opts = options or LoaderOptions()
    advance, done = _counter(p.payload_bytes, progress)
    t0 = time.monotonic()
    tasks, computed = _split_specs(p)
    failure: list[BaseException] = []

    def direct() -> None:
        try:
            read_into_slab(tasks, slab, opts, advance)
        except BaseException as e:  # re-raised below
            failure.append(e)

    reader_thread = threading.Thread(target=direct, name="weightcache-direct", daemon=True)
    reader_thread.start()
    try:
        reader = _Reader(p.checkpoint, slab.device if slab.device.type == "cuda" else None)
        for spec, rec in computed:
            if failure:
                break
            parts = [reader.slice(r) for r in spec.sources]
            out = OPS[spec.op](spec, parts, reader.tensor)
            if tuple(out.shape) != tuple(spec.stored_shape) or out.dtype != torch_dtype(spec.dtype):
                raise ShapeMismatch(
                    f"tensor {spec.name!r} of {p.checkpoint.path}: processing gave {tuple(out.shape)} "
                    f"{out.dtype}, plan expected {spec.stored_shape} {spec.dtype}",
                    tensor=spec.name,
                )
            raw = out.contiguous().reshape(-1).view(torch.uint8)
            slab[rec.offset_bytes : rec.offset_bytes + rec.size_bytes].copy_(raw)
            reader.clear()
            advance(rec.size_bytes)
    finally:
        reader_thread.join()
    if failure:
        raise failure[0]
    if slab.device.type == "cuda":
        torch.cuda.synchronize(slab.device)
    t_packed = time.monotonic()
    stored = [(r.name, r.offset_bytes, r.size_bytes) for r in p.records if r.alias_of is None]
    sums = digest.digests(slab, stored, opts.threads) if with_digests else {}
    t_end = time.monotonic()
    log.debug("packed checkpoint=%s size_bytes=%d direct=%d processed=%d pack_ms=%.1f digest_ms=%.1f",
              p.checkpoint.path, done[0], len(tasks), len(computed), (t_packed - t0) * 1e3, (t_end - t_packed) * 1e3)
    if timings is not None:
        timings.update(read_s=t_packed - t0, digest_s=t_end - t_packed)
    return _manifest(p, sums)


def verify(manifest: Manifest, slab) -> list[str]:
    """Names of the tensors whose resident bytes no longer match their digests.

    Args:
        slab (`torch.Tensor | SealedSlab`): the slab as 1-D ``uint8`` (host or
            CUDA), or a backend's sealed slab: a host one (it offers
            ``buffer``) is checked on its read-only mapping without torch
            (:func:`weightcache.digest.matches_buffer`), a CUDA one through
            its ``digests`` (``sum64`` by an NVRTC kernel, no host copy, no
            torch) when every digest is ``sum64``, else through its ``tensor``
            (``xxh3c`` of older manifests copied to the host in blocks;
            :func:`weightcache.digest.matches`).
    """
    stored = [r for r in manifest.tensors if r.alias_of is None]
    buf = getattr(slab, "buffer", None)
    if buf is not None:
        try:
            return [r.name for r in stored
                    if not digest.matches_buffer(buf[r.offset_bytes : r.offset_bytes + r.size_bytes], r.digest)]
        finally:
            buf.release()
    if hasattr(slab, "digests") and stored and all(r.digest.startswith("sum64:") for r in stored):
        # A CUDA sealed slab: sum64 by the NVRTC kernel through the read-only mapping, no host copy, no torch.
        from .memory import kernels

        if kernels.available():
            now = slab.digests([(r.name, r.offset_bytes, r.size_bytes) for r in stored])
            return [r.name for r in stored if now[r.name] != r.digest]
    if hasattr(slab, "tensor"):  # a CUDA sealed slab
        slab = slab.tensor
    return [r.name for r in stored
            if not digest.matches(slab[r.offset_bytes : r.offset_bytes + r.size_bytes], r.digest)]
