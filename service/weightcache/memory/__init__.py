"""Slab backends: where the bytes of one (model, layout, rank) live.

Two backends share one contract (:class:`Backend`):

- ``host``: a sealed memfd; importers ``mmap(PROT_READ)`` it
  (:mod:`weightcache.memory.host`).
- ``cuda``: one CUDA VMM allocation exported as a POSIX fd; importers map it
  with ``CU_MEM_ACCESS_FLAGS_PROT_READ`` (:mod:`weightcache.memory.cuda`).

This package is the only one that calls the CUDA driver. The daemon creates,
fills and seals slabs; engines import them from the fd received over the
socket. A slab's fd is the only handle that matters: the memory stays alive as
long as any process (the service, an engine, systemd's fd store) holds it.
"""

from __future__ import annotations

from typing import Protocol

from ..errors import ConfigError


class WritableSlab(Protocol):
    """A slab being filled by the loader.

    Attributes:
        size_bytes (`int`): mapping size (rounded up to the backend's granularity).
        tensor (`torch.Tensor`): the whole slab, 1-D ``uint8``, writable.
    """

    size_bytes: int
    tensor: object

    def seal(self) -> "SealedSlab":
        """Makes the slab read-only for everyone, returns the shareable handle."""

    def abort(self) -> None:
        """Frees a slab whose load failed (no partial slab stays allocated)."""


class SealedSlab(Protocol):
    """A sealed slab owned by the service.

    Attributes:
        fd (`int`): the shareable fd (memfd, or CUDA POSIX fd handle).
        size_bytes (`int`): mapping size.
        tensor (`torch.Tensor`): read-only 1-D ``uint8`` view for the owner
            (digests, ``verify``).
    """

    fd: int
    size_bytes: int
    tensor: object

    def close(self) -> None:
        """Unmaps the owner's view and closes the fd."""


class ImportedSlab(Protocol):
    """A slab imported by an engine from a received fd.

    Attributes:
        tensor (`torch.Tensor`): read-only 1-D ``uint8`` view of the whole slab.
    """

    tensor: object

    def close(self) -> None:
        """Drops the mapping. Views built on ``tensor`` must not be used after."""


class Backend(Protocol):
    """A slab backend: ``name`` is ``host`` or ``cuda``; see the module docstring."""
    name: str

    def allocate(self, size_bytes: int, label: str) -> WritableSlab:
        """Allocates a writable slab of at least ``size_bytes``.

        Raises:
            OutOfMemory (`out_of_memory`): the device or host has no room.
        """

    def adopt(self, fd: int, size_bytes: int) -> SealedSlab:
        """Takes ownership of an fd from systemd's fd store."""

    def import_fd(self, fd: int, size_bytes: int, device: str) -> ImportedSlab:
        """Maps a received fd read-only. Does not take ownership of ``fd``."""

    def mem_info(self) -> tuple[int, int]:
        """Returns ``(free_bytes, total_bytes)`` of the memory slabs come from (GPU, or host RAM)."""

    def device_info(self) -> dict:
        """Key fields of the slab's device (DESIGN section 5): ``backend``, ``gpu_uuid``, ``compute_capability``."""


def get_backend(name: str, gpu: int = 0) -> Backend:
    """Returns the backend named ``name`` (``host`` or ``cuda``) for GPU ``gpu``.

    Raises:
        ConfigError (`config_invalid`): unknown backend name.
    """
    if name == "host":
        from .host import HostBackend

        return HostBackend()
    if name == "cuda":
        from .cuda import CudaBackend

        return CudaBackend(gpu)
    raise ConfigError(f"unknown memory backend {name!r} (known: host, cuda)", key="service.backend")


def cuda_available() -> bool:
    """True when the CUDA driver (through ``cuda-bindings``) reports at least one device.

    Asked through the driver, not torch: the service must not import torch
    before READY when it adopts slabs from the fd store.
    """
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return False
    (err,) = cu.cuInit(0)[:1]
    if err != cu.CUresult.CUDA_SUCCESS:
        return False
    err, n = cu.cuDeviceGetCount()
    return err == cu.CUresult.CUDA_SUCCESS and n > 0
