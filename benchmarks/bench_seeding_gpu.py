#!/usr/bin/env python3
"""Peer seeding on the GPU (issue 37): GB/s of NIXL READs of a GPU slab into another process's GPU slab
(``VRAM`` -> ``VRAM``, UCX), against ``cuMemcpyDtoD`` of the same bytes on the same GPU, same run; and which
UCX transports carried them.

Two processes on GPU 0 per case, each with weightcache's own parts. The source allocates its memory, writes
a pattern, registers it with its :class:`weightcache.seeding.Agent` and progresses the agent until told to
stop. The receiver allocates a ``CudaWritableSlab`` (a VMM allocation with the POSIX-fd handle type, as the
cuda backend makes) and READs the source's with :meth:`Agent.read` (64 MiB requests, as the service's
receiver does), ``--reps`` times, with ``UCX_PROTO_INFO=y`` (UCX prints the protocols and transports it
selected; the lines naming a transport are kept); checks the ``sum64`` of what arrived against the source's
(the receiver's kernel); then copies its slab into a third with ``cuMemcpyDtoD`` (the device's own rate).

Cases (``--cases``): ``vmm`` (the source is a sealed ``CudaSealedSlab``, as the service offers),
``legacy`` (the source is a ``cuMemAlloc`` buffer: what UCX's ``cuda_ipc`` can map from another process;
it tells whether the VMM handle type is what keeps ``cuda_ipc`` out), ``dram`` (the source is host memory:
a host tier as the source).

One JSON line per case: ``read_gbps`` (each rep), ``dtod_gbps``, ``ratio`` (best READ / best DtoD),
``sum64_equal``, ``transports`` (UCX's lines). Nothing here is a link figure across nodes: see
docs/design.md, "What a fleet with RDMA gets".

Usage: PYTHONPATH=service:<nixl site> bench_seeding_gpu.py [--size-gb 4] [--reps 2] [--cases vmm,legacy,dram]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

SOURCE = r"""
import base64, ctypes, json, select, sys
from weightcache.memory.cuda_driver import _Device, _check, cu
from weightcache.memory.cuda_slabs import CudaWritableSlab
from weightcache.memory import kernels
from weightcache.seeding import Agent

size, case, in_ctx = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
d = _Device(0)
if in_ctx:  # UCX makes its worker (and cuda_ipc's iface) here: with the GPU's context current
    with d.current():
        agent = Agent("bench-src", "UCX")
else:
    agent = Agent("bench-src", "UCX")
mem = "DRAM" if case == "dram" else "VRAM"
if case == "vmm":
    w = CudaWritableSlab(d, size, "bench-src")
    ptr0 = w.ptr
elif case == "legacy":
    with d.current():
        ptr0 = int(_check("cuMemAlloc", cu.cuMemAlloc(size)))
if case in ("vmm", "legacy"):
    with d.current():
        _check("cuMemsetD32", cu.cuMemsetD32(ptr0, 0x9E3779B9, size // 4))
        for k in range(0, size, 1 << 30):  # distinct words every GiB: a misplaced block shows
            _check("cuMemsetD32", cu.cuMemsetD32(ptr0 + k, 0x1000 + k // (1 << 30), 1024))
    digest = kernels.sum64(d, [(ptr0, size)])[0]
    if case == "vmm":
        slab = w.seal()
        ptr, dev, current, holder = slab.device_range()
    else:
        ptr, dev, current = ptr0, 0, d.current
else:
    buf = ctypes.create_string_buffer(size)
    ctypes.memset(buf, 0x5A, size)
    ptr, dev, current = ctypes.addressof(buf), 0, d.current
    from weightcache.digest import sum64_buffer
    digest = sum64_buffer(memoryview(buf).cast("B")[:size])
with current():
    reg = agent.register(ptr, size, mem, dev)
print(json.dumps({"md": base64.b64encode(agent.metadata(reg)).decode(), "ptr": ptr, "dev": dev, "mem": mem,
                  "sum64": digest}), flush=True)
with current():  # a READ over TCP needs the target's progress (no NIXL progress thread, as in the service)
    while not select.select([sys.stdin], [], [], 0.0005)[0]:
        agent.progress()
    agent.deregister(reg)
"""

RECEIVER = r"""
import base64, json, sys, time
from weightcache.memory.cuda_driver import _Device, _check, cu
from weightcache.memory.cuda_slabs import CudaWritableSlab
from weightcache.memory import kernels
from weightcache.seeding import Agent

size, reps, in_ctx = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
offer = json.loads(sys.stdin.readline())
d = _Device(0)
dst = CudaWritableSlab(d, size, "bench-dst")
if in_ctx:
    with d.current():
        agent = Agent("bench-dst", "UCX")
else:
    agent = Agent("bench-dst", "UCX")
md = base64.b64decode(offer["md"])
reads = []
for _ in range(reps):
    dst.zero([(0, size)])
    reads.append(agent.read(md, [(offer["ptr"], size)], dst.ptr, size, time.monotonic() + 600, local_mem="VRAM",
                            local_dev=dst.gpu, remote_mem=offer["mem"], remote_dev=offer["dev"],
                            current=dst.current))
got = kernels.sum64(d, [(dst.ptr, size)])[0]
third = CudaWritableSlab(d, size, "bench-dtod")
dtod = []
with d.current():
    _check("cuCtxSynchronize", cu.cuCtxSynchronize())
    for _ in range(reps):
        t0 = time.perf_counter()
        _check("cuMemcpyDtoD", cu.cuMemcpyDtoD(third.ptr, dst.ptr, size))
        _check("cuCtxSynchronize", cu.cuCtxSynchronize())
        dtod.append(time.perf_counter() - t0)
print(json.dumps({"reads_s": reads, "dtod_s": dtod, "sum64_equal": got == offer["sum64"]}), flush=True)
"""

#: UCX's protocol lines worth keeping: the ones that name a transport.
_TRANSPORT = re.compile(r"cuda_ipc|cuda_copy|tcp|posix|sysv|cma|knem|rc_|ud_|dc_|gdr_copy|self")


def _json_line(text: str) -> dict:
    """The last line of ``text`` that is a JSON object (NIXL and UCX print their own lines on stdout)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON line in: {text[-2000:]}")


def one(case: str, size: int, reps: int, in_ctx: bool = False) -> dict:
    """One source/receiver pair; the case's result (see the module docstring)."""
    src = subprocess.Popen([sys.executable, "-c", SOURCE, str(size), case, str(int(in_ctx))], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        line = ""
        while not line.startswith("{"):
            line = src.stdout.readline()
            if not line:
                raise RuntimeError(f"case {case}: the source exited {src.wait()} before its offer")
        env = {**os.environ, "UCX_PROTO_INFO": "y"}
        dst = subprocess.run([sys.executable, "-c", RECEIVER, str(size), str(reps), str(int(in_ctx))], input=line, text=True,
                             capture_output=True, env=env, timeout=900, check=False)
        if dst.returncode != 0:
            raise RuntimeError(f"case {case}: the receiver exited {dst.returncode}: {dst.stderr[-3000:]}")
        res = _json_line(dst.stdout)
    finally:
        if src.poll() is None:
            src.stdin.write("\n")
            src.stdin.flush()
            src.wait(60)
    seen = []
    for t in (dst.stdout + dst.stderr).splitlines():
        t = " ".join(t.split())
        if _TRANSPORT.search(t) and t not in seen:
            seen.append(t[:200])
    best_read, best_dtod = min(res["reads_s"]), min(res["dtod_s"])
    return {"case": case, "size_bytes": size, "mem": ("DRAM" if case == "dram" else "VRAM") + "->VRAM",
            "read_gbps": [round(size / s / 1e9, 2) for s in res["reads_s"]],
            "dtod_gbps": [round(size / s / 1e9, 2) for s in res["dtod_s"]],
            "ratio": round(best_dtod / best_read, 4), "sum64_equal": res["sum64_equal"],
            "agent_in_context": in_ctx, "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
            "transports": seen[:24]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cases", default="vmm,legacy,dram", help="comma-separated: vmm, legacy, dram")
    ap.add_argument("--agent-in-context", action="store_true",
                    help="create both NIXL agents with the GPU's context current (does UCX then use cuda_ipc?)")
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
    size = int(args.size_gb * 2**30) // (2 << 20) * (2 << 20)
    ok = True
    for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
        try:
            res = one(case, size, args.reps, args.agent_in_context)
        except Exception as e:  # noqa: BLE001 - one case failing says something too; the others still run
            res = {"case": case, "error": repr(e)[:3000]}
        ok = ok and res.get("sum64_equal", False)
        print(json.dumps(res), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
