"""A publication on the cuda backend (DESIGN §6.3): the publisher's exported VMM allocation copied into one the
service owns.

A CUDA VMM allocation cannot be sealed as a memfd can: whoever holds its POSIX fd (the publisher made it and
keeps a copy) can map it read-write at any time. So the service never serves the publisher's memory. It imports
the fd read-only, allocates its own slab of the same size on its GPU, copies the publisher's bytes into it with
one device-to-device copy (``cuMemcpyDtoD``, at the GPU's memory bandwidth), waits for the copy, unmaps the
import, and seals its own slab (:meth:`~weightcache.memory.cuda_slabs.CudaWritableSlab.seal`: the fd it exports
goes to engines and the fd store). From then on nothing the publisher does changes what engines attach; the
digest recorded at commit is of the service's copy.

Forbidden imports: daemon, client, protocol, cli, torch.
"""

from __future__ import annotations

import logging
import time

from ..errors import PublicationInvalid
from .cuda_driver import CudaDriverError, _check, _Device, cu
from .cuda_mapping import _map_fd
from .cuda_slabs import CudaSealedSlab, CudaWritableSlab

log = logging.getLogger("weightcache.memory.cuda")

__all__ = ["adopt_publication"]


def adopt_publication(device: _Device, fd: int, size_bytes: int, label: str = "publication") -> CudaSealedSlab:
    """The service's own sealed copy of a publisher's exported VMM allocation.

    Args:
        device (`_Device`): the service's GPU (its primary context).
        fd (`int`): the POSIX-fd shareable handle the publisher sent (``cuMemExportToShareableHandle``); it stays
            the caller's (closed by the caller; the service keeps no reference to the publisher's memory).
        size_bytes (`int`): the publication's size in bytes, a multiple of the GPU's VMM granularity (2 MiB on
            an H200), at most the allocation behind ``fd``.
        label (`str`, *optional*): for the allocation's log lines.

    Returns:
        `CudaSealedSlab`: a new allocation of ``size_bytes`` on ``device`` holding the publisher's bytes, sealed
        (exported fd, owner mapping ``PROT_READ``).

    Raises:
        PublicationInvalid (`publication_invalid`): ``size_bytes`` is not a positive multiple of the granularity
            (``details["reason"] = "size"``), or ``fd`` is not a VMM handle of at least ``size_bytes`` usable on
            this GPU (``"not_vmm"``).
        OutOfMemory (`out_of_memory`): the GPU has no room for the service's copy; nothing stays allocated.
        CudaDriverError: the copy failed.
    """
    gran = device.granularity
    if size_bytes <= 0 or size_bytes % gran:
        raise PublicationInvalid(f"publish: a CUDA publication's size must be a positive multiple of the VMM "
                                 f"granularity {gran} bytes; the request says {size_bytes}", reason="size",
                                 size_bytes=size_bytes, granularity=gran)
    t0 = time.monotonic()
    try:
        src = _map_fd(device, fd, size_bytes, read_only=True)
    except CudaDriverError as e:
        raise PublicationInvalid(f"publish: the slab fd is not a CUDA VMM allocation of {size_bytes} bytes usable "
                                 f"on GPU {device.index} ({e}); send the fd of cuMemExportToShareableHandle",
                                 reason="not_vmm", size_bytes=size_bytes) from None
    try:
        own = CudaWritableSlab(device, size_bytes, label)
        try:
            with device.current():
                _check("cuMemcpyDtoD", cu.cuMemcpyDtoD(own.ptr, src.ptr, size_bytes), f"publication {label!r}")
            sealed = own.seal()  # synchronises: the copy has landed before the fd exists
        except BaseException:
            own.abort()
            raise
    finally:
        src.release()  # the publisher's memory is no longer mapped here
    log.info("publication copied gpu=%d label=%s size_bytes=%d duration_ms=%.1f", device.index, label, size_bytes,
             (time.monotonic() - t0) * 1e3)
    return sealed
