"""The parallel reader: checkpoint byte ranges straight to their slab offsets.

Every tensor whose slab bytes are checkpoint bytes (whole tensors, TP shards
along any dimension, the parts of a fused tensor, FP8 rows at a padded pitch:
:mod:`weightcache.placement`) is one or more :class:`ReadTask` s, contiguous
or strided, that never pass through Python objects: a pool of threads reads
them with ``os.preadv``

- host slab: straight into the memfd mapping (no staging; row-parallel
  shards copied row by row from a read-only mapping of the file with numpy,
  :func:`mapped`; with ``O_DIRECT`` through a per-thread buffer);
- CUDA slab: into a bounded ring of pinned host buffers (two per thread), each
  copied asynchronously on the thread's own CUDA stream to its planned offset
  (``cuMemcpyHtoDAsync``, ``cuMemcpy2DAsync`` for strided rows); a buffer is
  reused only after its copy's event completed.

Staging memory is ``threads * 2 * chunk_bytes`` and never the whole
checkpoint. With ``o_direct=True`` files are opened ``O_DIRECT`` (page cache
bypassed) and each read covers the 4 KiB-aligned superset of its range.

Two entry points: :func:`read_into_slab` writes into a torch tensor (the
torch pipeline, kept as the reference, and the client's disk fallback; a CPU
tensor goes through :func:`read_direct`'s host loop); :func:`read_direct`
needs no torch at all and fills a backend's writable slab through its
``buffer`` (host memfd mapping) or its ``stager()`` (CUDA: cuda-bindings'
pinned buffers, stream and events), then takes the content digests where the
bytes are (host: ``xxh3_128`` over the mapping; CUDA: ``sum64`` by a kernel
on the GPU) (:func:`weightcache.digest.slab_digests`).

Forbidden imports: torch at module level, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Iterator

from .. import digest
from ..checkpoint import Checkpoint, open_file
from ..errors import ConfigError
from ..manifest import TensorRecord, itemsize
from ..sizes import round_up
from ..tensor_spec import TensorSpec
from ._cpus import default_threads
from ._rows import compact_rows, copy_mapped_rows, mapped
from ._rows import pread_task as _pread_exact
from ._task import DIRECT_ALIGN, ReadTask

log = logging.getLogger(__package__)  # the package's logger: a room is no logger name of its own

@dataclass
class LoaderOptions:
    """Tuning of the reader.

    Attributes:
        threads (`int`): reader threads (config ``service.read_threads``).
        staging_bytes (`int`): pinned staging memory for CUDA slabs, in bytes
            (config ``service.staging_bytes``); split in ``2 * threads`` buffers
            (the cuda backend keeps them between loads: :class:`~weightcache.memory.cuda_staging.StagingPool`).
        o_direct (`bool`): bypass the page cache.
    """

    threads: int = field(default_factory=lambda: default_threads())
    staging_bytes: int = 256 * 1024 * 1024
    o_direct: bool = False

    @property
    def chunk_bytes(self) -> int:
        """The most file bytes one piece of a task reads (a staging buffer less the ``O_DIRECT`` margins)."""
        c = self.staging_bytes // (2 * max(1, self.threads))
        c -= c % (2 * DIRECT_ALIGN)
        return max(c - 2 * DIRECT_ALIGN, DIRECT_ALIGN)

    @property
    def buffer_bytes(self) -> int:
        """Size of each of a reader thread's two staging buffers (``chunk_bytes`` plus the ``O_DIRECT`` margins)."""
        return self.chunk_bytes + 2 * DIRECT_ALIGN


def direct_task(spec: TensorSpec, rec: TensorRecord, ck: Checkpoint) -> ReadTask | None:
    """The byte-range copy that produces ``spec``, or ``None`` when it needs processing.

    A spec qualifies when its op is a plain ``copy`` of one source without a
    dtype change, and the source slice is contiguous in the file (the whole
    tensor, or a slice along a dimension preceded only by size-1 dimensions).
    The file's path is :meth:`Checkpoint.file_path` (resolved once per file).
    """
    if spec.op != "copy" or spec.op_args or len(spec.sources) != 1 or spec.alias_of is not None:
        return None
    src = spec.sources[0]
    info = ck.tensors.get(src.name)
    if info is None or info.dtype != spec.dtype:
        return None
    if src.dim is None:
        start, n = info.offset_bytes, info.size_bytes
    else:
        if any(d != 1 for d in info.shape[: src.dim]):
            return None
        row = itemsize(info.dtype) * math.prod(info.shape[src.dim + 1 :])
        start, n = info.offset_bytes + src.start * row, (src.stop - src.start) * row
    if n != rec.size_bytes:
        return None
    return ReadTask(ck.file_path(info.file), start, n, rec.offset_bytes, spec.name)


def _split(tasks: list[ReadTask], chunk: int, o_direct: bool = False, staged: bool = True) -> list[ReadTask]:
    """Pieces of at most ``chunk`` bytes, whole rows (``staged=False``, a host slab: a mapped row may be longer).

    Raises ConfigError (`config_invalid`, ``service.staging_bytes``): a row to be staged is longer than ``chunk``.
    """
    out = []
    for t in tasks:
        if t.rows == 1:
            for off in range(0, t.length, chunk):
                n = min(chunk, t.length - off)
                out.append(ReadTask(t.path, t.file_offset + off, n, t.slab_offset + off, t.tensor))
            continue
        # Whole rows per piece: the staged bytes (packed rows, or the file span) fit one buffer.
        step = t.length if mapped(t, o_direct) else t.src_pitch
        g = max(1, (chunk - t.length) // step + 1) if chunk >= t.length else 1
        if t.length > chunk and (staged or not mapped(t, o_direct)):
            raise ConfigError(f"tensor {t.tensor!r}: a row of {t.length} bytes does not fit a {chunk}-byte staging "
                              f"buffer; raise service.staging_bytes", key="service.staging_bytes", tensor=t.tensor)
        for r0 in range(0, t.rows, g):
            n = min(g, t.rows - r0)
            out.append(ReadTask(t.path, t.file_offset + r0 * t.src_pitch, t.length, t.slab_offset + r0 * t.dst_pitch,
                                t.tensor, n, t.src_pitch, t.dst_pitch))
    # Largest first keeps the threads busy to the end.
    out.sort(key=lambda t: -t.nbytes)
    return out


class _Files:
    """One read-only fd per checkpoint file, shared by the threads."""

    def __init__(self, o_direct: bool) -> None:
        self.flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if o_direct else 0)
        self.fds: dict[str, int] = {}
        self.lock = threading.Lock()

    def fd(self, path: str) -> int:
        with self.lock:
            fd = self.fds.get(path)
            if fd is None:
                fd = self.fds[path] = open_file(path, self.flags)
                if not self.flags & os.O_DIRECT:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _drain(work: queue.SimpleQueue, errors: list[BaseException]) -> Iterator[ReadTask]:
    """The tasks left in ``work``, until it is empty or a thread failed."""
    while not errors:
        try:
            yield work.get_nowait()
        except queue.Empty:
            return


def _run_threads(worker: Callable[[], None], n: int, files: _Files, errors: list[BaseException]) -> None:
    """Runs ``n`` (at least 1) reader threads to the end, closes the files, raises the first error a thread kept
    (its threads' frames cleared: a slice of the host slab they held kept the slab's memory while the error was)."""
    threads = [threading.Thread(target=worker, name=f"weightcache-read-{i}", daemon=True) for i in range(max(1, n))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    files.close()
    for e in errors:
        traceback.clear_frames(e.__traceback__)
    if errors:
        raise errors[0]


def read_into_slab(tasks: list[ReadTask], slab, opts: LoaderOptions,
                   progress: Callable[[int], None] | None = None) -> int:
    """Runs ``tasks`` on a thread pool, writing into ``slab``.

    A CPU tensor is filled through its buffer by :func:`read_direct` (no
    digests); a CUDA tensor through torch's pinned buffers and streams.

    Args:
        tasks (`list[ReadTask]`): from :func:`direct_task`.
        slab (`torch.Tensor`): writable 1-D ``uint8`` (CPU or CUDA).
        opts (`LoaderOptions`): threads, staging memory, O_DIRECT.
        progress (`callable`, *optional*): called with the bytes of each finished chunk.

    Returns:
        `int`: bytes read from the checkpoint files.

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): a file ended early.
    """
    import torch

    if not tasks:
        return 0
    if slab.device.type != "cuda":
        view = memoryview(slab.numpy())
        try:
            return read_direct(tasks, SimpleNamespace(buffer=view), opts, progress, with_digests=False).bytes_read
        finally:
            view.release()
    chunk = opts.chunk_bytes
    work: queue.SimpleQueue = queue.SimpleQueue()
    for t in _split(tasks, chunk):
        work.put(t)
    files = _Files(opts.o_direct)
    errors: list[BaseException] = []
    read_total = [0]
    lock = threading.Lock()

    def worker() -> None:
        events: list[Any] = [None, None]
        try:
            size = opts.buffer_bytes
            bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            stream = torch.cuda.Stream(device=slab.device)
            i = 0
            for t in _drain(work, errors):
                fd = files.fd(t.path)
                b = i % 2
                i += 1
                if events[b] is not None:
                    events[b].synchronize()
                lo = t.file_offset - t.file_offset % DIRECT_ALIGN if opts.o_direct else t.file_offset
                delta = t.file_offset - lo
                need = delta + t.length
                span = round_up(need, DIRECT_ALIGN) if opts.o_direct else need
                mv = memoryview(bufs[b].numpy())[:span]
                _pread_exact(fd, mv, lo, need, t)
                src = bufs[b][delta : delta + t.length]
                dst = slab[t.slab_offset : t.slab_offset + t.length]
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                events[b] = ev
                with lock:
                    read_total[0] += t.length
                if progress is not None:
                    progress(t.length)
            stream.synchronize()
        except BaseException as e:  # surfaced to the caller below
            errors.append(e)

    t0 = time.monotonic()
    _run_threads(worker, opts.threads, files, errors)
    dt = time.monotonic() - t0
    log.debug("read ranges=%d size_bytes=%d duration_ms=%.1f rate_gbps=%.2f", len(tasks), read_total[0], dt * 1e3,
              read_total[0] / max(dt, 1e-9) / 1e9)
    return read_total[0]


@dataclass(frozen=True)
class DirectRead:
    """What :func:`read_direct` did.

    Attributes:
        bytes_read (`int`): bytes read from the checkpoint files.
        read_s (`float`): wall time of the read.
        digest_s (`float`): wall time of the digests after the read.
        digests (`dict[str, str]`): tensor name -> digest (empty without digests).
    """

    bytes_read: int
    read_s: float
    digest_s: float
    digests: dict[str, str]


def read_direct(tasks: list[ReadTask], slab, opts: LoaderOptions, progress: Callable[[int], None] | None = None,
                with_digests: bool = True, ranges: list[tuple[str, int, int]] | None = None) -> DirectRead:
    """Runs ``tasks`` into a backend's writable slab without importing torch; then takes the digests.

    Host slab (it has a ``buffer``): each thread ``preadv``s straight into the
    mapping (through an anonymous staging buffer with ``O_DIRECT``, or for a
    strided task read as one span); the XXH3 digests are taken from the
    mapping afterwards on the same number of threads
    (:func:`weightcache.digest.buffer_digests`). CUDA slab (it has
    ``stager()``): each thread reads into its two pinned buffers and queues
    ``cuMemcpyHtoDAsync`` (``cuMemcpy2DAsync`` for strided tasks) copies; the
    ``sum64`` digests are then taken on the GPU by the slab's ``digests``
    (an NVRTC kernel, :mod:`weightcache.memory.kernels`): no byte comes back to the host.

    Strided tasks whose rows are apart in the file (row-parallel shards) are
    copied from a read-only mapping of the file (:func:`mapped`); with
    ``O_DIRECT`` they are read as one span of the file and packed.

    Args:
        tasks (`list[ReadTask]`): byte ranges (several per tensor for fused or strided placements).
        slab (`HostWritableSlab | CudaWritableSlab`): the slab being filled.
        opts (`LoaderOptions`): threads, staging memory, O_DIRECT.
        progress (`callable`, *optional*): called with the bytes of each finished piece.
        with_digests (`bool`, *optional*, defaults to `True`): take digests.
        ranges (`list[tuple[str, int, int]]`, *optional*): ``(name, offset_bytes,
            size_bytes)`` to digest; defaults to one per task.

    Returns:
        `DirectRead`.

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): a file ended early.
        CudaDriverError (`device_error`): a staging allocation or copy failed.
    """
    import numpy as np

    host = getattr(slab, "buffer", None)
    chunk = opts.chunk_bytes
    work: queue.SimpleQueue = queue.SimpleQueue()
    for t in _split(tasks, chunk, opts.o_direct, staged=host is None):
        work.put(t)
    files = _Files(opts.o_direct)
    errors: list[BaseException] = []
    read_total = [0]
    lock = threading.Lock()
    size = opts.buffer_bytes

    def staged(t: ReadTask, stage: memoryview) -> tuple[int, int]:
        """Puts ``t`` into ``stage``; returns ``(offset of the first row in stage, pitch of rows in stage)``."""
        if mapped(t, opts.o_direct):
            copy_mapped_rows(files.fd(t.path), t, stage, 0, t.length)
            return 0, t.length
        fd = files.fd(t.path)
        lo = t.file_offset - t.file_offset % DIRECT_ALIGN if opts.o_direct else t.file_offset
        need = t.file_offset - lo + t.file_span
        span = round_up(need, DIRECT_ALIGN) if opts.o_direct else need
        _pread_exact(fd, stage[:span], lo, need, t)
        return t.file_offset - lo, t.src_pitch

    def done(n: int) -> None:
        with lock:
            read_total[0] += n
        if progress is not None:
            progress(n)

    def host_worker() -> None:
        stage: memoryview | None = None
        try:
            for t in _drain(work, errors):
                if mapped(t, opts.o_direct):  # file mapping to slab mapping, the rows only
                    copy_mapped_rows(files.fd(t.path), t, host, t.slab_offset, t.dst_pitch)
                elif not opts.o_direct and t.rows == 1:  # straight into the mapping
                    _pread_exact(files.fd(t.path), host[t.slab_offset : t.slab_offset + t.length], t.file_offset,
                                 t.length, t)
                else:
                    if stage is None:
                        stage = memoryview(mmap.mmap(-1, size))
                    first, pitch = staged(t, stage)
                    if t.rows == 1:
                        host[t.slab_offset : t.slab_offset + t.length] = stage[first : first + t.length]
                    else:
                        src = np.ndarray((t.rows, t.length), np.uint8, stage, first, (pitch, 1))
                        dst = np.ndarray((t.rows, t.length), np.uint8, host, t.slab_offset, (t.dst_pitch, 1))
                        dst[...] = src
                        del src, dst
                done(t.nbytes)
        except BaseException as e:  # surfaced to the caller below
            errors.append(e)
        finally:
            if stage is not None:
                stage.release()

    def cuda_worker() -> None:
        try:
            with slab.stager(size) as st:
                i = 0
                for t in _drain(work, errors):
                    b = i % 2
                    i += 1
                    st.wait(b)
                    first, pitch = staged(t, st.buffer(b))
                    if t.rows > 1 and t.dst_pitch == t.length and pitch != t.length:
                        first, pitch = compact_rows(st.buffer(b), first, pitch, t.length, t.rows), t.length
                    if t.rows == 1 or pitch == t.length == t.dst_pitch:
                        st.copy(b, first, t.nbytes, t.slab_offset)
                    else:
                        st.copy2d(b, first, pitch, t.length, t.rows, t.slab_offset, t.dst_pitch)
                    done(t.nbytes)
        except BaseException as e:  # surfaced to the caller below
            errors.append(e)

    t0 = time.monotonic()
    _run_threads(cuda_worker if host is None else host_worker, opts.threads, files, errors)
    t_read = time.monotonic()
    out: dict[str, str] = {}
    if with_digests:
        if ranges is None:
            ranges = [(t.tensor, t.slab_offset, t.length) for t in tasks]
        out = digest.slab_digests(slab, ranges, opts.threads)
    t_end = time.monotonic()
    log.debug("read direct ranges=%d size_bytes=%d read_ms=%.1f digest_ms=%.1f rate_gbps=%.2f", len(tasks),
              read_total[0], (t_read - t0) * 1e3, (t_end - t_read) * 1e3,
              read_total[0] / max(t_read - t0, 1e-9) / 1e9)
    return DirectRead(read_total[0], t_read - t0, t_end - t_read, out)
