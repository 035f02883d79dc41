"""One VMM mapping of the cuda backend: reserve, map, set access, export, unmap when the last view dies.

Owns :class:`_Mapping` (a VA range mapped to one physical allocation; what
torch tensors hold on to through ``__cuda_array_interface__``; unmapped by a
``weakref.finalize`` after ``cuCtxSynchronize`` when collected, or at once by
``release()``) and :func:`_map_fd` (``cuMemImportFromShareableHandle`` of a
POSIX fd, then a mapping; the fd stays open). See
:mod:`weightcache.memory.cuda` for the lifetime rules.

Forbidden imports: torch at module level, daemon, client, protocol, cli.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

from ..sizes import round_up
from .cuda_driver import _check, _Device, cu

log = logging.getLogger("weightcache.memory.cuda")  # one logger for the cuda backend, whichever module logs


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

