#!/usr/bin/env python3
"""Peer seeding (issue 37): a host-tier slab fetched from a peer service over NIXL (UCX, loopback) against
reading the same checkpoint from the page cache, same run; and the source's attaches while it serves.

One bf16 Llama-shaped checkpoint of ``--size-gb`` (random bytes, warmed into the page cache). Service ``a``
(host backend) loads it and serves it to peers (``serve_to_peers``). Then, ``--reps`` times each, a fresh
receiver service loads the same model:

- ``checkpoint``: no peers: it reads the checkpoint from the page cache (the ``loaded`` line's ``read_ms``:
  read and digests; ``duration_ms``: plan to sealed);
- ``peer``: ``peers = [a]``: it asks ``a`` (samples of the data, the key, the manifest), READs the slab with
  NIXL into its own memfd, checks every tensor's digest (the ``seeded`` line: READ seconds, digest ms; the
  ``loaded`` line's ``duration_ms``: plan to sealed).

While each ``peer`` receiver loads, this script attaches ``a``'s slab in a loop (an engine's well-behaved
attach: connect, attach, map, release) and compares those attaches' latency with idle attaches of the same
run (the issue's bound: within 2x of idle).

Usage: bench_seed.py [--size-gb G] [--reps N] [--dir DIR] [--remove]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_common import (
    GB,
    LLAMA2_7B,
    emit,
    layers_for,
    scaled,
    service_env,
    stats,
    versions,
    wait_ready,
    warm_page_cache,
    write_checkpoint,
    write_config,
)
from weightcache import attach

SECRET = "0123456789abcdef" * 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Svc:
    def __init__(self, base: Path, name: str, ck: Path, **service) -> None:
        self.dir = base / name
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        cfg = write_config(self.dir / "w.toml", {"m": {"path": ck, "serve_to_peers": True}}, "host", **service)
        self.log_path = self.dir / "log"
        self.sock = str(self.dir / "0.sock")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "weightcache", "serve", "--gpu", "0", "--config",
                                          str(cfg), "--listen", self.sock, "--backend", "host"],
                                         stdout=log, stderr=log, env=service_env())

    def ready(self) -> None:
        wait_ready(self.sock, self.proc, 600, self.log_path)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def one_attach(sock_dir: str) -> float:
    t0 = time.perf_counter()
    w = attach("m", socket_dir=sock_dir, fallback=False, timeout=30)
    w.close()
    return time.perf_counter() - t0


def field(log: str, line: str, name: str) -> float:
    m = re.findall(rf"{line}.*?\b{name}=([0-9.]+)", log)
    if not m:
        raise RuntimeError(f"no {line} {name} in the log:\n{log[-3000:]}")
    return float(m[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/wc-bench-seed")
    ap.add_argument("--remove", action="store_true", help="remove the checkpoint at the end")
    args = ap.parse_args()
    base = Path(args.dir)
    shape = layers_for(int(args.size_gb * GB), scaled(LLAMA2_7B, 4))
    ck = write_checkpoint(base / "ckpt", shape)
    warm_page_cache(ck)
    secret = base / "seed.secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    port = free_port()
    a = Svc(base, "a", ck, seed_listen=f"127.0.0.1:{port}", seed_secret_file=str(secret))
    rows: dict[str, list] = {"checkpoint": [], "peer": []}
    idle, busy = [], []
    try:
        a.ready()
        for _ in range(3):
            one_attach(str(a.dir))
        idle = [one_attach(str(a.dir)) for _ in range(30)]
        for rep in range(args.reps):
            for kind in ("checkpoint", "peer"):
                extra = {"peers": [f"127.0.0.1:{port}"], "seed_secret_file": str(secret)} if kind == "peer" else {}
                stop = threading.Event()
                during: list[float] = []

                def loop(stop: threading.Event = stop, during: list[float] = during) -> None:
                    while not stop.is_set():
                        during.append(one_attach(str(a.dir)))

                t = threading.Thread(target=loop) if kind == "peer" else None
                b = Svc(base, f"b-{kind}-{rep}", ck, **extra)
                try:
                    if t:
                        t.start()
                    b.ready()
                finally:
                    stop.set()
                    if t:
                        t.join()
                    b.stop()
                log = b.log()
                size = field(log, "loaded", "size_bytes")
                row = {"bytes": size, "duration_s": field(log, "loaded", "duration_ms") / 1e3}
                if kind == "peer":
                    assert "source=peer:" in log, log[-2000:]
                    row["transfer_s"] = field(log, "seeding: seeded", "duration_ms") / 1e3
                    row["read_gbps"] = field(log, "seeding: seeded", "read_gbps")
                    row["digest_s"] = field(log, "seeding: seeded", "digest_ms") / 1e3
                    busy += during
                else:
                    row["read_s"] = field(log, "loaded", "read_ms") / 1e3
                    row["read_gbps"] = size / row["read_s"] / GB
                rows[kind].append(row)
    finally:
        a.stop()
        if args.remove:
            shutil.rmtree(base, ignore_errors=True)
    ck_gbps = stats([r["bytes"] / r["duration_s"] / GB for r in rows["checkpoint"]])
    peer_gbps = stats([r["bytes"] / r["duration_s"] / GB for r in rows["peer"]])
    peer_read = stats([r["read_gbps"] for r in rows["peer"]])
    ck_read = stats([r["read_gbps"] for r in rows["checkpoint"]])
    si, sb = stats(idle), stats(busy) if busy else None
    size_gb = rows["peer"][0]["bytes"] / GB
    md = [(f"`bench_seed.py --size-gb {args.size_gb} --reps {args.reps}` ({time.strftime('%Y-%m-%d')}, "
           f"{os.cpu_count()} CPUs, host backend, UCX over loopback; slab {size_gb:.2f} GB)"), "",
          "| receiver | load, plan to sealed: GB/s median (min–max) | read stage GB/s median (min–max) |",
          "|---|---|---|",
          (f"| reads the checkpoint (page cache) | {ck_gbps['median']:.2f} ({ck_gbps['min']:.2f}–{ck_gbps['max']:.2f}) "
           f"| {ck_read['median']:.2f} ({ck_read['min']:.2f}–{ck_read['max']:.2f}) read + digests |"),
          (f"| seeded by the peer (NIXL READ) | {peer_gbps['median']:.2f} ({peer_gbps['min']:.2f}–{peer_gbps['max']:.2f}) "
           f"| {peer_read['median']:.2f} ({peer_read['min']:.2f}–{peer_read['max']:.2f}) READ alone; digests "
           f"{stats([r['digest_s'] for r in rows['peer']])['median']:.2f} s |"),
          "",
          f"peer / checkpoint, whole load: **{peer_gbps['median'] / ck_gbps['median']:.2f}x**",
          "",
          (f"source's attaches (connect, attach, map, release): idle p50 {si['median'] * 1e3:.2f} ms "
           f"(p90 {si['p90'] * 1e3:.2f}, n={si['n']})")
          + (f"; while it serves the peer p50 {sb['median'] * 1e3:.2f} ms (p90 {sb['p90'] * 1e3:.2f}, "
             f"n={sb['n']}): **{sb['median'] / si['median']:.2f}x** idle" if sb else "; none during the transfers")]
    emit("bench_seed", {"rows": rows, "idle_attach_s": idle, "busy_attach_s": busy, "versions": versions()},
         "\n".join(md))


if __name__ == "__main__":
    main()
