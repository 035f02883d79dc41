"""The cuda backend's slabs: writable (allocate, fill, seal), sealed (export, verify), imported (read-only view).

Owns :class:`CudaWritableSlab` (``cuMemCreate`` + a read-write mapping; the
loader's writes, zeroing, byte tables and digests; :meth:`~CudaWritableSlab.seal`
synchronises, exports the POSIX fd and downgrades the owner's view to
``PROT_READ``), :class:`CudaSealedSlab` (the service's sealed slab: the fd
and the owner's mapping; the read-only verify path, ``sum64`` digests on the
GPU through that mapping) and :class:`CudaImportedSlab` (an engine's
``PROT_READ`` mapping of a received fd).

Forbidden imports: torch at module level, daemon, client, protocol, cli.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

from ..errors import OutOfMemory
from ..sizes import round_up
from .cuda_driver import _check, _Device, cu
from .cuda_mapping import _Mapping
from .cuda_staging import CudaStager

log = logging.getLogger("weightcache.memory.cuda")  # one logger for the cuda backend, whichever module logs

__all__ = ["CudaWritableSlab", "CudaSealedSlab", "CudaImportedSlab"]


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

    @property
    def gpu(self) -> int:
        """The GPU index the slab lives on (NIXL's device id of a ``VRAM`` registration)."""
        return self._device.index

    @property
    def granularity(self) -> int:
        """The GPU's VMM allocation granularity in bytes (:attr:`size_bytes` is a multiple of it)."""
        return self._device.granularity

    def current(self):
        """A context manager making the slab's GPU context (the primary one) current on this thread."""
        return self._device.current()

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

    def kernels_expected(self) -> bool:
        """Whether the slab's GPU kernels are compiled, being compiled, or NVRTC loads (:func:`kernels.expected`)."""
        from . import kernels

        return kernels.expected(self._device)

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

    def export_fd(self) -> int:
        """Waits for all queued writes and exports the allocation as a new POSIX fd (close-on-exec; the caller
        closes it), leaving this slab writable: for a publisher whose own tensors live here, which the service
        copies into its own slab (``publish(home=...)``), not for an fd engines map.

        Raises:
            RuntimeError: the slab was sealed or aborted.
            CudaDriverError: synchronisation (a failed kernel) or export failed.
        """
        if self._mapping is None:
            raise RuntimeError(f"slab {self.label!r} was already sealed or aborted")
        with self._device.current():
            _check("cuCtxSynchronize", cu.cuCtxSynchronize(), f"a write into slab {self.label!r} failed")
        return self._mapping.export_fd()

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
        receivers (`set[int]`): pids its fd was sent to (see :class:`~weightcache.daemon.tiers.HeldByReceivers`).
    """

    def __init__(self, fd: int, size_bytes: int, mapping: _Mapping, owner_read_only: bool) -> None:
        self.fd = fd
        self.size_bytes = size_bytes
        self.owner_read_only = owner_read_only
        #: Pids of the processes its fd was sent to (the service's attach replies): once it is freed, its
        #: memory counts in the budget until they have all exited (weightcache.daemon.tiers.HeldByReceivers).
        self.receivers: set[int] = set()
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

    def device_range(self) -> tuple[int, int, Any, Any]:
        """The owner's read-only mapping, for a peer's READ (issue 37): ``(device_ptr, gpu_index, current,
        holder)``: ``current()`` makes the GPU's context current (a context manager); ``holder`` keeps the
        range mapped while it is referenced, even after :meth:`close` (an eviction during a transfer frees the
        memory when the transfer drops it).

        Raises:
            RuntimeError: the slab was closed.
        """
        m = self._mapping
        if m is None or not m.mapped:
            raise RuntimeError("sealed slab was closed")
        return m.ptr, m.device.index, m.device.current, m

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

