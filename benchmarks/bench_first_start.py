#!/usr/bin/env python3
"""First start to READY under socket activation: a fresh service process loads a bf16 checkpoint from the page cache.

What ``weightcache@N.socket`` does at a node's first start: the socket
exists, a connection arrives, systemd starts ``weightcache serve`` with the
listening socket (``LISTEN_FDS=1``, ``LISTEN_PID``, ``LISTEN_FDNAMES=listen``)
and ``NOTIFY_SOCKET``; the service loads its model and sends ``READY=1``.
Timed from the spawn to the ``READY=1`` datagram on a real notify socket
(``SOCK_DGRAM``, bound by this script).

Two activators:

- ``systemd``: ``systemd-socket-activate -l PATH --fdname=listen`` listens and
  starts the service when this script connects (the clock starts at the
  connect); used where the tool exists;
- ``holder``: this script binds the listener itself and starts the service with
  the fd at 3 and ``LISTEN_FDS``/``LISTEN_PID``/``LISTEN_FDNAMES`` set by a
  small exec wrapper (``LISTEN_PID`` must be the service's pid): what socket
  activation is, for machines without systemd (the GPU machine).

The service runs under a wrapper that notes wall-clock times (no change to
the service): its first line (interpreter started), the end of the serve
path's imports, the log records ``backend selected`` (config read, backend
chosen), ``serving`` (backend and daemon set up, the load begins) and
``loaded`` (its ``plan_ms``, ``allocate_ms``, ``read_ms``, ``digest_ms``,
``seal_ms``), and any ``import torch`` and the thread that asked. Stages:

interpreter, imports, config (+ backend choice), setup (backend, daemon),
plan, allocate, read, digests, seal, READY (from ``loaded`` to the
datagram). On CUDA the digests are taken from the staging buffers during the
read: "read" includes them and "digests" is the share of it they took (not
added to the total).

The checkpoint is random bf16 data in Llama-2-7B shapes with as many layers
as the size asks (HF naming, TP 1, 4 GB shards), written once and read once
before the timed starts so that it is in the page cache; one warm-up start
is not counted.

Usage: bench_first_start.py [--device cuda|cpu] [--size-gb G] [--reps N] [--read-threads N]
       [--activator systemd|holder] [--dir DIR] [--remove]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    GB, LLAMA2_7B, emit, has_cuda, layers_for, met, scaled, service_env, spread, stats, unix_listener, versions,
    write_checkpoint, write_config,
)

#: Runs in the service process: notes times to $WC_BENCH_TRACE (JSON lines), then runs the CLI in-process.
#: With the holder activator it first moves the listener to fd 3 and sets LISTEN_PID to its own pid.
WRAPPER = r"""
import time
T0 = time.time()
import json, logging, os, sys, threading
fd = os.environ.pop("WC_BENCH_LISTEN_FD", None)
if fd is not None:
    if int(fd) != 3:
        os.dup2(int(fd), 3)
        os.close(int(fd))
    os.environ.update(LISTEN_FDS="1", LISTEN_FDNAMES="listen", LISTEN_PID=str(os.getpid()))
trace = open(os.environ.pop("WC_BENCH_TRACE"), "a", buffering=1)
def note(event, t, **kw):
    trace.write(json.dumps({"event": event, "t": t, **kw}) + "\n")
note("interpreter", T0)
class TorchWatch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            note("torch_import", time.time(), thread=threading.current_thread().name)
            sys.meta_path.remove(self)
        return None
sys.meta_path.insert(0, TorchWatch())
import weightcache.cli, weightcache.daemon, weightcache.journal, weightcache.notify
note("imports", time.time())
class Note(logging.Handler):
    def emit(self, r):
        msg = r.getMessage()
        for key in ("backend selected", "serving ", "loaded ", "ready "):
            if msg.startswith(key):
                note(key.strip(), r.created, msg=msg)
logging.getLogger("weightcache").addHandler(Note())
sys.exit(weightcache.cli.main(sys.argv[1:]))
"""

STAGES = ("interpreter", "imports", "config", "setup", "plan", "allocate", "read", "digests", "seal", "ready")


def _recv_ready(nsock: socket.socket, proc: subprocess.Popen, timeout_s: float, log: Path) -> float:
    """Receives notify datagrams until ``READY=1``; returns its arrival time (``time.time()``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            raise RuntimeError(f"service: no READY=1 (rc={proc.poll()})\n" + log.read_text()[-3000:])
        nsock.settimeout(min(left, 0.5))
        try:
            data = nsock.recv(65536)
        except socket.timeout:
            continue
        if b"READY=1" in data.split(b"\n"):
            return time.time()


def one_start(work: Path, cfg: Path, backend: str, activator: str, timeout_s: float) -> dict:
    """Starts a fresh service, waits for READY=1, stops it; returns the stage times in seconds."""
    sock_path, notify_path = str(work / "0.sock"), str(work / "notify.sock")
    trace, log_path = work / "trace.jsonl", work / "service.log"
    for p in (sock_path, notify_path, trace):
        Path(p).unlink(missing_ok=True)
    nsock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    nsock.bind(notify_path)
    env = service_env({"NOTIFY_SOCKET": notify_path, "WC_BENCH_TRACE": str(trace)})
    serve = [sys.executable, "-c", WRAPPER, "serve", "--gpu", "0", "--config", str(cfg), "--backend", backend]
    log = open(log_path, "wb")
    listener = client = None
    try:
        if activator == "systemd":
            cmd = ["systemd-socket-activate", "-l", sock_path, "--fdname=listen"]
            cmd += [f"-E{k}" for k in ("PYTHONPATH", "PYTHONUNBUFFERED", "NOTIFY_SOCKET", "WC_BENCH_TRACE")]
            proc = subprocess.Popen(cmd + serve, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            deadline = time.monotonic() + 30
            while True:  # the path exists once bound, the connect succeeds once it listens
                client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                t0 = time.time()
                try:
                    client.connect(sock_path)  # the service starts now
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    client.close()
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("systemd-socket-activate did not listen\n" + log_path.read_text())
                time.sleep(0.005)
        else:
            listener = unix_listener(sock_path)
            env["WC_BENCH_LISTEN_FD"] = str(listener.fileno())
            t0 = time.time()
            proc = subprocess.Popen(serve, env=env, pass_fds=[listener.fileno()], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=log)
        t_ready = _recv_ready(nsock, proc, timeout_s, log_path)
        proc.terminate()
        proc.wait(60)
    finally:
        log.close()
        nsock.close()
        for s in (client, listener):
            if s is not None:
                s.close()
    ev: dict[str, dict] = {}
    torch_imports = []
    for line in trace.read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "torch_import":
            torch_imports.append(e)
        else:
            ev.setdefault(e["event"], e)
    loaded = {k: float(v) / 1e3 for k, v in re.findall(r"(\w+)_ms=([\d.]+)", ev["loaded"]["msg"])}
    gbps = float(re.search(r"read_gbps=([\d.]+)", ev["loaded"]["msg"]).group(1))
    size = int(re.search(r"size_bytes=(\d+)", ev["loaded"]["msg"]).group(1))
    t_load_start = ev["loaded"]["t"] - loaded["duration"]
    out = {
        "interpreter": ev["interpreter"]["t"] - t0,
        "imports": ev["imports"]["t"] - ev["interpreter"]["t"],
        "config": ev["backend selected"]["t"] - ev["imports"]["t"],
        "setup": t_load_start - ev["backend selected"]["t"],
        "plan": loaded["plan"], "allocate": loaded["allocate"], "read": loaded["read"],
        "digests": loaded["digest"], "seal": loaded["seal"],
        "ready": t_ready - ev["loaded"]["t"],
        "total": t_ready - t0,
        "read_gbps": gbps, "payload_bytes": size,
        "torch_free": "torch_free=yes" in ev["loaded"]["msg"],
        "torch_before_ready": any(e["t"] < t_ready for e in torch_imports),
    }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if has_cuda() else "cpu")
    ap.add_argument("--size-gb", type=float, default=None, help="checkpoint size; default 15 (cuda) or 0.5 (cpu)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--read-threads", type=int, default=None, help="service.read_threads (default: the service's)")
    ap.add_argument("--activator", choices=("systemd", "holder"),
                    default="systemd" if shutil.which("systemd-socket-activate") else "holder")
    ap.add_argument("--dir", default=os.environ.get("BENCH_DATA_DIR", "/tmp/weightcache-bench"))
    ap.add_argument("--remove", action="store_true", help="delete the checkpoint afterwards (default: keep, reused)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    gb = args.size_gb if args.size_gb is not None else (15.0 if cuda else 0.5)
    backend = "cuda" if cuda else "host"
    base = LLAMA2_7B if gb >= 2 else scaled(LLAMA2_7B, 4)
    t_write = time.monotonic()
    ck = write_checkpoint(Path(args.dir) / f"first-start-{gb:g}gb", layers_for(int(gb * GB), base), "random")
    for f in sorted(ck.glob("*.safetensors")):  # into the page cache
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(bytearray(64 << 20)):
                pass
    t_write = time.monotonic() - t_write
    work = Path(tempfile.mkdtemp(prefix="wc-first-"))
    service = {} if args.read_threads is None else {"read_threads": args.read_threads}
    cfg = write_config(work / "weightcache.toml", {"m": {"path": ck, "naming": "hf"}}, backend, **service)
    try:
        one_start(work, cfg, backend, args.activator, 600)  # warm-up: page cache, bytecode cache
        runs = [one_start(work, cfg, backend, args.activator, 600) for _ in range(args.reps)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.remove:
            shutil.rmtree(ck, ignore_errors=True)
    med = {k: stats([r[k] for r in runs]) for k in (*STAGES, "total", "read_gbps")}
    target_s = 1.5
    res = {"versions": versions(), "device": args.device, "backend": backend, "activator": args.activator,
           "size_gb": gb, "payload_bytes": runs[0]["payload_bytes"], "reps": args.reps,
           "read_threads": args.read_threads or "default", "cpus": len(os.sched_getaffinity(0)),
           "checkpoint_write_and_warm_s": t_write, "runs": runs, "stages_s": med,
           "torch_free": all(r["torch_free"] for r in runs),
           "torch_before_ready": any(r["torch_before_ready"] for r in runs),
           "target_s": target_s, "met": med["total"]["median"] <= target_s}
    md = [f"### First start to READY under socket activation ({backend} backend, {args.activator} activator; "
          f"{runs[0]['payload_bytes'] / GB:.2f} GB bf16 in page cache, {res['cpus']} CPUs, read_threads "
          f"{res['read_threads']}; median of {args.reps} fresh processes, (min–max))", "",
          "| stage | seconds |", "|---|---|"]
    for k in (*STAGES, "total"):
        s = med[k]
        name = {"total": "**total**", "digests": "digests (inside read)" if cuda else "digests"}.get(k, k)
        md.append(f"| {name} | {spread(s)} |")
    md += ["", f"read rate over the read: {med['read_gbps']['median']:.1f} GB/s; filled without torch: "
               f"{'yes' if res['torch_free'] else 'NO'}; torch imported before READY: "
               f"{'YES' if res['torch_before_ready'] else 'no'}; target <= {target_s} s: "
               f"{met(res['met'])}"]
    emit(f"first_start_{args.device}", res, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
