#!/usr/bin/env python3
"""Cold load from the page cache: weightcache's pipeline vs ``safetensors.torch.load_file``.

A BF16 checkpoint with Llama-2-7B shapes (291 tensors, 13.5 GB, 4 shards of
at most 4 GB, random bytes) is written once to ``--dir`` (reused by later runs
while complete), read once so the page cache holds it, then loaded
``--reps`` times by each contender, interleaved:

- weightcache: ``pipeline.plan`` (headers) + backend ``allocate`` +
  ``pipeline.execute(with_digests=False)`` into the slab (cuda: a VMM slab via
  ``CudaBackend.allocate``; host: a memfd), ``LoaderOptions(threads, staging_bytes)``;
  the slab is freed after each rep;
- safetensors: ``load_file(shard, device=DEVICE)`` for every shard.

Also timed: ``execute(with_digests=True)`` (the digest cost is the
difference), and ``o_direct=True`` (page cache bypassed). Rates are payload
bytes / wall time, GB = 1e9 bytes. The first weightcache slab is compared
byte for byte with safetensors' tensors before timing starts.

Usage: bench_load.py [--device cuda|cpu] [--size full|small] [--reps N]
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import GB, LLAMA2_7B, emit, has_cuda, met, scaled, stats, versions, warm_page_cache, write_checkpoint  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if has_cuda() else "cpu")
    ap.add_argument("--size", choices=("full", "small"), default=None,
                    help="full: Llama-2-7B shapes (13.5 GB); small: widths / 8 (0.2 GB). Default: full on cuda")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--staging-mb", type=int, default=512)
    ap.add_argument("--dir", default=os.environ.get("BENCH_DATA_DIR", "/tmp/weightcache-bench") )
    ap.add_argument("--no-odirect", action="store_true")
    args = ap.parse_args()
    size = args.size or ("full" if args.device == "cuda" else "small")

    import torch
    from safetensors.torch import load_file

    from weightcache import pipeline
    from weightcache.config import ModelConfig
    from weightcache.spec import RankRequest
    from weightcache.reader import LoaderOptions
    from weightcache.manifest import build_views
    from weightcache.memory import get_backend

    shape = LLAMA2_7B if size == "full" else scaled(LLAMA2_7B, 8)
    ck_dir = Path(args.dir) / f"load-llama7b-{size}"
    t0 = time.perf_counter()
    write_checkpoint(ck_dir, shape, "random", max_file_bytes=4 * 10**9 if size == "full" else 64 * 10**6)
    t_write = time.perf_counter() - t0
    shards = sorted(str(p) for p in ck_dir.glob("*.safetensors"))
    t_warm = warm_page_cache(ck_dir, args.threads)

    backend = get_backend("cuda" if args.device == "cuda" else "host", 0)
    model = ModelConfig(name="llama7b", path=str(ck_dir), dtype="auto", naming="hf")
    opts = LoaderOptions(threads=args.threads, staging_bytes=args.staging_mb << 20)
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize(dev)

    def wc_load(o: LoaderOptions, digests: bool, keep: bool = False):
        t0 = time.perf_counter()
        p = pipeline.plan(RankRequest(model, 1, 0), backend.device_info())
        t_plan = time.perf_counter()
        slab = backend.allocate(p.slab_size_bytes, "bench")
        t_alloc = time.perf_counter()
        man = pipeline.execute(p, slab.tensor, options=o, with_digests=digests)
        sync()
        t_end = time.perf_counter()
        out = {"plan_s": t_plan - t0, "alloc_s": t_alloc - t_plan, "exec_s": t_end - t_alloc, "total_s": t_end - t0,
               "payload_bytes": p.payload_bytes, "slab_bytes": slab.size_bytes, "tensors": len(p.records)}
        if keep:
            return out, slab, man
        slab.abort()
        return out, None, None

    def st_load() -> float:
        t0 = time.perf_counter()
        loaded = [load_file(s, device=str(dev) if args.device == "cuda" else "cpu") for s in shards]
        sync()
        dt = time.perf_counter() - t0
        del loaded
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        return dt

    # Correctness first: every tensor of one weightcache load equals safetensors' bytes.
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    first, slab, man = wc_load(opts, False, keep=True)
    # Peak RSS so far: torch + CUDA context + one weightcache load (staging included), nothing of safetensors'.
    rss_after_wc = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    views = build_views(slab.tensor, man)
    checked = 0
    for s in shards:
        for name, t in load_file(s, device=str(dev) if args.device == "cuda" else "cpu").items():
            if not torch.equal(views[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)):
                raise SystemExit(f"bench_load: bytes of {name} differ between weightcache and safetensors")
            checked += 1
    del views
    slab.abort()
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()

    payload = first["payload_bytes"]
    wc, st, wcd, od = [], [], [], []
    od_error = None
    st_load()  # warm-up of safetensors' own code paths
    for _ in range(args.reps):
        wc.append(wc_load(opts, False)[0])
        st.append(st_load())
    for _ in range(max(1, args.reps // 2)):
        wcd.append(wc_load(opts, True)[0])
    if not args.no_odirect:
        try:
            for _ in range(max(1, args.reps // 2)):
                od.append(wc_load(LoaderOptions(args.threads, args.staging_mb << 20, o_direct=True), False)[0])
        except OSError as e:
            od_error = f"{type(e).__name__}: {e}"

    def rate(xs: list[float]) -> dict[str, float]:
        return stats([payload / x / GB for x in xs])

    r_wc = rate([x["exec_s"] for x in wc])
    r_wc_total = rate([x["total_s"] for x in wc])
    r_st = rate(st)
    ratio = stats([s / w["exec_s"] for s, w in zip(st, wc)])
    dig_ms = stats([x["exec_s"] * 1e3 for x in wcd])
    nodig_ms = stats([x["exec_s"] * 1e3 for x in wc])
    r_od = rate([x["exec_s"] for x in od]) if od else None
    staging = opts.threads * 2 * (opts.chunk_bytes + 2 * 4096) if args.device == "cuda" else 0
    res = {
        "versions": versions(), "device": args.device, "size": size, "checkpoint": str(ck_dir),
        "payload_bytes": payload, "tensors": first["tensors"], "shards": len(shards), "reps": args.reps,
        "threads": opts.threads, "staging_bytes": staging, "write_s": t_write, "warm_s": t_warm,
        "bytes_checked_equal_tensors": checked,
        "weightcache_exec_gbps": r_wc, "weightcache_total_gbps": r_wc_total, "safetensors_gbps": r_st,
        "speedup": ratio, "exec_ms_no_digest": nodig_ms, "exec_ms_with_digest": dig_ms,
        "digest_ms": dig_ms["median"] - nodig_ms["median"],
        "plan_ms": stats([x["plan_s"] * 1e3 for x in wc]), "alloc_ms": stats([x["alloc_s"] * 1e3 for x in wc]),
        "odirect_gbps": r_od, "odirect_error": od_error,
        "slab_overhead_bytes": first["slab_bytes"] - payload, "peak_rss_bytes_before_load": rss_before,
        "peak_rss_bytes_after_wc": rss_after_wc,
        "targets": {"gbps>=30": r_wc["median"] >= 30, "speedup>=6": ratio["median"] >= 6},
    }

    def f(s: dict[str, float], fmt: str = "{:.1f}") -> str:
        return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"

    md = [f"### Load from page cache ({args.device}, {size}: {payload / GB:.2f} GB, {first['tensors']} tensors, "
          f"{len(shards)} shards, {args.reps} reps, median (min–max))", "",
          "| contender | GB/s | wall s |", "|---|---|---|",
          f"| weightcache execute (threads={opts.threads}, staging {staging / 2**20:.0f} MiB, no digests) | "
          f"{f(r_wc)} | {nodig_ms['median'] / 1e3:.3f} |",
          f"| weightcache plan+allocate+execute | {f(r_wc_total)} | "
          f"{stats([x['total_s'] for x in wc])['median']:.3f} |",
          f"| safetensors load_file(device={args.device!r}) per shard | {f(r_st)} | {stats(st)['median']:.3f} |",
          f"| weightcache execute with digests | {f(rate([x['exec_s'] for x in wcd]))} | "
          f"{dig_ms['median'] / 1e3:.3f} |"]
    if r_od:
        md.append(f"| weightcache execute, O_DIRECT | {f(r_od)} | "
                  f"{stats([x['exec_s'] for x in od])['median']:.3f} |")
    elif od_error:
        md.append(f"| weightcache execute, O_DIRECT | failed: {od_error} | |")
    md += ["", f"speedup vs safetensors (per rep pair): {f(ratio, '{:.2f}')}x; digest cost "
               f"{res['digest_ms']:.0f} ms ({payload / GB / max(res['digest_ms'] / 1e3, 1e-9):.0f} GB/s); "
               f"plan {res['plan_ms']['median']:.1f} ms, allocate {res['alloc_ms']['median']:.1f} ms; "
               f"slab bytes beyond tensors {res['slab_overhead_bytes']}; peak RSS {rss_before / 2**20:.0f} MiB before "
               f"the first load, {rss_after_wc / 2**20:.0f} MiB after it; all {checked} tensors byte-equal to "
               "safetensors'.",
           f"targets (cuda): >= 30 GB/s: {met(res['targets']['gbps>=30'])}; "
           f">= 6x safetensors: {met(res['targets']['speedup>=6'])}"
           + ("" if args.device == "cuda" else " (targets are for the H200; this is a CPU run)")]
    emit(f"load_{args.device}", res, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
