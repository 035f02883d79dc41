#!/usr/bin/env python3
"""Timeline of one service start to READY: every step of the start path, with its thread, in one fresh process.

Where ``bench_first_start.py`` reports stages (config, setup, plan, read),
this says what is inside them. The service runs under a wrapper (no change to
the service) that, as each module of the start path is imported, wraps its
start-up functions with timers (:data:`TIMED`: the config read, the backend's
probe and set-up, the CUDA driver's calls, the daemon's construction, the
load's plan and fill) and notes how long each ``weightcache`` module's own
import took; then it runs ``weightcache serve`` in-process. One warm-up start
(page cache, bytecode), then the traced one.

Output: a markdown table, one row per timed call or import of at least
``--min-ms`` (default 3 ms), times in ms from the interpreter's first line,
with the thread that ran it; ``--importtime`` also prints the imports
(``python -X importtime``, cumulative) of at least 8 ms. The wrappers cost a
few microseconds a call; ``-X importtime`` adds a little to every import, and
its counters are the interpreter's, not a thread's: while the driver's thread
and numpy's warm-up import beside the main thread, an import's cumulative time
includes what another thread imported meanwhile, and a self time can be
negative (the table above, with its threads, is the one to read).
Bytecode as in ``bench_first_start.py`` (``--bytecode``).

Usage: trace_start.py [--device cuda|cpu] [--size-gb G] [--naming hf|vllm] [--min-ms MS] [--importtime]
       [--bytecode cached|environment] [--dir DIR] [--remove]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    GB, LLAMA2_7B, emit, has_cuda, layers_for, scaled, service_env, versions, warm_page_cache, write_checkpoint,
    write_config,
)

#: Functions timed, by module (``Class.method`` for methods); wrapped as the module is imported.
TIMED = {
    "weightcache.config": ["load_config"],
    "weightcache.notify": ["listen_fds"],
    "weightcache.memory": ["select_backend", "get_backend", "probe_cuda"],
    "weightcache.memory.cuda_start": ["CudaStart.probe", "CudaStart.device"],
    "weightcache.memory.cuda_driver": ["_init_driver", "gpu_uuid", "_Device.__init__", "_Device.mem_info"],
    "weightcache.memory.cuda": ["CudaBackend.__init__", "CudaBackend.device_info"],
    "weightcache.memory.kernels": ["available", "prepare", "_load"],
    "weightcache.daemon.bootstrap": ["listener", "backend_for", "config_kept", "start_cuda"],
    "weightcache.daemon.loop": ["Daemon.__init__"],
    "weightcache.daemon.loads": ["Loader._room"],
    "weightcache.pipeline": ["plan", "fill"],
    "weightcache.checkpoint.header": ["_validate_with_safetensors", "warm_validation"],
    "weightcache.checkpoint": ["Checkpoint.__init__"],
    "cuda.bindings.driver": ["cuInit", "cuDeviceGetCount", "cuDevicePrimaryCtxRetain", "cuMemGetInfo",
                             "cuDeviceGetUuid", "cuMemCreate"],
}

#: Runs in the service process; ``WC_TRACE`` names the JSON-lines file, ``WC_TIMED`` is :data:`TIMED`.
WRAPPER = r"""
import time
T0 = time.time()
import functools, importlib.util, json, logging, os, sys, threading
trace = open(os.environ.pop("WC_TRACE"), "a", buffering=1)
TIMED = json.loads(os.environ.pop("WC_TIMED"))
def note(what, t0, t1):
    trace.write(json.dumps({"what": what, "t0": t0 - T0, "t1": t1 - T0,
                            "thread": threading.current_thread().name}) + "\n")
def timed(name, fn):
    @functools.wraps(fn)
    def w(*a, **k):
        t = time.time()
        try:
            return fn(*a, **k)
        finally:
            note(name, t, time.time())
    return w
def wrap(module):
    for path in TIMED.get(module.__name__, []):
        *owner, attr = path.split(".")
        obj = module
        for p in owner:
            obj = getattr(obj, p, None)
        if obj is not None and hasattr(obj, attr):
            try:
                setattr(obj, attr, timed(module.__name__.rsplit(".", 1)[-1] + "." + path, getattr(obj, attr)))
            except (AttributeError, TypeError):
                pass
class Finder:  # a meta path finder (no importlib.abc: its import is 30 ms of the traced start)
    def find_spec(self, name, path=None, target=None):
        if name not in TIMED and not name.startswith("weightcache"):
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module
        def exec_module(module, run=run, name=name):
            t = time.time()
            run(module)
            note("import " + name, t, time.time())
            wrap(module)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Finder())
note("interpreter", T0, T0)
import weightcache.cli
class Note(logging.Handler):
    def emit(self, r):
        msg = r.getMessage()
        if msg.startswith(("backend selected", "serving ", "loaded ", "ready ", "kernels compiled")):
            note("log: " + msg.split(" [event=")[0][:160], r.created, r.created)
logging.getLogger("weightcache").addHandler(Note())
sys.exit(weightcache.cli.main(sys.argv[1:]))
"""


def one_start(work: Path, cfg: Path, backend: str, pycache: Path | None, importtime: bool) -> tuple[float, list, str]:
    """Starts a fresh service, waits for READY=1, stops it; returns (READY after spawn in s, events, its log)."""
    trace, notify_path = work / "trace.jsonl", work / "notify.sock"
    for p in (trace, notify_path):
        p.unlink(missing_ok=True)
    nsock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    nsock.bind(str(notify_path))
    env = service_env({"NOTIFY_SOCKET": str(notify_path), "WC_TRACE": str(trace), "WC_TIMED": json.dumps(TIMED)})
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-c", WRAPPER, "serve", "--gpu", "0",
           "--config", str(cfg), "--backend", backend, "--listen", str(work / "0.sock")]
    log_path = work / "service.log"
    with open(log_path, "wb") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 600
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"service: no READY=1 (rc={proc.poll()})\n" + log_path.read_text()[-3000:])
                nsock.settimeout(0.5)
                try:
                    if b"READY=1" in nsock.recv(65536).split(b"\n"):
                        break
                except socket.timeout:
                    continue
            ready = time.time() - t0
        finally:
            proc.terminate()
            proc.wait(60)
            nsock.close()
    events = sorted((json.loads(line) for line in trace.read_text().splitlines()), key=lambda e: e["t0"])
    return ready, events, log_path.read_text()


def _importtime(log: str, min_ms: float) -> list[str]:
    rows = ["| cumulative ms | module |", "|---|---|"]
    for line in log.splitlines():
        if line.startswith("import time:") and "self [us]" not in line:
            _, cumulative, name = line.split(":", 1)[1].split("|")
            if int(cumulative) >= min_ms * 1e3:
                rows.append(f"| {int(cumulative) / 1e3:.1f} | `{name.rstrip()}` |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if has_cuda() else "cpu")
    ap.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size (default 2: the start does not "
                    "depend on it)")
    ap.add_argument("--naming", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--min-ms", type=float, default=3.0, help="rows shorter than this are left out (default 3)")
    ap.add_argument("--importtime", action="store_true", help="also run under -X importtime and list the imports")
    ap.add_argument("--bytecode", choices=("cached", "environment"), default="cached",
                    help="as bench_first_start.py: cached (as installed, default) or as the environment says")
    ap.add_argument("--dir", default=os.environ.get("BENCH_DATA_DIR", "/tmp/weightcache-bench"))
    ap.add_argument("--remove", action="store_true", help="delete the checkpoint afterwards")
    args = ap.parse_args()
    backend = "cuda" if args.device == "cuda" else "host"
    base = LLAMA2_7B if args.size_gb >= 2 else scaled(LLAMA2_7B, 4)
    ck = write_checkpoint(Path(args.dir) / f"first-start-{args.size_gb:g}gb", layers_for(int(args.size_gb * GB), base),
                          "random")
    warm_page_cache(ck)
    work = Path(tempfile.mkdtemp(prefix="wc-trace-"))
    pycache = work / "pycache" if args.bytecode == "cached" else None
    try:
        cfg = write_config(work / "weightcache.toml", {"m": {"path": ck, "naming": args.naming}}, backend)
        one_start(work, cfg, backend, pycache, False)  # warm-up: page cache, bytecode
        ready, events, log = one_start(work, cfg, backend, pycache, args.importtime)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.remove:
            shutil.rmtree(ck, ignore_errors=True)
    md = [f"### Service start timeline ({backend} backend, naming = \"{args.naming}\", {args.size_gb:g} GB, bytecode "
          f"{args.bytecode}): READY {ready:.3f} s after the spawn", "",
          "| start ms | end ms | ms | thread | what |", "|---|---|---|---|---|"]
    for e in events:
        ms = (e["t1"] - e["t0"]) * 1e3
        if ms >= args.min_ms or e["what"].startswith(("log: ", "interpreter")):
            md.append(f"| {e['t0'] * 1e3:.1f} | {e['t1'] * 1e3:.1f} | {ms:.1f} | {e['thread']} | `{e['what']}` |")
    if args.importtime:
        md += ["", "Imports (`-X importtime`, this process's threads together):", ""] + _importtime(log, 8.0)
    emit(f"trace_start_{args.device}_{args.naming}", {"versions": versions(), "ready_s": ready, "events": events},
         "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
