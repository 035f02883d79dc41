"""The load pipeline, one straight line shared by the service and the disk fallback.

::

    plan(rank)                 headers only: specs, offsets, slab size, cache key, dtypes served
      -> read                  checkpoint byte ranges (os.preadv)
      -> shard                 slices of the rank (sharding.shard_specs)
      -> process               quantized layers (the scheme registry's ops), dtype casts
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
from collections.abc import Mapping
from typing import Any, Callable

from . import digest, identity, placement, quant, sharding
from .checkpoint import Checkpoint
from .errors import ShapeMismatch
from .reader import LoaderOptions, direct_task, read_direct, read_into_slab
from .manifest import ALIGNMENT_BYTES, Manifest, TensorRecord, align, contiguous_stride, itemsize, torch_dtype
from .spec import DTYPE_NAMES, LoadRequest, RankRequest
from .tensor_spec import SourceRef, TensorSpec

log = logging.getLogger(__name__)

#: Bumped whenever the bytes produced for the same inputs change (defined with the cache key it is part of).
PIPELINE_VERSION = identity.PIPELINE_VERSION

#: Processing ops: name -> fn(spec, parts, fetch) -> tensor of spec.stored_shape
#: and spec.dtype. ``parts`` are the spec's sources, already sliced;
#: ``fetch(name)`` returns any other whole checkpoint tensor (e.g. a scale).
Op = quant.registry.Op


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


#: The pipeline's own ops; a plan's scheme ops come from its registry (:attr:`Plan.registry`).
OPS: Mapping[str, Op] = {"copy": _op_copy}


@dataclass
class Plan:
    """Everything decided before the first byte is read.

    Attributes:
        rank (`RankRequest`): what is loaded, and the rank.
        checkpoint (`Checkpoint`): opened from headers.
        specs (`list[TensorSpec]`): output tensors, in slab order.
        records (`list[TensorRecord]`): their records, offsets assigned, no digests yet.
        slab_size_bytes (`int`): bytes needed (before backend rounding).
        key (`dict`): the cache key (DESIGN §5), derived once (:func:`weightcache.identity.cache_key`).
        dtypes_served (`frozenset[str]`): the dtype names an engine may ask
            for and get this slab (:func:`weightcache.identity.served_dtypes`).
        registry (`quant.Registry`): the scheme families the plan was made with (their ops run it).
    """

    rank: RankRequest
    checkpoint: Checkpoint
    specs: list[TensorSpec]
    records: list[TensorRecord]
    slab_size_bytes: int
    key: dict[str, Any]
    dtypes_served: frozenset[str]
    registry: quant.Registry = quant.REGISTRY

    def op(self, name: str) -> Op:
        """The op ``name`` of a spec of this plan: the pipeline's own, else its registry's.

        Raises:
            KeyError: neither has it.
        """
        fn = OPS.get(name) or self.registry.op(name)
        if fn is None:
            raise KeyError(f"processing op {name!r} is neither the pipeline's nor a quantization scheme's")
        return fn

    @property
    def model(self) -> LoadRequest:
        """``rank.model``."""
        return self.rank.model

    @property
    def tp_size(self) -> int:
        """``rank.tp_size``."""
        return self.rank.tp_size

    @property
    def tp_rank(self) -> int:
        """``rank.tp_rank``."""
        return self.rank.tp_rank

    @property
    def payload_bytes(self) -> int:
        return sum(r.size_bytes for r in self.records if r.alias_of is None)


def plan(rank: RankRequest, device: dict[str, Any], checkpoint: Checkpoint | None = None,
         registry: quant.Registry = quant.REGISTRY) -> Plan:
    """Plans one slab from the checkpoint's headers alone.

    Args:
        rank (`RankRequest`): what to load (a :class:`weightcache.config.Placement` is one).
        device (`dict`): ``{backend, gpu_uuid, compute_capability}`` of the slab's device (cache key).
        checkpoint (`Checkpoint`, *optional*): ``rank.model.path`` already opened.
        registry (`quant.Registry`, *optional*): the quantization scheme families; ``quant.REGISTRY`` by default.

    Raises:
        CheckpointNotFound, CheckpointCorrupt: from opening the checkpoint.
        UnsupportedQuantization (`unsupported_quantization`): before any read.
        UnsupportedArchitecture (`unsupported_architecture`): TP > 1 without rules.
        ShapeMismatch (`shape_mismatch`): a tensor disagrees with ``config.json``.
    """
    model = rank.model
    ck = checkpoint or Checkpoint(model.path)
    # Once, first: UnsupportedQuantization wins over sharding's shape errors, before any read.
    scheme = quant.detect(ck, model.kernel, registry)
    cast_specs = sharding.shard_specs(ck, rank.tp_size, rank.tp_rank, model.naming, DTYPE_NAMES[model.dtype],
                                      registry)
    specs = quant.process_specs(ck, cast_specs, model.kernel, scheme)
    # The slab's identity, once: the dtypes it serves and the key's (effective) dtype.
    cast_from = identity.rank_cast_dtypes(rank, ck, registry)
    served = identity.served_dtypes(model.dtype, cast_from)
    key = identity.cache_key(rank, ck, device, scheme, identity.effective_dtype(model.dtype, cast_from))
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
    return Plan(rank, ck, specs, records, max(offset, ALIGNMENT_BYTES), key, served, registry)


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
    :func:`weightcache.reader.read_direct`) when the slab offers torch-free
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
    placed = placement.place_all(p.specs, p.records, p.checkpoint, p.registry.placer)
    if placed is None:
        return None
    if not host and hasattr(slab, "prepare_kernels"):
        slab.prepare_kernels()  # compiles while the reads run (no-op when prepare_fill started it)
        if not slab.kernels_expected():
            log.warning("NVRTC unavailable, the torch pipeline fills checkpoint=%s", p.checkpoint.path)
            return None
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
    offsets (:mod:`weightcache.reader`); the others are read, sliced,
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
            out = p.op(spec.op)(spec, parts, reader.tensor)
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
