#!/usr/bin/env python3
"""What a one-copy CUDA publication pays to reach the publisher's memory (issue 35's 2x target): the cost of
``cuIpcOpenMemHandle`` per allocation, serially and from several threads, against one device-to-device copy of
the same bytes; and the cost of the alternatives (a VMM allocation, its export and import).

A publisher process allocates ``--tensors`` tensors of ``--gb`` GB in all with torch's caching allocator (each
its own ``cudaMalloc`` segment, as vLLM's large weights are), exports a ``cuIpcGetMemHandle`` handle of each and
waits; an importer process (as the service) opens them in each mode of ``--threads`` (1 = serial), closes them,
and times each phase. One JSON line of results.

Usage: PYTHONPATH=service python3 benchmarks/probe_ipc_open.py [--gb 15] [--tensors 1200] [--threads 1,4,8,16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

PUBLISHER = r"""
import base64, sys, torch
from cuda.bindings import driver as cu
gb, n = float(sys.argv[1]), int(sys.argv[2])
per = int(gb * 1e9 / n) // 4096 * 4096
ts = [torch.empty(per, dtype=torch.uint8, device="cuda:0") for _ in range(n)]
torch.cuda.synchronize()
hs = []
for t in ts:
    err, h = cu.cuIpcGetMemHandle(t.data_ptr())
    assert err == cu.CUresult.CUDA_SUCCESS, err
    hs.append(base64.b64encode(bytes(h.reserved)).decode())
print(" ".join(hs), flush=True)
sys.stdin.read()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=15.0)
    ap.add_argument("--tensors", type=int, default=1200)
    ap.add_argument("--threads", default="1,4,8,16")
    args = ap.parse_args()
    import base64
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from cuda.bindings import driver as cu

    pub = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(args.gb), str(args.tensors)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    raw = [base64.b64decode(x) for x in pub.stdout.readline().split()]
    torch.zeros(1, device="cuda:0")
    ctx = cu.cuCtxGetCurrent()[1]
    out: dict = {"gpu": torch.cuda.get_device_name(0), "tensors": len(raw), "gb": args.gb}

    def open_one(r: bytes) -> int:
        cu.cuCtxSetCurrent(ctx)
        h = cu.CUipcMemHandle()
        h.reserved = r
        err, p = cu.cuIpcOpenMemHandle(h, cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        return int(p)

    def close_one(p: int) -> None:
        cu.cuCtxSetCurrent(ctx)
        cu.cuIpcCloseMemHandle(p)

    for rep in range(2):
        for t in [int(x) for x in args.threads.split(",")]:
            a = time.perf_counter()
            if t == 1:
                ptrs = [open_one(r) for r in raw]
            else:
                with ThreadPoolExecutor(t) as ex:
                    ptrs = list(ex.map(open_one, raw))
            b = time.perf_counter()
            for p in ptrs:
                cu.cuMemGetAddressRange(p)
            c = time.perf_counter()
            if t == 1:
                for p in ptrs:
                    close_one(p)
            else:
                with ThreadPoolExecutor(t) as ex:
                    list(ex.map(close_one, ptrs))
            d = time.perf_counter()
            out[f"rep{rep}_threads{t}"] = {"open_ms": (b - a) * 1e3, "range_ms": (c - b) * 1e3,
                                          "close_ms": (d - c) * 1e3}
    # the copy baseline: one contiguous device-to-device copy of the same bytes
    n = len(raw) * (int(args.gb * 1e9 / len(raw)) // 4096 * 4096)
    src = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    for _ in range(3):
        torch.cuda.synchronize(); a = time.perf_counter(); dst.copy_(src); torch.cuda.synchronize()
        out.setdefault("d2d_copy_ms", []).append((time.perf_counter() - a) * 1e3)
    del src, dst
    torch.cuda.empty_cache()
    # a VMM allocation of the same size: create, reserve, map, access, export; then release
    from weightcache.memory.cuda_driver import _Device
    from weightcache.memory.cuda_slabs import CudaWritableSlab
    d = _Device(0)
    for _ in range(2):
        a = time.perf_counter()
        w = CudaWritableSlab(d, -(-n // d.granularity) * d.granularity, "probe")
        b = time.perf_counter()
        w.abort()
        out.setdefault("vmm_alloc_ms", []).append((b - a) * 1e3)
        out.setdefault("vmm_release_ms", []).append((time.perf_counter() - b) * 1e3)
    pub.stdin.close()
    pub.wait()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
