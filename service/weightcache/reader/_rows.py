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
    row by row from an ``mmap`` of the file (numpy, the GIL released), so
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
    cache's own pages), copies the rows with numpy, and unmaps it at once,
    on the calling reader thread. Measured on the H200 host against one
    mapping per file (TP-8 rank fills, ext4 / tmpfs): 23.4 / 12.2 GB/s,
    against 22.4 / 10.6 for one mapping unmapped after the read (its
    ``munmap`` alone took 37 ms per rank of a 6 GB checkpoint, on one
    thread) and 19.7 / 9.7 for one mapping whose pieces are released with
    ``MADV_DONTNEED`` on their threads.

    A file its file system will not map (FUSE with ``direct_io``, virtiofs
    with ``cache=never``: ``ENODEV``), or a process out of mappings
    (``ENOMEM``), is read as spans instead (:func:`read_rows_by_spans`).

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): the file (``fstat`` now, or
            ``mmap``'s own check just after) ends before the task's last row;
            names the file and tensor, as a short ``pread`` does. A file
            truncated *during* the copy kills the process with ``SIGBUS``, as
            it would any ``mmap`` reader such as safetensors (docs/reliability.md).
    """
    import numpy as np

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
        src = np.ndarray((t.rows, t.length), np.uint8, m, t.file_offset - lo, (t.src_pitch, 1))
        out = np.ndarray((t.rows, t.length), np.uint8, dst, dst_offset, (dst_pitch, 1))
        np.copyto(out, src)
        del src, out  # no array exports the mapping any more
    finally:
        try:
            m.close()
        except BufferError:  # an exception's traceback still holds a view: unmapped when it is collected
            pass


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
