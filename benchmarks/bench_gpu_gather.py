#!/usr/bin/env python3
"""A TP rank's row-parallel rows from the page cache: the service's CPU copy against a GPU gather.

Issue 23 asks for TP-2 and TP-8 ranks at TP 1's rate per byte. A rank's
row-parallel shard (``o_proj``/``down_proj``) is ``rows`` rows of ``pitch /
TP`` bytes, ``pitch`` apart in the file; on the H200 host the CPU copies such
short rows at 0.3–0.75x the rate of whole rows even out of anonymous memory
(``bench_row_copy.py``). This benchmark asks whether the GPU can take the
gather off the CPU, reading the file's pages where they are:

- ``cpu``: what the service does (:func:`weightcache.reader._rows.copy_mapped_rows`
  into a :class:`~weightcache.memory.cuda_staging.CudaStager` buffer, then
  ``cuMemcpyHtoDAsync``), ``--threads`` reader threads, pieces of one staging
  buffer;
- ``2d``: ``cuMemHostRegister`` of a read-only shared mapping of the file
  (``CU_MEMHOSTREGISTER_READ_ONLY``: the page cache's own pages, page-locked),
  then the copy engine gathers the rows (``cuMemcpy2DAsync``, 4096 rows a call,
  four streams), then ``cuMemHostUnregister``;
- ``kern``: the same registration with ``CU_MEMHOSTREGISTER_DEVICEMAP``, and an
  NVRTC kernel reads the rows over PCIe (16-byte words, one block per row);
- ``hmm``: the kernel on the mapping's own addresses with no registration, only
  where the device reports ``CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS``
  (HMM); skipped otherwise;
- ``1d`` (TP 1 only): the registration and one contiguous copy per 4096 rows,
  the copy engine's ceiling.

The registration covers the whole span of the rows (``TP`` times a rank's
bytes), registered in ``--reg-threads`` pieces on as many threads. Reports GB/s
of payload (a rank's bytes) including registration and unregistration, the
copy alone, and the registration's own rate over the span; checks every byte
against the file. The file (``--gib`` GiB of random bytes in ``--dir``) is
read into the page cache first.

Recorded in benchmarks/RESULTS.md ("Sixth session: the GPU gathers a rank's
rows"). Needs a GPU, ``cuda-bindings`` and NVRTC.

Usage: bench_gpu_gather.py [--gib G] [--dir D] [--pitches 37888,7168] [--tps 1,2,8] [--modes cpu,2d,kern,hmm,1d]
       [--reg-threads 1,4,16] [--threads 16] [--reps 2]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, versions  # noqa: E402

GATHER = r"""
extern "C" __global__ void wc_gather(const unsigned char* src, unsigned long long pitch, unsigned long long width,
                                     unsigned long long rows, unsigned char* dst) {
  const unsigned long long words = width >> 4;
  for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
    const uint4* s = (const uint4*)(src + r * pitch);
    uint4* d = (uint4*)(dst + r * width);
    for (unsigned long long w = threadIdx.x; w < words; w += blockDim.x) d[w] = s[w];
  }
}
"""
ROWS_PER_CALL = 4096


def _ck(ret: tuple, what: str) -> Any:
    if int(ret[0]) != 0:
        raise RuntimeError(f"{what}: {ret[0]}")
    return ret[1] if len(ret) == 2 else None


def _threads(n: int, fn: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    ths = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    if errors:
        raise errors[0]


class Bench:
    """The file, its page-cache state, one device buffer of the file's size and the gather kernel on GPU 0."""

    def __init__(self, path: Path, size: int) -> None:
        from cuda.bindings import driver as cu

        from weightcache.memory.cuda_driver import _Device

        self.cu, self.path, self.size = cu, path, size
        self.dev = _Device(0)
        self.ctx = self.dev.ctx
        _ck(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.dbuf = int(_ck(cu.cuMemAlloc(size), "cuMemAlloc"))
        self.func = self._compile()
        attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS
        self.hmm = bool(_ck(cu.cuDeviceGetAttribute(attr, self.dev.dev), "cuDeviceGetAttribute"))

    def _compile(self) -> Any:
        from cuda.bindings import nvrtc

        cu = self.cu
        a = cu.CUdevice_attribute
        major = _ck(cu.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev.dev), "major")
        minor = _ck(cu.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev.dev), "minor")
        prog = _ck(nvrtc.nvrtcCreateProgram(GATHER.encode(), b"gather.cu", 0, [], []), "nvrtcCreateProgram")
        opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
        _ck(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), "nvrtcCompileProgram")
        img = b" " * _ck(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        _ck(nvrtc.nvrtcGetCUBIN(prog, img), "nvrtcGetCUBIN")
        mod = _ck(cu.cuModuleLoadData(img), "cuModuleLoadData")
        return _ck(cu.cuModuleGetFunction(mod, b"wc_gather"), "cuModuleGetFunction")

    def check(self, pitch: int, tp: int) -> bool:
        """Whether the device buffer holds rank 0's rows of the file, packed."""
        import numpy as np

        rows, width = self.size // pitch, pitch // tp
        out = np.empty((rows, width), np.uint8)
        _ck(self.cu.cuMemcpyDtoH(out.ctypes.data, self.dbuf, rows * width), "cuMemcpyDtoH")
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            src = np.ndarray((rows, width), np.uint8, m, 0, (pitch, 1))
            ok = bool(np.array_equal(out, src))
            del src
        _ck(self.cu.cuMemsetD8(self.dbuf, 0, rows * width), "cuMemsetD8")
        return ok

    def cpu(self, pitch: int, tp: int, threads: int) -> dict[str, float]:
        """The service's path: rows copied from a mapping into pinned staging, then one copy per piece."""
        from weightcache.reader import ReadTask
        from weightcache.memory.cuda_staging import CudaStager
        from weightcache.reader._rows import copy_mapped_rows

        rows, width = self.size // pitch, pitch // tp
        buf = 16 << 20
        per = max(1, buf // width)
        tasks = [ReadTask(str(self.path), r0 * pitch, width, r0 * width, "rows", min(per, rows - r0), pitch, width)
                 for r0 in range(0, rows, per)]
        lock = threading.Lock()
        it = iter(tasks)
        fd = os.open(self.path, os.O_RDONLY)

        def work(_: int) -> None:
            with CudaStager(self.dev, self.dbuf, self.size, buf) as st:
                i = 0
                while True:
                    with lock:
                        t = next(it, None)
                    if t is None:
                        return
                    b, i = i % 2, i + 1
                    st.wait(b)
                    copy_mapped_rows(fd, t, st.buffer(b), 0, t.length)
                    st.copy(b, 0, t.nbytes, t.slab_offset)

        try:
            t0 = time.perf_counter()
            _threads(threads, work)
            dt = time.perf_counter() - t0
        finally:
            os.close(fd)
        return {"total": dt, "copy": dt, "reg": 0.0, "unreg": 0.0}

    def gpu(self, pitch: int, tp: int, how: str, reg_threads: int) -> dict[str, float]:
        """``2d``, ``kern``, ``hmm`` or ``1d`` from a fresh read-only mapping of the file; times in seconds."""
        cu = self.cu
        rows, width = self.size // pitch, pitch // tp
        if how == "1d":
            width = pitch
        fd = os.open(self.path, os.O_RDONLY)
        m = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        os.close(fd)
        addr = _address(m)
        flags = int(cu.CU_MEMHOSTREGISTER_READ_ONLY) | (int(cu.CU_MEMHOSTREGISTER_DEVICEMAP) if how == "kern" else 0)
        unit = ROWS_PER_CALL * pitch  # a copy call stays inside one registration
        per = -(-self.size // reg_threads)
        step = -(-per // unit) * unit
        regs = [(o, min(step, self.size - o)) for o in range(0, self.size, step)] if how != "hmm" else []
        done: list[int] = []
        lock = threading.Lock()

        def reg(i: int) -> None:
            _ck(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
            o, n = regs[i]
            _ck(cu.cuMemHostRegister(addr + o, n, flags), f"cuMemHostRegister of {n} bytes of {self.path}")
            with lock:
                done.append(o)

        def unreg(i: int) -> None:
            _ck(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
            _ck(cu.cuMemHostUnregister(addr + done[i]), "cuMemHostUnregister")

        streams = [_ck(cu.cuStreamCreate(1), "cuStreamCreate") for _ in range(4)]
        t0 = time.perf_counter()
        try:
            _threads(len(regs), reg)
            t_reg = time.perf_counter()
            for j, r0 in enumerate(range(0, rows, ROWS_PER_CALL)):
                n = min(ROWS_PER_CALL, rows - r0)
                src, dst, s = addr + r0 * pitch, self.dbuf + r0 * width, streams[j % 4]
                if how == "1d":
                    _ck(cu.cuMemcpyHtoDAsync(dst, src, n * pitch, s), "cuMemcpyHtoDAsync")
                elif how == "2d":
                    c = cu.CUDA_MEMCPY2D()
                    c.srcMemoryType, c.srcHost, c.srcPitch = cu.CUmemorytype.CU_MEMORYTYPE_HOST, src, pitch
                    c.dstMemoryType, c.dstDevice, c.dstPitch = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE, dst, width
                    c.WidthInBytes, c.Height = width, n
                    _ck(cu.cuMemcpy2DAsync(c, s), "cuMemcpy2DAsync")
                else:
                    dsrc = src if how == "hmm" else int(_ck(cu.cuMemHostGetDevicePointer(src, 0), "devptr"))
                    _launch(cu, self.func, min(n, 1024), [dsrc, pitch, width, n, dst], s)
            for s in streams:
                _ck(cu.cuStreamSynchronize(s), "cuStreamSynchronize")
            t_copy = time.perf_counter()
        finally:
            _threads(len(done), unreg)
            for s in streams:
                cu.cuStreamDestroy(s)
            m.close()
        t_end = time.perf_counter()
        return {"total": t_end - t0, "copy": t_copy - t_reg, "reg": t_reg - t0, "unreg": t_end - t_copy}


def _address(m: mmap.mmap) -> int:
    import numpy as np

    a = np.frombuffer(m, np.uint8)
    p = int(a.ctypes.data)
    del a
    return p


def _launch(cu: Any, func: Any, blocks: int, args: list[int], stream: Any) -> None:
    holders = [ctypes.c_uint64(a) for a in args]
    params = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
    _ck(cu.cuLaunchKernel(func, blocks, 1, 1, 256, 1, 1, 0, stream, ctypes.addressof(params), 0), "cuLaunchKernel")


def write_file(path: Path, size: int) -> None:
    """``size`` bytes of random data at ``path`` (kept when it already has that size), then read once."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.stat().st_size != size:
        block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
        with open(path, "wb") as f:
            for off in range(0, size, len(block)):
                f.write(block[:min(len(block), size - off)])
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def gpu_count() -> int:
    """GPUs the CUDA driver sees through ``cuda-bindings`` (0 without the bindings, the driver or a GPU)."""
    try:
        from cuda.bindings import driver as cu

        if int(cu.cuInit(0)[0]) != 0:
            return 0
        err, n = cu.cuDeviceGetCount()
        return int(n) if int(err) == 0 else 0
    except Exception:  # noqa: BLE001 - no driver library is "no GPU" here
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--dir", default="/tmp/weightcache-bench/gather", help="where the file is written (ext4 here)")
    ap.add_argument("--pitches", default="37888,7168", help="row bytes (default: Qwen2.5-7B down_proj, o_proj bf16)")
    ap.add_argument("--tps", default="1,2,8")
    ap.add_argument("--modes", default="cpu,2d,kern,hmm,1d")
    ap.add_argument("--reg-threads", default="1,4,16")
    ap.add_argument("--threads", type=int, default=16, help="reader threads of the cpu mode")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    if not gpu_count():
        print("bench_gpu_gather.py needs a CUDA GPU (the driver reports none here): nothing measured", flush=True)
        return 0
    size = int(args.gib * (1 << 30))
    path = Path(args.dir) / "rows.bin"
    write_file(path, size)
    b = Bench(path, size)
    modes = args.modes.split(",")
    res: dict[str, Any] = {"versions": versions(), "gib": args.gib, "hmm": b.hmm, "runs": []}
    rows = []
    for pitch in (int(x) for x in args.pitches.split(",")):
        for tp in (int(x) for x in args.tps.split(",")):
            for how in modes:
                if (how == "hmm" and not b.hmm) or (how == "1d" and tp != 1):
                    continue
                for rt in ([args.threads] if how == "cpu" else [int(x) for x in args.reg_threads.split(",")]):
                    if how == "hmm" and rt != 1:
                        continue
                    best = None
                    for _ in range(args.reps):
                        d = b.cpu(pitch, tp, rt) if how == "cpu" else b.gpu(pitch, tp, how, rt)
                        if best is None or d["total"] < best["total"]:
                            best = d
                    ok = b.check(pitch, 1 if how == "1d" else tp)
                    payload = size // pitch * (pitch if how == "1d" else pitch // tp)
                    run = {"pitch": pitch, "tp": tp, "mode": how, "threads": rt, "bytes_equal": ok, **best,
                           "gbps": payload / best["total"] / 1e9, "copy_gbps": payload / best["copy"] / 1e9,
                           "reg_span_gbps": size / best["reg"] / 1e9 if best["reg"] else None}
                    res["runs"].append(run)
                    rows.append(f"| {pitch} | {tp} | {how} | {rt} | {run['gbps']:.1f} | {run['copy_gbps']:.1f} | "
                                f"{best['reg'] * 1e3:.0f} | {best['unreg'] * 1e3:.0f} | {'yes' if ok else 'NO'} |")
                    print(rows[-1], flush=True)
    md = [f"### A rank's rows from the page cache: CPU copy vs GPU gather ({args.gib:g} GiB file, best of "
          f"{args.reps}; HMM {'available' if b.hmm else 'not available'})", "",
          "| row pitch B | TP | mode | threads | GB/s payload, all in | copy alone | register ms | unregister ms |"
          " bytes equal |", "|---|---|---|---|---|---|---|---|---|", *rows]
    emit("gpu_gather", res, "\n".join(md))
    return 0 if all(r["bytes_equal"] for r in res["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
