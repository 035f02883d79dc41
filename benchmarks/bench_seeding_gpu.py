#!/usr/bin/env python3
"""Peer seeding on the GPU (issue 37): GB/s of one NIXL READ of a GPU slab into another process's GPU slab
(``VRAM`` -> ``VRAM``, UCX), against ``cuMemcpyDtoD`` of the same bytes on the same GPU, same run.

Two processes on GPU 0, each with weightcache's own parts: the source allocates a ``CudaWritableSlab`` of
``--size-gb`` (a VMM allocation with the POSIX-fd handle type, as the cuda backend makes), writes a pattern,
seals it (the owner's mapping read-only), registers it with its :class:`weightcache.seeding.Agent` as
``VRAM`` and progresses its agent until told to stop. This process allocates its own slab and READs the
source's with :meth:`Agent.read` (64 MiB requests, as the receiver does), ``--reps`` times; checks the
``sum64`` of what arrived against the source's (the kernel the receiver uses); then copies its slab into a
third one with ``cuMemcpyDtoD`` (the device's own copy rate: the bound of any same-GPU transfer).
``--mem DRAM`` makes the source a host buffer instead (``DRAM`` -> ``VRAM``, the host tier as a source).

One line of JSON: ``read_gbps`` (each rep), ``dtod_gbps``, ``ratio`` (best READ / DtoD), ``sum64_equal``,
``ucx_tls``. Nothing here is a link figure across nodes: see docs/design.md, "What a fleet with RDMA gets".

Usage: PYTHONPATH=service:<nixl site> bench_seeding_gpu.py [--size-gb 8] [--reps 3] [--mem VRAM|DRAM]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time

SOURCE = r"""
import base64, json, select, sys
from weightcache.memory.cuda_driver import _Device, _check, cu
from weightcache.memory.cuda_slabs import CudaWritableSlab
from weightcache.memory import kernels
from weightcache.seeding import Agent

size, mem = int(sys.argv[1]), sys.argv[2]
d = _Device(0)
agent = Agent("bench-src", "UCX")
if mem == "VRAM":
    w = CudaWritableSlab(d, size, "bench-src")
    with d.current():
        _check("cuMemsetD32", cu.cuMemsetD32(w.ptr, 0x9E3779B9, w.size_bytes // 4))
        for k in range(0, w.size_bytes, 1 << 30):  # distinct words every GiB: a misplaced block shows
            _check("cuMemsetD32", cu.cuMemsetD32(w.ptr + k, 0x1000 + k // (1 << 30), 1024))
    digest = kernels.sum64(d, [(w.ptr, size)])[0]
    slab = w.seal()
    ptr, dev, current, holder = slab.device_range()
else:
    import ctypes
    buf = ctypes.create_string_buffer(size)
    ctypes.memset(buf, 0x5A, size)
    ptr, dev, current = ctypes.addressof(buf), 0, d.current
    from weightcache.digest import sum64_buffer
    digest = sum64_buffer(memoryview(buf).cast("B")[:size])
with current():
    reg = agent.register(ptr, size, mem, dev)
print(json.dumps({"md": base64.b64encode(agent.metadata(reg)).decode(), "ptr": ptr, "dev": dev,
                  "sum64": digest}), flush=True)
with current():  # a READ over TCP needs the target's progress (no NIXL progress thread, as in the service)
    while not select.select([sys.stdin], [], [], 0.0005)[0]:
        agent.progress()
    agent.deregister(reg)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mem", choices=("VRAM", "DRAM"), default="VRAM", help="the source's memory kind")
    args = ap.parse_args()

    from weightcache.memory import cuda_driver
    from weightcache.seeding import NixlMissing, nixl_api

    if cuda_driver.load_driver() is None:
        print("bench_seeding_gpu needs a CUDA GPU (the driver reports none here): nothing measured")
        return 0
    try:
        nixl_api()
    except NixlMissing as e:
        print(f"bench_seeding_gpu needs NIXL: {e}; nothing measured")
        return 0
    from weightcache.memory import kernels
    from weightcache.memory.cuda_driver import _check, _Device, cu
    from weightcache.memory.cuda_slabs import CudaWritableSlab
    from weightcache.seeding import Agent

    size = int(args.size_gb * 2**30) // (2 << 20) * (2 << 20)
    src = subprocess.Popen([sys.executable, "-c", SOURCE, str(size), args.mem], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        offer = json.loads(src.stdout.readline())
        d = _Device(0)
        dst = CudaWritableSlab(d, size, "bench-dst")
        agent = Agent("bench-dst", "UCX")
        md = base64.b64decode(offer["md"])
        reads = []
        for _ in range(args.reps):
            dst.zero([(0, size)])
            s = agent.read(md, [(offer["ptr"], size)], dst.ptr, size, time.monotonic() + 600, local_mem="VRAM",
                           local_dev=dst.gpu, remote_mem=args.mem, remote_dev=offer["dev"], current=dst.current)
            reads.append(s)
        got = kernels.sum64(d, [(dst.ptr, size)])[0]
        third = CudaWritableSlab(d, size, "bench-dtod")
        with d.current():
            _check("cuCtxSynchronize", cu.cuCtxSynchronize())
            dtod = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                _check("cuMemcpyDtoD", cu.cuMemcpyDtoD(third.ptr, dst.ptr, size))
                _check("cuCtxSynchronize", cu.cuCtxSynchronize())
                dtod.append(time.perf_counter() - t0)
        third.abort()
        dst.abort()
    finally:
        if src.poll() is None:
            src.stdin.write("\n")
            src.stdin.flush()
            src.wait(60)
    best_read, best_dtod = min(reads), min(dtod)
    print(json.dumps({"size_bytes": size, "mem": f"{args.mem}->VRAM",
                      "read_gbps": [round(size / s / 1e9, 2) for s in reads],
                      "dtod_gbps": [round(size / s / 1e9, 2) for s in dtod],
                      "ratio": round(best_dtod / best_read, 3), "sum64_equal": got == offer["sum64"],
                      "ucx_tls": os.environ.get("UCX_TLS", "(all)")}))
    return 0 if got == offer["sum64"] else 1


if __name__ == "__main__":
    sys.exit(main())
