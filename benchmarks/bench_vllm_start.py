#!/usr/bin/env python3
"""vLLM engine start to first token, and the engine's weight memory: default loader vs ``copy`` vs ``zero_copy``.

Run with vLLM's interpreter (mk/vllm.mk builds it; the CPU build here)::

    .venv-vllm/bin/python benchmarks/bench_vllm_start.py [--reps 2] [--layers 8]

One float32 Llama checkpoint (transformers, random weights: hidden 1024,
8 heads / 4 KV heads, intermediate 2816, vocabulary 32000, ``--layers``
layers; about 640 MB at 8 layers) is written to ``$BENCH_DATA_DIR`` (reused),
and one ``weightcache serve --backend host`` holds it (``naming = "vllm"``,
``dtype = "float32"``). Each engine is a fresh process
(``tests/engines/vllm_runner.py``, in-process engine core, ``enforce_eager``,
``max_model_len`` 64), modes interleaved within each repetition so that all
three see the same machine state:

- ``default``: vLLM's own loader (safetensors from the page cache; the
  checkpoint is read once before the first run);
- ``copy``: ``load_format="weightcache"``, ``mode = "copy"``;
- ``zero_copy``: ``load_format="weightcache"`` (the default mode).

Reported per mode: the process's wall time from its start to the first
generated token (``first_token_s``: Python and vLLM imports, engine
construction with the weight load, KV-cache set-up, one-token
generation), the same from vLLM imported (``LLM()`` to first token), the model load (vLLM's ``get_model``: build, loader,
``process_weights_after_loading``), and after generation the engine's own memory
(``/proc/self/smaps_rollup`` ``Anonymous``: the shared memfd mapping is not
in it; smaps' ``Private_*`` would count the mapping's pages as private while
no other process maps them), the mapping's resident pages (``RssShmem``),
and the parameters outside the ``memfd:weightcache`` mapping. "Weight
memory" is the engine's own memory above the zero-copy engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, emit, service_env, versions, wait_ready, warm_page_cache, write_config  # noqa: E402

RUNNER = ROOT / "tests" / "engines" / "vllm_runner.py"
MODES = ("default", "copy", "zero_copy")
PROMPTS = [[1, 5, 17, 42, 99]]


def build_checkpoint(dest: Path, layers: int) -> Path:
    """A float32 LlamaForCausalLM by transformers (random weights), saved once."""
    if (dest / "config.json").exists():
        return dest
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(dest, max_shard_size="256MB")
    return dest


def run_engine(model: Path, mode: str, socket_dir: str) -> dict:
    job = {"model": str(model), "dtype": "float32", "prompts": PROMPTS, "max_tokens": 4, "probe": True}
    if mode != "default":
        job.update(load_format="weightcache", extra={"socket_dir": socket_dir, "fallback": False, "mode": mode})
    env = service_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_RPC_BASE_PATH": tempfile.mkdtemp(prefix="wc-bench-rpc-")})
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(RUNNER), json.dumps(job)], capture_output=True, text=True, env=env,
                       timeout=900, stdin=subprocess.DEVNULL)
    wall_s = time.monotonic() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines or "tokens" not in json.loads(lines[-1][7:]):
        raise SystemExit(f"{mode}: engine failed (rc={p.returncode})\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    result = json.loads(lines[-1][7:])
    (probe,) = result["probe"]
    m = probe["memory_kb"]
    return {"mode": mode, "first_token_s": result["first_token_s"], "engine_s": result["start_s"],
            "engine_to_first_token_s": result["first_token_s"] - result["import_s"], "import_s": result["import_s"],
            "process_wall_s": wall_s, "load_s": result["load_s"],
            "anonymous_bytes": m["Anonymous"] * 1024, "private_bytes": (m["Private_Clean"] + m["Private_Dirty"]) * 1024,
            "rss_shmem_bytes": m["RssShmem"] * 1024, "outside_params": len(probe["outside"]),
            "params": probe["params"], "param_bytes": probe["param_bytes"], "tokens": result["tokens"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    data = Path(os.environ.get("BENCH_DATA_DIR", "/tmp/weightcache-bench"))
    model = build_checkpoint(data / f"vllm-llama-{args.layers}l-f32", args.layers)
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    warm_page_cache(model)
    work = Path(tempfile.mkdtemp(prefix="wc-bench-vllm-", dir="/tmp"))
    cfg = write_config(work / "weightcache.toml", {"m": {"path": str(model), "naming": "vllm", "dtype": "float32"}},
                       backend="host")
    sock = str(work / "0.sock")
    log_path = work / "service.log"
    with open(log_path, "wb") as log:
        svc = subprocess.Popen([sys.executable, "-m", "weightcache", "serve", "--gpu", "0", "--config", str(cfg),
                                "--listen", sock, "--backend", "host"], stdout=log, stderr=log, env=service_env(),
                               stdin=subprocess.DEVNULL)
    try:
        wait_ready(sock, svc, 600, log_path)
        runs = [run_engine(model, mode, str(work)) for _ in range(args.reps) for mode in MODES]
    finally:
        svc.kill()
        svc.wait()
    tokens = {json.dumps(r["tokens"]) for r in runs}
    by_mode = {mode: [r for r in runs if r["mode"] == mode] for mode in MODES}
    zc_anon = statistics.median(r["anonymous_bytes"] for r in by_mode["zero_copy"])
    rows, summary = [], {}
    for mode, rs in by_mode.items():
        s = {"first_token_s": statistics.median(r["first_token_s"] for r in rs),
             "first_token_s_all": [round(r["first_token_s"], 2) for r in rs],
             "engine_to_first_token_s": statistics.median(r["engine_to_first_token_s"] for r in rs),
             "engine_to_first_token_s_all": [round(r["engine_to_first_token_s"], 2) for r in rs],
             "load_s": statistics.median(r["load_s"] for r in rs),
             "anonymous_bytes": statistics.median(r["anonymous_bytes"] for r in rs),
             "private_bytes": statistics.median(r["private_bytes"] for r in rs),
             "rss_shmem_bytes": statistics.median(r["rss_shmem_bytes"] for r in rs),
             "outside_params": rs[0]["outside_params"], "params": rs[0]["params"]}
        s["weight_bytes_above_zero_copy"] = s["anonymous_bytes"] - zc_anon
        summary[mode] = s
        load = f"{s['load_s']:.2f}"
        rows.append(f"| {mode} | {s['first_token_s']:.2f} ({', '.join(map(str, s['first_token_s_all']))}) "
                    f"| {s['engine_to_first_token_s']:.2f} ({', '.join(map(str, s['engine_to_first_token_s_all']))}) "
                    f"| {load} "
                    f"| {s['anonymous_bytes'] / 2**20:.0f} | {s['weight_bytes_above_zero_copy'] / 2**20:+.0f} "
                    f"| {s['rss_shmem_bytes'] / 2**20:.0f} | {s['outside_params']}/{s['params']} |")
    md = "\n".join([
        f"vLLM engine start, {time.strftime('%Y-%m-%d')}, Llama float32 {args.layers} layers, "
        f"{size / 2**20:.0f} MiB checkpoint, {args.reps} runs per mode, {os.cpu_count()} CPUs; "
        f"tokens identical across all runs: {len(tokens) == 1}",
        "",
        "| mode | process start to first token, s: median (runs) | `LLM()` to first token, s: median (runs) "
        "| model load, s: median | own memory (Anonymous), MiB "
        "| vs zero_copy, MiB | shared mapping resident (RssShmem), MiB | parameters outside the mapping |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    emit("vllm_start", {"versions": versions(), "checkpoint_bytes": size, "layers": args.layers,
                        "summary": summary, "runs": runs, "tokens_identical": len(tokens) == 1}, md)
    return 0 if len(tokens) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
