"""Strided row reads through one io_uring per thread: a ``read`` per row, one system call per batch (benchmark only).

``bench_tp_reads.py --ways uring`` measures this way against the reader's
mapped copy (:func:`weightcache.reader._rows.copy_mapped_rows`). A TP rank's
row-parallel shard is ``rows`` rows of ``length`` bytes (1–5 KB at TP 8),
``pitch`` apart in the file; an io_uring (Linux 5.6+, ``IORING_OP_READ``)
takes a batch of row reads in one ``io_uring_enter``, the kernel copying each
row out of the page cache into its place with the GIL released, and a file cut
under the reader is a short read rather than a mapping's ``SIGBUS``. Rejected
for the service: on the H200 host it copied at half the mapped copy's rate (the
kernel's ~1 µs per buffered read, against one page fault per ~16 pages mapped;
benchmarks/RESULTS.md, "Closing the TP-8 gap: what did not").

Only the system calls are used, through ``ctypes`` (no liburing): the ring
layout is the kernel's UAPI, ``include/uapi/linux/io_uring.h``
(``struct io_uring_params``, ``io_uring_sqe``, ``io_uring_cqe``; the ring
offsets ``IORING_OFF_SQ_RING``, ``IORING_OFF_CQ_RING``, ``IORING_OFF_SQES``).
Where io_uring is refused (``ENOSYS``; ``EPERM`` from a seccomp filter or
``kernel.io_uring_disabled``; ``ENOMEM`` from ``RLIMIT_MEMLOCK`` before Linux
5.12) :func:`ring` returns ``None``.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import weakref

import numpy as np

log = logging.getLogger(__name__)

SYS_IO_URING_SETUP = 425  # the same number on every architecture (asm-generic)
SYS_IO_URING_ENTER = 426
IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000
IORING_FEAT_SINGLE_MMAP = 1 << 0
IORING_ENTER_GETEVENTS = 1 << 0
IORING_OP_READ = 22

#: Submission entries per ring (a batch of rows per ``io_uring_enter``); the completion ring is twice as long.
RING_ENTRIES = 4096

SQE = np.dtype([("opcode", "u1"), ("flags", "u1"), ("ioprio", "<u2"), ("fd", "<i4"), ("off", "<u8"),
                ("addr", "<u8"), ("len", "<u4"), ("rw_flags", "<u4"), ("user_data", "<u8"),
                ("buf_index", "<u2"), ("personality", "<u2"), ("splice_fd_in", "<i4"), ("addr3", "<u8"),
                ("pad2", "<u8")])
CQE = np.dtype([("user_data", "<u8"), ("res", "<i4"), ("flags", "<u4")])
assert SQE.itemsize == 64 and CQE.itemsize == 16


class _SqOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "flags", "dropped",
                                               "array", "resv1")] + [("user_addr", ctypes.c_uint64)]


class _CqOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes",
                                               "flags", "resv1")] + [("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("sq_entries", "cq_entries", "flags", "sq_thread_cpu",
                                               "sq_thread_idle", "features", "wq_fd")] + [
        ("resv", ctypes.c_uint32 * 3), ("sq_off", _SqOffsets), ("cq_off", _CqOffsets)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class ShortRead(Exception):
    """A row read returned fewer bytes than asked: the file ends before ``offset + length``.

    Attributes:
        offset: the file offset of the first short row, bytes.
    """

    def __init__(self, offset: int) -> None:
        super().__init__(f"short read at file offset {offset}")
        self.offset = offset


class Ring:
    """One io_uring, used by one thread at a time: :meth:`read_rows` reads strided rows into memory.

    Raises:
        OSError: ``io_uring_setup`` or a ring ``mmap`` refused (see the module docstring).
    """

    def __init__(self, entries: int = RING_ENTRIES) -> None:
        p = _Params()
        fd = _syscall(ctypes.c_long(SYS_IO_URING_SETUP), ctypes.c_long(entries), ctypes.byref(p))
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"io_uring_setup: {os.strerror(e)}")
        self.fd = fd
        maps: list[mmap.mmap] = []
        self._maps = maps
        self._closer = weakref.finalize(self, _close, fd, maps)
        sq_size = p.sq_off.array + p.sq_entries * 4
        cq_size = p.cq_off.cqes + p.cq_entries * CQE.itemsize
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        if p.features & IORING_FEAT_SINGLE_MMAP:
            sq = cq = mmap.mmap(fd, max(sq_size, cq_size), flags=flags, prot=prot, offset=IORING_OFF_SQ_RING)
            maps.append(sq)
        else:
            sq = mmap.mmap(fd, sq_size, flags=flags, prot=prot, offset=IORING_OFF_SQ_RING)
            maps.append(sq)
            cq = mmap.mmap(fd, cq_size, flags=flags, prot=prot, offset=IORING_OFF_CQ_RING)
            maps.append(cq)
        sqes = mmap.mmap(fd, p.sq_entries * SQE.itemsize, flags=flags, prot=prot, offset=IORING_OFF_SQES)
        maps.append(sqes)
        self.entries = p.sq_entries
        self._sq_tail = np.ndarray((1,), "<u4", sq, p.sq_off.tail)
        self._sq_mask = int(np.ndarray((1,), "<u4", sq, p.sq_off.ring_mask)[0])
        np.ndarray((p.sq_entries,), "<u4", sq, p.sq_off.array)[:] = np.arange(p.sq_entries, dtype=np.uint32)
        self._cq_head = np.ndarray((1,), "<u4", cq, p.cq_off.head)
        self._cq_tail = np.ndarray((1,), "<u4", cq, p.cq_off.tail)
        self._cq_mask = int(np.ndarray((1,), "<u4", cq, p.cq_off.ring_mask)[0])
        self._cqes = np.ndarray((p.cq_entries,), CQE, cq, p.cq_off.cqes)
        self._sqes = np.ndarray((p.sq_entries,), SQE, sqes, 0)
        self._sqes[:] = np.zeros((), SQE)
        self._sqes["opcode"] = IORING_OP_READ
        self._inflight = 0

    def close(self) -> None:
        """Drops the views and closes the ring (no read is in flight outside :meth:`read_rows`)."""
        for name in ("_sq_tail", "_cq_head", "_cq_tail", "_cqes", "_sqes"):
            self.__dict__.pop(name, None)
        self._closer()

    def read_rows(self, fd: int, offset: int, pitch: int, length: int, rows: int, dst: int, dst_pitch: int) -> None:
        """Reads ``rows`` rows of ``length`` bytes from ``fd`` at ``offset + i * pitch`` to ``dst + i * dst_pitch``.

        ``dst`` is the address of writable memory the caller keeps alive for
        the call: every read has completed when this returns or raises.

        Raises:
            ShortRead: the file ended before a row's end (names the row's offset).
            OSError: a read failed (its ``errno``), or ``io_uring_enter`` did.
        """
        done = 0
        while done < rows:
            n = min(self.entries, rows - done)
            tail = int(self._sq_tail[0])
            idx = (tail + np.arange(n, dtype=np.uint64)) & self._sq_mask
            i = np.arange(done, done + n, dtype=np.uint64)
            sq = self._sqes
            sq["fd"][idx] = fd
            sq["off"][idx] = offset + i * pitch
            sq["addr"][idx] = dst + i * dst_pitch
            sq["len"][idx] = length
            sq["user_data"][idx] = i
            self._sq_tail[0] = (tail + n) & 0xFFFFFFFF
            self._inflight += n
            self._wait(n)
            self._reap(offset, pitch, length)
            done += n

    def _wait(self, submit: int) -> None:
        """Submits ``submit`` entries and waits until nothing is in flight (retries ``EINTR``)."""
        while True:
            got = _syscall(ctypes.c_long(SYS_IO_URING_ENTER), ctypes.c_long(self.fd), ctypes.c_long(submit),
                           ctypes.c_long(self._inflight), ctypes.c_long(IORING_ENTER_GETEVENTS), None,
                           ctypes.c_long(0))
            if got >= 0:
                submit -= got
                if submit <= 0 and self._completed() >= self._inflight:
                    return
                continue
            e = ctypes.get_errno()
            if e not in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                raise OSError(e, f"io_uring_enter: {os.strerror(e)}")

    def _completed(self) -> int:
        return (int(self._cq_tail[0]) - int(self._cq_head[0])) & 0xFFFFFFFF

    def _reap(self, offset: int, pitch: int, length: int) -> None:
        head, n = int(self._cq_head[0]), self._completed()
        c = self._cqes[(head + np.arange(n, dtype=np.uint64)) & self._cq_mask]
        self._cq_head[0] = (head + n) & 0xFFFFFFFF
        self._inflight -= n
        bad = c["res"] != length
        if bad.any():
            first = c[bad]
            errs = first["res"][first["res"] < 0]
            if errs.size:
                e = -int(errs[0])
                raise OSError(e, os.strerror(e))
            raise ShortRead(offset + int(first["user_data"].min()) * pitch)


def _close(fd: int, maps: list[mmap.mmap]) -> None:
    for m in maps:
        try:
            m.close()
        except BufferError:
            pass
    os.close(fd)


_local = threading.local()
_refused: list[str] = []


def ring() -> Ring | None:
    """This thread's :class:`Ring` (made on first use, closed when the thread ends); ``None`` where io_uring is refused.

    A refusal is logged once per process (INFO) and remembered.
    """
    r = getattr(_local, "ring", None)
    if r is not None or _refused:
        return r
    try:
        r = _local.ring = Ring()
    except OSError as e:
        if not _refused:
            _refused.append(str(e))
            log.info("io_uring refused (%s)", e)
        return None
    return r
