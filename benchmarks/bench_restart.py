#!/usr/bin/env python3
"""Restart to READY with the weights adopted from the fd store, a holder process standing in for systemd.

The holder (this script) does what PID 1 does for ``Type=notify`` with
``FileDescriptorStoreMax=``:

- it binds a ``SOCK_DGRAM`` notify socket and starts the service with
  ``NOTIFY_SOCKET`` pointing at it; it owns the listening socket and passes
  it as fd 3 named ``listen`` (``LISTEN_FDS``/``LISTEN_FDNAMES``/``LISTEN_PID``,
  set by a small exec wrapper so that ``LISTEN_PID`` is the service's pid);
- it keeps every fd the service sends with ``FDSTORE=1`` under its ``FDNAME``
  (and drops it on ``FDSTOREREMOVE=1``);
- after the first load (``READY=1`` plus the slab and manifest fds), it kills
  the service with SIGKILL, starts a new one passing the stored fds at
  fds 4, 5, ... after the listener, and times from just before the spawn to
  the ``READY=1`` datagram. Each size is restarted ``--reps`` times; the
  status reply then must say ``adopted``. The service runs from bytecode, as an
  installed package does (``PYTHONPYCACHEPREFIX`` of the run, written by the
  first start), whatever ``PYTHONDONTWRITEBYTECODE`` says.

Checkpoints are sparse (zeros, no disk): Llama-2-70B-shaped layers
(Llama-2-7B-shaped for the 1 GB one), HF naming, TP 1. Also timed, as the
floor of any restart: a fresh interpreter importing ``torch`` and
``weightcache.cli`` and, on CUDA, setting up the backend and torch's context.

Usage: bench_restart.py [--device cuda|cpu] [--sizes-gb 1,8,64] [--reps N]
"""

from __future__ import annotations

import argparse
import array
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    GB, LLAMA2_7B, LlamaShape, emit, has_cuda, layers_for, met, scaled, service_env, spread, stats, unix_listener, versions,
    write_checkpoint, write_config,
)

LLAMA2_70B = LlamaShape(8192, 28672, 64, 8, 128, 80, 32000)

# Moves the fds named in $WC_BENCH_FDS to 3, 4, ... and execs the service with
# LISTEN_PID set to its own pid, as systemd does.
WRAPPER = r"""
import fcntl, os, sys
fds = [int(x) for x in os.environ.pop("WC_BENCH_FDS").split(",")]
names = os.environ.pop("WC_BENCH_FDNAMES")
high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000 + i) for i, fd in enumerate(fds)]
for fd in fds:
    os.close(fd)
for i, fd in enumerate(high):
    os.dup2(fd, 3 + i)
    os.close(fd)
os.environ.update(LISTEN_FDS=str(len(fds)), LISTEN_FDNAMES=names, LISTEN_PID=str(os.getpid()))
os.execv(sys.executable, [sys.executable, "-m", "weightcache"] + sys.argv[1:])
"""

FLOOR = r"""
import sys, time
t0 = time.perf_counter()
import torch, weightcache.cli, weightcache.daemon
t1 = time.perf_counter()
if sys.argv[1] == "cuda":
    from weightcache.memory.cuda import CudaBackend
    CudaBackend(0).device_info()
    torch.empty(1, device="cuda:0")
    torch.cuda.synchronize()
t2 = time.perf_counter()
print(f"{t1 - t0:.6f} {t2 - t1:.6f}")
"""


class Holder:
    """The notify socket and fd store of one service instance (systemd's part)."""

    def __init__(self, work: Path, cfg: Path, backend: str) -> None:
        self.work, self.cfg, self.backend = work, cfg, backend
        self.notify_path = str(work / "notify.sock")
        self.nsock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.nsock.bind(self.notify_path)
        self.listener = unix_listener(str(work / "0.sock"))
        self.store: dict[str, int] = {}
        self.proc: subprocess.Popen | None = None
        self.log_path = work / "service.log"

    def start(self) -> float:
        names = ["listen"] + sorted(self.store)
        fds = [self.listener.fileno()] + [self.store[n] for n in sorted(self.store)]
        env = service_env({"NOTIFY_SOCKET": self.notify_path, "WC_BENCH_FDS": ",".join(map(str, fds)),
                           "WC_BENCH_FDNAMES": ":".join(names),
                           # From bytecode, as an installed package: the first start writes it here, the
                           # restarts read it (under PYTHONDONTWRITEBYTECODE=1 each compiled the service).
                           "PYTHONPYCACHEPREFIX": str(self.work / "pycache")})
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        log = open(self.log_path, "ab")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-c", WRAPPER, "serve", "--gpu", "0", "--config", str(self.cfg),
                                      "--backend", self.backend], pass_fds=fds, env=env, stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=log, cwd=self.work)
        log.close()
        return t0

    def wait(self, want_ready: bool, want_names: int, timeout_s: float) -> float:
        """Receives notifications until READY=1 (if wanted) and ``want_names`` stored fds; returns READY time."""
        deadline = time.monotonic() + timeout_s
        ready_t = 0.0
        while (want_ready and not ready_t) or len(self.store) < want_names:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise RuntimeError(f"service: no READY=1/fds in time (rc={self.proc.poll()})\n"
                                   + self.log_path.read_text()[-3000:])
            self.nsock.settimeout(min(left, 1.0))
            try:
                data, anc, _, _ = self.nsock.recvmsg(65536, socket.CMSG_SPACE(64 * 4))
            except socket.timeout:
                continue
            now = time.perf_counter()
            fds = []
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
                    fds.extend(a)
            kv = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            if kv.get("FDSTORE") == "1" and fds:
                name = kv.get("FDNAME", "stored")
                old = self.store.pop(name, None)
                if old is not None:
                    os.close(old)
                self.store[name] = fds[0]
                for extra in fds[1:]:
                    os.close(extra)
            else:
                for fd in fds:
                    os.close(fd)
            if kv.get("FDSTOREREMOVE") == "1":
                old = self.store.pop(kv.get("FDNAME", ""), None)
                if old is not None:
                    os.close(old)
            if kv.get("READY") == "1" and not ready_t:
                ready_t = now
        return ready_t

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        self.kill()
        for fd in self.store.values():
            os.close(fd)
        self.store.clear()
        self.nsock.close()
        self.listener.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if has_cuda() else "cpu")
    ap.add_argument("--sizes-gb", default=None, help="comma-separated; default 1,8,64 (cuda) or 0.05,0.2,0.5 (cpu)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=os.environ.get("BENCH_DATA_DIR", "/tmp/weightcache-bench"))
    args = ap.parse_args()
    cuda = args.device == "cuda"
    sizes = [float(x) for x in (args.sizes_gb or ("1,8,64" if cuda else "0.05,0.2,0.5")).split(",")]
    backend = "cuda" if cuda else "host"

    from weightcache import protocol
    from weightcache.session import Session

    floors = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", FLOOR, backend], env=service_env(), capture_output=True, text=True,
                             check=True).stdout.split()
        floors.append((float(out[0]), float(out[1])))
    rows = []
    for gb in sizes:
        target = int(gb * GB)
        if cuda:
            shape = layers_for(target, LLAMA2_7B if gb < 4 else LLAMA2_70B)
        else:
            shape = layers_for(target, scaled(LLAMA2_7B, 8))
        ck = write_checkpoint(Path(args.dir) / f"restart-{gb:g}gb-{backend}", shape, "sparse",
                              max_file_bytes=5 * 10**9)
        work = Path(tempfile.mkdtemp(prefix="wc-restart-"))
        cfg = write_config(work / "weightcache.toml", {"m": {"path": ck, "naming": "hf"}}, backend, read_threads=16)
        h = Holder(work, cfg, backend)
        try:
            t0 = h.start()
            t_ready = h.wait(True, 2, 1800) - t0
            h.wait(False, 2, 60)
            times, adopted = [], []
            for _ in range(args.reps):
                h.kill()
                t0 = h.start()
                times.append(h.wait(True, 2, 300) - t0)
                s = Session(str(work / "0.sock"), timeout=30)
                st = s.request(protocol.Status()).status
                s.close()
                adopted.append(all(x["adopted"] and x["state"] == "ready" for x in st["slabs"]))
            payload = st["slabs"][0]["total_bytes"]
            rows.append({"size_gb": gb, "payload_bytes": payload, "tensors": st["slabs"][0]["tensors"],
                         "first_load_to_ready_s": t_ready, "restart_to_ready_s": stats(times),
                         "all_adopted": all(adopted)})
        finally:
            h.close()
    ok = all(r["restart_to_ready_s"]["median"] <= 1.0 for r in rows)
    med = [r["restart_to_ready_s"]["median"] for r in rows]
    flat = max(med) <= 1.5 * min(med) + 0.05
    res = {"versions": versions(), "device": args.device, "reps": args.reps, "rows": rows,
           "floor_import_s": stats([a for a, _ in floors]), "floor_device_setup_s": stats([b for _, b in floors]),
           "targets": {"<=1s": ok, "flat": flat}}
    md = [f"### Restart to READY, slab adopted from the fd store ({args.device}; {args.reps} restarts per size, "
          "median (min–max))", "",
          "| slab payload | tensors | first load to READY s | restart (SIGKILL, new process) to READY s | adopted |",
          "|---|---|---|---|---|"]
    for r in rows:
        s = r["restart_to_ready_s"]
        md.append(f"| {r['payload_bytes'] / GB:.2f} GB | {r['tensors']} | {r['first_load_to_ready_s']:.2f} | "
                  f"{spread(s)} | {'yes' if r['all_adopted'] else 'NO'} |")
    md += ["", f"floor of any start, in a fresh interpreter: import torch + weightcache.cli/daemon "
               f"{res['floor_import_s']['median']:.3f} s" + (f", CudaBackend + torch CUDA context "
                                                               f"{res['floor_device_setup_s']['median']:.3f} s"
                                                               if cuda else ""),
           f"targets: <= 1 s: {met(ok)}; flat in size (max <= 1.5x min + 50 ms): "
           f"{met(flat)}"]
    emit(f"restart_{args.device}", res, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
