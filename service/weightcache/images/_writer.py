"""Writing images: one thread per service, off the serving loop, at a bounded rate, atomically.

A write (:meth:`ImageWriter.schedule`) takes a :class:`WriteJob`: the slab's manifest and key, and a
way to its bytes (``open_source``: a host slab's memfd, duplicated on the serving loop so that an
eviction meanwhile frees nothing under the writer; a CUDA slab copies itself to a host memfd first).
The thread then:

1. makes room within ``image_max_bytes`` (:meth:`ImageStore.make_room`); no room: no image;
2. writes ``.<name>.tmp-<pid>-<random>`` (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600) in the image
   directory: the header, then the slab's bytes with ``sendfile`` in pieces of at most 16 MiB (a
   quarter second's worth under a cap), sleeping between pieces so that the average stays under
   ``image_write_bytes_per_s``. Write-behind: each piece's writeback is started as soon as it is in the
   page cache and the piece before it is waited for and dropped from the cache
   (``sync_file_range``, ``POSIX_FADV_DONTNEED``), so that a write never holds more than two pieces of
   dirty pages: the disk paces it, other processes' writes are not throttled behind gigabytes of an
   image's dirty pages, the image does not push checkpoints out of the page cache, and the ``fsync``
   at the end (and so a stop, below) has little left to do;
3. ``fsync`` of the file, ``rename`` to the final name, ``fsync`` of the directory.

The thread runs at a nice value :data:`WRITER_NICE` above the service's: the copy is kernel time (``sendfile``
of the slab's pages into the page cache), and where CPUs are short (a busy host, a small VM) it then waits for
the serving loop and the engines instead of lengthening their tail latency (benchmarks/RESULTS.md, "An image
write and a concurrent attach").

A crash or ``kill -9`` before the rename leaves only the temporary name, which no read opens and the
next start removes (:meth:`ImageStore.prepare`); the write is then redone after the next load.

At stop (SIGTERM, ``systemctl stop``; :meth:`ImageWriter.finish`) the write under way goes on without
the rate cap and is kept when it is renamed within ``[service] image_stop_write_s``; past that it is
abandoned (the temporary file removed). Writes queued and not begun are dropped. Either way a slab the
next start takes back from the fd store whose image is missing or refused gets it written then
(:attr:`WriteJob.unless_valid`), and one loaded from the checkpoint gets it after its load.

Forbidden imports: torch, socket, selectors, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..journal import event
from ..manifest import Manifest
from ._format import build_header
from ._store import TMP_MARK, ImageStore

log = logging.getLogger(__package__)

#: Bytes per ``sendfile`` call (and per rate check).
PIECE_BYTES = 16 << 20
#: Added to the writer thread's nice value (:func:`_lower_priority`).
WRITER_NICE = 10
#: ``sync_file_range`` flags (linux/fs.h).
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4


class Abandoned(Exception):
    """The service is stopping and the write did not end within ``image_stop_write_s``."""


def _sync_file_range() -> Callable[[int, int, int, int], None] | None:
    """libc's ``sync_file_range`` (releases the GIL, as every ctypes call), or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def call(fd: int, offset: int, nbytes: int, flags: int) -> None:
        if fn(fd, offset, nbytes, flags) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"sync_file_range: {os.strerror(e)}")

    return call


_SYNC_RANGE = _sync_file_range()


@dataclass
class WriteJob:
    """One image to write.

    Attributes:
        placement (`Placement`): the slab's rank request (names the file; recorded in it).
        manifest (`Manifest`): the slab's manifest, digests included.
        key (`dict`): its full cache key.
        open_source (`callable`): ``() -> (fd, close)``: an fd whose bytes ``[0, slab_size_bytes)`` are the
            slab's, and what to call when done with it (runs on the writer's thread).
        priority_of (`callable`): model name -> its configured ``priority`` (None: not configured), for room.
        publication (`Publication`, *optional*): a published slab's (``to_json()``, ``engine_key_blake2b``...).
    """

    placement: Any
    manifest: Manifest
    key: dict
    open_source: Callable[[], tuple[int, Callable[[], None]]]
    priority_of: Callable[[str], int | None]
    publication: Any = None
    #: Called on the writer's thread once the job ended, whatever the outcome (the GPU slab's read is over).
    on_done: Callable[[], None] | None = None
    #: Written only when the directory holds no valid image of it already (a slab taken back from the fd
    #: store: its image may be there, or missing because the last stop abandoned its write).
    unless_valid: bool = False
    #: Called once the job ended, or :meth:`ImageWriter.schedule` refused it, whether or not
    #: :attr:`open_source` ran (image present, no room, dropped at stop, a failure before the copy): releases
    #: what it holds for the writer (a host slab's dup, made on the serving loop), else kept until the process
    #: exits, with the slab's pages. Idempotent with the ``close`` that ``open_source`` returns.
    drop_source: Callable[[], None] | None = None


class ImageWriter:
    """The writer thread of one :class:`ImageStore`.

    Args:
        store (`ImageStore`): where images go.
        rate_bytes_per_s (`int`): ``[service] image_write_bytes_per_s``; 0: as fast as the disk takes them.
    """

    def __init__(self, store: ImageStore, rate_bytes_per_s: int) -> None:
        self.store = store
        self.rate_bytes_per_s = rate_bytes_per_s
        self._jobs: queue.SimpleQueue[WriteJob | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="weightcache-image-writer", daemon=True)
        self._started = False
        #: ``time.monotonic()`` by which a write under way at stop must end (:meth:`finish`); None: serving.
        self._finish_by: float | None = None
        self._stopping = threading.Event()  # wakes a write sleeping under the rate cap

    def schedule(self, job: WriteJob) -> bool:
        """Queues ``job`` (serving loop; returns at once). False when a write of the same file is queued
        (``job.on_done`` is not called then)."""
        path = self.store.path_for(job.placement, job.publication)
        with self._lock:
            if path in self._pending:
                if job.drop_source is not None:
                    job.drop_source()
                return False
            self._pending.add(path)
            if not self._started:
                self._thread.start()
                self._started = True
        self._jobs.put(job)
        return True

    def pending(self) -> int:
        """Writes queued or under way."""
        with self._lock:
            return len(self._pending)

    def finish(self, bound_s: float) -> bool:
        """At stop: lets the write under way end without the rate cap if it can within ``bound_s`` seconds
        (kept: renamed into place), else abandons it (its temporary file removed); drops the writes queued.
        Waits for the thread up to ``bound_s`` plus 5 s (for the last ``fsync``, which write-behind keeps
        short). Serving loop, once it has stopped serving.

        Returns:
            `bool`: True when no write is left under way (a daemon thread: one still in ``fsync`` past the
            wait ends with the process, its temporary file removed by the next start).
        """
        with self._lock:
            self._finish_by = time.monotonic() + max(0.0, bound_s)
            started = self._started
        self._stopping.set()
        self._jobs.put(None)
        if not started:
            return True
        self._thread.join(max(0.0, bound_s) + 5.0)
        return not self._thread.is_alive()

    def _run(self) -> None:
        _lower_priority()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            path = self.store.path_for(job.placement, job.publication)
            p = job.placement
            try:
                if self._finish_by is not None:
                    log.info("image write dropped at stop model=%s tp_size=%d rank=%d file=%s", p.model.name,
                             p.tp_size, p.tp_rank, path)
                elif job.unless_valid and self._valid(job):
                    log.info("image present model=%s tp_size=%d rank=%d file=%s", p.model.name, p.tp_size,
                             p.tp_rank, path)
                else:
                    self.write(job, path)
            except Abandoned as e:
                log.warning("image write abandoned at stop model=%s tp_size=%d rank=%d file=%s detail=%s; the next "
                            "start writes it", p.model.name, p.tp_size, p.tp_rank, path, e)
            except Exception as e:  # noqa: BLE001 - one failed write costs that image only
                self.store.stats.write_failed()
                log.warning("image write failed model=%s tp_size=%d rank=%d file=%s error=%r", p.model.name,
                            p.tp_size, p.tp_rank, path, e)
            finally:
                if job.drop_source is not None:
                    job.drop_source()
                with self._lock:
                    self._pending.discard(path)
                if job.on_done is not None:
                    job.on_done()

    def _valid(self, job: WriteJob) -> bool:
        """Whether the directory holds an image of ``job``'s slab that fits its key and records (one that does
        not is moved aside by :meth:`ImageStore.find`, and written again)."""
        m = job.manifest
        if job.publication is not None:
            return self.store.find(job.placement, job.key, None, None, job.publication) is not None
        return self.store.find(job.placement, job.key, m.tensors, m.slab_size_bytes) is not None

    def write(self, job: WriteJob, path: str) -> bool:
        """Writes one image to ``path`` (on the calling thread); False when there is no room for it.

        Raises:
            OSError: the file could not be written (the temporary file is removed).
        """
        p, st = job.placement, self.store
        size = job.manifest.slab_size_bytes
        header = build_header(job.manifest, job.key, p.to_json(), st.backend, st.clock(),
                              job.publication.to_json() if job.publication is not None else None)
        if not st.make_room(len(header) + size, path, job.priority_of):
            st.stats.write_failed()
            log.warning("image not written model=%s tp_size=%d rank=%d size_bytes=%d reason=no-room limit_bytes=%d",
                        p.model.name, p.tp_size, p.tp_rank, len(header) + size, st.limit_bytes)
            return False
        tmp = os.path.join(st.directory, f".{os.path.basename(path)}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
        t0 = time.monotonic()
        src, close_src = job.open_source()
        try:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(out, 0o600)  # whatever the umask
                _write_all(out, header)
                self._copy(src, out, len(header), size, t0)
                self._check_stop(size, size)
                os.fsync(out)
                os.posix_fadvise(out, 0, 0, os.POSIX_FADV_DONTNEED)  # clean now: out of the page cache
            finally:
                os.close(out)
            os.rename(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        finally:
            close_src()
        dfd = os.open(st.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        dt = time.monotonic() - t0
        st.stats.wrote(size, dt)
        log.info("image written model=%s tp_size=%d rank=%d size_bytes=%d duration_ms=%.0f write_gbps=%.2f file=%s",
                 p.model.name, p.tp_size, p.tp_rank, size, dt * 1e3, size / max(dt, 1e-9) / 1e9, path,
                 extra=event("image_written", p.model.name, p.tp_rank, size_bytes=size, duration_ms=dt * 1e3,
                             tp_size=p.tp_size, file=path))
        return True

    def _check_stop(self, done: int, size: int) -> None:
        """Raises :class:`Abandoned` once the service stops and the time :meth:`finish` gave is over."""
        by = self._finish_by
        if by is not None and time.monotonic() > by:
            raise Abandoned(f"{done} of {size} bytes written when image_stop_write_s ran out")

    def _copy(self, src: int, out: int, at: int, size: int, t0: float) -> None:
        """``sendfile`` of ``size`` bytes from ``src`` (offset 0) to ``out`` (file offset ``at``), under the
        rate cap (lifted at stop), with write-behind (see the module docstring).

        Raises:
            Abandoned: the service stopped and :meth:`finish`'s time ran out.
            OSError: the memfd ended early, or a write failed.
        """
        done = 0
        rate = self.rate_bytes_per_s
        piece = min(PIECE_BYTES, max(64 << 10, rate // 4)) if rate else PIECE_BYTES
        behind: tuple[int, int] | None = None  # the piece whose writeback was started last
        sync_range = _SYNC_RANGE
        while done < size:
            self._check_stop(done, size)
            n = os.sendfile(out, src, done, min(piece, size - done))
            if n == 0:
                raise OSError(f"the slab's memfd ended at {done} of {size} bytes")
            if sync_range is not None:
                try:
                    sync_range(out, at + done, n, _WRITE)  # start this piece's writeback
                    if behind is not None:  # wait for the one before, then drop it from the page cache
                        sync_range(out, behind[0], behind[1], _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
                        os.posix_fadvise(out, behind[0], behind[1], os.POSIX_FADV_DONTNEED)
                except OSError as e:  # refused (a seccomp filter, a file system without it): the fsync does it all
                    log.info("image write-behind off for this write error=%s", e)
                    sync_range = None
                behind = (at + done, n)
            done += n
            if rate and self._finish_by is None:
                ahead = done / rate - (time.monotonic() - t0)
                if ahead > 0:
                    self._stopping.wait(ahead)  # a stop ends the sleep: the rest goes uncapped


def _lower_priority() -> None:
    """Raises the calling thread's nice value by :data:`WRITER_NICE` (Linux: a thread id is a pid for
    ``setpriority``), so that where CPUs are short the serving loop, the loader and the engines run before the
    write's copy (kernel time in ``sendfile``), which takes what they leave; unchanged where refused."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE))
    except OSError as e:
        log.info("image writer priority unchanged error=%s", e)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
