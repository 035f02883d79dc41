"""The few GPU kernels a torch-free load needs, compiled at run time with NVRTC, cached per device.

Two kernels, in CUDA C below (:data:`SOURCE`):

- ``wc_chunks_sum64``: the ``sum64`` digests of many byte ranges (``weightcache.digest``), each optionally
  copied in the same pass: little-endian 64-bit words ``w_i`` (the tail zero-padded), ``sum_i (w_i XOR
  (i * K)) * (2i + 1) mod 2**64``. The ranges are cut into :data:`CHUNK_BYTES` chunks, one block each, from a
  table in device memory (one launch for a whole slab: 1,200 launches of one range each left the copy at
  about 40 % of a device-to-device copy's rate on the H100); each thread reads 16-byte words, four in
  flight, warps reduce with ``__shfl_down_sync`` and ``atomicAdd`` into the range's 64-bit slot; the host
  XORs the byte length. The same value torch's element-wise version gives
  (:func:`weightcache.digest.digest`).
- ``wc_lut8``: ``p[i] = lut[p[i]]`` in place over a byte range, with a
  256-byte table passed by value (the FP8 requantisation of a fused part to
  the fused scale: :mod:`weightcache.quant.fp8_codes` computes the table on
  the host, so the GPU does a lookup, not arithmetic, and the bytes are those
  of the table).

Why NVRTC rather than torch: the torch-free load reads the first bytes before
torch would have finished importing (1.5–3 s on a cold node), and the two
operations are a lookup and a sum, not worth a framework. The program is
compiled once per process and device (``nvrtcCompileProgram`` to a cubin for
the device's ``sm_XY``, about 0.1–0.3 s, started on a background thread
while the reads run, :func:`prepare`) and loaded with
``cuModuleLoadData``. ``libnvrtc`` comes with NVIDIA's ``cuda-bindings``
wheels' ``nvidia-cuda-nvrtc`` (and with torch's CUDA wheels); when it cannot
be loaded, :func:`available` is False and the pipeline takes its torch path.

All functions run in the device's primary context (the caller pushes it).

Forbidden imports: torch, daemon, client, protocol, cli.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

SOURCE = r"""
typedef unsigned long long u64;
struct Lut { unsigned char v[256]; };

struct Chunk { u64 dst; u64 src; u64 word0; u64 nbytes; u64 slot; };

// One block per chunk of a range: copies it (dst != 0) and adds its words' share of the range's sum64 into
// slots[slot]. word0 is the chunk's first word index within its range; a range's tail bytes (nbytes & 7) sit in
// its last chunk. 16-byte loads and stores when both pointers allow, four in flight per thread.
extern "C" __global__ void wc_chunks_sum64(const Chunk* chunks, u64* slots) {
  const u64 K = 0x9E3779B97F4A7C15ull;
  const Chunk c = chunks[blockIdx.x];
  const u64 nw = c.nbytes >> 3;
  u64* d = (u64*)c.dst;
  const u64* w = (const u64*)c.src;
  u64 acc = 0;
  u64 done = 0;
  if (((c.dst | c.src) & 15) == 0) {
    const u64 np = nw >> 1;
    const ulonglong2* w2 = (const ulonglong2*)w;
    ulonglong2* d2 = (ulonglong2*)d;
    const u64 step = (u64)blockDim.x;
    u64 p = threadIdx.x;
    for (; p + 3 * step < np; p += 4 * step) {
      ulonglong2 x[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) x[k] = w2[p + k * step];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (d) d2[p + k * step] = x[k];
        const u64 i = c.word0 + 2 * (p + k * step);
        acc += (x[k].x ^ (i * K)) * (2 * i + 1);
        acc += (x[k].y ^ ((i + 1) * K)) * (2 * i + 3);
      }
    }
    for (; p < np; p += step) {
      const ulonglong2 x = w2[p];
      if (d) d2[p] = x;
      const u64 i = c.word0 + 2 * p;
      acc += (x.x ^ (i * K)) * (2 * i + 1);
      acc += (x.y ^ ((i + 1) * K)) * (2 * i + 3);
    }
    done = np * 2;
  }
  for (u64 j = done + threadIdx.x; j < nw; j += blockDim.x) {
    const u64 x = w[j];
    if (d) d[j] = x;
    const u64 i = c.word0 + j;
    acc += (x ^ (i * K)) * (2 * i + 1);
  }
  if (threadIdx.x == 0 && (c.nbytes & 7)) {
    const unsigned char* b = (const unsigned char*)w + nw * 8;
    unsigned char* db = (unsigned char*)d + nw * 8;
    u64 v = 0;
    for (int j = 0; j < (int)(c.nbytes & 7); ++j) { if (d) db[j] = b[j]; v |= ((u64)b[j]) << (8 * j); }
    const u64 i = c.word0 + nw;
    acc += (v ^ (i * K)) * (2 * i + 1);
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(slots + c.slot, acc);
}

extern "C" __global__ void wc_lut8(unsigned char* p, u64 n, Lut lut) {
  __shared__ unsigned char s[256];
  for (int j = threadIdx.x; j < 256; j += blockDim.x) s[j] = lut.v[j];
  __syncthreads();
  const u64 stride = (u64)gridDim.x * blockDim.x;
  const u64 n4 = ((u64)p & 3) ? 0 : n >> 2;
  unsigned int* p4 = (unsigned int*)p;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
    unsigned int x = p4[i];
    p4[i] = (unsigned int)s[x & 255] | ((unsigned int)s[(x >> 8) & 255] << 8)
          | ((unsigned int)s[(x >> 16) & 255] << 16) | ((unsigned int)s[x >> 24] << 24);
  }
  for (u64 i = n4 * 4 + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) p[i] = s[p[i]];
}
"""

_THREADS = 256
_MAX_BLOCKS = 4096

_lock = threading.Lock()
_modules: dict[int, Any] = {}  # device ordinal -> _Module
_compiling: dict[int, threading.Thread] = {}


class KernelError(RuntimeError):
    """NVRTC is missing or refused the program (the caller falls back to torch)."""


class _Module:
    def __init__(self, module: Any, lut8: Any, chunks_sum64: Any, compile_s: float) -> None:
        self.module, self.lut8, self.chunks_sum64, self.compile_s = module, lut8, chunks_sum64, compile_s


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
        nvrtc.nvrtcVersion()  # loads libnvrtc
    except Exception as e:  # noqa: BLE001 - absence of the library is an expected state
        raise KernelError(f"NVRTC is not loadable ({e}); install cuda-bindings' nvidia-cuda-nvrtc") from e
    return nvrtc


def available() -> bool:
    """Whether ``libnvrtc`` can be loaded here (no GPU needed)."""
    try:
        _nvrtc()
        return True
    except KernelError:
        return False


def _compile(major: int, minor: int) -> tuple[bytes, bool]:
    """(image, is_cubin): a cubin for ``sm_<major><minor>``, else PTX for ``compute_<major><minor>``."""
    nvrtc = _nvrtc()

    def check(ret, what, prog=None):
        err = ret[0]
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            text = ""
            if prog is not None:
                _, n = nvrtc.nvrtcGetProgramLogSize(prog)
                buf = b" " * n
                nvrtc.nvrtcGetProgramLog(prog, buf)
                text = buf.decode(errors="replace")
            raise KernelError(f"{what} failed: {err} {text}")
        return ret[1] if len(ret) == 2 else None

    last: Exception | None = None
    for arch, cubin in ((f"sm_{major}{minor}", True), (f"compute_{major}{minor}", False)):
        prog = check(nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"weightcache_kernels.cu", 0, [], []),
                     "nvrtcCreateProgram")
        try:
            opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++14"]
            try:
                check(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), f"nvrtcCompileProgram({arch})", prog)
            except KernelError as e:
                last = e
                continue
            if cubin:
                n = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
                img = b" " * n
                check(nvrtc.nvrtcGetCUBIN(prog, img), "nvrtcGetCUBIN")
            else:
                n = check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
                img = b" " * n
                check(nvrtc.nvrtcGetPTX(prog, img), "nvrtcGetPTX")
            return img, cubin
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
    raise KernelError(f"NVRTC could not compile the weightcache kernels for sm_{major}{minor}: {last}")


def _load(device: Any) -> _Module:
    from .cuda_driver import _check, cu

    t0 = time.monotonic()
    attr = cu.CUdevice_attribute
    major = int(_check("cuDeviceGetAttribute",
                       cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device.dev)))
    minor = int(_check("cuDeviceGetAttribute",
                       cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device.dev)))
    image, cubin = _compile(major, minor)
    with device.current():
        module = _check("cuModuleLoadData", cu.cuModuleLoadData(image), f"weightcache kernels for sm_{major}{minor}")
        lut8 = _check("cuModuleGetFunction", cu.cuModuleGetFunction(module, b"wc_lut8"))
        chunks_sum64 = _check("cuModuleGetFunction", cu.cuModuleGetFunction(module, b"wc_chunks_sum64"))
    dt = time.monotonic() - t0
    log.info("kernels compiled gpu=%d arch=sm_%d%d image=%s compile_ms=%.0f", device.index, major, minor,
             "cubin" if cubin else "ptx", dt * 1e3)
    return _Module(module, lut8, chunks_sum64, dt)


def module(device: Any) -> _Module:
    """The kernels on ``device`` (a ``memory.cuda._Device``), compiled on first use (or waited for).

    Raises:
        KernelError: NVRTC is missing or failed.
        CudaDriverError: loading the module failed.
    """
    with _lock:
        m = _modules.get(device.index)
        th = _compiling.get(device.index)
    if m is not None:
        return m
    if th is not None:
        th.join()
        with _lock:
            m = _modules.get(device.index)
        if m is not None:
            return m
    m = _load(device)
    with _lock:
        _modules.setdefault(device.index, m)
        return _modules[device.index]


def expected(device: Any) -> bool:
    """Whether the fill may plan on the kernels of ``device``: compiled, being compiled (its outcome is met by
    :func:`module`, whose ``KernelError`` sends the fill to the torch path), else :func:`available`.

    Unlike :func:`available` it does not wait for ``libnvrtc`` to load (about 56 ms on the H200 host) while a
    compile started by :func:`prepare` is loading it.
    """
    with _lock:
        if device.index in _modules or device.index in _compiling:
            return True
    return available()


def prepare(device: Any) -> None:
    """Starts compiling the kernels for ``device`` on a background thread (returns at once; no-op when done)."""
    with _lock:
        if device.index in _modules or device.index in _compiling:
            return

        def run() -> None:
            try:
                m = _load(device)
                with _lock:
                    _modules.setdefault(device.index, m)
            except Exception as e:  # noqa: BLE001 - module() retries and raises in the caller's thread
                log.debug("kernel compile failed gpu=%d error=%s", device.index, e)
            finally:
                with _lock:
                    _compiling.pop(device.index, None)

        th = threading.Thread(target=run, name=f"weightcache-nvrtc-{device.index}", daemon=True)
        _compiling[device.index] = th
    try:
        th.start()
    except RuntimeError as e:  # no thread to be had: module() compiles in its caller, expected() asks NVRTC
        with _lock:
            _compiling.pop(device.index, None)
        log.debug("kernel compile not started gpu=%d error=%s", device.index, e)


def _launch(func: Any, blocks: int, args: list, stream: Any = 0, threads: int = _THREADS) -> None:
    from .cuda_driver import _check, cu

    holders = [a if isinstance(a, ctypes._SimpleCData) or isinstance(a, ctypes.Structure) else ctypes.c_uint64(a)
               for a in args]
    params = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
    _check("cuLaunchKernel", cu.cuLaunchKernel(func, blocks, 1, 1, threads, 1, 1, 0, stream,
                                               ctypes.addressof(params), 0))


def _blocks(n: int, per_thread: int) -> int:
    return max(1, min(_MAX_BLOCKS, -(-n // (_THREADS * per_thread))))


class _Lut(ctypes.Structure):
    _fields_ = [("v", ctypes.c_ubyte * 256)]


def sum64(device: Any, ranges: list[tuple[int, int]]) -> list[str]:
    """``sum64:<16 hex>`` digests of ``(device_ptr, size_bytes)`` ranges, in order (waits for the result).

    Each pointer must be 8-byte aligned (slab records are 256-byte aligned). One launch of ``wc_chunks_sum64``
    for all ranges on the legacy stream (:data:`CHUNK_BYTES` per block), one 8-byte slot per range, one
    device-to-host copy of the slots at the end: the bytes never leave the GPU.

    Raises:
        ValueError: a misaligned pointer.
        KernelError, CudaDriverError: as :func:`module`, or a launch failed.
    """
    return _chunked(device, [(0, ptr, size) for ptr, size in ranges])


def copy_sum64(device: Any, copies: list[tuple[int, int, int]]) -> list[str]:
    """Copies each ``(dst_ptr, src_ptr, size_bytes)`` on the GPU and returns the ``sum64`` digest of the bytes it
    copied, in order (waits for the copies and the result).

    One pass over the source: each word is read once, written to ``dst`` and summed, so the digest is of exactly
    the bytes that landed in ``dst`` even while the source changes (a publisher's memory, DESIGN §6.3). The digest
    equals :func:`sum64` of ``dst`` afterwards. Both pointers must be 8-byte aligned (16-byte aligned pairs take
    16-byte loads and stores). One launch for all copies, :data:`CHUNK_BYTES` per block: about a device-to-device
    copy's rate (benchmarks/RESULTS.md).

    Raises:
        ValueError: a misaligned pointer, or a zero ``dst_ptr``.
        KernelError, CudaDriverError: as :func:`module`, or a launch failed.
    """
    if any(dst == 0 for dst, _, _ in copies):
        raise ValueError("copy_sum64: a copy's destination pointer is 0")
    return _chunked(device, copies)


#: Bytes of one block's share of a range in ``wc_chunks_sum64`` (a multiple of 16).
CHUNK_BYTES = 16 << 20
_CHUNK = ctypes.c_uint64 * 5  # dst, src, word0, nbytes, slot: the kernel's struct Chunk


def _chunk_table(items: list[tuple[int, int, int]], chunk: int = CHUNK_BYTES) -> tuple[Any, int]:
    """The ``struct Chunk`` table of ``(dst_ptr or 0, src_ptr, size_bytes)`` items (uint64, 5 per row) and its
    row count: each item cut into ``chunk``-byte pieces (a multiple of 16), its ``slot`` the item's index."""
    import numpy as np

    sizes = np.array([n for _, _, n in items], dtype=np.uint64)
    per = ((sizes + np.uint64(chunk - 1)) // np.uint64(chunk)).astype(np.int64)
    rows = int(per.sum())
    item = np.repeat(np.arange(len(items), dtype=np.int64), per)
    first = np.concatenate(([0], np.cumsum(per)[:-1])).astype(np.int64)
    k = (np.arange(rows, dtype=np.int64) - first[item]).astype(np.uint64)  # the chunk's index in its item
    off = k * np.uint64(chunk)
    table = np.empty((rows, 5), dtype=np.uint64)
    dst = np.array([d for d, _, _ in items], dtype=np.uint64)[item]
    table[:, 0] = np.where(dst == 0, np.uint64(0), dst + off)
    table[:, 1] = np.array([s for _, s, _ in items], dtype=np.uint64)[item] + off
    table[:, 2] = off // np.uint64(8)
    table[:, 3] = np.minimum(sizes[item] - off, np.uint64(chunk))
    table[:, 4] = item.astype(np.uint64)
    return table, rows


def _chunked(device: Any, items: list[tuple[int, int, int]]) -> list[str]:
    """Runs ``wc_chunks_sum64`` over ``(dst_ptr or 0, src_ptr, size_bytes)`` items in one launch and returns each
    item's ``sum64`` digest (a copy too where ``dst_ptr`` is not 0)."""
    from .cuda_driver import _check, cu

    if not items:
        return []
    for dst, src, _ in items:
        if dst % 8 or src % 8:
            raise ValueError(f"sum64 kernel: device pointer 0x{dst if dst % 8 else src:x} is not 8-byte aligned")
    m = module(device)
    table, rows = _chunk_table(items, CHUNK_BYTES)
    n = len(items)
    host = (ctypes.c_uint64 * n)()
    with device.current():
        slots = int(_check("cuMemAlloc", cu.cuMemAlloc(8 * n + 40 * max(rows, 1))))
        try:
            _check("cuMemsetD8", cu.cuMemsetD8(slots, 0, 8 * n))
            if rows:
                chunks = slots + 8 * n
                _check("cuMemcpyHtoD", cu.cuMemcpyHtoD(chunks, table.ctypes.data, 40 * rows))
                _launch(m.chunks_sum64, rows, [chunks, slots], threads=_CHUNK_THREADS)  # a block per chunk
            _check("cuMemcpyDtoH", cu.cuMemcpyDtoH(ctypes.addressof(host), slots, 8 * n))
        finally:
            cu.cuMemFree(slots)
    return [f"sum64:{(int(host[i]) ^ size) & 0xFFFFFFFFFFFFFFFF:016x}" for i, (_, _, size) in enumerate(items)]


_CHUNK_THREADS = 1024


def lut8(device: Any, ranges: list[tuple[int, int]], table: bytes, stream: Any = 0) -> None:
    """Queues ``p[i] = table[p[i]]`` over each ``(device_ptr, size_bytes)`` range (in place) on ``stream``.

    Args:
        table (`bytes`): 256 bytes.

    Raises:
        ValueError: ``table`` is not 256 bytes.
        KernelError, CudaDriverError: as :func:`module`, or a launch failed.
    """
    if len(table) != 256:
        raise ValueError(f"lut8: a table of 256 bytes is needed, got {len(table)}")
    m = module(device)
    lut = _Lut()
    ctypes.memmove(ctypes.addressof(lut), table, 256)
    with device.current():
        for ptr, size in ranges:
            if size:
                _launch(m.lut8, _blocks(size, 16), [ptr, size, lut], stream)
