"""A publication on the cuda backend (DESIGN §6.3): the publisher's memory copied into an allocation the service
owns, with the digests computed in the same pass.

A CUDA allocation cannot be sealed as a memfd can: whoever holds its handle can map it read-write at any time. So
the service never serves the publisher's memory. It allocates its own slab of the publication's size on its GPU
and copies the publisher's bytes into it, then seals its own slab
(:meth:`~weightcache.memory.cuda_slabs.CudaWritableSlab.seal`: the fd it exports goes to engines and the fd
store). From then on nothing the publisher does changes what engines attach.

The publisher's memory reaches the service in one of two ways (:class:`Adoption` takes either):

- **CUDA IPC** (``publish_cuda_ipc``, when the GPU has no room to stage): the publisher sends
  ``cuIpcGetMemHandle`` handles of the allocations its tensors live in (torch's caching allocator: ``cudaMalloc``
  segments) and, per copy, the segment, the offset in it, the offset in the slab and the length. The service opens each handle
  (``cuIpcOpenMemHandle``), checks every copy against the segment's size (``cuMemGetAddressRange``), copies, and
  closes the handles. One copy of the weights in all: the publisher makes none.
- **A staging VMM allocation** (``publish``, the client's default where the GPU has room, and when an
  allocation cannot be exported by IPC: torch's ``expandable_segments``, vLLM's sleep-mode allocator): the
  publisher copies its tensors into a VMM allocation it exports (``cuMemExportToShareableHandle``); the service
  imports it read-only and copies it. Opening IPC handles costs the service about 3 ms per GB, importing a VMM
  fd a fraction of a millisecond (benchmarks/RESULTS.md). When the publisher's tensors already live in such an
  allocation at their slab offsets (vLLM's publishing load moves the model it built into one,
  ``client.allocate_home``), that allocation is sent as it is and the service's copy is the only one.

Each tensor's ``sum64`` digest is computed by the copy itself (:func:`weightcache.memory.kernels.copy_sum64`:
every word read once, written to the service's slab and summed), so the digest is of exactly the bytes that
landed, even if the publisher writes its memory meanwhile, and the slab is read once, not twice. Ranges the fused
copy cannot take (overlapping views, an unaligned source) are copied plainly and digested after; bytes of the
slab that no copy covers are zeroed.

Forbidden imports: daemon, client, protocol, cli, torch.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import PublicationInvalid
from .cuda_driver import CudaDriverError, _check, _Device, cu
from .cuda_mapping import _map_fd
from .cuda_slabs import CudaSealedSlab, CudaWritableSlab

log = logging.getLogger("weightcache.memory.cuda")

__all__ = ["Adoption", "FillPlan", "IpcSource", "ipc_export", "plan_fill", "IPC_HANDLE_BYTES",
           "MAX_IPC_TABLE_BYTES"]

#: Bytes of a ``CUipcMemHandle``.
IPC_HANDLE_BYTES = 64
#: The largest IPC table a publication may send (JSON; about 170 bytes per tensor: 100,000 tensors fit).
MAX_IPC_TABLE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class IpcSource:
    """A publisher's memory by CUDA IPC.

    Attributes:
        segments (`tuple[bytes, ...]`): ``cuIpcGetMemHandle`` handles (64 bytes each) of the publisher's
            allocations.
        copies (`tuple[tuple[int, int, int, int], ...]`): ``(segment index, offset in the segment, offset in the
            slab, size)`` in bytes; the slab ranges do not overlap.
    """

    segments: tuple[bytes, ...]
    copies: tuple[tuple[int, int, int, int], ...]

    def to_json(self) -> bytes:
        """The table as ``publish_cuda_ipc`` sends it (docs/protocol.md, "Publication")."""
        return json.dumps({"segments": [h.hex() for h in self.segments],
                           "copies": [list(c) for c in self.copies]}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "IpcSource":
        """Parses a table :meth:`to_json` wrote.

        Raises:
            PublicationInvalid (`publication_invalid`, ``reason = "ipc"``): not that JSON shape: ``segments`` a
                list of 128 lowercase hex digits each, ``copies`` a list of 4 non-negative integers each.
        """
        try:
            doc = json.loads(data)
            raw, copies = doc["segments"], doc["copies"]
            if not isinstance(raw, list) or not isinstance(copies, list):
                raise TypeError("segments and copies must be lists")
            segments = []
            for i, h in enumerate(raw):
                if not isinstance(h, str) or len(h) != 2 * IPC_HANDLE_BYTES or h != h.lower():
                    raise ValueError(f"segments[{i}] is not {2 * IPC_HANDLE_BYTES} lowercase hex digits")
                segments.append(bytes.fromhex(h))
            for i, c in enumerate(copies):
                if not (isinstance(c, list) and len(c) == 4 and all(type(v) is int and v >= 0 for v in c)):
                    raise ValueError(f"copies[{i}] is not 4 non-negative integers [segment, src_offset, "
                                     f"dst_offset, size]")
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
            raise PublicationInvalid(f"publish: the CUDA IPC table does not decode: {e}", reason="ipc") from None
        return cls(tuple(segments), tuple(tuple(c) for c in copies))


def ipc_export(device: _Device, ptrs: list[int]) -> tuple[list[bytes], list[tuple[int, int]]]:
    """The publisher's side of CUDA IPC: the handles of the allocations ``ptrs`` lie in, and where each lies.

    Args:
        device (`_Device`): the publisher's GPU (its primary context: the one torch uses).
        ptrs (`list[int]`): device addresses of the bytes to publish.

    Returns:
        `tuple`: (one 64-byte ``cuIpcGetMemHandle`` handle per distinct allocation, ``(segment index, offset of
        the pointer in that allocation)`` per pointer).

    Raises:
        CudaDriverError: an allocation cannot be exported this way (a VMM allocation: the caller stages instead).
    """
    handles: list[bytes] = []
    index: dict[int, int] = {}
    where: list[tuple[int, int]] = []
    with device.current():
        for ptr in ptrs:
            base, _ = _check("cuMemGetAddressRange", cu.cuMemGetAddressRange(ptr), f"pointer 0x{ptr:x}")
            base = int(base)
            if base not in index:
                h = _check("cuIpcGetMemHandle", cu.cuIpcGetMemHandle(base), f"allocation at 0x{base:x}")
                index[base] = len(handles)
                handles.append(bytes(h.reserved))
            where.append((index[base], ptr - base))
    return handles, where


class Adoption:
    """One publication's copy into the service's own slab, set up on the serving loop and carried out by the
    publication's worker (:meth:`run`), which then owns nothing of the publisher's.

    Args:
        device (`_Device`): the service's GPU.
        source (`int | IpcSource`): a dup of the publisher's staging VMM fd (closed by :meth:`run` or
            :meth:`close`), or its IPC table.
        size_bytes (`int`): the publication's size in bytes, a positive multiple of the GPU's VMM granularity.
        label (`str`): for log lines.

    Attributes:
        size_bytes (`int`): the size of the service's slab (what the memory budget reserves).

    Raises:
        PublicationInvalid (`publication_invalid`): ``size_bytes`` is not a positive multiple of the granularity
            (``details["reason"] = "size"``), or the IPC copies are malformed (``"ipc"``: a segment index that
            does not exist, a negative or overlapping range, a range outside the slab).
    """

    def __init__(self, device: _Device, source: int | IpcSource, size_bytes: int, label: str) -> None:
        gran = device.granularity
        if size_bytes <= 0 or size_bytes % gran:
            raise PublicationInvalid(f"publish: a CUDA publication's size must be a positive multiple of the VMM "
                                     f"granularity {gran} bytes; the request says {size_bytes}", reason="size",
                                     size_bytes=size_bytes, granularity=gran)
        if isinstance(source, IpcSource):
            _check_copies(source, size_bytes)
        self.device, self.source, self.size_bytes, self.label = device, source, size_bytes, label

    def close(self) -> None:
        """Closes the staging fd if :meth:`run` did not (idempotent)."""
        if isinstance(self.source, int) and self.source >= 0:
            os.close(self.source)
            self.source = -1

    def run(self, ranges: list[tuple[str, int, int]]) -> tuple[CudaSealedSlab, dict[str, str] | None]:
        """Copies the publisher's bytes into a new allocation of :attr:`size_bytes` and seals it.

        Args:
            ranges (`list[tuple[str, int, int]]`): ``(name, offset_bytes, size_bytes)`` of every stored tensor
                (inside the slab, checked by the caller).

        Returns:
            `tuple`: (the sealed slab, each range's ``sum64`` digest by name; None when the NVRTC kernels are
            missing: the caller digests the sealed slab its own way).

        Raises:
            PublicationInvalid (`publication_invalid`): the staging fd is not a VMM allocation of
                :attr:`size_bytes` usable on this GPU (``"not_vmm"``); an IPC handle does not open here, or a copy
                reaches past its allocation (``"ipc"``).
            OutOfMemory (`out_of_memory`): the GPU has no room for the service's copy; nothing stays allocated.
            CudaDriverError: the copy failed.
        """
        t0 = time.monotonic()
        release: list[Any] = []
        marks = [t0]
        later = False
        try:
            if isinstance(self.source, IpcSource):
                pieces = self._open_ipc(release)
                how = "ipc"
            else:
                pieces = self._map_staging(release)
                how = "staging"
            marks.append(time.monotonic())
            own = CudaWritableSlab(self.device, self.size_bytes, self.label)
            try:
                marks.append(time.monotonic())
                digests = _fill(self.device, own, pieces, ranges)
                marks.append(time.monotonic())
                sealed = own.seal()  # synchronises: every copy has landed before the fd exists
                marks.append(time.monotonic())
            except BaseException:
                own.abort()
                raise
            # the copy has landed: unmapping the publisher's staging allocation (about 4 ms for 15 GB) need not
            # hold up the reply; IPC handles are closed here, before the publisher may free its memory
            later = how == "staging" and _later(release)
        finally:
            if not later:
                for undo in reversed(release):
                    undo()
            self.close()
        log.info("publication copied gpu=%d label=%s size_bytes=%d via=%s fused_digests=%s duration_ms=%.1f "
                 "open_ms=%.1f allocate_ms=%.1f copy_ms=%.1f seal_ms=%.1f", self.device.index, self.label,
                 self.size_bytes, how, digests is not None, (time.monotonic() - t0) * 1e3,
                 *[(b - a) * 1e3 for a, b in zip(marks, marks[1:])])
        return sealed, digests

    def _map_staging(self, release: list[Any]) -> list[tuple[int, int, int]]:
        try:
            src = _map_fd(self.device, self.source, self.size_bytes, read_only=True)
        except CudaDriverError as e:
            raise PublicationInvalid(f"publish: the slab fd is not a CUDA VMM allocation of {self.size_bytes} bytes "
                                     f"usable on GPU {self.device.index} ({e}); send the fd of "
                                     f"cuMemExportToShareableHandle", reason="not_vmm",
                                     size_bytes=self.size_bytes) from None
        release.append(src.release)  # the publisher's memory is no longer mapped here
        return [(0, src.ptr, self.size_bytes)]

    def _open_ipc(self, release: list[Any]) -> list[tuple[int, int, int]]:
        src = self.source
        assert isinstance(src, IpcSource)
        bases: list[tuple[int, int]] = []
        dev = self.device

        def close_all() -> None:
            with dev.current():
                cu.cuCtxSynchronize()  # no copy may still read a segment being closed
                for b, _ in bases:
                    cu.cuIpcCloseMemHandle(b)

        release.append(close_all)
        with dev.current():
            for i, raw in enumerate(src.segments):
                h = cu.CUipcMemHandle()
                h.reserved = raw
                ret = cu.cuIpcOpenMemHandle(h, cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                if ret[0] != cu.CUresult.CUDA_SUCCESS:
                    raise PublicationInvalid(f"publish: CUDA IPC handle {i} does not open on GPU {dev.index} "
                                             f"({ret[0]}); the publisher's allocation must be live, on this "
                                             f"node, until the reply", reason="ipc", segment=i)
                base = int(ret[1])
                bases.append((base, 0))  # opened: closed by close_all even if the next call raises
                _, seg = _check("cuMemGetAddressRange", cu.cuMemGetAddressRange(base), f"IPC segment {i}")
                bases[-1] = (base, int(seg))
        pieces = []
        for seg, src_off, dst_off, n in src.copies:
            base, seg_bytes = bases[seg]
            if src_off + n > seg_bytes:
                raise PublicationInvalid(f"publish: IPC copy of {n} bytes at offset {src_off} reaches past segment "
                                         f"{seg} ({seg_bytes} bytes)", reason="ipc", segment=seg)
            pieces.append((dst_off, base + src_off, n))
        return sorted(pieces)


def _later(release: list[Any]) -> bool:
    """Runs ``release``'s undo callables (in reverse) on a short-lived thread; False (nothing started) when no
    thread can be had, and the caller runs them itself."""
    def run() -> None:
        for undo in reversed(release):
            try:
                undo()
            except Exception as e:  # noqa: BLE001 - an unmap that fails leaves a mapping, not wrong bytes: log it
                log.error("publication source release failed error=%r", e)

    try:
        threading.Thread(target=run, name="weightcache-publication-release", daemon=True).start()
    except RuntimeError:
        return False
    return True


def _check_copies(src: IpcSource, size_bytes: int) -> None:
    """Raises PublicationInvalid (``reason = "ipc"``) unless every copy names a segment and a slab range inside
    ``size_bytes``, and no two slab ranges overlap."""
    for i, h in enumerate(src.segments):
        if len(h) != IPC_HANDLE_BYTES:
            raise PublicationInvalid(f"publish: CUDA IPC handle {i} has {len(h)} bytes, {IPC_HANDLE_BYTES} expected",
                                     reason="ipc", segment=i)
    end = 0
    for seg, src_off, dst_off, n in sorted(src.copies, key=lambda c: c[2]):
        if not 0 <= seg < len(src.segments) or min(src_off, dst_off, n) < 0 or dst_off + n > size_bytes \
                or dst_off < end:
            raise PublicationInvalid(f"publish: IPC copy (segment {seg}, offset {src_off}, slab offset {dst_off}, "
                                     f"{n} bytes) names no segment, lies outside the {size_bytes}-byte slab or "
                                     f"overlaps another", reason="ipc", segment=seg)
        end = dst_off + n


@dataclass(frozen=True)
class FillPlan:
    """How :func:`plan_fill` fills a slab: every byte written once.

    Attributes:
        zero (`list[tuple[int, int]]`): ``(slab offset, size)`` no piece covers: zeroed.
        plain (`list[tuple[int, int, int]]`): ``(slab offset, source pointer, size)``: copied without a digest.
        fused (`dict[str, tuple[int, int, int]]`): range name -> ``(slab offset, source pointer, size)``: copied
            and digested in one pass (:func:`weightcache.memory.kernels.copy_sum64`).
        after (`list[tuple[str, int, int]]`): the ranges left (``(name, slab offset, size)``): digested from the
            slab once the copies landed.
    """

    zero: list[tuple[int, int]]
    plain: list[tuple[int, int, int]]
    fused: dict[str, tuple[int, int, int]]
    after: list[tuple[str, int, int]]


def plan_fill(pieces: list[tuple[int, int, int]], ranges: list[tuple[str, int, int]], size_bytes: int,
              fused_ok: bool = True) -> FillPlan:
    """Splits the copy of ``pieces`` into a ``size_bytes`` slab so that each tensor range lying inside one piece
    (the first of overlapping ones, 8-byte aligned at both ends' starts) is copied and digested in one pass.

    Args:
        pieces (`list[tuple[int, int, int]]`): ``(slab offset, source pointer, size)``, sorted by slab offset, not
            overlapping, inside the slab.
        ranges (`list[tuple[str, int, int]]`): ``(name, slab offset, size)`` of the stored tensors (may overlap:
            views of one storage).
        size_bytes (`int`): the slab's size.
        fused_ok (`bool`): False: no fused copy (no kernels): every piece plain, every range ``after``.

    Returns:
        `FillPlan`.
    """
    starts = [p[0] for p in pieces]
    fused: dict[str, tuple[int, int, int]] = {}
    taken: list[tuple[int, int]] = []
    end = -1
    for name, off, n in sorted(ranges, key=lambda r: (r[1], -r[2])) if fused_ok else ():
        if n == 0 or off < end or name in fused:
            continue
        i = bisect.bisect_right(starts, off) - 1
        if i < 0 or off + n > pieces[i][0] + pieces[i][2]:
            continue
        src = pieces[i][1] + off - pieces[i][0]
        if src % 8 or off % 8:
            continue
        fused[name] = (off, src, n)
        taken.append((off, off + n))
        end = off + n
    zero: list[tuple[int, int]] = []
    plain: list[tuple[int, int, int]] = []
    pos = 0
    for d0, sp, n in pieces:
        if d0 > pos:
            zero.append((pos, d0 - pos))
        cur = d0
        j = bisect.bisect_left(taken, (d0, -1))
        while j < len(taken) and taken[j][0] < d0 + n:
            a, b = taken[j]
            if a > cur:
                plain.append((cur, sp + cur - d0, a - cur))
            cur = max(cur, b)
            j += 1
        if cur < d0 + n:
            plain.append((cur, sp + cur - d0, d0 + n - cur))
        pos = max(pos, d0 + n)
    if pos < size_bytes:
        zero.append((pos, size_bytes - pos))
    return FillPlan(zero, plain, fused, [r for r in ranges if r[0] not in fused])


def _fill(device: _Device, own: CudaWritableSlab, pieces: list[tuple[int, int, int]],
          ranges: list[tuple[str, int, int]]) -> dict[str, str] | None:
    """Carries out :func:`plan_fill` into ``own`` and returns each range's ``sum64`` digest (None without the
    NVRTC kernels: plain copies only, the caller digests)."""
    from . import kernels

    try:
        kernels.module(device)
        fused_ok = True
    except Exception as e:  # noqa: BLE001 - KernelError or a driver error: the caller digests its own way
        log.debug("publication copy without fused digests gpu=%d error=%s", device.index, e)
        fused_ok = False
    plan = plan_fill(pieces, ranges, own.size_bytes, fused_ok)
    with device.current():
        for off, n in plan.zero:
            _check("cuMemsetD8Async", cu.cuMemsetD8Async(own.ptr + off, 0, n, 0))
        for off, src, n in plan.plain:
            _check("cuMemcpyDtoDAsync", cu.cuMemcpyDtoDAsync(own.ptr + off, src, n, 0))
    if not fused_ok:
        return None
    names = list(plan.fused)
    digests = dict(zip(names, kernels.copy_sum64(device, [(own.ptr + off, src, n)
                                                          for off, src, n in (plan.fused[k] for k in names)])))
    if plan.after:
        digests.update(zip([r[0] for r in plan.after],
                           kernels.sum64(device, [(own.ptr + off, n) for _, off, n in plan.after])))
    return digests
