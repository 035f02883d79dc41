#!/usr/bin/env python3
"""An image write's effect on a concurrent attach (issue 36: "p99 within 2x of idle").

One ``weightcache serve`` (``--backend host`` or ``cuda``) holds model A READY (small, ``image = false``) and
has model B (``--write-gb``, ``image = true``, ``preload = "disk"``: loaded at its first attach). The bench
process (an engine) attaches A and closes it in a loop (``attach(..., fallback=False)`` end to end, close
outside the timing):

1. **idle**: ``--idle-s`` seconds, no image written;
2. **write**: B is attached once (it loads, READY), which starts the write of B's image; A's attach loop runs
   from the moment the temporary file appears until the image has its final name (the write, its ``fsync``
   and the rename);
3. **idle** again, ``--idle-s`` seconds (pooled with the first: a shared machine's load drifts).

``--compare DIR`` runs the services of another tree (an earlier commit's ``service/``) too, alternating with
this tree's service by service, for a before/after in one run.

Reported: p50/p99/max of A's attach latency (ms) in both phases, their ratio, and the write's own figures from
the service's ``image written`` line (seconds, GB/s) under ``--rate`` (``[service] image_write_bytes_per_s``;
default: the service's default, 1 GiB/s; 0: uncapped).

Usage: bench_image_write_p99.py [--backend host|cuda] [--write-gb 2] [--rate BYTES] [--idle-s 4] [--reps 3]
                                [--compare SERVICE_DIR] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    GB,
    LLAMA2_7B,
    SERVICE_DIR,
    emit,
    layers_for,
    scaled,
    service_env,
    stats,
    versions,
    wait_ready,
    write_checkpoint,
)

_WRITTEN = re.compile(r"image written .*?size_bytes=(\d+) duration_ms=(\d+) write_gbps=([\d.]+)")


def _config(path: Path, a: Path, b: Path, backend: str, images: Path, rate: int | None) -> Path:
    lines = ["[service]", f'backend = "{backend}"', f'image_dir = "{images}"']
    if rate is not None:
        lines.append(f"image_write_bytes_per_s = {rate}")
    for name, ck, extra in (("a", a, ["image = false"]), ("b", b, ["image = true", 'preload = "disk"'])):
        lines += [f'\n[models."{name}"]', f'path = "{ck}"', *extra, "layouts = [{ tp = 1, gpus = [0] }]"]
    path.write_text("\n".join(lines) + "\n")
    return path


def _attach_loop(path: str, device: str, sock_dir: str, until, min_n: int = 0,
                 at: list[float] | None = None) -> list[float]:
    """Attaches ``path`` and closes it until ``until()`` (checked after each) and at least ``min_n`` times; ms.
    ``at``: gets each attach's start (``time.monotonic()``)."""
    from weightcache import attach

    out = []
    while True:
        if at is not None:
            at.append(time.monotonic())
        t0 = time.perf_counter()
        w = attach(path, device=device, fallback=False, socket_dir=sock_dir)
        out.append((time.perf_counter() - t0) * 1e3)
        w.close()
        del w
        if until() and len(out) >= min_n:
            return out


def _dirty_bytes() -> int:
    """``Dirty + Writeback`` of /proc/meminfo, bytes (0 where unreadable)."""
    try:
        f = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return sum(int(f[k].split()[0]) << 10 for k in ("Dirty", "Writeback"))
    except (OSError, KeyError, ValueError):
        return 0


def _rep(a: Path, b: Path, backend: str, device: str, images: Path, rate: int | None, idle_s: float,
         service_dir: str) -> dict:
    """One service (run from ``service_dir``): warm-up, an idle phase, B's load and the write phase, an idle phase
    again; the service stopped after."""
    from weightcache import attach

    shutil.rmtree(images, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix="wcbw-", dir="/tmp"))
    sock = work / "0.sock"
    cfg = _config(work / "wc.toml", a, b, backend, images, rate)
    log = work / "serve.log"
    with open(log, "w") as lf:
        proc = subprocess.Popen([sys.executable, "-m", "weightcache", "serve", "--gpu", "0", "--config", str(cfg),
                                 "--listen", str(sock), "--backend", backend], stdout=lf, stderr=lf,
                                env=service_env({"PYTHONPATH": service_dir}), cwd=work)
    try:
        deadline = time.monotonic() + 600
        while True:  # A READY
            try:
                attach(str(a), device=device, fallback=False, socket_dir=str(work)).close()
                break
            except Exception:  # noqa: BLE001 - not up yet
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"model a never attached\n{log.read_text()[-4000:]}") from None
                time.sleep(0.1)
        _attach_loop(str(a), device, str(work), lambda: True, 20)  # warm-up
        t_end = time.monotonic() + idle_s
        idle = _attach_loop(str(a), device, str(work), lambda: time.monotonic() > t_end, 50)

        def tmp_file() -> bool:
            return any(".tmp-" in p.name for p in images.iterdir()) if images.exists() else False

        def final() -> bool:
            return images.exists() and any(p.name.endswith(".safetensors") and not p.name.startswith(".")
                                           for p in images.iterdir())

        t0 = time.monotonic()
        attach(str(b), device=device, fallback=False, socket_dir=str(work), timeout=600).close()  # B loads
        load_b_s = time.monotonic() - t0
        deadline = time.monotonic() + 60
        while not (tmp_file() or final()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no image write started\n{log.read_text()[-4000:]}")
            time.sleep(0.005)
        t_w = time.monotonic()
        starts: list[float] = []
        dirty: list[int] = []
        sampling = threading.Event()

        def sample() -> None:  # the machine's dirty page cache while the write runs
            while not sampling.wait(0.05):
                dirty.append(_dirty_bytes())

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        during = _attach_loop(str(a), device, str(work), final, at=starts)
        sampling.set()
        window_s = time.monotonic() - t_w
        wait_ready(str(sock), proc, 60, log)
        t_end = time.monotonic() + idle_s
        idle += _attach_loop(str(a), device, str(work), lambda: time.monotonic() > t_end, 50)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = log.read_text()
    shutil.rmtree(work, ignore_errors=True)
    w = _WRITTEN.search(text)
    if w is None:
        raise RuntimeError(f"no image written line\n{text[-4000:]}")
    return {"idle": idle, "write": during, "starts": [t - t_w for t in starts], "window_s": window_s,
            "load_b_s": load_b_s, "size": int(w.group(1)), "write_s": int(w.group(2)) / 1e3,
            "write_gbps": float(w.group(3)), "dirty_max": max(dirty, default=0)}


def _report(reps: list[dict]) -> tuple[dict, dict, float, list[str]]:
    """Pooled idle and write stats, their p99 ratio, and one line per service."""
    s_idle = stats([x for r in reps for x in r["idle"]])
    s_write = stats([x for r in reps for x in r["write"]])
    per = []
    for r in reps:
        i, w = stats(r["idle"]), stats(r["write"])
        slow = sum(1 for ms in r["write"] if ms > 2 * i["p99"])
        per.append(f"p99 {i['p99']:.2f} -> {w['p99']:.2f} ms ({w['p99'] / i['p99']:.2f}x), write {r['write_s']:.2f} s "
                   f"({r['write_gbps']:.2f} GB/s), {slow} of {w['n']} attaches over 2x the idle p99, "
                   f"Dirty+Writeback peak {r['dirty_max'] / GB:.2f} GB")
    return s_idle, s_write, s_write["p99"] / s_idle["p99"], per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=("host", "cuda"), default="host")
    ap.add_argument("--write-gb", type=float, default=2.0, help="size of model B, whose image is written")
    ap.add_argument("--rate", type=int, default=None, help="image_write_bytes_per_s (default: the service's)")
    ap.add_argument("--idle-s", type=float, default=4.0, help="each idle phase (one before, one after the write)")
    ap.add_argument("--reps", type=int, default=3, help="services started, each an idle then a write phase")
    ap.add_argument("--compare", metavar="SERVICE_DIR", help="another service tree (an earlier commit's service/): "
                    "its services alternate with this tree's, rep by rep")
    ap.add_argument("--dir", default=os.environ.get("BENCH_DATA_DIR") or tempfile.gettempdir())
    args = ap.parse_args()
    device = "cpu" if args.backend == "host" else "cuda:0"
    base = Path(args.dir) / "bench-image-write"
    # A: the 7B tensor list at 1/8 of the widths (291 tensors, ~0.2 GB); B: 7B widths to --write-gb. Sparse
    # files: the bytes written are the slab's whatever they hold, and the checkpoints cost no disk.
    a = write_checkpoint(base / "a", scaled(LLAMA2_7B, 8), "sparse")
    # Under 1 GB (one 7B layer and the embeddings are 0.93 GB): quarter widths, for a quick run.
    shape_b = layers_for(int(args.write_gb * GB), LLAMA2_7B if args.write_gb >= 1 else scaled(LLAMA2_7B, 4))
    b = write_checkpoint(base / f"b-{shape_b.layers}l", shape_b, "sparse")
    images = base / "images"
    trees = {"this tree": str(SERVICE_DIR)}
    if args.compare:
        trees[args.compare] = str(Path(args.compare).resolve())
    reps: dict[str, list[dict]] = {k: [] for k in trees}
    for _ in range(args.reps):
        for name, d in trees.items():
            reps[name].append(_rep(a, b, args.backend, device, images, args.rate, args.idle_s, d))
    shutil.rmtree(images, ignore_errors=True)
    size = reps["this tree"][0]["size"]
    rate = "the service's default (1 GiB/s)" if args.rate is None else ("uncapped" if args.rate == 0 else
                                                                         f"{args.rate / 1e9:.3f} GB/s")
    md = [(f"Attach latency of model A (0.2 GB, 291 tensors) during an image write of model B ({size / GB:.2f} GB), "
           f"backend {args.backend}, write rate cap {rate}, {args.reps} services per tree (idle {args.idle_s:g} s "
           f"before and after the write, pooled)"),
          "", "| service tree | phase | attaches | p50 (ms) | p99 (ms) | max (ms) | p99 / idle |",
          "|---|---|---|---|---|---|---|"]
    out: dict = {"backend": args.backend, "size_bytes": size, "rate": args.rate, "versions": versions(), "trees": {}}
    lines = []
    for name in trees:
        s_idle, s_write, ratio, per = _report(reps[name])
        for phase, s in (("idle", s_idle), ("during the write", s_write)):
            md.append(f"| {name} | {phase} | {s['n']} | {s['median']:.2f} | {s['p99']:.2f} | {s['max']:.2f} | "
                      + (f"**{ratio:.2f}x** |" if phase != "idle" else "|"))
        lines += ["", f"{name}, per service:", ""] + [f"{k + 1}. {line}" for k, line in enumerate(per)]
        out["trees"][name] = {"idle_ms": s_idle, "write_ms": s_write, "p99_ratio": ratio, "reps": reps[name]}
    md += ["", "Issue target: p99 during the write within 2x of idle.", *lines]
    emit(f"image_write_p99_{args.backend}", out, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
