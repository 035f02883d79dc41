#!/usr/bin/env python3
"""Attach under concurrency: N engine processes, already initialised, attach at the same instant.

A ``weightcache serve`` subprocess (``--backend host`` or ``cuda``, ``-v`` so
that it logs its own time per request) holds one 7B-class Llama rank (the
Llama-2-7B layout of ``bench_common``, HF naming, 291 tensors; sparse file:
the layout is what an attach costs, not the bytes; on ``cpu`` every width is
divided by 16, same tensor count). N engine processes are forked from a parent
that imported torch and weightcache; each initialises its device and attaches
and closes ``--warmup`` times (imports done, CUDA context and backend ready).
Then, per round, all N wait on one ``multiprocessing.Barrier`` and call
``attach(path, device=..., fallback=False)`` the moment it opens; the time to
the returned ``Attachment`` is the end-to-end latency; ``close()`` follows
outside the timing.

Where the time goes, per attach (the client's functions are wrapped with
timers in each engine; "reply wait" is from the last byte of the request to
the frame and fds of the reply, i.e. the service's queue, its own work, the fd
passing and the scheduler):

- service: the service's own time per ``attach`` (handler + writing the reply
  and its two fds), from its ``request served ... duration_us=`` debug lines;
- connect, send, reply wait, manifest file read + unpack, key check (``stat()``),
  fd import + map (host: ``mmap``; cuda: the driver's import, reserve, map and
  set access), views.

Usage: bench_concurrency.py [--device cpu|cuda] [--ns 1,8,32,64] [--samples 64] [--warmup 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    LLAMA2_7B, emit, has_cuda, patch_timers, scaled, service_env, stats, versions, wait_ready, write_checkpoint,
    write_config,
)

STAGES = ("connect", "send", "reply wait", "manifest file", "key check", "import + map", "views")


def _instrument(acc: dict[str, float], device: str) -> None:
    """Wraps the client's steps with timers adding seconds into ``acc`` (this process only)."""
    from weightcache import identity  # the client imports identity on first use: not its attribute
    from weightcache.client import _attach as client  # the room whose names the stages patch

    backend = client.local_backend(device)
    patch_timers([(client.Session, "__init__", "connect"), (client.Session, "send", "send"),
                  (client.Session, "replies", "reply wait"), (client, "read_file", "manifest file"),
                  (identity, "check_key", "key check"), (type(backend), "import_fd", "import + map"),
                  (client, "build_views", "views")], acc)


def _engine(cfg: dict, rounds: int, barrier, results) -> None:
    """One engine: initialise, warm up, then ``rounds`` barrier-synchronised attaches."""
    from weightcache import attach

    dev = cfg["device"]
    if dev.startswith("cuda"):
        import torch

        torch.cuda.init()
        torch.empty(1, device=dev)
    kw = dict(device=dev, fallback=False, socket_dir=cfg["socket_dir"], timeout=120.0)
    for _ in range(cfg["warmup"]):
        attach(cfg["path"], **kw).close()
    acc: dict[str, float] = {}
    _instrument(acc, dev)
    out = []
    for _ in range(rounds):
        acc.clear()
        barrier.wait(timeout=300)  # an engine that died breaks the barrier instead of hanging the others
        c0, t0 = time.process_time(), time.perf_counter()
        w = attach(cfg["path"], **kw)
        t1, c1 = time.perf_counter(), time.process_time()
        n = len(w.tensors)
        w.close()
        out.append({"e2e_ms": (t1 - t0) * 1e3, "cpu_ms": (c1 - c0) * 1e3, "tensors": n,
                    **{k: v * 1e3 for k, v in acc.items()}})
    results.put(out)


_SERVED = re.compile(r"request served type=attach peer_pid=\d+ duration_us=(\d+)")


def run_n(cfg: dict, n: int, samples: int, log_path: Path) -> dict:
    rounds = max(3, -(-samples // n))
    ctx = mp.get_context(cfg["start_method"])
    if cfg["start_method"] == "forkserver":  # engines fork from a server that imported these, CUDA untouched
        ctx.set_forkserver_preload(["torch", "weightcache.client"])
    barrier, results = ctx.Barrier(n), ctx.Queue()
    log_from = log_path.stat().st_size
    procs = [ctx.Process(target=_engine, args=(cfg, rounds, barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    rows = []
    for _ in procs:
        try:
            rows += results.get(timeout=600)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            for p in procs:
                p.kill()
            raise SystemExit(f"bench_concurrency: N={n}: no result from an engine in 600 s (exit codes {dead})")
    for p in procs:
        p.join(60)
    with open(log_path, "rb") as f:
        f.seek(log_from)
        served = [int(m.group(1)) / 1e3 for m in _SERVED.finditer(f.read().decode(errors="replace"))]
    served = served[n * cfg["warmup"]:]  # the warm-up attaches come first
    r = {"n": n, "rounds": rounds, "tensors": rows[0]["tensors"], "e2e_ms": stats([x["e2e_ms"] for x in rows]),
         "engine_cpu_ms": stats([x["cpu_ms"] for x in rows]),
         "service_ms": stats(served) if served else None,
         "stages_ms": {s: stats([x.get(s, 0.0) for x in rows]) for s in STAGES}}
    return r


def markdown(res: dict) -> str:
    rs = res["runs"]
    single = rs[0]["e2e_ms"]["median"] if rs and rs[0]["n"] == 1 else None
    md = [f"### Attach under concurrency, backend {res['backend']}, {rs[0]['tensors']} tensors "
          f"({res['checkpoint']}), {res['versions'].get('cpus')} CPUs", "",
          "| N at once | attaches | e2e p50 ms | e2e p99 ms | p99 / single p50 | service p50 ms | service p99 ms "
          "| engine CPU p50 ms | CPU floor ms |",
          "|---|---|---|---|---|---|---|---|---|"]
    cpus = int(res["versions"].get("cpus") or 1)
    for r in rs:
        e, s = r["e2e_ms"], r["service_ms"] or {"median": float("nan"), "p99": float("nan")}
        c = r["engine_cpu_ms"]["median"]
        ratio = f"{e['p99'] / single:.1f}" if single else "-"
        # Every engine's own CPU work plus the service's, spread over every CPU: the last attach of a
        # round cannot finish earlier than this, whatever the service does.
        floor = r["n"] * (c + (s["median"] if s["median"] == s["median"] else 0.0)) / min(cpus, r["n"])
        md.append(f"| {r['n']} | {e['n']} | {e['median']:.2f} | {e['p99']:.2f} | {ratio} | "
                  f"{s['median']:.3f} | {s['p99']:.3f} | {c:.2f} | {floor:.1f} |")
    md += ["", "Per attach, client side (p50 / p99 ms):", "",
           "| N | " + " | ".join(STAGES) + " |", "|---|" + "---|" * len(STAGES)]
    for r in rs:
        md.append(f"| {r['n']} | " + " | ".join(f"{r['stages_ms'][s]['median']:.2f} / {r['stages_ms'][s]['p99']:.2f}"
                                               for s in STAGES) + " |")
    return "\n".join(md)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if has_cuda() else "cpu")
    ap.add_argument("--ns", default="1,8,32,64", help="engine counts, comma-separated")
    ap.add_argument("--samples", type=int, default=64, help="attaches per N at least (rounds = samples / N, >= 3)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--start-method", default=None, choices=("fork", "spawn", "forkserver"),
                    help="how engines start (default: fork on cpu, sharing the parent's imported torch pages; "
                         "forkserver on cuda, since a process that touched CUDA cannot fork a CUDA user)")
    args = ap.parse_args()
    if args.start_method is None:
        args.start_method = "forkserver" if args.device == "cuda" else "fork"

    import torch  # noqa: F401 - imported once here, inherited by the forked engines

    import weightcache.client  # noqa: F401

    data = Path(os.environ.get("BENCH_DATA_DIR", "/tmp/weightcache-bench"))
    shape = LLAMA2_7B if args.device == "cuda" else scaled(LLAMA2_7B, 16)
    name = "llama7b-sparse" if args.device == "cuda" else "llama7b-div16-sparse"
    ck = write_checkpoint(data / name, shape, fill="sparse")
    backend = "cuda" if args.device == "cuda" else "host"
    work = Path(tempfile.mkdtemp(prefix="wc-bench-conc-"))
    sock = work / "0.sock"
    cfgf = write_config(work / "weightcache.toml", {"m": {"path": ck}}, backend)
    log_path = work / "serve.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "weightcache", "serve", "--gpu", "0", "--backend", backend,
                                 "--config", str(cfgf), "--listen", str(sock), "-v"],
                                stdout=logf, stderr=subprocess.STDOUT, env=service_env())
    try:
        wait_ready(str(sock), proc, 900, log_path)
        cfg = {"device": "cuda:0" if args.device == "cuda" else "cpu", "socket_dir": str(work), "path": str(ck),
               "warmup": args.warmup, "start_method": args.start_method}
        runs = []
        for n in (int(x) for x in args.ns.split(",")):
            print(f"N={n} ...", file=sys.stderr, flush=True)
            runs.append(run_n(cfg, n, args.samples, log_path))
    finally:
        proc.terminate()
        proc.wait(60)
    res = {"backend": backend, "checkpoint": f"{name}, {shape.bytes() / 2**30:.2f} GiB", "versions": versions(),
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "runs": runs}
    emit("bench_concurrency", res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
