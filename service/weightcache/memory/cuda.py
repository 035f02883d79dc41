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

Where each part lives (this module keeps :class:`CudaBackend` and re-exports
the rest under its old names): :mod:`~weightcache.memory.cuda_driver` (the
driver import, :func:`_check`, :class:`CudaDriverError`, one GPU's context),
:mod:`~weightcache.memory.cuda_mapping` (a VMM mapping, import of an fd),
:mod:`~weightcache.memory.cuda_slabs` (writable, sealed and imported slabs,
the digest path), :mod:`~weightcache.memory.cuda_staging` (pinned staging),
:mod:`~weightcache.memory.cuda_tier` (the host tier's copies) and
:mod:`~weightcache.memory.kernels` (NVRTC kernels).

Forbidden imports: daemon, client, protocol, cli.
"""

from __future__ import annotations

import threading
from typing import Any

from ..sizes import round_up
from .cuda_driver import _check, _Device, _require_driver, cu, gpu_uuid
from .cuda_mapping import _map_fd, check_vmm_fd, import_checked
from .cuda_slabs import CudaImportedSlab, CudaSealedSlab, CudaWritableSlab
from .cuda_staging import StagingPool

__all__ = ["CudaBackend"]


class CudaBackend:
    """The ``cuda`` backend for one GPU. See the module docstring.

    Args:
        gpu (`int`): CUDA ordinal as torch counts it.
        device (`_Device`, *optional*): GPU ``gpu`` with its primary context already retained
            (:meth:`weightcache.memory.cuda_start.CudaStart.device`); None: retained here.

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

    def __init__(self, gpu: int, device: _Device | None = None) -> None:
        _require_driver()
        self.gpu = int(gpu)
        self._devices: dict[int, _Device] = {}
        if device is not None and device.index == self.gpu:
            self._devices[self.gpu] = device
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

    def prepare_fill(self, threads: int, buffer_bytes: int) -> None:
        """Starts, on background threads, what a torch-free fill of this GPU needs: the pinned staging
        (``threads`` sets of two ``buffer_bytes`` buffers, :class:`~weightcache.memory.cuda_staging.StagingPool`,
        kept for the next loads) and the NVRTC kernels (:func:`weightcache.memory.kernels.prepare`), so that a
        load's plan overlaps them. Returns at once; errors surface at the fill (which then allocates or
        falls back itself)."""
        from . import kernels

        dev = self._device(self.gpu)
        StagingPool.of(dev).warm(threads, buffer_bytes)
        kernels.prepare(dev)  # a missing NVRTC is met (and the torch path chosen) by the fill itself

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
            ManifestSlabMismatch (`manifest_slab_mismatch`): the fd cannot be a VMM handle
                (:func:`~weightcache.memory.cuda_mapping.check_vmm_fd`: an entry another process put in the store).
            CudaDriverError: the fd is not a VMM handle, or is smaller than ``size_bytes``.
        """
        check_vmm_fd(fd, size_bytes)
        mapping = _map_fd(self._device(self.gpu), fd, size_bytes, read_only=True)
        return CudaSealedSlab(fd, mapping.size_bytes, mapping, owner_read_only=True)

    def defer_publication(self, source: Any, size_bytes: int, label: str) -> Any:
        """A publication's copy into the service's own slab, checked now and run later by the publication's worker
        (:class:`weightcache.memory.cuda_publish.Adoption`: its ``size_bytes`` is what the budget reserves).

        Args:
            source: a dup of the publisher's staging VMM fd (owned by the adoption from here on), or an
                :class:`~weightcache.memory.cuda_publish.IpcSource`.
            size_bytes (`int`): the publication's size, a multiple of :attr:`granularity`.

        Raises:
            PublicationInvalid (`publication_invalid`): the size or the IPC copies are malformed.
        """
        from . import cuda_publish

        return cuda_publish.Adoption(self._device(self.gpu), source, int(size_bytes), label)

    def ipc_export(self, ptrs: list[int]) -> tuple[list[bytes], list[tuple[int, int]]]:
        """The publisher's CUDA IPC handles of the allocations ``ptrs`` lie in
        (:func:`weightcache.memory.cuda_publish.ipc_export`).

        Raises:
            CudaDriverError: an allocation cannot be exported by IPC (a VMM allocation).
        """
        from . import cuda_publish

        return cuda_publish.ipc_export(self._device(self.gpu), ptrs)

    def allocate_publication(self, size_bytes: int) -> CudaWritableSlab:
        """A writable VMM allocation for an engine to fill with what it publishes, ``size_bytes`` rounded up to
        :attr:`granularity`; :meth:`CudaWritableSlab.seal` exports the fd sent with ``publish``."""
        return self.allocate(size_bytes, "publish")

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
            ManifestSlabMismatch (`manifest_slab_mismatch`): the fd is not a VMM handle of this node, or is
                smaller than ``size_bytes`` (:func:`~weightcache.memory.cuda_mapping.import_checked`: whatever
                answers at the socket path chose it; issue 38, P10).
            CudaDriverError: another driver failure.
        """
        return CudaImportedSlab(import_checked(self._device(self._device_index(device)), fd, size_bytes))

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
