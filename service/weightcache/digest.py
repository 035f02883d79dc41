"""Content digests of resident tensors (recorded at load, checked by ``verify``).

Three algorithms, named by the digest string's prefix (``verify`` dispatches
on it, so a manifest may mix them):

- ``xxh3_128:<hex>`` (32 hex digits) for host memory: XXH3 128-bit (the
  ``xxhash`` package; about 7 GB/s per core where BLAKE2b gives 0.4), several
  tensors at once on a thread pool.
- ``xxh3c:<hex>`` (32 hex digits) for GPU memory filled without torch
  (:func:`weightcache.loader.read_direct` on the cuda backend), taken from the
  pinned staging buffers on their way to the GPU: the tensor's bytes cut in
  chunks of :data:`CHUNK_BYTES` (1 MiB) counted from its first byte (the last
  chunk may be shorter; a zero-byte tensor has no chunk); ``d_k`` = the
  16-byte big-endian XXH3-128 digest (``xxhash.xxh3_128(chunk).digest()``) of
  chunk ``k``; the digest is XXH3-128 of ``d_0 || d_1 || ...``. Chunks are
  hashed by the reader threads in any order and assembled by index
  (:class:`ChunkedXXH3`); ``xxhash`` releases the GIL, about 10 GB/s per
  thread. ``verify`` copies the tensor to the host in blocks and hashes it the
  same way.
- ``sum64:<hex>`` (16 hex digits) for GPU memory written by the torch
  pipeline (casts, quantization, column shards), computed on the GPU so
  digests cost no device-to-host traffic: the bytes (zero-padded to a multiple of 8) as
  little-endian 64-bit words ``w_i``; ``sum_i (w_i XOR (i * K)) * (2i + 1)
  mod 2**64``, XOR the byte length. Every multiplier is odd, hence invertible
  mod 2**64, so changing any single word always changes the sum. It detects
  accidental changes (an engine writing through a read-write remap), not a
  forger; the socket's group is the trust boundary (DESIGN §4).

The torch-free load (:func:`weightcache.loader.read_direct`) takes its
digests without torch: XXH3 over the memfd mapping (:func:`xxh3_buffer`),
``xxh3c`` from the pinned staging buffers. :class:`Sum64` sums ``sum64`` from
host chunks in any order (the same value as on the GPU); ``matches_buffer``
uses it for a ``sum64`` digest of host bytes.

Forbidden imports: torch at module level, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

#: Chunk size of the ``xxh3c`` digest, in bytes (part of the format: changing it needs a new prefix).
CHUNK_BYTES = 1 << 20
#: Host bytes per device-to-host copy when ``verify`` hashes an ``xxh3c`` tensor on the GPU.
_VERIFY_BLOCK = 64 << 20
_K = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio constant as a signed int64
_CHUNK = 256 * 1024 * 1024
_MASK = (1 << 64) - 1


def _xxh3(t) -> str:
    import xxhash

    if t.numel() == 0:
        return "xxh3_128:" + xxhash.xxh3_128(b"").hexdigest()
    return "xxh3_128:" + xxhash.xxh3_128(memoryview(t.numpy())).hexdigest()


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
        self._parts: list[bytes | None] = [None] * (-(-size_bytes // CHUNK_BYTES))

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


class Sum64:
    """The ``sum64`` digest of one tensor, summed from its chunks in any order, without torch.

    Each chunk adds ``sum_i (w_i XOR (i * K)) * (2i + 1) mod 2**64`` over its
    words, ``i`` counted from the tensor's first byte; :meth:`hexdigest` XORs
    the byte length, as :func:`digest` does on the GPU. Chunks must start at a
    multiple of 8 bytes of the tensor; only the last may have a length that is
    not (it is zero-padded, as on the GPU). Thread-safe.

    Args:
        size_bytes (`int`): the tensor's length in bytes.

    Example:
        >>> s = Sum64(16)
        >>> s.add(b"\x01" * 8, 8); s.add(b"\x02" * 8, 0)
        >>> s.hexdigest().startswith("sum64:")
        True
    """

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self._acc = 0
        self._lock = threading.Lock()

    def add(self, buf, offset_bytes: int) -> None:
        """Adds the chunk ``buf`` (bytes-like) found at ``offset_bytes`` of the tensor.

        Raises:
            ValueError: ``offset_bytes`` is not a multiple of 8.
        """
        if offset_bytes % 8:
            raise ValueError(f"sum64 chunk at byte {offset_bytes}: chunks must start at a multiple of 8")
        part = _sum64_words(buf, offset_bytes // 8)
        with self._lock:
            self._acc = (self._acc + part) & _MASK

    def hexdigest(self) -> str:
        """``sum64:<16 hex digits>``, equal to :func:`digest` of the whole tensor on the GPU."""
        return f"sum64:{(self._acc ^ self.size_bytes) & _MASK:016x}"


_STEP_WORDS = 1 << 17  # words per numpy pass: 1 MiB blocks, scratch reused per thread
_scratch = threading.local()
_bases: list = []


def _sum64_bases():
    """``(j * K, 2j + 1)`` for ``j < _STEP_WORDS`` as ``uint64`` arrays, built once."""
    import numpy as np

    if not _bases:
        j = np.arange(_STEP_WORDS, dtype=np.uint64)
        _bases.append((j * np.uint64(_K & _MASK), j * np.uint64(2) + np.uint64(1)))
    return _bases[0]


def _sum64_words(buf, first_word: int) -> int:
    """``sum_i (w_i XOR (i * K)) * (2i + 1) mod 2**64`` over ``buf``'s little-endian words, ``i`` from ``first_word``.

    numpy with wrap-around ``uint64`` arithmetic, in 1 MiB blocks through
    per-thread scratch arrays (fresh temporaries would page-fault on every
    chunk); a tail shorter than a word is zero-padded.
    """
    import numpy as np

    mv = memoryview(buf).cast("B")
    n = len(mv)
    words = n // 8
    base_k, base_odd = _sum64_bases()
    a = getattr(_scratch, "a", None)
    if a is None:
        a = _scratch.a = np.empty(_STEP_WORDS, dtype=np.uint64)
        _scratch.b = np.empty(_STEP_WORDS, dtype=np.uint64)
    b = _scratch.b
    acc = 0
    for lo in range(0, words, _STEP_WORDS):
        m = min(_STEP_WORDS, words - lo)
        s = first_word + lo
        w = np.frombuffer(mv, dtype="<u8", count=m, offset=lo * 8)
        np.add(base_k[:m], np.uint64((s * _K) & _MASK), out=a[:m])  # (s + j) * K
        np.bitwise_xor(a[:m], w, out=a[:m])
        np.add(base_odd[:m], np.uint64((2 * s) & _MASK), out=b[:m])  # 2 (s + j) + 1
        np.multiply(a[:m], b[:m], out=a[:m])
        acc += int(a[:m].sum(dtype=np.uint64))  # the array sum wraps mod 2**64
        del w
    if n % 8:
        tail = int.from_bytes(bytes(mv[words * 8 :]), "little")
        i = first_word + words
        acc += ((tail ^ (i * _K)) & _MASK) * (2 * i + 1)
    mv.release()
    return acc & _MASK


def digest(t) -> str:
    """Digest of a 1-D ``uint8`` tensor's bytes (host: XXH3-128, CUDA: sum64)."""
    if t.device.type == "cuda":
        return _sum64(t)
    return _xxh3(t)


def digests(slab, ranges: list[tuple[str, int, int]], threads: int = 8) -> dict[str, str]:
    """Digests of ``(name, offset_bytes, size_bytes)`` ranges of a 1-D ``uint8`` slab, in ``ranges`` order.

    Host slabs are hashed through one memoryview of the whole slab, in a few
    batches per thread (not one task per tensor: a rank of 150k tensors would
    spend seconds in task bookkeeping).
    """
    if slab.device.type == "cuda":
        return {name: digest(slab[off : off + n]) for name, off, n in ranges}
    import xxhash

    whole = memoryview(slab.numpy())

    def run(batch: list[tuple[str, int, int]]) -> list[tuple[str, str]]:
        return [(name, "xxh3_128:" + xxhash.xxh3_128(whole[off : off + n]).hexdigest()) for name, off, n in batch]

    if threads <= 1 or len(ranges) < 2:
        return dict(run(ranges))
    k = min(len(ranges), threads * 4)
    with ThreadPoolExecutor(max_workers=threads) as ex:
        done = dict(pair for part in ex.map(run, [ranges[i::k] for i in range(k)]) for pair in part)
    return {name: done[name] for name, _, _ in ranges}


def matches_buffer(buf, recorded: str) -> bool:
    """Whether the bytes of ``buf`` (bytes-like, e.g. a host slab's mapping) still have the digest ``recorded``;
    no torch."""
    algo = recorded.split(":", 1)[0]
    if algo == "sum64":
        s = Sum64(len(memoryview(buf)))
        s.add(buf, 0)
        return s.hexdigest() == recorded
    if algo == "xxh3_128":
        return xxh3_buffer(buf) == recorded
    if algo == "xxh3c":
        return xxh3c_buffer(buf) == recorded
    raise ValueError(f"unknown digest algorithm in {recorded!r}")


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
