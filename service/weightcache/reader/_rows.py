"""A TP rank's row-parallel pieces: strided rows copied out of the checkpoint file.

A row-parallel shard (``o_proj``/``down_proj`` at TP > 1) is ``rows`` rows
of ``length`` bytes, ``src_pitch`` apart in the file. :func:`mapped` says
whether a piece of it is copied from a read-only mapping of the file
(:func:`copy_mapped_rows`, only the rank's bytes leave the page cache), read
as spans where the file system will not map it (:func:`read_rows_by_spans`),
or, with ``O_DIRECT``, read as one span and packed in the staging buffer
(:func:`compact_rows`). The reader (:mod:`weightcache.reader._loader`) calls these
from its threads; measured in ``benchmarks/bench_tp_reads.py``.

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from ..checkpoint.header import pread_exact, truncated
from ._task import ReadTask

log = logging.getLogger(__package__)  # the package's logger: a room is no logger name of its own


def pread_task(fd: int, buf: memoryview, offset: int, need: int, t: ReadTask) -> None:
    """Fills the first ``need`` bytes of ``buf`` from ``fd`` at ``offset``, part of task ``t``.

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): the file ended first; names the file, the tensor and
            where the task ends in the file (its last row's end for a strided task).
    """
    pread_exact(fd, buf, offset, need, str(t.path), t.tensor, t.file_offset + t.file_span)


def mapped(t: ReadTask, o_direct: bool) -> bool:
    """Whether the strided task ``t`` is copied from a read-only shared mapping of its file rather than read.

    A row-parallel shard (``o_proj``/``down_proj`` at TP > 1: rows of
    ``length`` bytes ``src_pitch`` apart, ``src_pitch > length``) is copied
    row by row from an ``mmap`` of the file (a guarded copy, the GIL released), so
    only its own bytes are copied out of the page cache
    (:func:`copy_mapped_rows`). Reading the span from the first row to the
    last and discarding the bytes between copies ``TP`` times the payload;
    ``preadv`` with a scratch iovec for the gaps copies them all the same; a
    ``pread`` per row pays ~10 µs per call (TP 8 of a 15 GB Llama: 34.8 s).
    Measured on the H200 host (16 threads, page cache; benchmarks/RESULTS.md
    "Row-parallel shards from a mapping"): whole TP-8 rank fills of a 6 GB
    Llama at 23.4 GB/s on ext4 (9.4 as spans; TP 1: 36.0), 12.2 on tmpfs
    (9.4; TP 1: 31.1), where what is left is the page-table work for the
    pages between the rows (4 KiB pages on tmpfs, large folios on ext4).
    With ``O_DIRECT`` (the page cache bypassed) the span is read and packed
    instead (:func:`compact_rows`). Rows contiguous in the file
    (``src_pitch == length``: FP8 rows padded only in the slab) are one read.
    """
    return t.rows > 1 and t.src_pitch != t.length and not o_direct


def in_page_cache(fd: int, offset: int) -> bool:
    """Whether the byte at ``offset`` of ``fd`` is in the page cache: a 1-byte ``preadv2(RWF_NOWAIT)``.

    Asked of a row-parallel piece's last row before its rows are copied from
    the mapping. A page fault on a file not in the page cache reads only
    about 128 KiB around the fault, synchronously, one request per fault and
    thread, where a ``pread`` of the span is one large request: a piece whose
    last row is not cached is read ahead whole first (``MADV_WILLNEED``,
    asynchronous). A cached piece pays one system call; the read-ahead's
    page-cache walk alone cost 10–20 % of the mapped copy's rate on the H200
    host. ``False`` also where the file system cannot answer without waiting
    (``EOPNOTSUPP``).
    """
    try:
        os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT)
    except (BlockingIOError, OSError):
        return False
    return True


def copy_mapped_rows(fd: int, t: ReadTask, dst: memoryview, dst_offset: int, dst_pitch: int) -> None:
    """Copies the ``t.rows`` rows of ``t`` from its file ``fd`` to ``dst``: row ``i`` at ``dst_offset + i * dst_pitch``.

    Maps the task's span of the file read-only (``MAP_SHARED``: the page
    cache's own pages), copies the rows with a guarded copy
    (:func:`guarded_copy_rows`: a file cut during the copy is an error, never
    ``SIGBUS``), and unmaps it at once, on the calling reader thread.
    Measured on the H200 host against one mapping per file (TP-8 rank fills,
    ext4 / tmpfs, numpy copies): 23.4 / 12.2 GB/s, against 22.4 / 10.6 for
    one mapping unmapped after the read (its ``munmap`` alone took 37 ms per
    rank of a 6 GB checkpoint, on one thread) and 19.7 / 9.7 for one mapping
    whose pieces are released with ``MADV_DONTNEED`` on their threads.

    A file its file system will not map (FUSE with ``direct_io``, virtiofs
    with ``cache=never``: ``ENODEV``), a process out of mappings
    (``ENOMEM``), or a process whose seccomp filter refuses the guarded copy
    (``EPERM``, ``ENOSYS``), is read as spans instead (:func:`read_rows_by_spans`).

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): the file (``fstat`` now,
            ``mmap``'s own check just after, or the guarded copy during the
            copy) ends before the task's last row; names the file and tensor,
            as a short ``pread`` does. A file truncated while its rows are
            copied (``cp new.safetensors model.safetensors``) fails that
            model's load only (docs/reliability.md).
    """
    end = t.file_offset + t.file_span
    lo = t.file_offset - t.file_offset % mmap.ALLOCATIONGRANULARITY
    if os.fstat(fd).st_size < end:
        raise truncated(str(t.path), t.tensor, end)
    try:
        m = mmap.mmap(fd, end - lo, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=lo)
    except ValueError:  # cut between the fstat and mmap's own check
        raise truncated(str(t.path), t.tensor, end) from None
    except OSError as e:
        log.debug("mapping refused file=%s error=%r: rows read as spans", t.path, e)
        read_rows_by_spans(fd, t, dst, dst_offset, dst_pitch)
        return
    try:
        if not in_page_cache(fd, end - t.length):
            m.madvise(mmap.MADV_WILLNEED)  # from disk: large read-ahead requests, not one per page fault
        copied = guarded_copy_rows(dst, dst_offset, dst_pitch, m, t.file_offset - lo, t.src_pitch, (t.rows, t.length))
        if copied is None:
            log.debug("guarded copy refused file=%s: rows read as spans", t.path)
            read_rows_by_spans(fd, t, dst, dst_offset, dst_pitch)
        elif copied < t.rows:
            raise truncated(str(t.path), t.tensor, end)
    finally:
        try:
            m.close()
        except BufferError:  # an exception's traceback still holds a view: unmapped when it is collected
            pass


#: Rows per ``process_vm_readv`` call: Linux's ``IOV_MAX`` (``UIO_MAXIOV``), on each side.
IOV_MAX = 1024


def guarded_copy_rows(dst: memoryview, dst_offset: int, dst_pitch: int, src: mmap.mmap, src_offset: int,
                      src_pitch: int, shape: tuple[int, int]) -> int | None:
    """Copies ``shape = (rows, length)``: ``rows`` rows of ``length`` bytes from ``src`` at ``src_offset``
    (``src_pitch`` apart) to ``dst`` at ``dst_offset`` (``dst_pitch`` apart); returns the rows copied whole, or
    ``None`` where the copy is refused.

    The copy is ``process_vm_readv`` of this process's own pages (one iovec
    per row, :data:`IOV_MAX` rows a call, the GIL released): the kernel
    faults the source pages in itself, so a page past the end of a file cut
    during the copy is ``EFAULT`` (or a short count) returned here, where a
    load of it (numpy) raises ``SIGBUS`` and kills the process. Reading
    one's own memory needs no ptrace right; the unit's
    ``SystemCallFilter=@system-service`` allows it (through ``@ipc``); a
    filter that refuses it gives ``EPERM``, ``None`` here. The cost: on the
    H200 host this copy ran at half the numpy copy's rate (the kernel pins
    each source page through ``get_user_pages``, without fault-around;
    benchmarks/RESULTS.md, ``bench_tp_reads.py --ways mmap,vmread``: TP 2
    16.8 against 29.3 GB/s, TP 8 5.1 against 10.0, ext4), about the rate of
    reading the span (:func:`read_rows_by_spans`); the price of a service
    that a checkpoint's writer cannot kill.

    Returns:
        `int | None`: ``rows`` when all were copied; fewer when the source
        ended (the file was cut); ``None`` when the kernel refused the call
        (``EPERM``, ``ENOSYS``) before copying anything.

    Raises:
        ValueError: a row would fall outside ``dst`` or ``src``.
    """
    import numpy as np

    rows, length = shape
    if rows < 1:
        return rows
    for buf, off, pitch in ((dst, dst_offset, dst_pitch), (src, src_offset, src_pitch)):
        if off < 0 or off + (rows - 1) * pitch + length > len(buf):
            raise ValueError(f"rows outside the buffer: offset {off} + {rows} rows of {length} bytes {pitch} apart > "
                             f"{len(buf)} bytes")
    libc = ctypes.CDLL(None, use_errno=True)
    readv = libc.process_vm_readv
    readv.restype = ctypes.c_ssize_t
    readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    d, s = np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8)
    try:
        step = np.arange(IOV_MAX, dtype=np.uint64)
        local, remote = np.empty((IOV_MAX, 2), np.uint64), np.empty((IOV_MAX, 2), np.uint64)
        local[:, 1] = remote[:, 1] = length
        packed = dst_pitch == length  # rows back to back in dst: one local iovec per call
        pid = os.getpid()
        for r0 in range(0, rows, IOV_MAX):
            n = min(IOV_MAX, rows - r0)
            if packed:
                local[0] = (d.ctypes.data + dst_offset + r0 * dst_pitch, n * length)
            else:
                local[:n, 0] = step[:n] * dst_pitch + (d.ctypes.data + dst_offset + r0 * dst_pitch)
            remote[:n, 0] = step[:n] * src_pitch + (s.ctypes.data + src_offset + r0 * src_pitch)
            got = readv(pid, local.ctypes.data, 1 if packed else n, remote.ctypes.data, n, 0)
            if got < 0:
                err = ctypes.get_errno()
                if err in (errno.EPERM, errno.ENOSYS) and r0 == 0:
                    return None
                if err != errno.EFAULT:
                    raise OSError(err, f"process_vm_readv: {os.strerror(err)}")
                return r0
            if got < n * length:
                return r0 + got // length
        return rows
    finally:
        del d, s  # no array exports the mapping any more


#: Bytes of the per-thread buffer :func:`read_rows_by_spans` reads spans into.
SPAN_BUFFER_BYTES = 8 << 20
_span_buffers = threading.local()


def read_rows_by_spans(fd: int, t: ReadTask, dst: memoryview, dst_offset: int, dst_pitch: int) -> None:
    """:func:`copy_mapped_rows` where the file cannot be mapped: reads spans of whole rows (``pread``, at most
    :data:`SPAN_BUFFER_BYTES` or one row) into a per-thread buffer and copies the rows out with numpy.

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): the file ended first; names the file and tensor.
    """
    import numpy as np

    size = max(SPAN_BUFFER_BYTES, t.length)
    buf = getattr(_span_buffers, "buf", None)
    if buf is None or len(buf) < size:
        buf = _span_buffers.buf = memoryview(bytearray(size))
    g = (size - t.length) // t.src_pitch + 1
    for r0 in range(0, t.rows, g):
        n = min(g, t.rows - r0)
        span = (n - 1) * t.src_pitch + t.length
        pread_task(fd, buf[:span], t.file_offset + r0 * t.src_pitch, span, t)
        src = np.ndarray((n, t.length), np.uint8, buf, 0, (t.src_pitch, 1))
        out = np.ndarray((n, t.length), np.uint8, dst, dst_offset + r0 * dst_pitch, (dst_pitch, 1))
        np.copyto(out, src)
        del src, out


def compact_rows(buf: memoryview, first: int, pitch: int, length: int, rows: int) -> int:
    """Packs ``rows`` rows of ``length`` bytes, read ``pitch`` apart from ``first``, to the start of ``buf``; returns 0.

    A row-parallel shard read as a span of the file becomes one contiguous
    host-to-device copy instead of a ``cuMemcpy2DAsync`` of narrow rows (on
    the H200 host, 2-D copies of 4 KB rows took 1.4 ms per call to queue).
    In place, front to back, in blocks whose destination ends before their
    source begins (so no temporary copy): block sizes grow by ``pitch /
    length``, a dozen numpy copies for 4096 rows.
    """
    import numpy as np

    src = np.ndarray((rows, length), np.uint8, buf, first, (pitch, 1))
    dst = np.ndarray((rows, length), np.uint8, buf, 0, (length, 1))
    a = 0
    while a < rows:
        b = min(rows, max(a + 1, (first + a * pitch) // length))
        if first or a:  # row 0 with first == 0 is already in place
            dst[a:b] = src[a:b]
        a = b
    del src, dst
    return 0
