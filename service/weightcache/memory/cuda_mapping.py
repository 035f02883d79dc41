"""One VMM mapping of the cuda backend: reserve, map, set access, export, unmap when the last view dies.

Owns :class:`_Mapping` (a VA range mapped to one physical allocation; what
torch tensors hold on to through ``__cuda_array_interface__``; unmapped by a
``weakref.finalize`` after ``cuCtxSynchronize`` when collected, or at once by
``release()``), :func:`_map_fd` (``cuMemImportFromShareableHandle`` of a
POSIX fd, then a mapping; the fd stays open) and :func:`check_vmm_fd` /
:func:`import_checked` (what a received fd must be before the driver is given it, and the driver's refusals
as ``manifest_slab_mismatch``: issue 38, P10 on CUDA). See
:mod:`weightcache.memory.cuda` for the lifetime rules.

Forbidden imports: torch at module level, daemon, client, protocol, cli.
"""

from __future__ import annotations

import logging
import os
import stat
import weakref
from typing import Any

from ..errors import ManifestSlabMismatch
from ..sizes import round_up
from .cuda_driver import CudaDriverError, _check, _Device, cu

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



#: The major number of NVIDIA's character devices (``/dev/nvidiactl``, ``/dev/nvidia0``...): an exported VMM
#: handle is an open file of one (``NV_MAJOR_DEVICE_NUMBER`` of the kernel module; tests/gpu checks it).
NVIDIA_MAJOR = 195

#: What the driver answers ``cuMemImportFromShareableHandle`` or ``cuMemMap`` for an fd that is no VMM handle
#: of this node, or one smaller than the manifest says: the sender's fault, not the device's.
_REFUSED = ("CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_INVALID_HANDLE", "CUDA_ERROR_NOT_SUPPORTED",
            "CUDA_ERROR_INVALID_DEVICE", "CUDA_ERROR_NOT_PERMITTED", "CUDA_ERROR_OPERATING_SYSTEM")


def _kind(st: os.stat_result) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file (a memfd?)")):
        if test(st.st_mode):
            return name
    if stat.S_ISCHR(st.st_mode):
        return f"the character device {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    return "an anonymous file"


def _nvidia_node(fd: int) -> bool:
    """Whether ``fd`` is open on a device node named ``/dev/nvidia*`` (``nvidia-uvm`` has a dynamic major)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia")
    except OSError:
        return False


def check_vmm_fd(fd: int, size_bytes: int) -> None:
    """Checks, before the driver sees it, that a received slab fd can be a CUDA VMM POSIX-fd handle: an open
    file of one of NVIDIA's character devices (major :data:`NVIDIA_MAJOR`, or a node named ``/dev/nvidia*``). Whatever answers at the socket path
    sends these fds (issue 38, P10): a FIFO, socket, directory, block device, regular file or memfd, or another
    character device (``/dev/zero``) is refused here. An anonymous file is left to the driver
    (:func:`import_checked`).

    Raises:
        ManifestSlabMismatch (`manifest_slab_mismatch`): the fd is none of those; ``details.slab_size_bytes``.
    """
    st = os.fstat(fd)
    if stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev) == NVIDIA_MAJOR or _nvidia_node(fd)):
        return
    if not any(test(st.st_mode) for test in (stat.S_ISFIFO, stat.S_ISSOCK, stat.S_ISDIR, stat.S_ISBLK, stat.S_ISREG,
                                              stat.S_ISCHR)):
        return
    raise ManifestSlabMismatch(f"the slab fd received is {_kind(st)}, not a CUDA VMM handle (an open file of "
                               f"NVIDIA's device {NVIDIA_MAJOR}:*); not mapped (is the process at the socket path "
                               f"the weightcache service?)", slab_size_bytes=size_bytes)


def import_checked(device: _Device, fd: int, size_bytes: int) -> _Mapping:
    """:func:`check_vmm_fd`, then :func:`_map_fd` read-only, the driver's refusal of the fd (not a VMM handle
    of this node, another handle type, an allocation smaller than ``size_bytes``) turned into
    ``manifest_slab_mismatch``; ``fd`` stays the caller's.

    Raises:
        ManifestSlabMismatch (`manifest_slab_mismatch`): see above; ``details.call``, ``details.result``.
        CudaDriverError: any other driver failure (out of memory, a lost device).
    """
    check_vmm_fd(fd, size_bytes)
    try:
        return _map_fd(device, fd, size_bytes, read_only=True)
    except CudaDriverError as e:
        # The import of a received fd fails with CUDA_ERROR_UNKNOWN for an eventfd or /dev/nvidiactl (H200,
        # driver 580): any refusal of the import but an out-of-memory is the fd's fault, not the device's.
        refused = (e.result != "CUDA_ERROR_OUT_OF_MEMORY" if e.call == "cuMemImportFromShareableHandle"
                   else e.call == "cuMemMap" and e.result in _REFUSED)
        if not refused:
            raise
        raise ManifestSlabMismatch(f"the slab fd received was refused by the CUDA driver ({e.call}: {e.result}): "
                                   f"not a VMM handle of this node of at least {size_bytes} bytes; not mapped (is "
                                   f"the process at the socket path the weightcache service?)",
                                   slab_size_bytes=size_bytes, call=e.call, result=e.result) from None
