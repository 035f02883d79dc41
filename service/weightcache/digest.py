"""Content digests of resident tensors (recorded at load, checked by ``verify``).

Three algorithms, named by the digest string's prefix (``verify`` dispatches
on it, so a manifest may mix them):

- ``xxh3_128:<hex>`` (32 hex digits) for host memory: XXH3 128-bit (the
  ``xxhash`` package; about 7 GB/s per core where BLAKE2b gives 0.4), several
  tensors at once on a thread pool.
- ``xxh3c:<hex>`` (32 hex digits): what torch-free CUDA fills recorded
  before they took ``sum64`` on the GPU (slabs adopted from the fd store may
  still carry it; ``verify`` checks it), once taken from the pinned staging
  buffers on their way to the GPU: the tensor's bytes cut in
  chunks of :data:`CHUNK_BYTES` (1 MiB) counted from its first byte (the last
  chunk may be shorter; a zero-byte tensor has no chunk); ``d_k`` = the
  16-byte big-endian XXH3-128 digest (``xxhash.xxh3_128(chunk).digest()``) of
  chunk ``k``; the digest is XXH3-128 of ``d_0 || d_1 || ...``. Chunks are
  hashed by the reader threads in any order and assembled by index
  (:class:`ChunkedXXH3`); ``xxhash`` releases the GIL, about 10 GB/s per
  thread. ``verify`` copies the tensor to the host in blocks and hashes it the
  same way.
- ``sum64:<hex>`` (16 hex digits) for GPU memory, computed on the GPU so
  digests cost no device-to-host traffic (torch's element-wise ops in the
  torch pipeline; an NVRTC kernel, :mod:`weightcache.memory.kernels`, for
  torch-free fills and ``verify``): the bytes (zero-padded to a multiple of 8) as
  little-endian 64-bit words ``w_i``; ``sum_i (w_i XOR (i * K)) * (2i + 1)
  mod 2**64``, XOR the byte length. Every multiplier is odd, hence invertible
  mod 2**64, so changing any single word always changes the sum. It detects
  accidental changes (an engine writing through a read-write remap), not a
  forger; the socket's group is the trust boundary (DESIGN §4).

One family per backend: host slabs ``xxh3_128``, CUDA slabs ``sum64``. The
torch-free load takes its digests without torch (:func:`slab_digests`): XXH3
over the memfd mapping, ``sum64`` by a kernel over the VMM mapping.

Forbidden imports: torch at module level, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .sizes import ceil_div

#: Chunk size of the ``xxh3c`` digest, in bytes (part of the format: changing it needs a new prefix).
CHUNK_BYTES = 1 << 20
#: Host bytes per device-to-host copy when ``verify`` hashes an ``xxh3c`` tensor on the GPU.
_VERIFY_BLOCK = 64 << 20
_K = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio constant as a signed int64
_CHUNK = 256 * 1024 * 1024


def _xxh3(t) -> str:
    return xxh3_buffer(memoryview(t.numpy()))


def _sum64(t) -> str:
    import torch

    n = t.numel()
    acc = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, n, _CHUNK):
        c = t[start : start + _CHUNK]
        if c.numel() % 8:
            c = torch.cat([c, torch.zeros(8 - c.numel() % 8, dtype=torch.uint8, device=t.device)])
        w = c.view(torch.int64)
        idx = torch.arange(start // 8, start // 8 + w.numel(), dtype=torch.int64, device=t.device)
        acc += ((w ^ (idx * _K)) * (idx * 2 + 1)).sum()
    v = (int(acc.item()) ^ n) & ((1 << 64) - 1)
    return f"sum64:{v:016x}"


def xxh3_buffer(buf) -> str:
    """``xxh3_128:<hex>`` of a buffer's bytes (a ``memoryview`` of the slab): equals :func:`digest` of the same
    bytes as a CPU tensor."""
    import xxhash

    return "xxh3_128:" + xxhash.xxh3_128(buf).hexdigest()


#: Bytes of one step of :func:`sum64_buffer` (its temporaries are a few times this).
_SUM64_STEP = 16 << 20
_K_U64 = 0x9E3779B97F4A7C15


def sum64_buffer(buf) -> str:
    """``sum64:<hex>`` of a host buffer's bytes (bytes-like), computed with numpy on the CPU: the value the GPU
    kernel (:func:`weightcache.memory.kernels.sum64`) and :func:`digest` of a CUDA tensor give for the same
    bytes. For a host copy of a GPU slab whose manifest carries ``sum64`` (a peer's GPU slab read into a
    CUDA service's host tier, issue 37). About 1 GB/s per thread; numpy releases the GIL.

    Example:
        >>> sum64_buffer(b"")
        'sum64:0000000000000000'
    """
    import numpy as np

    mv = memoryview(buf).cast("B")
    n = len(mv)
    acc = 0
    k = np.uint64(_K_U64)
    try:
        for lo in range(0, n, _SUM64_STEP):
            part = mv[lo : lo + _SUM64_STEP]
            m = len(part)
            if m % 8:  # the tail, zero-padded to a whole word
                part = bytes(part) + bytes(8 - m % 8)
            w = np.frombuffer(part, dtype="<u8")
            idx = np.arange(lo // 8, lo // 8 + len(w), dtype=np.uint64)
            acc = (acc + int(((w ^ (idx * k)) * (idx * np.uint64(2) + np.uint64(1))).sum(dtype=np.uint64))) \
                & 0xFFFFFFFFFFFFFFFF
    finally:
        mv.release()
    return f"sum64:{(acc ^ n) & 0xFFFFFFFFFFFFFFFF:016x}"


class ChunkedXXH3:
    """The ``xxh3c`` digest of one tensor, from chunks hashed by any thread in any order.

    Each :meth:`add` hashes whole :data:`CHUNK_BYTES` chunks (XXH3-128, GIL
    released) and files their digests by index; :meth:`hexdigest` hashes the
    digests in index order. Thread-safe as long as no two calls cover the same
    chunk (each chunk's slot is written once).

    Args:
        size_bytes (`int`): the tensor's length in bytes.

    Example:
        >>> c = ChunkedXXH3(CHUNK_BYTES + 3)
        >>> c.add(b"abc", CHUNK_BYTES); c.add(bytes(CHUNK_BYTES), 0)
        >>> c.hexdigest() == xxh3c_buffer(bytes(CHUNK_BYTES) + b"abc")
        True
    """

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self._parts: list[bytes | None] = [None] * ceil_div(size_bytes, CHUNK_BYTES)

    def add(self, buf, offset_bytes: int) -> None:
        """Hashes the bytes ``buf`` (bytes-like) found at ``offset_bytes`` of the tensor.

        Raises:
            ValueError: ``offset_bytes`` is not a multiple of :data:`CHUNK_BYTES`,
                or ``buf`` ends inside a chunk before the tensor's end, or past it.
        """
        import xxhash

        mv = memoryview(buf).cast("B")
        n = len(mv)
        end = offset_bytes + n
        if offset_bytes % CHUNK_BYTES or end > self.size_bytes or (end % CHUNK_BYTES and end != self.size_bytes):
            mv.release()
            raise ValueError(f"xxh3c: bytes {offset_bytes}..{end} of a {self.size_bytes}-byte tensor do not cover "
                             f"whole {CHUNK_BYTES}-byte chunks; staging chunks must align to CHUNK_BYTES")
        k = offset_bytes // CHUNK_BYTES
        for lo in range(0, n, CHUNK_BYTES):
            # The hasher object's update releases the GIL (the one-shot xxh3_128_digest does not).
            self._parts[k] = xxhash.xxh3_128(mv[lo : lo + CHUNK_BYTES]).digest()
            k += 1
        mv.release()

    def hexdigest(self) -> str:
        """``xxh3c:<32 hex digits>``.

        Raises:
            ValueError: a chunk was never added (the fill lost a piece).
        """
        import xxhash

        missing = [k for k, d in enumerate(self._parts) if d is None]
        if missing:
            raise ValueError(f"xxh3c: {len(missing)} of {len(self._parts)} chunks of a {self.size_bytes}-byte tensor "
                             f"were never hashed (first: chunk {missing[0]})")
        return "xxh3c:" + xxhash.xxh3_128(b"".join(self._parts)).hexdigest()  # type: ignore[arg-type]


def xxh3c_buffer(buf) -> str:
    """``xxh3c:<hex>`` of a whole buffer's bytes in this thread (what :class:`ChunkedXXH3` assembles)."""
    c = ChunkedXXH3(len(memoryview(buf).cast("B")))
    c.add(buf, 0)
    return c.hexdigest()


def _xxh3c(t) -> str:
    """``xxh3c`` of a 1-D ``uint8`` tensor on any device: copied to one host buffer block by block."""
    import torch

    n = t.numel()
    c = ChunkedXXH3(n)
    host = torch.empty(min(n, _VERIFY_BLOCK), dtype=torch.uint8, pin_memory=t.is_cuda and n > 0)
    view = memoryview(host.numpy())
    for lo in range(0, n, _VERIFY_BLOCK):
        m = min(_VERIFY_BLOCK, n - lo)
        host[:m].copy_(t[lo : lo + m])
        c.add(view[:m], lo)
    view.release()
    return c.hexdigest()


def digest(t) -> str:
    """Digest of a 1-D ``uint8`` tensor's bytes (host: XXH3-128, CUDA: sum64)."""
    if t.device.type == "cuda":
        return _sum64(t)
    return _xxh3(t)


def digests(slab, ranges: list[tuple[str, int, int]], threads: int = 8) -> dict[str, str]:
    """Digests of ``(name, offset_bytes, size_bytes)`` ranges of a 1-D ``uint8`` slab, in ``ranges`` order.

    CUDA slabs get ``sum64`` on the GPU; host slabs ``xxh3_128`` through one
    memoryview of the whole slab (:func:`buffer_digests`).
    """
    if slab.device.type == "cuda":
        return {name: digest(slab[off : off + n]) for name, off, n in ranges}
    whole = memoryview(slab.numpy())
    try:
        return buffer_digests(whole, ranges, threads)
    finally:
        whole.release()


def buffer_digests(buf, ranges: list[tuple[str, int, int]], threads: int = 8) -> dict[str, str]:
    """``xxh3_128`` digests of ``(name, offset_bytes, size_bytes)`` ranges of ``buf`` (a ``memoryview`` of
    a host slab), in ``ranges`` order; no torch.

    The ranges are hashed in a few batches per thread (not one task per
    tensor: a rank of 150k tensors would spend seconds in task bookkeeping).
    """
    def one(off: int, n: int) -> str:
        view = buf[off : off + n]
        try:
            return xxh3_buffer(view)
        finally:
            view.release()  # the slab's mapping can close as soon as the digests are taken

    def run(batch: list[tuple[str, int, int]]) -> list[tuple[str, str]]:
        return [(name, one(off, n)) for name, off, n in batch]

    if threads <= 1 or len(ranges) < 2:
        return dict(run(ranges))
    k = min(len(ranges), threads * 4)
    with ThreadPoolExecutor(max_workers=threads) as ex:
        done = dict(pair for part in ex.map(run, [ranges[i::k] for i in range(k)]) for pair in part)
    return {name: done[name] for name, _, _ in ranges}


def slab_digests(slab, ranges: list[tuple[str, int, int]], threads: int = 8) -> dict[str, str]:
    """Digests of ``(name, offset_bytes, size_bytes)`` ranges of a backend's slab, where its bytes are; no torch.

    A host slab (it offers ``buffer``, a ``memoryview`` of the memfd mapping)
    gets ``xxh3_128`` (:func:`buffer_digests`); a CUDA slab (it offers
    ``digests``) gets ``sum64`` from an NVRTC kernel on its GPU
    (:func:`weightcache.memory.kernels.sum64`): the same values
    :func:`digest` gives for the same bytes, without a device-to-host copy.

    Raises:
        TypeError: ``slab`` offers neither.
    """
    buf = getattr(slab, "buffer", None)
    if buf is not None:
        return buffer_digests(buf, ranges, threads)
    if hasattr(slab, "digests"):
        return slab.digests(ranges)
    raise TypeError(f"{type(slab).__name__} offers neither a host buffer nor GPU digests")


def matches_buffer(buf, recorded: str) -> bool:
    """Whether the bytes of ``buf`` (bytes-like, e.g. a host slab's mapping) still have the digest ``recorded``;
    no torch.

    Raises:
        ValueError: ``recorded`` is not an ``xxh3_128`` or ``xxh3c`` digest.
    """
    algo = recorded.split(":", 1)[0]
    if algo == "xxh3_128":
        return xxh3_buffer(buf) == recorded
    if algo == "xxh3c":
        return xxh3c_buffer(buf) == recorded
    raise ValueError(f"digest {recorded!r}: host bytes are checked against xxh3_128 or xxh3c digests; "
                     f"sum64 is recorded and checked on the GPU (matches)")


def matches(t, recorded: str) -> bool:
    """Whether ``t``'s bytes (1-D ``uint8``, host or CUDA) still have the digest ``recorded`` (any algorithm above).

    Raises:
        ValueError: ``recorded`` names no algorithm above.
    """
    algo = recorded.split(":", 1)[0]
    if algo == "sum64":
        return _sum64(t) == recorded
    if algo == "xxh3_128":
        return _xxh3(t.cpu()) == recorded
    if algo == "xxh3c":
        return _xxh3c(t) == recorded
    raise ValueError(f"unknown digest algorithm in {recorded!r}")
