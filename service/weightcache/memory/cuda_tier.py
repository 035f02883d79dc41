"""The host tier on a CUDA node: sealed memfds, page-locked for the driver, and the copies to and from the GPU.

Owns :class:`HostTierSlab` (a sealed memfd mapped ``PROT_READ`` and
registered with ``cuMemHostRegister(CU_MEMHOSTREGISTER_READ_ONLY)``, so that a
promotion's ``cuMemcpyHtoDAsync`` runs at link speed from it),
:func:`demote` (GPU slab -> a new host-tier slab: ``cuMemcpyDtoH`` into a
fresh memfd, sealed like a host slab, then mapped and registered) and
:func:`promote` (host-tier slab -> a new sealed GPU slab: one asynchronous
copy on its own stream while the caller checks the host copy's digests).

The memfd is sealed against every change (``F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_WRITE | F_SEAL_SEAL``) before it is registered, so the bytes a
promotion copies are the bytes the demotion wrote; systemd's fd store keeps
the fd (``host-<id>``) across restarts, and :func:`adopt` maps and registers
it again.

Forbidden imports: torch, weightcache.daemon, weightcache.client, weightcache.protocol, weightcache.cli.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import time
from typing import Any, Callable

from ..errors import OutOfMemory

from .cuda_driver import _check, _error_string, cu
from .host import HostWritableSlab

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


class HostTierSlab:
    """A sealed memfd of the host tier, mapped read-only and page-locked for this GPU's copies.

    Attributes:
        fd (`int`): the memfd (owned; closed by :meth:`close`), -1 once closed.
        size_bytes (`int`): its size (the GPU slab's mapping size).
        ptr (`int`): host address of the read-only mapping (0 once closed).
        buffer (`memoryview | None`): a new read-only view of the mapping (format ``B``) for digests;
            None once closed.

    Raises:
        OutOfMemory (`out_of_memory`): the mapping or the page-locking failed (``RLIMIT_MEMLOCK``, no RAM).
    """

    def __init__(self, device: Any, fd: int, size_bytes: int) -> None:
        self.fd, self.size_bytes, self._device = fd, int(size_bytes), device
        addr = _libc.mmap(None, self.size_bytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OutOfMemory(f"host tier: mmap of {self.size_bytes} bytes failed: {os.strerror(err)}",
                              size_bytes=self.size_bytes)
        self.ptr = int(addr)
        t0 = time.monotonic()
        with device.current():
            ret = cu.cuMemHostRegister(self.ptr, self.size_bytes, cu.CU_MEMHOSTREGISTER_READ_ONLY)
        if ret[0] != cu.CUresult.CUDA_SUCCESS:
            _libc.munmap(self.ptr, self.size_bytes)
            self.ptr = 0
            raise OutOfMemory(f"host tier: cuMemHostRegister of {self.size_bytes} bytes failed with "
                              f"{_error_string(ret[0])}; raise the unit's LimitMEMLOCK= or lower "
                              f"host_tier_bytes", size_bytes=self.size_bytes)
        log.debug("host tier slab registered size_bytes=%d duration_ms=%.0f", self.size_bytes,
                  (time.monotonic() - t0) * 1e3)

    @property
    def buffer(self) -> memoryview | None:
        """A read-only ``memoryview`` of the whole mapping (the caller releases it); None once closed."""
        if not self.ptr:
            return None
        return memoryview((ctypes.c_ubyte * self.size_bytes).from_address(self.ptr)).cast("B").toreadonly()

    def close(self) -> None:
        """Unregisters and unmaps the mapping and closes the fd (idempotent)."""
        if self.ptr:
            with self._device.current():
                cu.cuMemHostUnregister(self.ptr)
            _libc.munmap(self.ptr, self.size_bytes)
            self.ptr = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def adopt(device: Any, fd: int, size_bytes: int) -> HostTierSlab:
    """Takes ownership of a sealed host-tier memfd (systemd's fd store, or a host-tier load) and registers it."""
    return HostTierSlab(device, fd, size_bytes)


def seal_host(device: Any, writable: HostWritableSlab) -> HostTierSlab:
    """Seals a host slab filled for the host tier (``preload = "host"``) and registers it."""
    sealed = writable.seal()
    fd, size = sealed.fd, sealed.size_bytes
    sealed.fd = -1  # the HostTierSlab owns the fd from here
    sealed.close()
    return HostTierSlab(device, fd, size)


def demote(device: Any, sealed: Any, label: str) -> HostTierSlab:
    """GPU -> host tier: a new sealed, registered memfd holding the GPU slab's ``size_bytes`` bytes.

    Args:
        device: the slab's ``cuda._Device``.
        sealed (`CudaSealedSlab`): the GPU slab (not closed here).
        label (`str`): model/layout/rank, for the memfd's name and messages.

    Raises:
        OutOfMemory (`out_of_memory`): host RAM has no room; CudaDriverError: the copy failed.
    """
    size = sealed.size_bytes
    t0 = time.monotonic()
    w = HostWritableSlab(size, f"host-tier:{label}")
    try:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(w.buffer))
        with device.current():
            # Registered for the copy (a pageable DtoH goes through the driver's small bounce buffers).
            _check("cuMemHostRegister", cu.cuMemHostRegister(addr, size, 0), f"host tier {label}")
            try:
                _check("cuMemcpyDtoH", cu.cuMemcpyDtoH(addr, sealed._mapping.ptr, size), f"demotion of {label}")
            finally:
                cu.cuMemHostUnregister(addr)
        t1 = time.monotonic()
        out = seal_host(device, w)
    except BaseException:
        w.abort()
        raise
    log.info("host tier copy made label=%s size_bytes=%d copy_ms=%.0f register_ms=%.0f", label, size,
             (t1 - t0) * 1e3, (time.monotonic() - t1) * 1e3)
    return out


def promote(device: Any, backend: Any, hosted: HostTierSlab, label: str,
            while_copying: Callable[[], None] | None = None) -> Any:
    """Host tier -> a new sealed GPU slab with the same bytes, copied from the page-locked mapping at link speed.

    Args:
        device: this GPU's ``cuda._Device``; backend (`CudaBackend`): allocates the GPU slab.
        hosted (`HostTierSlab`): the source (stays the caller's).
        while_copying (`callable`, *optional*): run while the copy is in flight (the digests of the host copy).

    Returns:
        `CudaSealedSlab`.

    Raises:
        OutOfMemory (`out_of_memory`): the GPU has no room; CudaDriverError: the copy failed.
    """
    w = backend.allocate(hosted.size_bytes, label)
    try:
        with device.current():
            stream = _check("cuStreamCreate", cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)))
            try:
                _check("cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync(w.ptr, hosted.ptr, hosted.size_bytes, stream),
                       f"promotion of {label}")
                if while_copying is not None:
                    while_copying()
                _check("cuStreamSynchronize", cu.cuStreamSynchronize(stream), f"promotion of {label}")
            finally:
                cu.cuStreamDestroy(stream)
        return w.seal()
    except BaseException:
        w.abort()
        raise
