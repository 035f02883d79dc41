"""Host backend: slabs are sealed memfds, importers map them ``PROT_READ``.

Sealing (memfd_create(2), fcntl(2) "File Sealing"): after the fill the service
adds ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE`` while its writable
mapping still exists, drops that mapping, then adds ``F_SEAL_WRITE |
F_SEAL_SEAL``. From then on no process can write the bytes: a writable
``mmap`` of the fd fails with ``EPERM`` and ``write(2)`` with ``EPERM``.

A publication (:meth:`HostBackend.adopt_publication`) is a memfd an engine filled and unmapped: the service adds
the same seals (``F_SEAL_WRITE`` with the rest, which the kernel refuses while any writable mapping of the file
remains), and from then on owns bytes nobody can change.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import warnings

from ..errors import ManifestSlabMismatch, OutOfMemory, PublicationInvalid, SlabStillMapped
from ..sizes import round_up

PAGE = mmap.PAGESIZE
F_SEAL_SEAL = 0x0001
F_SEAL_SHRINK = 0x0002
F_SEAL_GROW = 0x0004
F_SEAL_WRITE = 0x0008
F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; not named in Python 3.11's fcntl
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)


def _frombuffer(buf, writable: bool):
    import torch

    if writable:
        return torch.frombuffer(buf, dtype=torch.uint8)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable; that is the point.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


class _MappedTensor:
    """A 1-D ``uint8`` torch view of ``self._map``, built on first use (loads that need no torch import none).

    ``_writable`` says whether the mapping is ``PROT_WRITE``; the view is None
    once the mapping is gone.
    """

    _writable = False
    _map: mmap.mmap | None
    _tensor = None

    @property
    def tensor(self):
        """1-D ``uint8`` tensor over the mapping (writable as the mapping is), built on first use (imports torch)."""
        if self._tensor is None and self._map is not None:
            self._tensor = _frombuffer(self._map, writable=self._writable)
        return self._tensor


def sealed_memfd(data: bytes, name: str) -> int:
    """A new memfd holding ``data``, sealed against every change (shrink, grow, write, further seals).

    Args:
        data (`bytes`): the content.
        name (`str`): the memfd's name (``/proc/<pid>/fd`` shows ``memfd:<name>``).

    Returns:
        `int`: the fd (close-on-exec); the caller owns it.
    """
    fd = os.memfd_create(name[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SealedFile:
    """A sealed memfd and its size, owned by whoever holds this object (e.g. a slab's manifest file).

    Attributes:
        fd (`int`): the memfd (close-on-exec); -1 once closed.
        size_bytes (`int`): its content's size.
    """

    def __init__(self, fd: int, size_bytes: int) -> None:
        self.fd = fd
        self.size_bytes = size_bytes

    @classmethod
    def create(cls, data: bytes, name: str) -> "SealedFile":
        """A new sealed memfd holding ``data`` (see :func:`sealed_memfd`)."""
        return cls(sealed_memfd(data, name), len(data))

    def read(self) -> bytes:
        """The whole content."""
        return os.pread(self.fd, self.size_bytes, 0)

    def close(self) -> None:
        """Closes the fd (other holders keep their own)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def host_memory_info() -> tuple[int, int]:
    """``(free_bytes, total_bytes)`` of host RAM: ``MemAvailable`` and ``MemTotal`` of /proc/meminfo."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0]) * 1024
    return info.get("MemAvailable", 0), info.get("MemTotal", 0)


def _round(size_bytes: int) -> int:
    return max(PAGE, round_up(size_bytes, PAGE))


class HostWritableSlab(_MappedTensor):
    """A memfd being filled.

    Attributes:
        size_bytes (`int`): mapping size, a multiple of the page size.
        buffer (`memoryview`): the writable mapping, format ``B``, ``size_bytes``
            long; what the torch-free reader writes into.
        tensor (`torch.Tensor`): the same bytes as a writable 1-D ``uint8`` CPU
            tensor, built on first use (importing torch then).
    """

    _writable = True

    def __init__(self, size_bytes: int, label: str) -> None:
        self.size_bytes = _round(size_bytes)
        self.fd = os.memfd_create(f"weightcache:{label}"[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size_bytes)
            # Touch the pages now so an exhausted tmpfs/RAM fails here, not with SIGBUS later.
            os.posix_fallocate(self.fd, 0, self.size_bytes)
            self._map = mmap.mmap(self.fd, self.size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(self.fd)
            raise OutOfMemory(
                f"host slab {label!r} of {self.size_bytes} bytes could not be allocated: {e}",
                size_bytes=self.size_bytes,
                model=label,
            ) from None
        self.buffer: memoryview | None = memoryview(self._map)
        self._tensor = None

    def _unmap(self) -> None:
        self._tensor = None
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None
        if self._map is not None:
            self._map.close()
            self._map = None

    def seal(self) -> "HostSealedSlab":
        """Seals the memfd read-only for every process (see the module docstring); returns the owner's handle."""
        fcntl.fcntl(self.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE)
        # The loader holds no views of the writable mapping any more: unmap it
        # so that F_SEAL_WRITE (which needs no writable mapping) can be added.
        self._unmap()
        fcntl.fcntl(self.fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SEAL)
        fd, self.fd = self.fd, -1
        return HostSealedSlab(fd, self.size_bytes)

    def abort(self) -> None:
        """Unmaps and closes a slab whose load failed: nothing stays allocated.

        A view still held keeps the mapping, and Python's duplicate of the fd,
        until it dies (the reader clears its failed threads' frames for that:
        :func:`weightcache.reader._loader._run_threads`); this fd is closed either way.
        """
        try:
            self._unmap()
        except BufferError:
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class HostSealedSlab(_MappedTensor):
    """A sealed memfd owned by the service, with a read-only view for digests."""

    def __init__(self, fd: int, size_bytes: int) -> None:
        self.fd = fd
        self.size_bytes = size_bytes
        self._map = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        self._tensor = None

    @property
    def buffer(self) -> memoryview | None:
        """A new read-only ``memoryview`` (format ``B``) of the mapping, for torch-free digests; the caller
        releases it. None after :meth:`close`."""
        return None if self._map is None else memoryview(self._map)

    def close(self) -> None:
        """Closes the fd and drops the owner's view.

        The mapping itself goes when the last tensor view of it dies (torch
        keeps a reference to the ``mmap`` object, not a buffer export), so a
        view still held elsewhere never points at unmapped memory.
        """
        self._tensor = None
        self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


#: Every seal a slab the service owns carries, and a client checks before it maps one: nothing can write,
#: grow or shrink it, or take a seal off.
SLAB_SEALS = F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL


def seal_publication(fd: int, size_bytes: int) -> HostSealedSlab:
    """Seals a publisher's memfd against every change and returns the service's own handle of it (a dup of ``fd``).

    Args:
        fd (`int`): the memfd received with ``publish``; the caller keeps (and closes) it.
        size_bytes (`int`): the size the publication declares; the memfd must hold exactly this many bytes.

    Returns:
        `HostSealedSlab`: owned by the caller, mapped ``PROT_READ``.

    Raises:
        PublicationInvalid (`publication_invalid`): not a memfd (``details["reason"] = "not_memfd"``), made
            without ``MFD_ALLOW_SEALING`` or sealed otherwise by its publisher (``not_sealable``), or of another
            size (``size``).
        SlabStillMapped (`slab_still_mapped`): a writable mapping of it remains (``F_SEAL_WRITE`` got ``EBUSY``).
    """
    try:
        seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError as e:
        raise PublicationInvalid(f"publish: the slab fd is not a memfd ({e.strerror}); send a memfd made with "
                                 f"MFD_ALLOW_SEALING", reason="not_memfd") from None
    actual = os.fstat(fd).st_size
    if actual != size_bytes or size_bytes <= 0:
        raise PublicationInvalid(f"publish: the slab memfd holds {actual} bytes, the request says {size_bytes}",
                                 reason="size", size_bytes=size_bytes, actual_bytes=actual)
    if seals & SLAB_SEALS != SLAB_SEALS:
        if seals & F_SEAL_SEAL:
            raise PublicationInvalid(f"publish: the slab memfd cannot be sealed (seals {seals:#x}: made without "
                                     f"MFD_ALLOW_SEALING, or F_SEAL_SEAL added before F_SEAL_WRITE)",
                                     reason="not_sealable", seals=seals)
        try:
            fcntl.fcntl(fd, F_ADD_SEALS, SLAB_SEALS)
        except OSError as e:
            if e.errno == errno.EBUSY:
                raise SlabStillMapped("publish: the slab memfd is still mapped writable (F_SEAL_WRITE refused, "
                                      "EBUSY); unmap every writable mapping of it before publishing",
                                      reason="writable_mapping") from None
            raise PublicationInvalid(f"publish: the slab memfd could not be sealed: {e.strerror}",
                                     reason="not_sealable") from None
    own = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0)
    try:
        return HostSealedSlab(own, size_bytes)
    except BaseException:
        os.close(own)
        raise




def check_sealed_memfd(fd: int, size_bytes: int) -> None:
    """Checks that a received slab fd is a memfd sealed with :data:`SLAB_SEALS` holding at least ``size_bytes``
    (and at least one) byte, before it is mapped.

    Whatever answers at the socket path sends these fds: an unsealed memfd's bytes could change under the
    engine (and its ``ftruncate`` kill it with ``SIGBUS``); a FIFO, socket, directory or device cannot be
    mapped as a slab at all (issue 38, P10).

    Raises:
        ManifestSlabMismatch (`manifest_slab_mismatch`): not a regular file, no seals (not a memfd), seals
            missing (``details.seals``), or fewer bytes than ``size_bytes``; ``details.slab_size_bytes``.
    """
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = f"is not a memfd but {_kind(st.st_mode)}"
    else:
        try:
            seals = fcntl.fcntl(fd, F_GET_SEALS)
        except OSError:
            seals = None
        if seals is None:
            problem = "is a regular file that cannot be sealed, not a memfd"
        elif seals & SLAB_SEALS != SLAB_SEALS:
            problem = (f"is a memfd without the seals F_SEAL_WRITE|F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL "
                       f"(seals 0x{seals:x}): its bytes could change under the engine")
        elif st.st_size < max(size_bytes, 1):
            problem = f"holds {st.st_size} bytes, the manifest says {size_bytes}"
    if problem is not None:
        raise ManifestSlabMismatch(f"the slab fd received {problem}; not mapped (is the process at the socket "
                                   f"path the weightcache service?)", slab_size_bytes=size_bytes,
                                   fd_size_bytes=st.st_size)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


class HostImportedSlab:
    """A received memfd mapped ``PROT_READ``; ``tensor`` is read-only ``uint8``.

    The mapping stays valid after the fd is closed and after the service dies.
    """

    def __init__(self, fd: int, size_bytes: int) -> None:
        check_sealed_memfd(fd, size_bytes)
        self.size_bytes = size_bytes
        self._map = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        self.tensor = _frombuffer(self._map, writable=False)

    def close(self) -> None:
        """Drops this object's references; the mapping goes when the last view dies."""
        self.tensor = None
        self._map = None


class HostBackend:
    """The ``host`` backend (sealed memfd). See the module docstring."""

    name = "host"

    def allocate(self, size_bytes: int, label: str) -> HostWritableSlab:
        """A writable memfd of ``size_bytes`` rounded up to the page size.

        Raises:
            OutOfMemory (`out_of_memory`): ``posix_fallocate`` found no room.
        """
        return HostWritableSlab(size_bytes, label)

    def adopt(self, fd: int, size_bytes: int) -> HostSealedSlab:
        """Takes ownership of a sealed memfd handed back by systemd's fd store."""
        return HostSealedSlab(fd, size_bytes)

    # --- the host tier: on this backend the same memory as the slabs, so no move copies a byte ---

    def allocate_host(self, size_bytes: int, label: str) -> HostWritableSlab:
        """A writable slab for the host tier (``preload = "host"``): here the same as :meth:`allocate`."""
        return HostWritableSlab(size_bytes, label)

    def adopt_host(self, fd: int, size_bytes: int) -> HostSealedSlab:
        """Takes ownership of a host-tier memfd handed back by systemd's fd store."""
        return HostSealedSlab(fd, size_bytes)

    def demote(self, sealed: HostSealedSlab, label: str) -> HostSealedSlab:
        """GPU -> host tier: on this backend both are host RAM, so ``sealed`` itself (no copy)."""
        return sealed

    def promote(self, hosted: HostSealedSlab, label: str, while_copying=None) -> HostSealedSlab:
        """Host tier -> GPU: on this backend both are host RAM, so ``hosted`` itself (no copy; ``while_copying``
        is not called: there is nothing to check)."""
        return hosted

    def adopt_publication(self, fd: int, size_bytes: int) -> HostSealedSlab:
        """Seals an engine's published memfd and owns it (:func:`seal_publication`); ``fd`` stays the caller's."""
        return seal_publication(fd, size_bytes)

    def import_fd(self, fd: int, size_bytes: int, device: str = "cpu") -> HostImportedSlab:
        """Maps a received memfd ``PROT_READ``; the caller keeps (and closes) ``fd``."""
        return HostImportedSlab(fd, size_bytes)

    def mem_info(self) -> tuple[int, int]:
        """Returns ``(free_bytes, total_bytes)`` of host RAM (/proc/meminfo ``MemAvailable``, ``MemTotal``)."""
        return host_memory_info()

    def device_info(self) -> dict:
        """Key fields of the slab's device (DESIGN §5): host memory has no GPU."""
        return {"backend": "host", "gpu_uuid": "", "compute_capability": ""}
