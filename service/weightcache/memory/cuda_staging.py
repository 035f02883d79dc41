"""Pinned staging into a cuda slab without torch: :class:`CudaStager`, one per reader thread, and the
:class:`StagingPool` that keeps their memory between loads.

A stager holds one :class:`_StagingSet`: two page-locked host buffers (one
``cuMemAllocHost`` of twice the buffer size), a non-blocking stream
(``cuStreamCreate``) and a blocking-sync event per buffer (``cuEventCreate``);
each chunk is copied with ``cuMemcpyHtoDAsync`` (or ``cuMemcpy2DAsync``) and
its buffer reused only after ``cuEventSynchronize`` on the event recorded
behind the copy.

Page-locking is the expensive part: on the H200 host, 16 reader threads each
allocating their 2 x 8 MiB at the start of a fill spent 0.08-0.2 s each,
serialised in the driver, out of a 0.55 s read of 15 GB. So the sets are
kept per GPU (:class:`StagingPool`, ``service.staging_bytes`` of pinned
memory held for the life of the service, as ``[service] staging_bytes``
documents) and the first ones are allocated by one background thread while
the load plans (:meth:`StagingPool.warm`).

Forbidden imports: torch, daemon, client, protocol, cli.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

from .cuda_driver import _check, _Device, cu

__all__ = ["CudaStager", "StagingPool"]

log = logging.getLogger(__name__)


class _StagingSet:
    """Two pinned buffers of ``buffer_bytes`` (one allocation), a stream and two events, in ``device``'s context.

    Raises:
        CudaDriverError: an allocation failed (nothing stays allocated).
    """

    def __init__(self, device: _Device, buffer_bytes: int) -> None:
        self.device = device
        self.buffer_bytes = int(buffer_bytes)
        self.host: list[int] = []
        self.views: list[memoryview] = []
        self.events: list[Any] = []
        self.stream: Any = None
        self._block = 0
        _check("cuCtxPushCurrent", cu.cuCtxPushCurrent(device.ctx))
        try:
            self.stream = _check("cuStreamCreate", cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)))
            self._block = int(_check("cuMemAllocHost", cu.cuMemAllocHost(2 * self.buffer_bytes),
                                     f"2 x {self.buffer_bytes} bytes of pinned staging memory (service.staging_bytes)"))
            for i in range(2):
                ptr = self._block + i * self.buffer_bytes
                self.host.append(ptr)
                self.views.append(memoryview((ctypes.c_ubyte * self.buffer_bytes).from_address(ptr)).cast("B"))
                # Blocking sync: a reader waiting for its buffer sleeps instead of spinning on a core
                # that the other readers' preadv needs.
                flags = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING) | int(cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
                self.events.append(_check("cuEventCreate", cu.cuEventCreate(flags)))
        except BaseException:
            self._free_current()
            raise
        finally:
            cu.cuCtxPopCurrent()

    def free(self) -> None:
        """Frees the buffers, events and stream (the set is spent)."""
        _check("cuCtxPushCurrent", cu.cuCtxPushCurrent(self.device.ctx))
        try:
            self._free_current()
        finally:
            cu.cuCtxPopCurrent()

    def _free_current(self) -> None:
        for v in self.views:
            v.release()
        self.views.clear()
        for ev in self.events:
            cu.cuEventDestroy(ev)
        self.events.clear()
        if self._block:
            cu.cuMemFreeHost(self._block)
            self._block = 0
        self.host.clear()
        if self.stream is not None:
            cu.cuStreamDestroy(self.stream)
            self.stream = None


class StagingPool:
    """One GPU's staging sets, kept between loads (see the module docstring).

    :meth:`take` hands a free set of the asked size (waiting for one that
    :meth:`warm` is allocating, else allocating it); :meth:`give` takes it back
    after its stream drained. Sets of another size (``staging_bytes`` or
    ``read_threads`` changed by a reload) are freed as they come back or are
    found, and a warm-up of a size no longer asked for stops (a fill at the new
    size neither waits for it nor counts its sets as its own). A :meth:`warm`
    for fewer sets than the last (``read_threads`` lowered with ``staging_bytes``,
    the buffer size unchanged) frees the kept sets beyond its count. Thread-safe.

    Args:
        device (`_Device`): the GPU whose primary context owns the streams.
    """

    def __init__(self, device: _Device) -> None:
        self.device = device
        self._free: list[_StagingSet] = []
        self._cond = threading.Condition()
        self._warming: dict[int, int] = {}  # buffer size -> sets a warm-up thread still has to allocate
        self._size = 0  # the buffer size last asked for
        self._sets = 0  # the sets the last warm() asked for

    @classmethod
    def of(cls, device: _Device) -> "StagingPool":
        """The pool of ``device`` (created on first use)."""
        with _POOLS_LOCK:
            pool = getattr(device, "_staging_pool", None)
            if pool is None:
                pool = device._staging_pool = cls(device)
            return pool

    def warm(self, sets: int, buffer_bytes: int) -> threading.Thread | None:
        """Allocates up to ``sets`` sets of ``buffer_bytes`` on one background thread; returns it (None: enough
        sets kept or being made, or no thread could start).

        One thread allocating in turn avoids the readers' contention in the
        driver; a failure is left for :meth:`take` to meet and report.
        """
        spent: list[_StagingSet] = []
        with self._cond:
            self._resize(buffer_bytes)
            if sets < self._sets:  # fewer readers at the same buffer size: keep no more than they take
                spent, self._free = self._free[max(0, sets):], self._free[:max(0, sets)]
            self._sets = sets
            missing = sets - len(self._free) - self._warming.get(buffer_bytes, 0)
            if missing > 0:
                self._warming[buffer_bytes] = self._warming.get(buffer_bytes, 0) + missing
        for s in spent:
            s.free()
        if missing <= 0:
            return None

        def run() -> None:
            left = missing
            while left:
                with self._cond:
                    if buffer_bytes != self._size:  # a reload asked for another size: the rest is not needed
                        self._warmed(buffer_bytes, left)
                        return
                try:
                    got: _StagingSet | None = _StagingSet(self.device, buffer_bytes)
                except Exception as e:  # noqa: BLE001 - take() allocates itself and raises the error
                    log.debug("staging warm-up stopped error=%r", e)
                    got = None
                with self._cond:
                    # A failure gives up the rest: takers then allocate (and report) for themselves.
                    done = 1 if got is not None else left
                    self._warmed(buffer_bytes, done)
                    left -= done
                    if got is not None and got.buffer_bytes == self._size:
                        self._free.append(got)
                        got = None
                if got is not None:  # a reload changed the size meanwhile
                    got.free()

        th = threading.Thread(target=run, name="weightcache-staging-warm", daemon=True)
        try:
            th.start()
        except RuntimeError as e:  # no thread to be had: the takers allocate for themselves, never wait for it
            with self._cond:
                self._warmed(buffer_bytes, missing)
            log.debug("staging warm-up not started error=%r", e)
            return None
        return th

    def take(self, buffer_bytes: int) -> _StagingSet:
        """A set of ``buffer_bytes``: a free one, one being warmed, else a new one.

        Raises:
            CudaDriverError: a new set could not be allocated.
        """
        with self._cond:
            self._resize(buffer_bytes)
            while True:
                # Of this size only: while this waited, a fill at another size (a load abandoned by its timeout
                # beside the next one, after a reload) may have put its own sets here.
                for i in range(len(self._free) - 1, -1, -1):
                    if self._free[i].buffer_bytes == buffer_bytes:
                        return self._free.pop(i)
                if not self._warming.get(buffer_bytes):
                    break
                self._cond.wait()
        return _StagingSet(self.device, buffer_bytes)

    def give(self, s: _StagingSet) -> None:
        """Returns a set whose stream has drained (freed instead when its size is no longer asked for)."""
        with self._cond:
            if s.buffer_bytes == self._size:
                self._free.append(s)
                self._cond.notify_all()
                return
        s.free()

    def close(self) -> None:
        """Frees every free set (sets in use are freed when given back: their size no longer matches)."""
        with self._cond:
            spent, self._free = self._free, []
            self._size = -1
        for s in spent:
            s.free()

    def _warmed(self, buffer_bytes: int, n: int) -> None:
        """(Lock held.) ``n`` sets of ``buffer_bytes`` are no longer being warmed (made, failed or not needed)."""
        left = self._warming.get(buffer_bytes, 0) - n
        if left > 0:
            self._warming[buffer_bytes] = left
        else:
            self._warming.pop(buffer_bytes, None)
        self._cond.notify_all()

    def _resize(self, buffer_bytes: int) -> None:
        """(Lock held.) Drops the free sets of another size than ``buffer_bytes``."""
        if buffer_bytes == self._size:
            return
        self._size = buffer_bytes
        keep = [s for s in self._free if s.buffer_bytes == buffer_bytes]
        for s in self._free:
            if s.buffer_bytes != buffer_bytes:
                s.free()
        self._free = keep


_POOLS_LOCK = threading.Lock()


class CudaStager:
    """One reader thread's way into a slab without torch: a pooled set of two pinned buffers, a stream, two events.

    Use as a context manager in the thread that copies: entering makes the
    device's primary context current and takes a set from the device's
    :class:`StagingPool`, leaving waits for every copy
    (``cuStreamSynchronize``) and gives the set back (frees it when a copy
    failed). Per chunk: ``wait(i)``, fill ``buffer(i)``, ``copy(i, ...)``.

    Args:
        device (`_Device`): the slab's GPU.
        slab_ptr (`int`): device address of the slab's first byte.
        slab_bytes (`int`): the slab's size (copies are bounds-checked against it).
        buffer_bytes (`int`): size of each of the two pinned buffers.

    Raises:
        CudaDriverError: a driver call failed (on enter, on a copy, or on exit).
    """

    def __init__(self, device: _Device, slab_ptr: int, slab_bytes: int, buffer_bytes: int) -> None:
        self._device = device
        self._slab_ptr = int(slab_ptr)
        self._slab_bytes = int(slab_bytes)
        self.buffer_bytes = int(buffer_bytes)
        self._set: _StagingSet | None = None
        self._host: list[int] = []
        self._views: list[memoryview] = []
        self._events: list[Any] = []
        self._recorded = [False, False]
        self._stream: Any = None

    def __enter__(self) -> "CudaStager":
        _check("cuCtxPushCurrent", cu.cuCtxPushCurrent(self._device.ctx))
        try:
            s = self._set = StagingPool.of(self._device).take(self.buffer_bytes)
        except BaseException:
            cu.cuCtxPopCurrent()
            raise
        self._host, self._views, self._events, self._stream = s.host, s.views, s.events, s.stream
        return self

    def buffer(self, i: int) -> memoryview:
        """Pinned buffer ``i`` (0 or 1), writable, ``buffer_bytes`` long; :meth:`wait` on it first."""
        return self._views[i]

    def wait(self, i: int) -> None:
        """Blocks until the last copy out of buffer ``i`` is done (``cuEventSynchronize``)."""
        if self._recorded[i]:
            _check("cuEventSynchronize", cu.cuEventSynchronize(self._events[i]), "a copy into the slab failed")
            self._recorded[i] = False

    def copy(self, i: int, src_offset: int, length: int, slab_offset: int) -> None:
        """Queues ``length`` bytes at ``src_offset`` of buffer ``i`` to ``slab_offset`` of the slab.

        Raises:
            ValueError: the range is outside the buffer or the slab.
        """
        if src_offset < 0 or length < 0 or src_offset + length > self.buffer_bytes \
                or slab_offset < 0 or slab_offset + length > self._slab_bytes:
            raise ValueError(f"staged copy of {length} bytes from buffer offset {src_offset} to slab offset "
                             f"{slab_offset}: outside the buffer ({self.buffer_bytes}) or slab ({self._slab_bytes})")
        _check("cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync(self._slab_ptr + slab_offset, self._host[i] + src_offset,
                                                         length, self._stream))
        _check("cuEventRecord", cu.cuEventRecord(self._events[i], self._stream))
        self._recorded[i] = True

    def copy2d(self, i: int, src_offset: int, src_pitch: int, width: int, rows: int, slab_offset: int,
               dst_pitch: int) -> None:
        """Queues ``rows`` rows of ``width`` bytes from buffer ``i`` (rows ``src_pitch`` apart, from ``src_offset``)
        to the slab (rows ``dst_pitch`` apart, from ``slab_offset``): one ``cuMemcpy2DAsync``.

        Raises:
            ValueError: the rows reach outside the buffer or the slab.
        """
        src_end = src_offset + (rows - 1) * src_pitch + width
        dst_end = slab_offset + (rows - 1) * dst_pitch + width
        if min(src_offset, slab_offset, width, rows - 1) < 0 or src_end > self.buffer_bytes \
                or dst_end > self._slab_bytes or src_pitch < width or dst_pitch < width:
            raise ValueError(f"staged 2-D copy of {rows} rows of {width} bytes (pitches {src_pitch}/{dst_pitch}) "
                             f"from buffer offset {src_offset} to slab offset {slab_offset}: outside the buffer "
                             f"({self.buffer_bytes}) or slab ({self._slab_bytes})")
        c = cu.CUDA_MEMCPY2D()
        c.srcMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_HOST
        c.srcHost = self._host[i] + src_offset
        c.srcPitch = src_pitch
        c.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        c.dstDevice = self._slab_ptr + slab_offset
        c.dstPitch = dst_pitch
        c.WidthInBytes = width
        c.Height = rows
        _check("cuMemcpy2DAsync", cu.cuMemcpy2DAsync(c, self._stream))
        _check("cuEventRecord", cu.cuEventRecord(self._events[i], self._stream))
        self._recorded[i] = True

    def __exit__(self, *exc: Any) -> None:
        s, self._set = self._set, None
        try:
            _check("cuStreamSynchronize", cu.cuStreamSynchronize(self._stream), "a copy into the slab failed")
        except BaseException:
            if s is not None:
                s.free()
            raise
        else:
            if s is not None:
                StagingPool.of(self._device).give(s)
        finally:
            self._host, self._views, self._events, self._stream = [], [], [], None
            cu.cuCtxPopCurrent()
