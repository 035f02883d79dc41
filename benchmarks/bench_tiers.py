#!/usr/bin/env python3
"""Switching between two models under a memory budget that holds one (issue 24): host tier vs reload.

Two bf16 checkpoints of ``--size-gb`` each (Llama-2-7B shapes, random bytes, in
the page cache), one ``weightcache serve`` (cuda backend by default) with
``memory_budget_bytes`` = 1.3 x one model and ``host_tier_bytes`` = 2.2 x one
model: ``a`` (priority 1) loads at start, ``b`` goes to the host tier
(``preload = "host"``). Then, ``--reps`` times each way, an engine process (this
script) attaches the model that is not on the GPU and reads one tensor of it
(a GPU reduction: the "first token" stand-in); the service demotes the other
model to the host tier and promotes the asked one. Timed:

- attach-to-first-read, as the engine sees it (the attach waits for the switch);
- from the service's journal lines: the promotion's copy (``promoted ... copy_ms``,
  host -> GPU from page-locked memory), its digest check of the host copy
  (overlapping the copy), and the demotion (``demoted`` and, when the host
  tier had no copy yet, ``host tier copy made ... copy_ms``);

then the same switch without a host tier (``host_tier_bytes = 0`` applied by a
reload): the other model is dropped and the asked one read again from the page cache.

Usage: bench_tiers.py [--device cuda|cpu] [--size-gb G] [--reps N] [--dir DIR] [--remove]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_common import (GB, LLAMA2_7B, emit, has_cuda, layers_for, met, service_env, spread, stats, versions,
                          warm_page_cache, write_checkpoint, write_config)

from weightcache import attach, protocol  # noqa: E402
from weightcache.session import Session  # noqa: E402
from weightcache.errors import WeightcacheError  # noqa: E402


def _status(sock: str) -> dict:
    s = Session(sock, timeout=10.0)
    try:
        return s.request(protocol.Status()).status
    finally:
        s.close()


def _request(sock: str, msg) -> object:
    s = Session(sock, timeout=120.0)
    try:
        return s.request(msg)
    finally:
        s.close()


def _wait(sock: str, proc: subprocess.Popen, log: Path, cond, what: str, timeout_s: float = 600.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"service exited ({proc.returncode}) waiting for {what}\n{log.read_text()[-3000:]}")
        try:
            st = _status(sock)
            if cond(st):
                return st
        except (OSError, WeightcacheError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def _tiers(st: dict) -> dict[str, str]:
    return {s["model"]: s["tier"] for s in st["slabs"]}


def _switch(sock: str, proc, log: Path, model: str, device: str) -> float:
    """Attaches ``model`` (not on the GPU), reads one tensor; returns seconds from the attach to the read's end."""
    t0 = time.perf_counter()
    w = attach(model, socket_dir=str(Path(sock).parent), device=device, fallback=False, timeout=600)
    try:
        t = w.tensors["model.embed_tokens.weight"]
        float(t[:4096].float().sum().item())  # the first read of the switched-in slab
        dt = time.perf_counter() - t0
    finally:
        w.close()
    _wait(sock, proc, log, lambda st: all(not s["leases"] for s in st["slabs"]), "the lease to end")
    return dt


def _lines(log: Path, start: int, pattern: str) -> list[dict[str, float]]:
    out = []
    for line in log.read_text()[start:].splitlines():
        if re.search(pattern, line):
            out.append({k: float(v) for k, v in re.findall(r"(\w+)=([0-9.]+)(?=\s|$)", line)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if has_cuda() else "cpu")
    ap.add_argument("--size-gb", type=float, default=15.0)
    ap.add_argument("--reps", type=int, default=2, help="switches each way with the host tier")
    ap.add_argument("--dir", default="/dev/shm/wc-bench-tiers")
    ap.add_argument("--remove", action="store_true", help="delete the checkpoints afterwards")
    args = ap.parse_args()
    backend = "cuda" if args.device == "cuda" else "host"
    dev = "cuda:0" if args.device == "cuda" else "cpu"
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    shape = layers_for(int(args.size_gb * GB), LLAMA2_7B)
    t = time.monotonic()
    cks = {n: write_checkpoint(work / n, shape) for n in ("a", "b")}
    for p in cks.values():
        warm_page_cache(p)
    print(f"checkpoints: 2 x {shape.bytes() / GB:.2f} GB bf16 ({shape.layers} layers) in "
          f"{time.monotonic() - t:.0f} s", flush=True)
    size = shape.bytes()
    budget, host_tier = int(size * 1.3), int(size * 2.2)
    cfg = work / "weightcache.toml"
    models = {"a": {"path": cks["a"], "priority": 1}, "b": {"path": cks["b"], "preload": "host"}}
    write_config(cfg, models, backend, socket_dir=str(work / "run"), memory_budget_bytes=budget,
                 host_tier_bytes=host_tier)
    log = work / "service.log"
    if log.exists():
        log.unlink()
    (work / "run").mkdir(exist_ok=True)
    sock = str(work / "run" / "0.sock")
    with open(log, "wb") as lf:
        proc = subprocess.Popen([sys.executable, "-m", "weightcache", "serve", "--gpu", "0", "--config", str(cfg)],
                                env=service_env(), stdout=lf, stderr=lf, stdin=subprocess.DEVNULL)
    result: dict = {"device": args.device, "size_bytes": size, "budget_bytes": budget, "host_tier_bytes": host_tier,
                    "versions": versions()}
    try:
        t0 = time.monotonic()
        st = _wait(sock, proc, log, lambda st: _tiers(st) == {"a": "gpu", "b": "host"},
                   "a on the GPU, b in the host tier")
        result["start_s"] = time.monotonic() - t0
        # Warm the engine side (CUDA context, imports) on the resident model: not a switch.
        w = attach("a", socket_dir=str(work / "run"), device=dev, fallback=False, timeout=600)
        float(w.tensors["model.embed_tokens.weight"][:16].float().sum().item())
        w.close()
        _wait(sock, proc, log, lambda st: all(not s["leases"] for s in st["slabs"]), "the lease to end")

        mark = len(log.read_text())
        host_switch = []
        for i in range(args.reps):
            for m in ("b", "a"):
                host_switch.append(_switch(sock, proc, log, m, dev))
                assert _tiers(_status(sock))[m] == "gpu"
        promoted = _lines(log, mark, r"promoted model=")
        demoted = _lines(log, mark, r"demoted model=")
        copies = _lines(log, mark, r"host tier copy made")
        result["host_tier"] = {"attach_to_read_s": host_switch, "promotions": promoted, "demotions": demoted,
                               "host_copies_made": copies}

        # The same switch without a host tier: a reload drops the host tier, each switch reads the page cache.
        write_config(cfg, models | {"b": {"path": cks["b"]}}, backend, socket_dir=str(work / "run"),
                     memory_budget_bytes=budget, host_tier_bytes=0)
        _request(sock, protocol.Reload())
        mark = len(log.read_text())
        st = _status(sock)
        away = "b" if _tiers(st)["a"] == "gpu" else "a"
        reload_switch = []
        for m in (away, "a" if away == "b" else "b"):
            reload_switch.append(_switch(sock, proc, log, m, dev))
        loaded = _lines(log, mark, r"loaded model=")
        result["no_host_tier"] = {"attach_to_read_s": reload_switch, "loads": loaded}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if args.remove:
            shutil.rmtree(work, ignore_errors=True)

    def sp(xs: list[float]) -> str:
        return spread(stats(xs)) if xs else "n/a"

    gb = size / GB
    ht, nh = result["host_tier"], result["no_host_tier"]
    copy_gbps = [p["copy_gbps"] for p in ht["promotions"] if "copy_gbps" in p]
    copy_ms = [p["copy_ms"] for p in ht["promotions"] if "copy_ms" in p]
    digest_ms = [p.get("digest_ms", 0.0) for p in ht["promotions"]]
    made = [c["copy_ms"] + c.get("register_ms", 0.0) for c in ht["host_copies_made"]]
    read_gbps = [x["read_gbps"] for x in nh["loads"] if "read_gbps" in x]
    switch = stats(ht["attach_to_read_s"])
    md = [f"### Tiers: switching between two {gb:.1f} GB bf16 models, budget holds one ({args.device})", "",
          f"memory_budget_bytes = {budget / GB:.1f} GB, host_tier_bytes = {host_tier / GB:.1f} GB; "
          f"{len(ht['attach_to_read_s'])} switches with the host tier, {len(nh['attach_to_read_s'])} without.", "",
          "| what | value |", "|---|---|",
          f"| attach to first read, host tier (promotion + demotion) | {spread(switch)} s |",
          f"| promotion copy host -> GPU | {sp([x / 1e3 for x in copy_ms])} s, {sp(copy_gbps)} GB/s "
          f"(target >= 30 GB/s: {met(bool(copy_gbps) and min(copy_gbps) >= 30)}) |",
          f"| digest check of the host copy (during the copy) | {sp([x / 1e3 for x in digest_ms])} s |",
          f"| demotion GPU -> host (first time per model: copy + page-lock) | {sp([x / 1e3 for x in made])} s |",
          f"| every demotion (`demoted ... duration_ms`: to the sealed copy, off the serving loop) | "
          f"{sp([d['duration_ms'] / 1e3 for d in ht['demotions'] if 'duration_ms' in d])} s |",
          f"| demotion after a promotion (host copy kept) | {len(ht['demotions']) - len(made)} of "
          f"{len(ht['demotions'])} demotions copied nothing |",
          f"| attach to first read, no host tier (load from page cache) | "
          f"{sp(nh['attach_to_read_s'])} s, read {sp(read_gbps)} GB/s |",
          ""]
    emit("bench_tiers", result, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
