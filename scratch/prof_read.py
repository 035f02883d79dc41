#!/usr/bin/env python3
"""Scratch profiler (not committed): where a torch-free CUDA fill spends its time, per layout, fresh process."""
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "benchmarks"))
sys.path.insert(0, str(HERE / "service"))
D = Path(os.environ.get("PROF_DIR", "/dev/shm/prof"))


def gen():
    from bench_common import GB, LLAMA2_7B, layers_for, write_checkpoint, warm_page_cache, LlamaShape
    from modelopt_fp8_checkpoint import LLAMA3_8B, PER_CHANNEL, PER_TENSOR, write_modelopt_fp8
    t = time.time()
    out = {"bf16": write_checkpoint(D / "bf16-15", layers_for(int(15 * GB), LLAMA2_7B), "random")}
    if os.environ.get("PROF_FP8", "1") == "1":
        out["fp8t"] = write_modelopt_fp8(D / "fp8t", LLAMA3_8B, PER_TENSOR)
        out["fp8c"] = write_modelopt_fp8(D / "fp8c", LLAMA3_8B, PER_CHANNEL)
    for ck in out.values():
        warm_page_cache(ck)
    print(f"gen {time.time() - t:.1f}s", flush=True)
    return out


def fill(ck, naming, tp, ranks):
    from weightcache import loader, pipeline, placement, digest
    from weightcache.memory import get_backend
    from weightcache.memory import cuda_staging
    from weightcache.spec import LoadRequest, RankRequest

    acc = defaultdict(float)
    cnt = defaultdict(int)
    lk = threading.Lock()

    def wrap(obj, name, key):
        f = getattr(obj, name)

        def w(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                dt = time.perf_counter() - t
                with lk:
                    acc[key] += dt
                    cnt[key] += 1
        setattr(obj, name, w)

    wrap(loader, "_pread_exact", "pread")
    wrap(cuda_staging.CudaStager, "wait", "wait")
    wrap(cuda_staging.CudaStager, "__enter__", "stager_enter")
    wrap(cuda_staging.CudaStager, "__exit__", "stager_exit")
    wrap(cuda_staging.CudaStager, "copy", "copy")
    wrap(cuda_staging.CudaStager, "copy2d", "copy2d")
    wrap(placement, "scalar_values", "scalar_values")
    wrap(digest, "slab_digests", "digests")
    wrap(loader, "read_direct", "read_direct")
    t0 = time.perf_counter()
    be = get_backend("cuda", 0)
    dev = be.device_info()
    t_be = time.perf_counter() - t0
    from weightcache.memory import cuda_slabs
    wrap(cuda_slabs.CudaWritableSlab, "zero", "zero")
    wrap(cuda_slabs.CudaWritableSlab, "write", "write")
    wrap(cuda_slabs.CudaWritableSlab, "apply_lut", "lut")
    res = []
    for rank in ranks:
        acc.clear(); cnt.clear()
        t = time.perf_counter()
        p = pipeline.plan(RankRequest(LoadRequest("m", str(ck), naming=naming), tp, rank), dev)
        t_plan = time.perf_counter() - t
        placed = placement.place_all(p.specs, p.records, p.checkpoint)
        opts = loader.LoaderOptions()
        split = loader._split(placed.reads, opts.chunk_bytes) if placed else []
        w = be.allocate(p.slab_size_bytes, "m")
        t = time.perf_counter()
        f = pipeline.fill(p, w, options=opts)
        t_fill = time.perf_counter() - t
        w.abort()
        res.append({"rank": rank, "plan_s": t_plan, "fill_s": t_fill, "read_s": f.read_s, "digest_s": f.digest_s,
                    "bytes": f.bytes_read, "gbps": f.bytes_read / f.read_s / 1e9, "torch_free": f.torch_free,
                    "reads": len(placed.reads) if placed else None, "pieces": len(split),
                    "strided": sum(1 for x in split if x.rows > 1),
                    "span_bytes": sum(x.file_span for x in split),
                    "zeros": len(placed.zeros) if placed else None, "small": len(placed.small) if placed else None,
                    "luts": len(placed.luts) if placed else None, "threads": opts.threads, "chunk": opts.chunk_bytes,
                    "acc": {k: round(v, 4) for k, v in acc.items()}, "cnt": dict(cnt)})
    return {"backend_s": t_be, "ranks": res}


def main():
    cks = gen()
    cases = [("bf16", "hf", 1, [0]), ("bf16", "vllm", 1, [0]), ("fp8t", "vllm", 1, [0]), ("fp8c", "vllm", 1, [0]),
             ("bf16", "vllm", 2, [0, 1]), ("bf16", "vllm", 8, list(range(8))), ("bf16", "hf", 8, list(range(8)))]
    cases = [c for c in cases if c[0] in cks]
    reps = int(os.environ.get("PROF_REPS", "2"))
    for rep in range(reps):
        for kind, naming, tp, ranks in cases:
            if rep and tp == 8:
                continue
            r = subprocess.run([sys.executable, __file__, "fill", str(cks[kind]), naming, str(tp),
                                ",".join(map(str, ranks))], capture_output=True, text=True)
            if r.returncode:
                print(kind, naming, tp, "FAILED", r.stderr[-3000:], flush=True)
                continue
            got = json.loads(r.stdout.strip().splitlines()[-1])
            tot_b = sum(x["bytes"] for x in got["ranks"])
            tot_r = sum(x["read_s"] for x in got["ranks"])
            print(f"== {kind} {naming} tp{tp} rep{rep}: backend {got['backend_s']:.3f}s read {tot_r:.3f}s "
                  f"{tot_b / tot_r / 1e9:.1f} GB/s", flush=True)
            for x in got["ranks"][:3]:
                print("  ", json.dumps(x), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "fill":
        print(json.dumps(fill(sys.argv[2], sys.argv[3], int(sys.argv[4]), [int(x) for x in sys.argv[5].split(",")])))
    else:
        main()
