"""The parallel reader: checkpoint byte ranges straight to their slab offsets.

Tensors whose slab bytes are a contiguous byte range of one checkpoint file
(whole tensors, and row shards along dim 0 without a dtype change) never pass
through Python objects: a pool of threads reads them with ``os.preadv``

- host slab: straight into the memfd mapping (no staging);
- CUDA slab: into a bounded ring of pinned host buffers (two per thread), each
  copied with ``non_blocking=True`` on the thread's own CUDA stream to its
  planned offset; a buffer is reused only after its copy's event completed.

Staging memory is ``threads * 2 * chunk_bytes`` and never the whole
checkpoint. With ``o_direct=True`` files are opened ``O_DIRECT`` (page cache
bypassed) and each read covers the 4 KiB-aligned superset of its range.

Two entry points: :func:`read_into_slab` writes into a torch tensor (loads
that also process tensors, and the client's disk fallback; a CPU tensor goes
through :func:`read_direct`'s host loop);
:func:`read_direct` needs no torch at all and fills a backend's writable slab
through its ``buffer`` (host memfd mapping) or its ``stager()`` (CUDA:
cuda-bindings' pinned buffers, stream and events), taking the content
digests on the way (host: ``xxh3_128`` over the mapping; CUDA: ``xxh3c``
from the staging buffers) (:mod:`weightcache.digest`). A service's first load of an
unquantized checkpoint without a cast goes that way, so its first bytes are
read before torch is imported.

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
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Iterator

from . import digest
from .checkpoint import Checkpoint, open_file, pread_exact
from .manifest import TensorRecord, itemsize
from .sizes import round_up
from .spec import TensorSpec

log = logging.getLogger(__name__)

DIRECT_ALIGN = 4096
#: Bounds of the default reader thread count (:func:`default_threads`).
MIN_DEFAULT_THREADS, MAX_DEFAULT_THREADS = 4, 32


def default_threads() -> int:
    """Reader threads when ``service.read_threads`` is not set: the CPUs this process may run on, 4 to 32.

    ``os.sched_getaffinity(0)`` (what systemd's ``CPUAffinity=`` and cgroup
    cpusets leave), else ``os.cpu_count()``. A copy from the page cache is
    bound by memory bandwidth per core: on a 16-core H200 host 8 threads read
    19.4 GB/s and 16 threads 33.8 GB/s.
    """
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or MIN_DEFAULT_THREADS
    return max(MIN_DEFAULT_THREADS, min(MAX_DEFAULT_THREADS, n))


@dataclass(frozen=True)
class ReadTask:
    """``length`` bytes at ``file_offset`` of ``path`` go to ``slab_offset``."""

    path: str
    file_offset: int
    length: int
    slab_offset: int
    tensor: str


@dataclass
class LoaderOptions:
    """Tuning of the reader.

    Attributes:
        threads (`int`): reader threads (config ``service.read_threads``).
        staging_bytes (`int`): pinned staging memory for CUDA slabs, in bytes
            (config ``service.staging_bytes``); split in ``2 * threads`` buffers
            (:func:`read_direct` rounds each to whole digest chunks, at least one).
        o_direct (`bool`): bypass the page cache.
    """

    threads: int = field(default_factory=lambda: default_threads())
    staging_bytes: int = 256 * 1024 * 1024
    o_direct: bool = False

    @property
    def chunk_bytes(self) -> int:
        c = self.staging_bytes // (2 * max(1, self.threads))
        c -= c % (2 * DIRECT_ALIGN)
        return max(c - 2 * DIRECT_ALIGN, DIRECT_ALIGN)


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


def _split(tasks: list[ReadTask], chunk: int) -> list[ReadTask]:
    out = []
    for t in tasks:
        for off in range(0, t.length, chunk):
            n = min(chunk, t.length - off)
            out.append(ReadTask(t.path, t.file_offset + off, n, t.slab_offset + off, t.tensor))
    # Largest first keeps the threads busy to the end.
    out.sort(key=lambda t: -t.length)
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


def _pread_exact(fd: int, buf: memoryview, offset: int, need: int, t: ReadTask) -> None:
    pread_exact(fd, buf, offset, need, t.path, t.tensor, t.file_offset + t.length)


def _drain(work: queue.SimpleQueue, errors: list[BaseException]) -> Iterator[ReadTask]:
    """The tasks left in ``work``, until it is empty or a thread failed."""
    while not errors:
        try:
            yield work.get_nowait()
        except queue.Empty:
            return


def _run_threads(worker: Callable[[], None], n: int, files: _Files, errors: list[BaseException]) -> None:
    """Runs ``n`` (at least 1) reader threads to the end, closes the files, raises the first error a thread kept."""
    threads = [threading.Thread(target=worker, name=f"weightcache-read-{i}", daemon=True) for i in range(max(1, n))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    files.close()
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
            size = chunk + 2 * DIRECT_ALIGN
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
        read_s (`float`): wall time of the read (on CUDA it includes the
            digests, taken from the staging buffers on the way).
        digest_s (`float`): host: wall time of the digests after the read;
            CUDA: the share of ``read_s`` the digests took (thread-seconds spent
            hashing, divided by the number of threads).
        digests (`dict[str, str]`): tensor name -> digest (empty without digests).
    """

    bytes_read: int
    read_s: float
    digest_s: float
    digests: dict[str, str]


def read_direct(tasks: list[ReadTask], slab, opts: LoaderOptions, progress: Callable[[int], None] | None = None,
                with_digests: bool = True) -> DirectRead:
    """Runs ``tasks`` into a backend's writable slab without importing torch; takes each tensor's digest.

    Host slab (it has a ``buffer``): each thread ``preadv``s straight into the
    mapping (through an anonymous staging buffer with ``O_DIRECT``); the
    XXH3 digests are taken from the mapping afterwards on the same number of
    threads. CUDA slab (it has ``stager()``): each thread reads into its two
    pinned buffers and queues ``cuMemcpyHtoDAsync`` copies; the XXH3-128 of
    each :data:`weightcache.digest.CHUNK_BYTES` chunk is taken from the pinned
    buffer while its copy runs (staged pieces are cut at multiples of that
    size from each tensor's start, and each staging buffer holds at least
    one), giving the ``xxh3c`` digests (:class:`weightcache.digest.ChunkedXXH3`)
    that ``verify`` recomputes from the slab.

    Args:
        tasks (`list[ReadTask]`): from :func:`direct_task`, one per tensor.
        slab (`HostWritableSlab | CudaWritableSlab`): the slab being filled.
        opts (`LoaderOptions`): threads, staging memory, O_DIRECT.
        progress (`callable`, *optional*): called with the bytes of each finished chunk.
        with_digests (`bool`, *optional*, defaults to `True`): take digests.

    Returns:
        `DirectRead`.

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): a file ended early.
        CudaDriverError (`device_error`): a staging allocation or copy failed.
    """
    host = getattr(slab, "buffer", None)
    chunk = opts.chunk_bytes
    if host is None:  # every staged piece covers whole xxh3c chunks of its tensor
        chunk = max(digest.CHUNK_BYTES, chunk - chunk % digest.CHUNK_BYTES)
    work: queue.SimpleQueue = queue.SimpleQueue()
    for t in _split(tasks, chunk):
        work.put(t)
    starts = {t.tensor: t.slab_offset for t in tasks}
    sums = {t.tensor: digest.ChunkedXXH3(t.length) for t in tasks} if with_digests and host is None else {}
    files = _Files(opts.o_direct)
    errors: list[BaseException] = []
    read_total = [0]
    summing = [0.0]  # thread-seconds spent hashing (CUDA)
    lock = threading.Lock()
    size = chunk + 2 * DIRECT_ALIGN

    def one(t: ReadTask, stage: memoryview | None) -> memoryview | None:
        """Reads ``t``; returns the staged bytes (None when read in place)."""
        fd = files.fd(t.path)
        if stage is None:
            _pread_exact(fd, host[t.slab_offset : t.slab_offset + t.length], t.file_offset, t.length, t)
            return None
        lo = t.file_offset - t.file_offset % DIRECT_ALIGN if opts.o_direct else t.file_offset
        need = t.file_offset - lo + t.length
        span = round_up(need, DIRECT_ALIGN) if opts.o_direct else need
        _pread_exact(fd, stage[:span], lo, need, t)
        return stage[t.file_offset - lo : need]

    def done(n: int) -> None:
        with lock:
            read_total[0] += n
        if progress is not None:
            progress(n)

    def host_worker() -> None:
        stage = memoryview(mmap.mmap(-1, size)) if opts.o_direct else None
        try:
            for t in _drain(work, errors):
                got = one(t, stage)
                if got is not None:
                    host[t.slab_offset : t.slab_offset + t.length] = got
                    got.release()
                done(t.length)
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
                    buf = st.buffer(b)
                    got = one(t, buf)  # buf[delta : delta + t.length]
                    st.copy(b, t.file_offset % DIRECT_ALIGN if opts.o_direct else 0, t.length, t.slab_offset)
                    if sums:
                        d0 = time.monotonic()
                        sums[t.tensor].add(got, t.slab_offset - starts[t.tensor])
                        dt = time.monotonic() - d0
                        with lock:
                            summing[0] += dt
                    got.release()
                    done(t.length)
        except BaseException as e:  # surfaced to the caller below
            errors.append(e)

    t0 = time.monotonic()
    _run_threads(cuda_worker if host is None else host_worker, opts.threads, files, errors)
    t_read = time.monotonic()
    out = {name: s.hexdigest() for name, s in sums.items()}
    if with_digests and host is not None:
        out = digest.buffer_digests(host, [(t.tensor, t.slab_offset, t.length) for t in tasks], opts.threads)
    t_end = time.monotonic()
    digest_s = t_end - t_read if host is not None else summing[0] / max(1, opts.threads)
    log.debug("read direct ranges=%d size_bytes=%d read_ms=%.1f digest_ms=%.1f rate_gbps=%.2f", len(tasks),
              read_total[0], (t_read - t0) * 1e3, digest_s * 1e3, read_total[0] / max(t_read - t0, 1e-9) / 1e9)
    return DirectRead(read_total[0], t_read - t0, digest_s, out)

