#!/usr/bin/env python3
"""Reading row-parallel TP shards (strided columns) out of the page cache: six ways side by side (four by default).

A TP rank's ``o_proj``/``down_proj`` shard is a column slice: ``rows`` rows of
``row_bytes / TP`` bytes, ``row_bytes`` apart in the file. This benchmark
writes a file of ``--layers`` Qwen2.5-7B-shaped ``down_proj`` ([3584, 18944]
bf16) and ``o_proj`` ([3584, 3584] bf16) tensors, keeps it in the page cache,
and has ``--threads`` threads fill a TP rank's rows into their own
``staging``-sized buffers (packed rows, what the CUDA reader sends in one
copy), by each of:

- ``span``: ``preadv`` from the first row to the last, then
  :func:`weightcache.reader._rows.compact_rows` (the reader's ``O_DIRECT`` way);
- ``iov``: ``preadv`` with one iovec per row and a scratch iovec for the bytes
  between rows (iovec lists built once per thread and shape);
- ``mmap``: :func:`weightcache.reader._rows.copy_mapped_rows` from a read-only
  mapping of the piece's span, unmapped after it (the reader's way without
  ``O_DIRECT``; since issue 38 its rows are copied by ``process_vm_readv``,
  :func:`weightcache.reader._rows.guarded_copy_rows`, so a file cut under it is
  ``checkpoint_corrupt`` instead of ``SIGBUS``);
- ``numpy``: the same mapping copied by numpy, the reader's way before issue 38
  (a file cut during the copy kills the process with ``SIGBUS``): the A/B of
  the guarded copy's cost;
- ``row``: one ``pread`` per row;
- ``vmread``: the same mapping, the rows copied by the kernel with
  ``process_vm_readv`` on this process (one call per 1024 rows, ``IOV_MAX``)
  instead of numpy: a page gone from the file (cut during the copy) is a
  short count (``EFAULT``), not the ``SIGBUS`` that kills the service
  (docs/reliability.md). Allowed by the unit's ``SystemCallFilter=@system-service``
  (``@ipc``); on a process itself no ptrace check applies. Not in the default
  ``--ways``: on the H200 host it copied at half the mapped numpy copy's rate
  (benchmarks/RESULTS.md), so the reader keeps numpy;
- ``uring``: a ``read`` per row through one io_uring per thread, a batch of
  up to 4096 rows per ``io_uring_enter`` (:mod:`uring_rows`). Not in the
  default ``--ways``: half the mapped copy's rate on the H200 host.

A way named with ``+fd`` (``mmap+fd``) opens the file once per thread instead
of sharing one descriptor (and its read-ahead state) between the threads; with
any ``+fd`` way TP 1 is also read both ways.

TP 1 reads whole rows with ``preadv`` (the reference rate). Reports GB/s of
payload (the bytes the rank keeps), median of ``--reps`` (rank ``rep % TP``). The end-to-end figures are ``bench_first_start.py
--tp N`` and ``bench_layouts.py --tps``.

Usage: bench_tp_reads.py [--file PATH] [--layers N] [--threads N] [--reps N] [--tps 1,2,8]
       [--ways span,iov,mmap,row[,vmread,uring,mmap+fd,...]] [--keep]
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "service"))
import uring_rows  # noqa: E402
from bench_common import GB, emit, stats, versions  # noqa: E402

#: (rows, row bytes) of Qwen2.5-7B's down_proj and o_proj in bf16.
SHAPES = ((3584, 18944 * 2), (3584, 3584 * 2))
STAGING = 8 << 20  # one reader buffer at the service's defaults (256 MiB over 16 threads x 2)


def write_file(path: Path, layers: int) -> list[tuple[int, int, int]]:
    """Writes (once) ``layers`` x :data:`SHAPES` of random bytes; returns ``(offset, rows, row_bytes)`` per tensor."""
    import numpy as np

    tensors, off = [], 0
    for _ in range(layers):
        for rows, pitch in SHAPES:
            tensors.append((off, rows, pitch))
            off += rows * pitch
    if not path.exists() or path.stat().st_size != off:
        block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
        with open(path, "wb") as f:
            left = off
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
    return tensors


def rank_tasks(path: str, tensors: list[tuple[int, int, int]], tp: int, rank: int, packed: bool) -> list[Any]:
    """The rank's rows as :class:`weightcache.reader.ReadTask` pieces that fit one staging buffer."""
    from weightcache.reader import ReadTask

    out = []
    for off, rows, pitch in tensors:
        length = pitch // tp
        if tp == 1:
            step = STAGING // pitch
        elif packed:
            step = STAGING // length
        else:  # the file span fits the buffer
            step = max(1, (STAGING - length) // pitch + 1)
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            out.append(ReadTask(path, off + rank * length + r0 * pitch, length, 0, "w", n, pitch, length))
    return out


def numpy_rows(t: Any, fd: int, dst: Any) -> None:
    """``mmap``'s way as it was before issue 38: the rows copied out of the mapping by numpy (``SIGBUS`` if the
    file is cut meanwhile)."""
    import mmap

    import numpy as np

    end = t.file_offset + t.file_span
    lo = t.file_offset - t.file_offset % mmap.ALLOCATIONGRANULARITY
    m = mmap.mmap(fd, end - lo, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=lo)
    try:
        src = np.ndarray((t.rows, t.length), np.uint8, m, t.file_offset - lo, (t.src_pitch, 1))
        out = np.ndarray((t.rows, t.length), np.uint8, dst, 0, (t.length, 1))
        np.copyto(out, src)
        del src, out
    finally:
        m.close()


def vm_read_rows(t: Any, fd: int, dst: Any) -> None:
    """``mmap``'s way with the rows copied by ``process_vm_readv`` (this process) into ``dst`` (a numpy array).

    Raises:
        OSError: fewer bytes copied than the rows hold (the file was cut under the mapping).
    """
    import ctypes
    import mmap

    import numpy as np

    global _vm_readv
    if _vm_readv is None:
        f = ctypes.CDLL(None, use_errno=True).process_vm_readv
        f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        f.restype = ctypes.c_ssize_t
        _vm_readv = f
    end = t.file_offset + t.file_span
    lo = t.file_offset - t.file_offset % mmap.ALLOCATIONGRANULARITY
    m = mmap.mmap(fd, end - lo, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=lo)
    try:
        a = np.frombuffer(m, np.uint8)
        base = a.ctypes.data + t.file_offset - lo
        del a
        pid, out = os.getpid(), dst.ctypes.data
        for r0 in range(0, t.rows, 1024):
            n = min(1024, t.rows - r0)
            remote = np.empty((n, 2), np.uint64)
            remote[:, 0] = base + (r0 + np.arange(n, dtype=np.uint64)) * t.src_pitch
            remote[:, 1] = t.length
            local = np.array([[out + r0 * t.length, n * t.length]], np.uint64)
            got = _vm_readv(pid, local.ctypes.data, 1, remote.ctypes.data, n, 0)
            if got != n * t.length:
                raise OSError(ctypes.get_errno(), f"process_vm_readv copied {got} of {n * t.length} bytes")
    finally:
        m.close()


_vm_readv: Any = None


def fill(way: str, tasks: list[Any], fd: int, threads: int, own_fd: str | None = None) -> float:
    """Runs ``tasks`` on ``threads`` threads by ``way``; returns the wall time in seconds."""
    import numpy as np

    from weightcache.reader import _loader as loader

    work: queue.SimpleQueue = queue.SimpleQueue()
    for t in tasks:
        work.put(t)
    iov_max = os.sysconf("SC_IOV_MAX") // 2 * 2

    errors: list[BaseException] = []

    def worker() -> None:
        try:
            work_through()
        except BaseException as e:  # a way that fails must not read as a fast one
            errors.append(e)

    def work_through() -> None:
        if own_fd is None:
            return work_with(fd)
        mine = os.open(own_fd, os.O_RDONLY)  # a struct file per thread: no shared read-ahead state
        try:
            work_with(mine)
        finally:
            os.close(mine)

    def work_with(fd: int) -> None:
        stage_array = np.zeros(STAGING + 8192, np.uint8)
        stage = memoryview(stage_array)
        scratch = memoryview(bytearray(64 << 10))
        iovs: dict[tuple[int, int, int], list[list[memoryview]]] = {}
        while True:
            try:
                t = work.get_nowait()
            except queue.Empty:
                return
            if t.rows == 1 or t.src_pitch == t.length:
                os.preadv(fd, [stage[: t.length * t.rows]], t.file_offset)
            elif way == "span":
                os.preadv(fd, [stage[: t.file_span]], t.file_offset)
                loader.compact_rows(stage, 0, t.src_pitch, t.length, t.rows)
            elif way == "iov":
                key = (t.length, t.src_pitch, t.rows)
                if key not in iovs:
                    v = []
                    for r in range(t.rows):
                        v.append(stage[r * t.length : (r + 1) * t.length])
                        if r < t.rows - 1:
                            v.append(scratch[: t.src_pitch - t.length])
                    iovs[key] = [v[i : i + iov_max] for i in range(0, len(v), iov_max)]
                off = t.file_offset
                for part in iovs[key]:
                    off += os.preadv(fd, part, off)
            elif way == "mmap":
                loader.copy_mapped_rows(fd, t, stage, 0, t.length)
            elif way == "uring":
                ring = uring_rows.ring()
                if ring is None:
                    raise RuntimeError(f"io_uring refused: {uring_rows._refused[0]}")
                ring.read_rows(fd, t.file_offset, t.src_pitch, t.length, t.rows, stage_array.ctypes.data,
                                       t.length)
            elif way == "vmread":
                vm_read_rows(t, fd, stage_array)
            elif way == "numpy":
                numpy_rows(t, fd, stage)
            else:
                for r in range(t.rows):
                    os.preadv(fd, [stage[r * t.length : (r + 1) * t.length]], t.file_offset + r * t.src_pitch)

    ths = [threading.Thread(target=worker) for _ in range(threads)]
    t0 = time.perf_counter()
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    if errors:
        raise RuntimeError(f"way {way!r} failed in a reader thread") from errors[0]
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", default="/dev/shm/weightcache-bench-tp-reads.bin")
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--threads", type=int, default=None, help="default: the service's read_threads default")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tps", default="1,2,8")
    ap.add_argument("--ways", default="span,iov,mmap,row")
    ap.add_argument("--keep", action="store_true", help="keep the file")
    args = ap.parse_args()
    from weightcache.reader import default_threads

    threads = args.threads or default_threads()
    path = Path(args.file)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = write_file(path, args.layers)
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    rows: list[dict[str, Any]] = []
    try:
        for tp in (int(x) for x in args.tps.split(",")):
            tp1_ways = ["whole rows", "whole rows+fd"] if "+fd" in args.ways else ["whole rows"]
            for way in tp1_ways if tp == 1 else args.ways.split(","):
                if way.removesuffix("+fd") == "uring" and uring_rows.ring() is None:
                    rows.append({"tp": tp, "way": way, "refused": uring_rows._refused[0]})
                    continue
                rates = []
                for rep in range(args.reps):
                    packed = way.removesuffix("+fd") in ("mmap", "numpy", "row", "iov", "vmread", "uring")
                    tasks = rank_tasks(str(path), tensors, tp, rep % tp, packed=packed)
                    base = way.removesuffix("+fd")
                    dt = fill(base, tasks, fd, threads, str(path) if base != way else None)
                    rates.append(sum(t.nbytes for t in tasks) / dt / GB)
                rows.append({"tp": tp, "way": way, "payload_gb": sum(t.nbytes for t in tasks) / GB,
                             "gbps": stats(rates)})
    finally:
        os.close(fd)
        if not args.keep:
            path.unlink()
    ref = rows[0]["gbps"]["median"] if rows and rows[0]["tp"] == 1 else None
    md = [f"### Row-parallel shards out of the page cache ({size / GB:.2f} GB file, {threads} threads, "
          f"{os.cpu_count()} CPUs, kernel {os.uname().release}; GB/s of payload, median (min–max) of {args.reps})", "",
          "| TP | way | payload GB | GB/s | vs TP 1 |", "|---|---|---|---|---|"]
    for r in rows:
        if "refused" in r:  # io_uring refused here (seccomp, kernel.io_uring_disabled): said, not failed
            md.append(f"| {r['tp']} | {r['way']} | – | refused: {r['refused']} | – |")
            continue
        s = r["gbps"]
        vs = f"{s['median'] / ref:.2f}x" if ref else "-"
        md.append(f"| {r['tp']} | {r['way']} | {r['payload_gb']:.3f} | {s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f}) "
                  f"| {vs} |")
    emit("tp_reads", {"versions": versions(), "threads": threads, "file_bytes": size, "rows": rows}, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
