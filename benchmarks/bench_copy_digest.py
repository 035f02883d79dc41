#!/usr/bin/env python3
"""The service's copy with digests (``kernels.copy_sum64``: one launch of ``wc_chunks_sum64`` over a whole slab)
against torch's device-to-device copy of the same bytes, on GPU 0: GB/s per chunk size and block size, for
``--gb`` GB in ``--tensors`` ranges (what a publication of that many tensors copies). One JSON line.

Usage: PYTHONPATH=service python3 benchmarks/bench_copy_digest.py [--gb 15] [--tensors 1200]
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=15.0)
    ap.add_argument("--tensors", type=int, default=1200)
    ap.add_argument("--chunks-mib", default="1,4,16")
    ap.add_argument("--threads", default="256,512,1024")
    args = ap.parse_args()
    import torch

    from weightcache.memory import kernels
    from weightcache.memory.cuda import CudaBackend

    dev = CudaBackend(0)._device(0)
    per = int(args.gb * 1e9 / args.tensors) // 256 * 256
    n = per * args.tensors
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    items = [(dst.data_ptr() + i * per, src.data_ptr() + i * per, per) for i in range(args.tensors)]
    out: dict = {"gpu": torch.cuda.get_device_name(0), "bytes": n, "tensors": args.tensors}
    kernels.copy_sum64(dev, items[:2])  # compile
    for _ in range(3):
        torch.cuda.synchronize()
        a = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        out.setdefault("torch_copy_gbps", []).append(round(n / (time.perf_counter() - a) / 1e9, 1))
    want = None
    for chunk in [int(c) << 20 for c in args.chunks_mib.split(",")]:
        for threads in [int(t) for t in args.threads.split(",")]:
            kernels.CHUNK_BYTES, kernels._CHUNK_THREADS = chunk, threads
            rates = []
            for _ in range(3):
                dst.zero_()
                torch.cuda.synchronize()
                a = time.perf_counter()
                got = kernels.copy_sum64(dev, items)
                rates.append(round(n / (time.perf_counter() - a) / 1e9, 1))
            want = want or got
            assert got == want and torch.equal(dst[:per], src[:per])
            out[f"chunk{chunk >> 20}MiB_threads{threads}_gbps"] = rates
    a = time.perf_counter()
    kernels.sum64(dev, [(s, m) for _, s, m in items])
    torch.cuda.synchronize()
    out["sum64_only_gbps"] = round(n / (time.perf_counter() - a) / 1e9, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
