"""Pinned staging into a cuda slab without torch: :class:`CudaStager`, one per reader thread.

Two page-locked host buffers (``cuMemAllocHost``), a non-blocking stream
(``cuStreamCreate``) and a blocking-sync event per buffer (``cuEventCreate``);
each chunk is copied with ``cuMemcpyHtoDAsync`` (or ``cuMemcpy2DAsync``) and
its buffer reused only after ``cuEventSynchronize`` on the event recorded
behind the copy.

Forbidden imports: torch, daemon, client, protocol, cli.
"""

from __future__ import annotations

import ctypes
from typing import Any

from .cuda_driver import _check, _Device, cu

__all__ = ["CudaStager"]


class CudaStager:
    """One reader thread's way into a slab without torch: two pinned buffers, a stream, two events.

    Use as a context manager in the thread that copies: entering makes the
    device's primary context current and allocates, leaving waits for every
    copy (``cuStreamSynchronize``) and frees. Per chunk: ``wait(i)``, fill
    ``buffer(i)``, ``copy(i, ...)``.

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
        self._host: list[int] = []
        self._views: list[memoryview] = []
        self._events: list[Any] = []
        self._recorded = [False, False]
        self._stream: Any = None

    def __enter__(self) -> "CudaStager":
        _check("cuCtxPushCurrent", cu.cuCtxPushCurrent(self._device.ctx))
        try:
            self._stream = _check("cuStreamCreate",
                                  cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)))
            for _ in range(2):
                ptr = int(_check("cuMemAllocHost", cu.cuMemAllocHost(self.buffer_bytes),
                                 f"{self.buffer_bytes} bytes of pinned staging memory (service.staging_bytes)"))
                self._host.append(ptr)
                self._views.append(memoryview((ctypes.c_ubyte * self.buffer_bytes).from_address(ptr)).cast("B"))
                # Blocking sync: a reader waiting for its buffer sleeps instead of spinning on a core
                # that the other readers' preadv needs.
                flags = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING) | int(cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
                self._events.append(_check("cuEventCreate", cu.cuEventCreate(flags)))
        except BaseException:
            self._free()
            raise
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
        try:
            if self._stream is not None:
                _check("cuStreamSynchronize", cu.cuStreamSynchronize(self._stream), "a copy into the slab failed")
        finally:
            self._free()

    def _free(self) -> None:
        for v in self._views:
            v.release()
        self._views.clear()
        for ev in self._events:
            cu.cuEventDestroy(ev)
        self._events.clear()
        for ptr in self._host:
            cu.cuMemFreeHost(ptr)
        self._host.clear()
        if self._stream is not None:
            cu.cuStreamDestroy(self._stream)
            self._stream = None
        cu.cuCtxPopCurrent()

