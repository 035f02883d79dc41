#!/usr/bin/env python3
"""Where a CUDA ``publish()`` spends its time on the publisher's side: cProfile of one ``publish()`` of ``--gb``
GB in ``--tensors`` bf16 tensors to a real ``weightcache serve --backend cuda`` on GPU 0, for each of ``--paths``
(``staging``, ``ipc``, ``home``: the tensors moved into a home allocation first), after one warm-up publication; prints the top functions by cumulative time and the
service's own log lines of each publication (its copy and commit durations).

Usage: PYTHONPATH=service python3 benchmarks/profile_publish.py [--gb 15] [--tensors 1200] [--paths staging,ipc]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=15.0)
    ap.add_argument("--tensors", type=int, default=1200)
    ap.add_argument("--paths", default="staging,ipc")
    args = ap.parse_args()
    import torch
    from bench_common import bench_engine_key, move_into_home
    from checkpoints import write_checkpoint
    from service_harness import ServiceProcess, make_config

    from weightcache.client import publish

    cap = torch.cuda.get_device_capability(0)
    rows = int(args.gb * 1e9 / args.tensors) // 2 // 4096
    work = Path(tempfile.mkdtemp(prefix="wc-prof-publish-"))
    ck = write_checkpoint(work / "ck", {"w": torch.zeros(4, 4)}, config={"architectures": ["Bench"]})
    svc = ServiceProcess(work / "svc", make_config({"m": ck}, backend="cuda",
                                                   memory_budget_bytes=int(args.gb * 1e9 * 2.5) + (1 << 30)),
                         gpu=0, backend="cuda").start()
    try:
        svc.wait_settled()
        tensors = {f"model.layers.{i}.w": torch.randn(rows, 4096, device="cuda:0").to(torch.bfloat16)
                   for i in range(args.tensors)}
        home = None
        for i, path in enumerate([p for p in args.paths.split(",") for _ in range(2)]):
            if path == "home" and home is None:  # the tensors moved into a home allocation, as vLLM's load does
                home, tensors = move_into_home(tensors, "cuda:0")
            key = bench_engine_key(str(i), cap)
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            got = publish(str(ck), key, tensors, device="cuda:0", socket_dir=svc.socket_dir, timeout=600,
                          cuda_path="staging" if path == "home" else path, home=home)
            prof.disable()
            dt = time.perf_counter() - t0
            if i % 2:  # the second of each path: warm
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
                print(f"== {path}: publish() {dt * 1e3:.1f} ms")
                print("\n".join(ln for ln in out.getvalue().splitlines() if ln.strip())[:6000])
            subprocess.run([sys.executable, "-m", "weightcache", "evict", "--socket-dir", svc.socket_dir,
                            "--gpu", "0", "--force", got.label], capture_output=True, check=False)
        print("\n".join(ln[:260] for ln in svc.log().splitlines() if "publication copied" in ln
                        or "publication prepared" in ln or "published model" in ln))
    finally:
        svc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
