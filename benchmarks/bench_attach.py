#!/usr/bin/env python3
"""Attach latency: weightcache (service + client, and the raw import + views) vs torch CUDA IPC.

Two layouts, both BF16 Llama shapes:

- 7B-class: the Llama-2-7B checkpoint of ``bench_load`` served with
  ``naming = "vllm"`` (fused ``qkv_proj``/``gate_up_proj``): 195 tensors, 12.55 GiB;
- 70B-class TP-8 rank: a checkpoint holding exactly one TP-8 rank of
  Llama-2-70B (723 tensors in HF naming, 16.0 GiB; sparse file, zeros),
  served at TP 1 (the manifest has the rank's names, shapes and sizes; how
  the slab was filled does not change an attach).

A ``weightcache serve`` subprocess (``--backend cuda`` or ``host``) holds
both. A separate engine process then times, per layout, after warm-ups:

1. ``attach(path, device=..., fallback=False)`` end to end (connect, hello,
   attach request, reply with the manifest and fd, local cache key from the
   checkpoint's headers, fd import, views); ``close()`` outside the timing;
2. the raw part: ``backend.import_fd`` + ``manifest.build_views`` on an fd
   and manifest already received, then the frame decode
   (``protocol.decode``) and ``Manifest.from_wire`` alone;
3. torch: the bench process allocates every tensor of the same manifest
   separately (``torch.empty``, one allocation per tensor) and sends
   ``torch.multiprocessing.reductions.reduce_tensor`` of each through a
   ``torch.multiprocessing`` queue (torch's own transport, pickle: the
   baseline's, never weightcache's); the engine times rebuilding all of them
   (``rebuild_fn(*args)``, which opens each CUDA IPC handle), dropping them
   between iterations so each rebuild opens the handles again. Also the
   same with all tensors as views of one allocation.

Usage: bench_attach.py [--device cuda|cpu] [--iters N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    LLAMA2_7B, LLAMA2_70B_TP8_RANK, emit, has_cuda, met, scaled, service_env, stats, versions, wait_ready,
    write_checkpoint, write_config,
)


def _engine(cfg: dict, items_q, result_q) -> None:
    """The engine process: every timing of one run; results go back as a JSON-able dict."""
    sys.path.insert(0, cfg["service_dir"])
    import torch

    from weightcache import attach, protocol
    from weightcache.session import Session
    from weightcache.manifest import build_views
    from weightcache.manifest import unpack_file
    from weightcache.memory import get_backend

    dev = cfg["device"]
    out: dict = {}
    if dev.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=dev)
    for m in cfg["models"]:
        r: dict = {}
        kw = dict(device=dev, fallback=False, socket_dir=cfg["socket_dir"], naming=m["naming"])
        for _ in range(cfg["warmup"]):
            attach(m["path"], **kw).close()
        times, close_t, ntens = [], [], 0
        prof = None
        if cfg.get("profile"):
            import cProfile

            prof = cProfile.Profile()
        for _ in range(cfg["iters"]):
            if prof is not None:
                prof.enable()
            t0 = time.perf_counter()
            w = attach(m["path"], **kw)
            t1 = time.perf_counter()
            if prof is not None:
                prof.disable()
            ntens = len(w.tensors)
            w.close()
            del w
            t2 = time.perf_counter()
            times.append((t1 - t0) * 1e3)
            close_t.append((t2 - t1) * 1e3)
        if prof is not None:
            import pstats

            print(f"--- engine profile, attach() of {m['label']}, {cfg['iters']} calls", file=sys.stderr)
            pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
        r["attach_ms"] = stats(times)
        r["close_ms"] = stats(close_t)
        r["tensors"] = ntens
        # Raw: one reply, then import + views on its fd repeatedly.
        s = Session(os.path.join(cfg["socket_dir"], "0.sock"))
        reply = s.request(protocol.Attach(model=m["path"], tp_size=1, tp_rank=0, wait_ms=0, dtype="auto",
                                          naming=m["naming"], mode="zero_copy"))
        fd, manifest_fd = s.last_fds
        frame = protocol.encode(reply)
        r["manifest_json_bytes"] = reply.manifest_size_bytes  # the manifest file beside the frame
        raw = os.pread(manifest_fd, reply.manifest_size_bytes, 0)
        os.close(manifest_fd)
        manifest = unpack_file(raw)[1]
        backend = get_backend(reply.backend, 0)
        imp, views_t, dec, mj = [], [], [], []
        for _ in range(cfg["warmup"] + cfg["iters"]):
            t0 = time.perf_counter()
            slab = backend.import_fd(fd, manifest.slab_size_bytes, dev)
            t1 = time.perf_counter()
            views = build_views(slab.tensor, manifest)
            t2 = time.perf_counter()
            protocol.decode(frame[4:])
            t3 = time.perf_counter()
            unpack_file(raw)
            t4 = time.perf_counter()
            del views
            slab.close()
            del slab
            imp.append((t1 - t0) * 1e3)
            views_t.append((t2 - t1) * 1e3)
            dec.append((t3 - t2) * 1e3)
            mj.append((t4 - t3) * 1e3)
        w = cfg["warmup"]
        r["import_ms"], r["views_ms"] = stats(imp[w:]), stats(views_t[w:])
        r["decode_ms"], r["manifest_from_json_ms"] = stats(dec[w:]), stats(mj[w:])
        r["raw_ms"] = stats([a + b for a, b in zip(imp[w:], views_t[w:])])
        os.close(fd)
        s.close()
        out[m["label"]] = r
    # torch CUDA IPC baseline.
    if dev.startswith("cuda"):
        while True:
            msg = items_q.get()
            if msg is None:
                break
            label, kind, items = msg
            times = []
            for i in range(cfg["warmup"] + cfg["iters"]):
                t0 = time.perf_counter()
                ts = [fn(*args) for fn, args in items]
                torch.cuda.current_stream().synchronize()
                t1 = time.perf_counter()
                del ts
                gc.collect()
                if i >= cfg["warmup"]:
                    times.append((t1 - t0) * 1e3)
            out[label][f"torch_{kind}_ms"] = stats(times)
            result_q.put(("done", label, kind))
    result_q.put(("result", out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if has_cuda() else "cpu")
    ap.add_argument("--size", choices=("full", "small"), default=None)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dir", default=os.environ.get("BENCH_DATA_DIR", "/tmp/weightcache-bench"))
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the engine's attach() calls and the service (top functions to stderr)")
    args = ap.parse_args()
    size = args.size or ("full" if args.device == "cuda" else "small")
    cuda = args.device == "cuda"

    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import reduce_tensor

    s7 = LLAMA2_7B if size == "full" else scaled(LLAMA2_7B, 8)
    s70 = LLAMA2_70B_TP8_RANK if size == "full" else scaled(LLAMA2_70B_TP8_RANK, 8)
    base = Path(args.dir)
    ck7 = write_checkpoint(base / f"load-llama7b-{size}", s7, "random",
                           max_file_bytes=4 * 10**9 if size == "full" else 64 * 10**6)
    ck70 = write_checkpoint(base / f"attach-llama70b-tp8rank-{size}", s70, "sparse")
    work = Path(tempfile.mkdtemp(prefix="wc-attach-"))
    sock = str(work / "0.sock")
    cfg_path = write_config(work / "weightcache.toml", {
        "llama7b-vllm": {"path": ck7, "naming": "vllm"},
        "llama70b-tp8-rank": {"path": ck70, "naming": "hf"},
    }, "cuda" if cuda else "host", read_threads=16)
    log_path = work / "service.log"
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        prof_args = ["-m", "cProfile", "-o", str(work / "service.prof")] if args.profile else []
        proc = subprocess.Popen([sys.executable, *prof_args, "-m", "weightcache", "serve", "--gpu", "0", "--config", str(cfg_path),
                                 "--listen", sock, "--backend", "cuda" if cuda else "host"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=service_env(), cwd=work)
    try:
        st = wait_ready(sock, proc, 900, log_path)
        t_ready = time.perf_counter() - t0
        models = [{"label": "7B-class (Llama-2-7B, vllm naming)", "path": str(ck7), "naming": "vllm"},
                  {"label": "70B-class TP-8 rank (Llama-2-70B rank, hf naming)", "path": str(ck70), "naming": "hf"}]
        ctx = mp.get_context("spawn")
        items_q, result_q = ctx.Queue(), ctx.Queue()
        ecfg = {"device": "cuda:0" if cuda else "cpu", "socket_dir": str(work), "models": models,
                "iters": args.iters, "warmup": args.warmup, "profile": args.profile, "service_dir": str(Path(__file__).resolve().parents[1]
                                                                             / "service")}
        eng = ctx.Process(target=_engine, args=(ecfg, items_q, result_q))
        eng.start()
        if cuda:
            from weightcache.manifest import torch_dtype

            for m, name in zip(models, ("llama7b-vllm", "llama70b-tp8-rank")):
                # Shapes of the served manifest: ask the service for it once.
                from weightcache import protocol
                from weightcache.client import read_manifest_file
                from weightcache.session import Session

                s = Session(sock)
                rep = s.request(protocol.Attach(model=name, tp_size=1, tp_rank=0, wait_ms=0, mode="zero_copy"))
                man = read_manifest_file(s.last_fds[1], rep.manifest_size_bytes)
                for fd in s.last_fds:
                    os.close(fd)
                s.close()
                recs = [r for r in man.tensors if r.alias_of is None]
                per = [torch.empty(r.shape, dtype=torch_dtype(r.dtype), device="cuda:0") for r in recs]
                items_q.put((m["label"], "per_tensor", [reduce_tensor(t) for t in per]))
                while True:
                    msg = result_q.get()
                    if msg[0] == "done":
                        break
                del per
                one = torch.empty(man.slab_size_bytes, dtype=torch.uint8, device="cuda:0")
                views = [one[r.offset_bytes: r.offset_bytes + r.size_bytes].view(torch_dtype(r.dtype))
                         .as_strided(r.shape, r.stride) for r in recs]
                items_q.put((m["label"], "one_allocation", [reduce_tensor(t) for t in views]))
                while True:
                    msg = result_q.get()
                    if msg[0] == "done":
                        break
                del views, one
                torch.cuda.empty_cache()
        items_q.put(None)
        while True:
            msg = result_q.get(timeout=600)
            if msg[0] == "result":
                res_models = msg[1]
                break
        eng.join(60)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if args.profile and (work / "service.prof").exists():
        import pstats

        print("--- service profile (whole run, load included)", file=sys.stderr)
        pstats.Stats(str(work / "service.prof"), stream=sys.stderr).sort_stats("tottime").print_stats(30)
    labels = [m["label"] for m in models]
    r7, r70 = res_models[labels[0]], res_models[labels[1]]
    ratio = r70["attach_ms"]["median"] / r7["attach_ms"]["median"]
    raw_ratio = r70["raw_ms"]["median"] / r7["raw_ms"]["median"]
    res = {"versions": versions(), "device": args.device, "size": size, "iters": args.iters,
           "service_ready_s": t_ready, "models": res_models,
           "targets": {"p50<=1ms(7B, attach)": r7["attach_ms"]["median"] <= 1.0,
                       "p50<=1ms(7B, raw import+views)": r7["raw_ms"]["median"] <= 1.0,
                       "700/200<=2 (attach)": ratio <= 2.0, "700/200<=2 (raw)": raw_ratio <= 2.0},
           "ratio_attach": ratio, "ratio_raw": raw_ratio}

    def f(s: dict) -> str:
        return f"{s['median']:.3f} / {s['p99']:.3f}"

    md = [f"### Attach latency ({args.device}, {size}; p50 / p99 ms over {args.iters} after {args.warmup} warm-ups)", "",
          "| path | " + " | ".join(f"{lab} ({res_models[lab]['tensors']} tensors)" for lab in labels) + " |",
          "|---|---|---|"]
    rows = [("attach() through the service (end to end)", "attach_ms"),
            ("raw: import_fd + build_views", "raw_ms"),
            ("  import_fd (fd import + map + tensor wrap)", "import_ms"),
            ("  build_views", "views_ms"),
            ("  protocol.decode of the attach reply frame", "decode_ms"),
            ("  unpack_file (manifest file: JSON + packed columns)", "manifest_from_json_ms"),
            ("close()", "close_ms"),
            ("torch reduce_tensor/rebuild, one allocation per tensor", "torch_per_tensor_ms"),
            ("torch reduce_tensor/rebuild, views of one allocation", "torch_one_allocation_ms")]
    for title, key in rows:
        if key in r7:
            md.append(f"| {title} | {f(r7[key])} | {f(r70[key])} |")
    md += ["", f"manifest file bytes: {r7['manifest_json_bytes']} / {r70['manifest_json_bytes']}; "
               f"70B-rank/7B p50 ratio: attach {ratio:.2f}, raw {raw_ratio:.2f}; service ready after {t_ready:.1f} s",
           "targets: p50 <= 1 ms (7B, attach end to end): "
           f"{met(res['targets']['p50<=1ms(7B, attach)'])}; (7B, raw import+views): "
           f"{met(res['targets']['p50<=1ms(7B, raw import+views)'])}; 700-tensor within 2x: attach "
           f"{met(ratio <= 2)}, raw {met(raw_ratio <= 2)}"]
    emit(f"attach_{args.device}", res, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
