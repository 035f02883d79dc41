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

from dataclasses import dataclass
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

    def allocate_host(self, size_bytes: int, label: str) -> WritableSlab:
        """A writable slab in the host tier (host RAM; pinned once sealed on ``cuda``), filled like a slab.

        Raises:
            OutOfMemory (`out_of_memory`): host RAM has no room.
        """

    def adopt_host(self, fd: int, size_bytes: int) -> SealedSlab:
        """Takes ownership of a host-tier memfd from systemd's fd store."""

    def demote(self, sealed: SealedSlab, label: str) -> SealedSlab:
        """Copies a sealed slab GPU -> host tier (a sealed memfd); the caller closes ``sealed`` unless the
        answer is ``sealed`` itself (the ``host`` backend, where both tiers are host RAM).

        Raises:
            OutOfMemory (`out_of_memory`): host RAM has no room.
        """

    def promote(self, hosted: SealedSlab, label: str) -> SealedSlab:
        """Copies a host-tier slab -> a new sealed GPU slab (through pinned memory at link speed); ``hosted``
        stays the caller's (the ``host`` backend answers ``hosted`` itself).

        Raises:
            OutOfMemory (`out_of_memory`): the device has no room.
        """

    def device_info(self) -> dict:
        """Key fields of the slab's device (DESIGN section 5): ``backend``, ``gpu_uuid``, ``compute_capability``."""


def get_backend(name: str, gpu: int = 0, device: object = None) -> Backend:
    """Returns the backend named ``name`` (``host`` or ``cuda``) for GPU ``gpu``.

    ``device``: for ``cuda``, GPU ``gpu`` with its primary context already retained
    (:meth:`weightcache.memory.cuda_start.CudaStart.device`); None: the backend retains it.

    Raises:
        ConfigError (`config_invalid`): unknown backend name.
    """
    if name == "host":
        from .host import HostBackend

        return HostBackend()
    if name == "cuda":
        from .cuda import CudaBackend

        return CudaBackend(gpu, device=device)
    raise ConfigError(f"unknown memory backend {name!r} (known: host, cuda)", key="service.backend")


@dataclass(frozen=True)
class CudaProbe:
    """What the CUDA driver answered.

    Attributes:
        usable (`bool`): the driver library loaded, ``cuInit`` succeeded and at
            least one device answered.
        devices (`int`): devices the driver reports (0 when not usable).
        reason (`str`): why, in words, for the journal and ``STATUS=``
            (``"CUDA driver reports 8 device(s)"``, ``"the CUDA driver library
            libcuda.so.1 could not be loaded: ..."``).
    """

    usable: bool
    devices: int
    reason: str


def probe_cuda() -> CudaProbe:
    """Asks the CUDA driver (through ``cuda-bindings``) whether a device answers; never raises.

    Asked through the driver, not torch: the service must not import torch
    before READY when it adopts slabs from the fd store. Every way the driver
    can be missing is an answer, not an exception: ``cuda-bindings`` not
    installed (``ImportError``), ``libcuda.so.1`` absent (``cuda.pathfinder``'s
    ``DynamicLibNotFoundError``, an ``OSError`` or ``RuntimeError`` from the
    loader), ``cuInit`` failing (no device node, driver/library mismatch), or
    no device.

    Returns:
        `CudaProbe`.
    """
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:
        return CudaProbe(False, 0, f"cuda-bindings is not installed ({e})")
    except (OSError, RuntimeError) as e:  # e.g. cuda.pathfinder's ctypes.util.find_library without a temp dir
        return CudaProbe(False, 0, f"cuda-bindings failed to import: {type(e).__name__}: {str(e).rstrip('.')}")
    # cuInit loads libcuda.so.1 on first use; cuda.pathfinder raises DynamicLibNotFoundError
    # (a RuntimeError) when it is absent, other loaders an OSError.
    try:
        (err,) = cu.cuInit(0)[:1]
        if err != cu.CUresult.CUDA_SUCCESS:
            return CudaProbe(False, 0, f"the CUDA driver is installed but cuInit failed with {_cu_name(err)} "
                                       f"(no device node, or the driver and its kernel module differ)")
        err, n = cu.cuDeviceGetCount()
    except (OSError, RuntimeError) as e:
        return CudaProbe(False, 0, f"the CUDA driver library (libcuda.so.1) could not be loaded: "
                                   f"{type(e).__name__}: {str(e).rstrip('.')}")
    if err != cu.CUresult.CUDA_SUCCESS:
        return CudaProbe(False, 0, f"cuDeviceGetCount failed with {_cu_name(err)}")
    if n < 1:
        return CudaProbe(False, 0, "the CUDA driver reports no device")
    return CudaProbe(True, int(n), f"the CUDA driver reports {n} device(s)")


def _cu_name(err: object) -> str:
    return getattr(err, "name", None) or str(err)


def select_backend(name: str, probe=probe_cuda) -> tuple[str, str]:
    """Resolves the configured ``[service] backend`` to ``host`` or ``cuda``, saying why.

    Args:
        name (`str`): ``auto``, ``cuda`` or ``host``.
        probe (`Callable[[], CudaProbe]`, *optional*): the driver question
            (:func:`probe_cuda`).

    Returns:
        `tuple[str, str]`: the backend name and the reason, for the journal
        (``("host", "backend = auto: cuda-bindings is not installed ...")``).

    Raises:
        ConfigError (`config_invalid`): ``cuda`` on a node whose driver does
            not load or has no device (the message names the cause and the
            fix), or an unknown name.
    """
    if name == "host":
        return "host", "backend = host in the configuration"
    if name not in ("auto", "cuda"):
        raise ConfigError(f"unknown memory backend {name!r} (known: auto, host, cuda)", key="service.backend")
    p = probe()
    if p.usable:
        return "cuda", f"backend = {name}: {p.reason}"
    if name == "auto":
        return "host", f"backend = auto: {p.reason}; slabs live in host memory"
    raise ConfigError(
        f"backend = \"cuda\" but {p.reason}; install the NVIDIA driver (or fix the device access), or set "
        f"backend = \"host\" (or \"auto\") in [service] to serve from host memory", key="service.backend")
