#!/usr/bin/env python3
"""Where the time of one ``attach()`` goes: a stage breakdown of the real client path.

Serves a 7B-class checkpoint (Llama-2-7B shapes, ``naming = "vllm"``: 195
tensors; sparse file, zeros: how the slab was filled does not change an
attach) from a ``weightcache serve`` subprocess, then times ``attach()`` in
this process with the client's own functions wrapped by timers (no copy of the
client logic): connect, send, the local checkpoint (``config.json``) and key
fields, waiting for the service (the blocking ``recvmsg``), frame decode,
``Manifest.from_wire``, the key check (``stat()`` of the files), fd import +
mapping, views. What the wrappers do not cover
(argument handling, the context manager, object creation) is ``other``.
Stage times are medians, so they need not add up to the end-to-end median.

Usage: bench_attach_stages.py [--device cuda|cpu] [--iters N]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import LLAMA2_7B, emit, has_cuda, patch_timers, scaled, service_env, stats, versions, wait_ready, write_checkpoint, write_config  # noqa: E402,E501


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if has_cuda() else "cpu")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--dir", default=os.environ.get("BENCH_DATA_DIR", "/tmp/weightcache-bench"))
    args = ap.parse_args()
    cuda = args.device == "cuda"
    shape = LLAMA2_7B if cuda else scaled(LLAMA2_7B, 8)
    ck = write_checkpoint(Path(args.dir) / f"stages-llama7b-{'full' if cuda else 'small'}", shape, "sparse")
    work = Path(tempfile.mkdtemp(prefix="wc-stages-"))
    sock = str(work / "0.sock")
    cfg = write_config(work / "weightcache.toml", {"llama7b-vllm": {"path": ck, "naming": "vllm"}},
                       "cuda" if cuda else "host", read_threads=16)
    log_path = work / "service.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "weightcache", "serve", "--gpu", "0", "--config", str(cfg),
                                 "--listen", sock, "--backend", "cuda" if cuda else "host"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=service_env(), cwd=work)
    try:
        wait_ready(sock, proc, 900, log_path)
        res = _measure(str(ck), str(work), "cuda:0" if cuda else "cpu", args.iters, args.warmup)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    res["versions"] = versions()
    rows = [f"### attach() stage breakdown ({args.device}; 7B-class, {res['tensors']} tensors; "
            f"p50 / p90 µs over {args.iters} after {args.warmup} warm-ups)", "",
            "| stage | p50 µs | p90 µs |", "|---|---|---|"]
    for name, s in res["stages"].items():
        rows.append(f"| {name} | {s['median']:.0f} | {s['p90']:.0f} |")
    rows.append(f"| **attach() end to end** | **{res['attach_us']['median']:.0f}** | {res['attach_us']['p90']:.0f} |")
    emit(f"attach_stages_{args.device}", res, "\n".join(rows))
    return 0


def _measure(ck: str, socket_dir: str, device: str, iters: int, warmup: int) -> dict:
    import torch

    from weightcache import identity, session  # the client imports identity on first use
    from weightcache.client import _attach as client  # the room whose names the stages patch

    if device.startswith("cuda"):
        torch.empty(1, device=device)
    acc: dict[str, float] = {}
    backend = client.local_backend(device)
    patches = [
        (client.Session, "__init__", "connect"),
        (client.Session, "send", "send hello + attach"),
        (client.Checkpoint, "__init__", "local Checkpoint: config.json (overlaps the service)"),
        (identity, "key_fields", "local key fields (overlaps the service)"),
        (session, "recv_with_fds", "recvmsg: waiting for the service + reading the reply"),
        (client.protocol.Connection, "next_message", "frame decode (JSON)"),
        (client.Manifest, "from_wire", "Manifest.from_wire (packed columns)"),
        (identity, "check_key", "key check: fields + stat() of the files"),
        (type(backend), "import_fd", "fd import + map + set access + tensor wrap"),
        (client, "build_views", "build_views (runs + unbind)"),
    ]
    saved = patch_timers(patches, acc)
    stage_times: dict[str, list[float]] = {name: [] for _, _, name in patches}
    other = "other (argument handling, manifest file fstat + pread + JSON, GC pause, Attachment)"
    stage_times[other] = []
    e2e, ntens = [], 0
    try:
        kw = dict(device=device, fallback=False, socket_dir=socket_dir, naming="vllm")
        for i in range(warmup + iters):
            acc.clear()
            t0 = time.perf_counter()
            w = client.attach(ck, **kw)
            dt = time.perf_counter() - t0
            ntens = len(w.tensors)
            w.close()
            del w
            if i >= warmup:
                e2e.append(dt * 1e6)
                for _, _, name in patches:  # disjoint: none of them calls another
                    stage_times[name].append(acc.get(name, 0.0) * 1e6)
                stage_times[other].append((dt - sum(acc.values())) * 1e6)
    finally:
        for owner, attr, orig in saved:
            setattr(owner, attr, orig)
    return {"device": device, "iters": iters, "tensors": ntens, "attach_us": stats(e2e),
            "stages": {k: stats(v) for k, v in stage_times.items()}}


if __name__ == "__main__":
    sys.exit(main())
