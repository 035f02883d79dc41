"""CUDA backend: a slab is one CUDA VMM allocation shared as a POSIX fd.

Driver calls (CUDA Driver API, "Virtual Memory Management"), through NVIDIA's
``cuda.bindings.driver`` (package ``cuda-bindings``, extra ``weightcache[cuda]``):

- allocate: ``cuMemCreate`` (pinned device memory on the GPU, requested
  handle type ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``, size rounded up to
  ``cuMemGetAllocationGranularity``, 2 MiB on H200), then a VA reservation
  (``cuMemAddressReserve``), ``cuMemMap`` and ``cuMemSetAccess`` read-write.
  The physical allocation handle is released right after the map: from then
  on the mapping (and, once sealed, the exported fds) keep the memory alive.
- seal: ``cuCtxSynchronize`` (pending writes from any stream land), export the
  shareable handle (``cuMemRetainAllocationHandle`` +
  ``cuMemExportToShareableHandle``), then downgrade the owner's own mapping to
  ``CU_MEM_ACCESS_FLAGS_PROT_READ`` with ``cuMemSetAccess``. If the driver
  refuses the downgrade, the owner keeps a read-write view (logged as a
  warning; :attr:`CudaSealedSlab.owner_read_only` says which happened).
- import: ``cuMemImportFromShareableHandle`` (does not consume the fd),
  reserve, map, ``cuMemSetAccess`` ``PROT_READ``.
- fill without torch (:class:`CudaStager`, one per reader thread): two
  page-locked host buffers (``cuMemAllocHost``), a non-blocking stream
  (``cuStreamCreate``) and a blocking-sync event per buffer (``cuEventCreate``); each chunk
  is copied with ``cuMemcpyHtoDAsync`` and its buffer reused only after
  ``cuEventSynchronize`` on the event recorded behind the copy.

Read-only is enforced by the GPU's page tables: a kernel writing through a
``PROT_READ`` mapping faults (``cudaErrorIllegalAddress``, which poisons the
writer's CUDA context) and a memcpy into it fails (``cudaErrorInvalidValue``).
This stops accidents, not a hostile process: whoever holds the fd can map it
read-write (docs/design.md section 4).

Lifetime: every mapping is a :class:`_Mapping` object. ``.tensor`` is built by
``torch.as_tensor`` from the mapping's ``__cuda_array_interface__``, and torch
keeps a reference to the mapping for as long as any tensor sharing that
storage (views included) is alive. So ``close()`` only drops the slab's own
references: the VA range is unmapped (after ``cuCtxSynchronize``) when the last
view dies. ``abort()`` is the exception: it unmaps at once, since a failed
load's partial slab must not stay allocated; views of an aborted slab must not
be used afterwards.

All calls run in the device's *primary* context (``cuDevicePrimaryCtxRetain``),
the one PyTorch's runtime uses, pushed for the duration of each call. The GPU
index is the CUDA ordinal as torch counts it (after ``CUDA_VISIBLE_DEVICES``).

Forbidden imports: daemon, client, protocol, cli.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import weakref
from typing import Any, Iterator

from ..errors import ConfigError, DeviceError, OutOfMemory
from ..sizes import round_up

try:  # cuda-bindings is an optional dependency (extra "cuda").
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - exercised on machines without it
    cu = None

log = logging.getLogger(__name__)

__all__ = [
    "CudaBackend",
    "CudaDriverError",
    "CudaWritableSlab",
    "CudaSealedSlab",
    "CudaImportedSlab",
    "CudaStager",
    "gpu_uuid",
]


class CudaDriverError(DeviceError):
    """A CUDA driver call failed with something other than out-of-memory.

    Attributes:
        call (`str`): the driver function, e.g. ``cuMemMap``.
        result (`str`): the ``CUresult`` name, e.g. ``CUDA_ERROR_INVALID_VALUE``.
        result_code (`int`): the numeric ``CUresult``.
    """

    def __init__(self, call: str, result: Any, context: str = "") -> None:
        self.call = call
        self.result_code = int(result)
        self.result = getattr(result, "name", str(result))
        text = _error_string(result)
        msg = f"{call} failed with {self.result} ({self.result_code}): {text}"
        if context:
            msg += f"; {context}"
        super().__init__(msg, call=call, result=self.result)


def _require_driver() -> None:
    if cu is None:
        raise ConfigError(
            "memory backend 'cuda' needs NVIDIA's cuda-bindings package, which is not installed; "
            "fix: pip install 'weightcache[cuda]' or use backend 'host'",
            key="service.backend",
        )


def _error_string(result: Any) -> str:
    try:
        err, text = cu.cuGetErrorString(result)
    except Exception:  # noqa: BLE001 - best effort text for an error message
        return "(no description)"
    if err != cu.CUresult.CUDA_SUCCESS or not text:
        return "(no description)"
    return text.decode() if isinstance(text, bytes) else str(text)


def _check(call: str, ret: tuple, context: str = "") -> Any:
    """Returns the outputs of a ``cuda.bindings.driver`` call or raises.

    Raises:
        CudaDriverError: the call's ``CUresult`` is not ``CUDA_SUCCESS``.
    """
    err = ret[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaDriverError(call, err, context)
    if len(ret) == 1:
        return None
    if len(ret) == 2:
        return ret[1]
    return ret[1:]


def _init_driver() -> None:
    _require_driver()
    try:
        ret = cu.cuInit(0)
    except Exception as e:  # cuda.pathfinder raises when libcuda.so is absent
        raise CudaDriverError("cuInit", cu.CUresult.CUDA_ERROR_NO_DEVICE, f"driver library not loadable: {e}") from e
    _check("cuInit", ret, "is an NVIDIA driver installed and a GPU visible (CUDA_VISIBLE_DEVICES)?")


def _format_uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _uuid_bytes(uuid_struct: Any) -> bytes:
    raw = uuid_struct.bytes
    if isinstance(raw, str):
        raw = raw.encode("latin-1")
    return bytes(raw)[:16]


def gpu_uuid(index: int) -> str:
    """Returns the UUID of GPU ``index`` as ``nvidia-smi -L`` prints it.

    Args:
        index (`int`): CUDA ordinal as torch counts it (after ``CUDA_VISIBLE_DEVICES``).

    Returns:
        `str`: ``"GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"`` (from ``cuDeviceGetUuid``).

    Raises:
        CudaDriverError: no such device, or the driver is unusable.
    """
    _init_driver()
    dev = _check("cuDeviceGet", cu.cuDeviceGet(index), f"GPU index {index}")
    return _format_uuid(_uuid_bytes(_check("cuDeviceGetUuid", cu.cuDeviceGetUuid(dev))))


class _Device:
    """One GPU: its ``CUdevice``, retained primary context and VMM granularity."""

    def __init__(self, index: int) -> None:
        _init_driver()
        self.index = index
        self.dev = _check("cuDeviceGet", cu.cuDeviceGet(index), f"GPU index {index}")
        self.ctx = _check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self.dev), f"GPU index {index}")
        self.prop = cu.CUmemAllocationProp()
        self.prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = index
        self.prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.granularity = int(
            _check(
                "cuMemGetAllocationGranularity",
                cu.cuMemGetAllocationGranularity(
                    self.prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
            )
        )

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Makes the primary context current on this thread for the block."""
        _check("cuCtxPushCurrent", cu.cuCtxPushCurrent(self.ctx))
        try:
            yield
        finally:
            cu.cuCtxPopCurrent()

    def access_desc(self, read_only: bool) -> Any:
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.index
        desc.flags = (
            cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
            if read_only
            else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        )
        return desc

    def mem_info(self) -> tuple[int, int]:
        """Returns ``(free_bytes, total_bytes)`` of the GPU (``cuMemGetInfo``)."""
        with self.current():
            free, total = _check("cuMemGetInfo", cu.cuMemGetInfo())
        return int(free), int(total)


def _unmap(device: _Device, ptr: int, size_bytes: int) -> None:
    """Finalizer body: waits for queued work, unmaps, frees the VA range."""
    try:
        with device.current():
            # Kernels queued on any stream may still read the range.
            cu.cuCtxSynchronize()
            _check("cuMemUnmap", cu.cuMemUnmap(ptr, size_bytes))
            _check("cuMemAddressFree", cu.cuMemAddressFree(ptr, size_bytes))
        log.debug("slab unmapped gpu=%d ptr=0x%x size_bytes=%d", device.index, ptr, size_bytes)
    except Exception as e:  # noqa: BLE001 - a finalizer must not raise
        log.warning("slab unmap failed gpu=%d ptr=0x%x size_bytes=%d error=%s", device.index, ptr, size_bytes, e)


class _Mapping:
    """A VA range of ``size_bytes`` mapped to one physical allocation.

    The object is what torch tensors hold on to (``__cuda_array_interface__``);
    the range is unmapped when the object is collected, or at once by
    :meth:`release`.
    """

    def __init__(self, device: _Device, handle: Any, size_bytes: int, read_only: bool) -> None:
        self.device = device
        self.size_bytes = size_bytes
        self.read_only = read_only
        with device.current():
            ptr = _check(
                "cuMemAddressReserve",
                cu.cuMemAddressReserve(size_bytes, device.granularity, 0, 0),
                f"size_bytes={size_bytes}",
            )
            try:
                _check(
                    "cuMemMap",
                    cu.cuMemMap(ptr, size_bytes, 0, handle, 0),
                    f"size_bytes={size_bytes} (larger than the allocation behind the fd?)",
                )
            except BaseException:
                cu.cuMemAddressFree(ptr, size_bytes)
                raise
            try:
                _check("cuMemSetAccess", cu.cuMemSetAccess(ptr, size_bytes, [device.access_desc(read_only)], 1))
            except BaseException:
                cu.cuMemUnmap(ptr, size_bytes)
                cu.cuMemAddressFree(ptr, size_bytes)
                raise
        self.ptr = int(ptr)
        self._finalizer = weakref.finalize(self, _unmap, device, self.ptr, size_bytes)
        # At interpreter exit the process teardown frees everything anyway.
        self._finalizer.atexit = False

    @property
    def mapped(self) -> bool:
        return self._finalizer.alive

    @property
    def __cuda_array_interface__(self) -> dict:
        if not self._finalizer.alive:
            raise RuntimeError(f"slab mapping at 0x{self.ptr:x} was released")
        return {
            "shape": (self.size_bytes,),
            "typestr": "|u1",
            # torch refuses CAI's read-only flag ("should always be False");
            # read-only is enforced by the mapping's access flags instead.
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }

    def set_read_only(self) -> bool:
        """Downgrades the range to ``PROT_READ``; returns False if the driver refuses."""
        with self.device.current():
            ret = cu.cuMemSetAccess(self.ptr, self.size_bytes, [self.device.access_desc(True)], 1)
        if ret[0] != cu.CUresult.CUDA_SUCCESS:
            log.warning(
                "owner view stays read-write gpu=%d size_bytes=%d call=cuMemSetAccess result=%s",
                self.device.index,
                self.size_bytes,
                getattr(ret[0], "name", ret[0]),
            )
            return False
        self.read_only = True
        return True

    def export_fd(self) -> int:
        """Exports the physical allocation as a new POSIX fd (close-on-exec)."""
        with self.device.current():
            handle = _check("cuMemRetainAllocationHandle", cu.cuMemRetainAllocationHandle(self.ptr))
            try:
                fd = int(
                    _check(
                        "cuMemExportToShareableHandle",
                        cu.cuMemExportToShareableHandle(
                            handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
                        ),
                    )
                )
            finally:
                cu.cuMemRelease(handle)
        os.set_inheritable(fd, False)
        return fd

    def release(self) -> None:
        """Unmaps now, whatever views still exist (they must not be used after)."""
        self._finalizer()

    def tensor(self):
        """A 1-D ``uint8`` CUDA tensor over the whole range; it keeps ``self`` alive."""
        import torch

        t = torch.as_tensor(self, device=torch.device("cuda", self.device.index))
        if t.data_ptr() != self.ptr or t.numel() != self.size_bytes:
            raise RuntimeError(
                f"torch wrapped the slab mapping as a copy (data_ptr 0x{t.data_ptr():x}, "
                f"expected 0x{self.ptr:x}); is the mapping on cuda:{self.device.index}?"
            )
        return t


def _map_fd(device: _Device, fd: int, size_bytes: int, read_only: bool) -> _Mapping:
    """Imports a POSIX fd handle and maps its first ``size_bytes``; ``fd`` stays open."""
    size_bytes = max(device.granularity, round_up(size_bytes, device.granularity))
    with device.current():
        handle = _check(
            "cuMemImportFromShareableHandle",
            cu.cuMemImportFromShareableHandle(fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            f"fd {fd} is not a CUDA VMM POSIX-fd handle usable on GPU {device.index}",
        )
        try:
            return _Mapping(device, handle, size_bytes, read_only)
        finally:
            # The mapping holds the allocation from here on.
            cu.cuMemRelease(handle)


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


class CudaWritableSlab:
    """A VMM allocation being filled by the loader.

    Attributes:
        size_bytes (`int`): allocation size, rounded up to the granularity.
        ptr (`int`): device address of the first byte (valid until :meth:`seal`/:meth:`abort`).
        tensor (`torch.Tensor`): the whole slab, shape ``(size_bytes,)``, dtype
            ``U8``, on ``cuda:<gpu>``, writable until :meth:`seal`; built on
            first use (importing torch then).
        label (`str`): what the slab holds (model/layout/rank), for messages.
    """

    def __init__(self, device: _Device, size_bytes: int, label: str) -> None:
        self.label = label
        self.size_bytes = max(device.granularity, round_up(size_bytes, device.granularity))
        self._device = device
        with device.current():
            ret = cu.cuMemCreate(self.size_bytes, device.prop, 0)
            if ret[0] == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                free, total = _check("cuMemGetInfo", cu.cuMemGetInfo())
                raise OutOfMemory(
                    f"cuda slab {label!r} of {self.size_bytes} bytes could not be allocated on GPU {device.index}: "
                    f"{int(free)} of {int(total)} bytes free; fix: evict another model, place this one on "
                    f"another GPU, or use a larger tp_size",
                    size_bytes=self.size_bytes,
                    model=label,
                    gpu=device.index,
                    free_bytes=int(free),
                    total_bytes=int(total),
                )
            handle = _check("cuMemCreate", ret, f"slab {label!r} size_bytes={self.size_bytes} gpu={device.index}")
            try:
                self._mapping: _Mapping | None = _Mapping(device, handle, self.size_bytes, read_only=False)
            finally:
                # The mapping holds the allocation from here on; unmapping frees it.
                cu.cuMemRelease(handle)
        self.ptr = self._mapping.ptr
        self._tensor = None
        log.info("slab allocated gpu=%d label=%s size_bytes=%d", device.index, label, self.size_bytes)

    @property
    def tensor(self):
        """The writable ``uint8`` tensor over the slab, built on first use (imports torch)."""
        if self._tensor is None and self._mapping is not None:
            self._tensor = self._mapping.tensor()
        return self._tensor

    def stager(self, buffer_bytes: int) -> CudaStager:
        """A :class:`CudaStager` into this slab with two pinned buffers of ``buffer_bytes`` (one per reader thread).

        Raises:
            RuntimeError: the slab was sealed or aborted.
        """
        if self._mapping is None:
            raise RuntimeError(f"slab {self.label!r} was already sealed or aborted")
        return CudaStager(self._device, self.ptr, self.size_bytes, buffer_bytes)

    def _range(self, offset: int, size: int) -> int:
        if self._mapping is None:
            raise RuntimeError(f"slab {self.label!r} was already sealed or aborted")
        if offset < 0 or size < 0 or offset + size > self.size_bytes:
            raise ValueError(f"range {offset}+{size} is outside slab {self.label!r} ({self.size_bytes} bytes)")
        return self.ptr + offset

    def prepare_kernels(self) -> None:
        """Starts compiling the slab's GPU kernels in the background (:func:`weightcache.memory.kernels.prepare`)."""
        from . import kernels

        kernels.prepare(self._device)

    def zero(self, ranges: list[tuple[int, int]]) -> None:
        """Sets each ``(offset_bytes, size_bytes)`` range to zero (``cuMemsetD8``, synchronous)."""
        with self._device.current():
            for off, n in ranges:
                if n:
                    _check("cuMemsetD8", cu.cuMemsetD8(self._range(off, n), 0, n), f"slab {self.label!r}")

    def write(self, offset: int, data: bytes) -> None:
        """Copies host bytes ``data`` to ``offset`` (``cuMemcpyHtoD``, synchronous; for small computed tensors)."""
        if not data:
            return
        buf = ctypes.create_string_buffer(bytes(data), len(data))
        with self._device.current():
            _check("cuMemcpyHtoD", cu.cuMemcpyHtoD(self._range(offset, len(data)), ctypes.addressof(buf), len(data)),
                   f"slab {self.label!r}")

    def apply_lut(self, ranges: list[tuple[int, int]], table: bytes) -> None:
        """Replaces every byte ``b`` of the ``(offset_bytes, size_bytes)`` ranges by ``table[b]`` on the GPU.

        Raises:
            KernelError: NVRTC is missing (:mod:`weightcache.memory.kernels`).
        """
        from . import kernels

        kernels.lut8(self._device, [(self._range(o, n), n) for o, n in ranges], table)

    def digests(self, ranges: list[tuple[str, int, int]]) -> dict[str, str]:
        """``sum64`` digests of ``(name, offset_bytes, size_bytes)`` ranges, computed on the GPU (no host copy).

        Waits for every queued write first (``cuCtxSynchronize``).
        """
        return _digests(self._device, self.ptr, self.size_bytes, ranges, self.label)

    def seal(self) -> "CudaSealedSlab":
        """Waits for all queued writes, exports the fd, makes the owner's view read-only.

        Returns:
            `CudaSealedSlab`: owns the exported fd; this slab is spent.

        Raises:
            CudaDriverError: synchronisation (a failed kernel) or export failed.
        """
        if self._mapping is None:
            raise RuntimeError(f"slab {self.label!r} was already sealed or aborted")
        mapping = self._mapping
        with self._device.current():
            _check("cuCtxSynchronize", cu.cuCtxSynchronize(), f"a write into slab {self.label!r} failed")
        fd = mapping.export_fd()
        try:
            owner_read_only = mapping.set_read_only()
            sealed = CudaSealedSlab(fd, self.size_bytes, mapping, owner_read_only)
        except BaseException:
            os.close(fd)
            raise
        self._tensor = None
        self._mapping = None
        log.info(
            "slab sealed gpu=%d label=%s size_bytes=%d owner_read_only=%s",
            self._device.index,
            self.label,
            self.size_bytes,
            owner_read_only,
        )
        return sealed

    def abort(self) -> None:
        """Frees the allocation now; views of ``tensor`` must not be used after."""
        self._tensor = None
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            mapping.release()
            log.info("slab aborted gpu=%d label=%s size_bytes=%d", self._device.index, self.label, self.size_bytes)


class CudaSealedSlab:
    """A sealed VMM allocation owned by the service.

    Attributes:
        fd (`int`): the POSIX fd shareable handle (owned: closed by :meth:`close`).
        size_bytes (`int`): mapping size, a multiple of the granularity.
        tensor (`torch.Tensor`): shape ``(size_bytes,)``, dtype ``U8``, on
            ``cuda:<gpu>``; read-only when ``owner_read_only`` (writes fault).
        owner_read_only (`bool`): whether the driver accepted the ``PROT_READ``
            downgrade of the owner's mapping.
    """

    def __init__(self, fd: int, size_bytes: int, mapping: _Mapping, owner_read_only: bool) -> None:
        self.fd = fd
        self.size_bytes = size_bytes
        self.owner_read_only = owner_read_only
        self._mapping: _Mapping | None = mapping
        self._tensor = None

    @property
    def tensor(self):
        """Built on first use: adopting a slab at restart must not import torch before READY."""
        if self._tensor is None and self._mapping is not None:
            self._tensor = self._mapping.tensor()
        return self._tensor

    @property
    def mapped(self) -> bool:
        """Whether this slab still holds its mapping (False after :meth:`close`)."""
        return self._mapping is not None and self._mapping.mapped

    def digests(self, ranges: list[tuple[str, int, int]]) -> dict[str, str]:
        """``sum64`` digests of ``(name, offset_bytes, size_bytes)`` ranges on the GPU, through the read-only
        mapping; no torch, no host copy (``verify``).

        Raises:
            RuntimeError: the slab was closed.
            KernelError: NVRTC is missing.
        """
        if self._mapping is None:
            raise RuntimeError("sealed slab was closed")
        return _digests(self._mapping.device, self._mapping.ptr, self.size_bytes, ranges, "sealed slab")

    def close(self) -> None:
        """Closes the fd and drops the owner's mapping (unmapped once no view is alive)."""
        self._tensor = None
        self._mapping = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _digests(device: _Device, ptr: int, size_bytes: int, ranges: list[tuple[str, int, int]],
             label: str) -> dict[str, str]:
    from . import kernels

    for name, off, n in ranges:
        if off < 0 or n < 0 or off + n > size_bytes:
            raise ValueError(f"tensor {name!r}: range {off}+{n} is outside {label} ({size_bytes} bytes)")
    with device.current():
        _check("cuCtxSynchronize", cu.cuCtxSynchronize(), f"a write into {label} failed")
    sums = kernels.sum64(device, [(ptr + off, n) for _, off, n in ranges])
    return {name: d for (name, _, _), d in zip(ranges, sums)}


class CudaImportedSlab:
    """A received fd mapped ``PROT_READ`` on an engine's GPU.

    Attributes:
        size_bytes (`int`): mapping size.
        tensor (`torch.Tensor`): shape ``(size_bytes,)``, dtype ``U8``, on
            ``cuda:<gpu>``, read-only (kernel writes fault with
            ``cudaErrorIllegalAddress``, copies into it fail with
            ``cudaErrorInvalidValue``). Valid while any view of it is alive,
            independently of the fd and of the service process.
    """

    def __init__(self, mapping: _Mapping) -> None:
        self.size_bytes = mapping.size_bytes
        self._mapping: _Mapping | None = mapping
        self.tensor = mapping.tensor()

    @property
    def mapped(self) -> bool:
        return self._mapping is not None and self._mapping.mapped

    def close(self) -> None:
        """Drops this slab's references; the range is unmapped when the last view dies."""
        self.tensor = None
        self._mapping = None


class CudaBackend:
    """The ``cuda`` backend for one GPU. See the module docstring.

    Args:
        gpu (`int`): CUDA ordinal as torch counts it.

    Raises:
        ConfigError (`config_invalid`): ``cuda-bindings`` is not installed.
        CudaDriverError: no driver, or no GPU ``gpu``.

    Example:
        >>> b = CudaBackend(0)
        >>> w = b.allocate(10 << 20, "demo")          # 10 MiB, rounded to 2 MiB units
        >>> w.tensor[:4] = 7
        >>> s = w.seal()                               # s.fd goes to engines
        >>> r = b.import_fd(s.fd, s.size_bytes, "cuda:0")
        >>> int(r.tensor[0])
        7
    """

    name = "cuda"

    def __init__(self, gpu: int) -> None:
        _require_driver()
        self.gpu = int(gpu)
        self._devices: dict[int, _Device] = {}
        self._lock = threading.Lock()
        self._info: dict | None = None
        self._device(self.gpu)

    def _device(self, index: int) -> _Device:
        with self._lock:
            dev = self._devices.get(index)
            if dev is None:
                dev = self._devices[index] = _Device(index)
            return dev

    @property
    def granularity(self) -> int:
        """VMM allocation granularity of this GPU in bytes (2 MiB on H200)."""
        return self._device(self.gpu).granularity

    def mem_info(self) -> tuple[int, int]:
        """Returns ``(free_bytes, total_bytes)`` of this GPU (``cuMemGetInfo``)."""
        return self._device(self.gpu).mem_info()

    def allocate(self, size_bytes: int, label: str) -> CudaWritableSlab:
        """Allocates a writable slab of at least ``size_bytes`` on this GPU.

        Args:
            size_bytes (`int`): bytes needed; rounded up to the granularity.
            label (`str`): model/layout/rank, used in messages and logs.

        Returns:
            `CudaWritableSlab`

        Raises:
            OutOfMemory (`out_of_memory`): ``cuMemCreate`` found no room; nothing
                stays allocated.
            CudaDriverError: any other driver failure.
        """
        return CudaWritableSlab(self._device(self.gpu), int(size_bytes), label)

    def adopt(self, fd: int, size_bytes: int) -> CudaSealedSlab:
        """Takes ownership of an fd from systemd's fd store and maps it read-only.

        Args:
            fd (`int`): POSIX fd handle of a slab exported earlier (any process).
            size_bytes (`int`): the slab's ``size_bytes`` from its manifest.

        Returns:
            `CudaSealedSlab` owning ``fd``. If this raises, ``fd`` stays the caller's.

        Raises:
            CudaDriverError: the fd is not a VMM handle, or is smaller than ``size_bytes``.
        """
        mapping = _map_fd(self._device(self.gpu), fd, size_bytes, read_only=True)
        return CudaSealedSlab(fd, mapping.size_bytes, mapping, owner_read_only=True)

    # --- the host tier (weightcache.memory.cuda_tier) ---

    def allocate_host(self, size_bytes: int, label: str) -> Any:
        """A writable host slab for the host tier (``preload = "host"``), ``size_bytes`` rounded up to the VMM
        granularity (the size of the GPU slab its promotion makes); sealing it page-locks it."""
        from .host import HostWritableSlab

        size = max(self.granularity, round_up(int(size_bytes), self.granularity))
        return _HostTierWritable(self, HostWritableSlab(size, label))

    def adopt_host(self, fd: int, size_bytes: int) -> Any:
        """Takes ownership of a host-tier memfd from systemd's fd store and page-locks it for promotions."""
        from . import cuda_tier

        return cuda_tier.adopt(self._device(self.gpu), fd, size_bytes)

    def demote(self, sealed: "CudaSealedSlab", label: str) -> Any:
        """Copies a sealed GPU slab into a new host-tier slab (:func:`weightcache.memory.cuda_tier.demote`)."""
        from . import cuda_tier

        return cuda_tier.demote(self._device(self.gpu), sealed, label)

    def promote(self, hosted: Any, label: str, while_copying: Any = None) -> "CudaSealedSlab":
        """Copies a host-tier slab into a new sealed GPU slab at link speed
        (:func:`weightcache.memory.cuda_tier.promote`); ``while_copying()`` runs during the copy."""
        from . import cuda_tier

        return cuda_tier.promote(self._device(self.gpu), self, hosted, label, while_copying)

    def import_fd(self, fd: int, size_bytes: int, device: Any = None) -> CudaImportedSlab:
        """Maps a received fd read-only; does not take ownership of ``fd``.

        Args:
            fd (`int`): POSIX fd handle received over the socket; the caller closes it
                (the mapping does not need it).
            size_bytes (`int`): the slab's ``size_bytes`` from the manifest.
            device (`str` | `torch.device` | `int`, *optional*): ``"cuda:N"``;
                defaults to this backend's GPU.

        Returns:
            `CudaImportedSlab`

        Raises:
            ValueError: ``device`` is not a CUDA device.
            CudaDriverError: the fd is not a VMM handle, or is smaller than ``size_bytes``.
        """
        return CudaImportedSlab(_map_fd(self._device(self._device_index(device)), fd, size_bytes, read_only=True))

    def _device_index(self, device: Any) -> int:
        if device is None:
            return self.gpu
        if isinstance(device, int):
            return device
        import torch

        d = torch.device(device)
        if d.type != "cuda":
            raise ValueError(f"cuda backend cannot map a slab on device {str(d)!r}; use 'cuda:N'")
        return self.gpu if d.index is None else d.index

    def device_info(self) -> dict:
        """Key fields of the slab's device (DESIGN section 5).

        Returns:
            `dict`: ``{"backend": "cuda", "gpu_uuid": "GPU-...", "compute_capability": "9.0"}``.
        """
        if self._info is not None:  # a GPU's identity does not change while a process holds its context
            return dict(self._info)
        dev = self._device(self.gpu)
        attr = cu.CUdevice_attribute
        major = _check(
            "cuDeviceGetAttribute", cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev.dev)
        )
        minor = _check(
            "cuDeviceGetAttribute", cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev.dev)
        )
        self._info = {"backend": "cuda", "gpu_uuid": gpu_uuid(self.gpu), "compute_capability": f"{major}.{minor}"}
        return dict(self._info)


class _HostTierWritable:
    """A host slab filled for the host tier on a CUDA node: a :class:`~weightcache.memory.host.HostWritableSlab`
    whose :meth:`seal` also page-locks it (:func:`weightcache.memory.cuda_tier.seal_host`)."""

    def __init__(self, backend: CudaBackend, writable: Any) -> None:
        self._backend, self._w = backend, writable
        self.size_bytes = writable.size_bytes

    def __getattr__(self, name: str) -> Any:  # buffer, tensor, fd: as the host slab's
        return getattr(self._w, name)

    def seal(self) -> Any:
        from . import cuda_tier

        return cuda_tier.seal_host(self._backend._device(self._backend.gpu), self._w)

    def abort(self) -> None:
        self._w.abort()
