#!/usr/bin/env python3
"""The vLLM layout and TP ranks against the HF layout, same checkpoint, same run: the load alone, in process.

For a Llama-shaped and a Qwen2-shaped (q/k/v biases, tied embeddings) bf16
checkpoint in the page cache, times :func:`weightcache.pipeline.fill` of
each (naming, TP) into a fresh slab of the backend (host: a memfd; cuda: a
VMM allocation), ranks of a TP layout one after the other (summed), and
reports each case against ``naming = "hf"`` at TP 1. Also whether torch was
needed (``torch_free``) and, with ``--oracle``, that the bytes equal the torch
pipeline's (host backend only).

Targets (issue 23, CPU CI): vLLM TP 1 within 1.3x of HF, TP 2 (ranks summed)
within 1.5x; on the GPU, within 1.1x.

Usage: bench_layouts.py [--device cpu|cuda] [--size-gb G] [--reps N] [--threads N] [--oracle]
       [--tps 1,2,8]
       [--dir DIR] [--remove]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import GB, LlamaShape, emit, has_cuda, layers_for, met, stats, versions, warm_page_cache  # noqa: E402
from bench_common import write_checkpoint as _write_llama  # noqa: E402

#: Qwen2.5-7B's dimensions.
QWEN25_7B = (3584, 18944, 28, 4, 128, 28, 152064)
LLAMA3_8B = LlamaShape(4096, 14336, 32, 8, 128, 32, 128256)


@dataclass(frozen=True)
class Qwen2Shape(LlamaShape):
    """A Qwen2 decoder: Llama's tensors plus q/k/v biases, tied embeddings (no ``lm_head.weight``)."""

    def config(self) -> dict[str, Any]:
        return {**super().config(), "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                "tie_word_embeddings": True}

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        out = []
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for name, shape in super().tensors():
            if name == "lm_head.weight":
                continue
            out.append((name, shape))
            for proj, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                if name.endswith(f"self_attn.{proj}.weight"):
                    out.append((name[: -len("weight")] + "bias", (n,)))
        return out


def _scaled(shape: LlamaShape, gb: float, cls=LlamaShape) -> LlamaShape:
    """``shape`` (widths divided by 4 under 2 GB) with the layers that give about ``gb``."""
    if gb < 2:
        shape = cls(shape.hidden // 4, shape.inter // 4, shape.heads, shape.kv_heads, shape.head_dim // 4,
                    shape.layers, shape.vocab // 4)
    else:
        shape = cls(**shape.__dict__)
    n = layers_for(int(gb * GB), shape).layers
    return cls(**{**shape.__dict__, "layers": n})


def _fill_once(ck: Path, naming: str, tp: int, backend: Any, device: dict, threads: int | None,
               oracle: bool) -> dict:
    from weightcache import pipeline
    from weightcache.reader import _loader as loader
    from weightcache.spec import LoadRequest, RankRequest

    opts = loader.LoaderOptions() if threads is None else loader.LoaderOptions(threads=threads)
    total = 0.0
    size = 0
    free = True
    same = None
    for rank in range(tp):
        p = pipeline.plan(RankRequest(LoadRequest("m", str(ck), naming=naming), tp, rank), device)
        w = backend.allocate(p.slab_size_bytes, "m")
        t0 = time.perf_counter()
        f = pipeline.fill(p, w, options=opts)
        total += time.perf_counter() - t0
        size += f.bytes_read
        free = free and f.torch_free
        if oracle and getattr(w, "buffer", None) is not None:
            import torch

            slab = torch.zeros(p.slab_size_bytes, dtype=torch.uint8)
            pipeline.execute(p, slab, options=opts)
            same = (same is not False) and bytes(w.buffer[: p.slab_size_bytes]) == bytes(slab.numpy())
        w.abort()
    return {"fill_s": total, "payload_bytes": size, "torch_free": free, "oracle_equal": same}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if has_cuda() else "cpu")
    ap.add_argument("--size-gb", type=float, default=None, help="per checkpoint; default 15 (cuda) or 0.5 (cpu)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="reader threads (default: the service's)")
    ap.add_argument("--oracle", action="store_true", help="also compare the bytes with the torch pipeline (host)")
    ap.add_argument("--dir", default=os.environ.get("BENCH_DATA_DIR", "/tmp/weightcache-bench"))
    ap.add_argument("--tps", default="1,2", help="TP sizes to load, comma-separated (default 1,2)")
    ap.add_argument("--remove", action="store_true")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    gb = args.size_gb if args.size_gb is not None else (15.0 if cuda else 0.5)
    from weightcache.memory import get_backend

    backend = get_backend("cuda", 0) if cuda else get_backend("host")
    device = backend.device_info()
    shapes = {"llama": _scaled(LLAMA3_8B, gb), "qwen2": _scaled(Qwen2Shape(*QWEN25_7B), gb, Qwen2Shape)}
    tps = [int(x) for x in args.tps.split(",")]
    cases = [("hf", 1), ("vllm", 1)] + [(n, tp) for tp in tps if tp > 1 for n in ("hf", "vllm")]
    res: dict[str, Any] = {"versions": versions(), "device": args.device, "size_gb": gb, "reps": args.reps,
                           "threads": args.threads or "default", "cpus": len(os.sched_getaffinity(0)), "models": {}}
    md = [f"### Load by layout, same checkpoint, same run ({args.device}, {'cuda' if cuda else 'host'} backend, "
          f"{res['cpus']} CPUs, reader threads {res['threads']}, row-parallel shards copied from "
          f"the file's mapping; in-process `pipeline.fill`, ranks one after the "
          f"other, median of {args.reps} (min–max))", "",
          "| model | naming | TP | payload GB | fill s | GB/s | vs hf TP 1 | torch-free | bytes = torch pipeline |",
          "|---|---|---|---|---|---|---|---|---|"]
    try:
        for fam, shape in shapes.items():
            ck = _write_llama(Path(args.dir) / f"layouts-{fam}-{gb:g}gb", shape, "random")
            warm_page_cache(ck)
            runs: dict[str, list] = {}
            for _ in range(args.reps):  # interleaved, so drift hits every case alike
                for naming, tp in cases:
                    if shape.heads % tp or (shape.kv_heads % tp and tp % shape.kv_heads):
                        continue  # not a layout of this model (Qwen2.5-7B: 28 heads, no TP 8)
                    got = runs.setdefault(f"{naming}/{tp}", [])
                    got.append(_fill_once(ck, naming, tp, backend, device, args.threads, args.oracle and not got))
            base = stats([r["fill_s"] for r in runs["hf/1"]])["median"]
            out = {}
            for key, rs in runs.items():
                naming, tp = key.split("/")
                s = stats([r["fill_s"] for r in rs])
                ratio = s["median"] / base
                target = 1.0 if naming == "hf" and tp == "1" else (1.1 if cuda else 1.3 if tp == "1" else 1.5)
                oracle = rs[0]["oracle_equal"]
                out[key] = {"fill_s": s, "ratio_vs_hf_tp1": ratio, "target": target,
                            "torch_free": all(r["torch_free"] for r in rs), "oracle_equal": oracle,
                            "payload_bytes": rs[0]["payload_bytes"]}
                md.append(f"| {fam} | {naming} | {tp} | {rs[0]['payload_bytes'] / GB:.2f} | "
                          f"{s['median']:.3f} ({s['min']:.3f}–{s['max']:.3f}) | "
                          f"{rs[0]['payload_bytes'] / s['median'] / GB:.1f} | {ratio:.2f}x"
                          f"{'' if key == 'hf/1' else f' (≤ {target}x: {met(ratio <= target)})'} | "
                          f"{'yes' if out[key]['torch_free'] else 'NO'} | "
                          f"{'n/a' if oracle is None else ('yes' if oracle else 'NO')} |")
            res["models"][fam] = {"shape": shape.__dict__, "cases": out}
            if args.remove:
                shutil.rmtree(ck, ignore_errors=True)
    finally:
        pass
    emit(f"layouts_{args.device}", res, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
