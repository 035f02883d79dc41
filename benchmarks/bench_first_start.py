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

The service runs from bytecode, as an installed package does (pip and
dh_python3 write the ``.pyc`` files at install): the warm-up start writes it
under a ``PYTHONPYCACHEPREFIX`` of the run, whatever ``PYTHONDONTWRITEBYTECODE``
says. ``--bytecode environment`` keeps the environment as it is instead; where it
sets ``PYTHONDONTWRITEBYTECODE=1`` (both workplaces here do) every start then
compiles the service's modules from source (a 0.2 GB host start on the CPU
machine: 0.84 s against 0.47 s), as the first-start results in RESULTS.md
before its section "Service start before the read" did.

``--naming hf,vllm`` starts the same checkpoint under each naming in turn
(the vLLM layout: fused ``qkv_proj``/``gate_up_proj``, vocab padding) and
reports the ratio to ``hf``; ``--tp N`` serves every rank of TP ``N`` from
the one service on GPU 0 (READY once all are loaded; stages and bytes summed
over the ranks); ``--fp8 tensor|channel`` uses a Llama-3-8B-shaped ModelOpt
FP8 checkpoint (``benchmarks/modelopt_fp8_checkpoint.py``) instead;
``--instances`` (with ``--tp N``) starts instead one service per rank, all at once, as
``weightcache.target`` starts a node's instances (each its own process, its rank on GPU 0 here),
against one instance loading the whole checkpoint started the same way, interleaved: the node's time to
the last READY and the load rate per byte, TP N against TP 1;
``--cold-attach [N]`` has N fresh processes (default 1) attach rank 0 after the
last timed READY, each in two orders: *client first* (``import weightcache``,
``weightcache.attach`` (the client's import), ``import torch`` + CUDA init,
then the first and a second ``attach()``, each timed apart; the CUDA attach
path is imported ahead on a thread meanwhile, see ``weightcache.client._imports``)
and *torch first* (``import torch`` + CUDA init, then the client's import and
at once the first ``attach()``: what the client's import costs in a process
that has torch already, and a first attach with no time for the import ahead);
the first process then asks the service to ``verify`` the model. The client-first attaches are also split into
stages by timers wrapped around the client's own functions (connect, send, the backend's set-up, waiting for the
reply, the manifest file, the key check, the fd's import and mapping, the views, GC collections; about 1 µs per
wrapped call), first against second: what a process pays once.
``--cold-attach-clients LABEL=DIR,...`` runs the attaching processes with
another client on ``PYTHONPATH`` (e.g. an older tree, to compare), interleaved
per sample; the service stays the source tree's.

Usage: bench_first_start.py [--device cuda|cpu] [--size-gb G] [--reps N] [--read-threads N]
       [--activator systemd|holder] [--naming hf,vllm] [--tp N [--instances]] [--fp8 none|tensor|channel]
       [--cold-attach [N]] [--cold-attach-clients LABEL=DIR,...] [--bytecode cached|environment] [--dir DIR]
       [--remove]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    GB, LLAMA2_7B, LlamaShape, emit, has_cuda, layers_for, met, scaled, service_env, spread, stats, unix_listener,
    versions, warm_page_cache, write_checkpoint, write_config,
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


def _start_env(work: Path, pycache: Path | None) -> tuple[str, socket.socket, Path, dict[str, str]]:
    """A start's files in ``work``, cleared: its socket path, a bound notify socket (``notify.sock``), the trace
    path, and the service's environment (``NOTIFY_SOCKET``, the trace; bytecode under ``pycache`` when given)."""
    sock_path, notify_path, trace = str(work / "0.sock"), str(work / "notify.sock"), work / "trace.jsonl"
    for p in (sock_path, notify_path, trace):
        Path(p).unlink(missing_ok=True)
    nsock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    nsock.bind(notify_path)
    env = service_env({"NOTIFY_SOCKET": notify_path, "WC_BENCH_TRACE": str(trace)})
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    return sock_path, nsock, trace, env


def one_start(work: Path, cfg: Path, backend: str, activator: str, timeout_s: float,
              cold_attach: dict | None = None, pycache: Path | None = None) -> dict:
    """Starts a fresh service, waits for READY=1, stops it; returns the stage times in seconds.

    With ``cold_attach`` (the keywords of :func:`_cold_attach`), fresh processes attach rank 0 before the service
    stops. With ``pycache``, the service reads and writes its bytecode there (``PYTHONPYCACHEPREFIX``).
    """
    sock_path, nsock, trace, env = _start_env(work, pycache)
    log_path = work / "service.log"
    serve = [sys.executable, "-c", WRAPPER, "serve", "--gpu", "0", "--config", str(cfg), "--backend", backend]
    log = open(log_path, "wb")
    listener = client = proc = None
    try:
        if activator == "systemd":
            cmd = ["systemd-socket-activate", "-l", sock_path, "--fdname=listen"]
            cmd += [f"-E{k}" for k in ("PYTHONPATH", "PYTHONUNBUFFERED", "NOTIFY_SOCKET", "WC_BENCH_TRACE",
                                       "PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE") if k in env]
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
        if cold_attach is not None:
            attached = _cold_attach(work, **cold_attach)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        log.close()
        nsock.close()
        for s in (client, listener):
            if s is not None:
                s.close()
    out = _parse_trace(trace, t0, t_ready)
    if cold_attach is not None:
        out["cold_attach"] = attached
    return out


def _parse_trace(trace: Path, t0: float, t_ready: float) -> dict:
    """The stage times (seconds) of one start from the wrapper's trace: ``t0`` its spawn, ``t_ready`` its READY=1."""
    ev: dict[str, dict] = {}
    torch_imports = []
    loads = []
    for line in trace.read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "torch_import":
            torch_imports.append(e)
        elif e["event"] == "loaded":
            loads.append(e)
        else:
            ev.setdefault(e["event"], e)
    # One "loaded" line per rank (every rank of the layout is on GPU 0): stages summed, bytes summed.
    per = [{k: float(v) / 1e3 for k, v in re.findall(r"(\w+)_ms=([\d.]+)", e["msg"])} for e in loads]
    size = sum(int(re.search(r"size_bytes=(\d+)", e["msg"]).group(1)) for e in loads)
    t_load_start = min(e["t"] - d["duration"] for e, d in zip(loads, per))
    t_loaded = max(e["t"] for e in loads)
    total = {k: sum(d[k] for d in per) for k in ("plan", "allocate", "read", "digest", "seal")}
    out = {
        "interpreter": ev["interpreter"]["t"] - t0,
        "imports": ev["imports"]["t"] - ev["interpreter"]["t"],
        "config": ev["backend selected"]["t"] - ev["imports"]["t"],
        "setup": t_load_start - ev["backend selected"]["t"],
        "plan": total["plan"], "allocate": total["allocate"], "read": total["read"],
        "digests": total["digest"], "seal": total["seal"],
        "ready": t_ready - t_loaded,
        "total": t_ready - t0,
        "read_gbps": size / max(total["read"], 1e-9) / 1e9, "payload_bytes": size, "ranks": len(loads),
        "torch_free": all("torch_free=yes" in e["msg"] for e in loads),
        "torch_before_ready": any(e["t"] < t_ready for e in torch_imports),
        "t_load_start": t_load_start, "t_loaded": t_loaded,
    }
    return out


def instance_configs(work: Path, models: dict, backend: str, tp: int, **service) -> list[Path]:
    """One config per rank of TP ``tp``, for :func:`concurrent_start`: rank ``k`` on GPU 0, the others on GPUs 1..

    Each instance (``serve --gpu 0``) then loads only its rank, as the instances of a node with one GPU per rank
    do; the other GPU indices only number instances that are not started (``serve`` does not check them).
    """
    out = []
    for k in range(tp):
        gpus = [0 if r == k else 1 + r - (r > k) for r in range(tp)]
        d = work / f"rank{k}"
        d.mkdir(parents=True, exist_ok=True)
        cfg = write_config(d / "weightcache.toml", models, backend, tp=tp, **service)
        text = cfg.read_text().replace(f"gpus = {[0] * tp}", f"gpus = {gpus}")
        cfg.write_text(text)
        out.append(cfg)
    return out


def concurrent_start(cfgs: list[Path], backend: str, timeout_s: float, pycache: Path | None = None) -> dict:
    """Starts one fresh service per config at once (holder activator), waits for every READY=1; returns the node's
    figures: ``total`` (first spawn to last READY), ``load_window`` (first load start to last load end),
    ``load_gbps`` (payload summed over that window), and ``instances`` (each one's :func:`_parse_trace`).
    """
    runs = []
    try:
        for cfg in cfgs:
            work = cfg.parent
            sock_path, nsock, trace, env = _start_env(work, pycache)
            listener = unix_listener(sock_path)
            env["WC_BENCH_LISTEN_FD"] = str(listener.fileno())
            runs.append({"work": work, "nsock": nsock, "listener": listener, "trace": trace, "env": env,
                         "log_path": work / "service.log", "cfg": cfg})
        for r in runs:  # spawned back to back: what systemd does for the instances of weightcache.target
            r["log"] = open(r["log_path"], "wb")
            serve = [sys.executable, "-c", WRAPPER, "serve", "--gpu", "0", "--config", str(r["cfg"]),
                     "--backend", backend]
            r["t0"] = time.time()
            r["proc"] = subprocess.Popen(serve, env=r["env"], pass_fds=[r["listener"].fileno()],
                                         stdin=subprocess.DEVNULL, stdout=r["log"], stderr=r["log"])
        for r in runs:
            r["t_ready"] = _recv_ready(r["nsock"], r["proc"], timeout_s, r["log_path"])
    finally:
        for r in runs:
            if "proc" in r:
                r["proc"].terminate()
                r["proc"].wait(60)
                r["log"].close()
            r["nsock"].close()
            r["listener"].close()
    inst = [_parse_trace(r["trace"], r["t0"], r["t_ready"]) for r in runs]
    t0, t_ready = min(r["t0"] for r in runs), max(r["t_ready"] for r in runs)
    window = max(x["t_loaded"] for x in inst) - min(x["t_load_start"] for x in inst)
    size = sum(x["payload_bytes"] for x in inst)
    return {"total": t_ready - t0, "load_window": window, "load_gbps": size / max(window, 1e-9) / 1e9,
            "payload_bytes": size, "instances": inst,
            "torch_free": all(x["torch_free"] for x in inst)}


#: Stage timers for the attaching processes: wraps the client's own functions (no copy of its logic) so that each
#: call adds its seconds under ``"<stage> [<enclosing stage>]"``; ``STAGE_TIMES`` collects one attach's, GC
#: collections included (``gc.callbacks``). A module not imported yet (the import ahead not done, another client)
#: is not imported here: its stages are left out (``install_stage_timers`` again, before the second attach, adds
#: those the first imported). About 1 µs per wrapped call.
STAGE_TIMERS = r"""
import functools, gc, sys, time
STAGES = (  # module, owner (class or None), attribute, stage name
    ("weightcache.session", "Session", "__init__", "connect"),
    ("weightcache.session", "Session", "send", "send hello + attach"),
    ("weightcache.client._attach", None, "_prepare_backend", "backend set-up while the service answers"),
    ("weightcache.client._attach", None, "local_backend", "local_backend (the first: the backend's set-up)"),
    ("weightcache.memory.cuda", "CudaBackend", "__init__", "CudaBackend(): primary context, granularity"),
    ("weightcache.memory.cuda_driver", None, "_init_driver", "cuInit (driver symbols resolved here if not ahead)"),
    ("weightcache.memory.cuda", "CudaBackend", "device_info", "device_info: attributes + UUID"),
    ("weightcache.session", "Session", "replies", "waiting for the reply (recvmsg) + decode"),
    ("weightcache.client._attach", None, "read_file", "manifest file: pread + JSON + packed columns"),
    ("weightcache.client._attach", None, "_expected_fields", "expected key fields (the checkpoint's config.json)"),
    ("weightcache.identity", None, "check_key", "key check: fields + stat() of the files"),
    ("weightcache.memory.cuda", "CudaBackend", "import_fd", "fd import + map + set access + tensor wrap"),
    ("weightcache.memory.cuda_mapping", "_Mapping", "tensor", "torch.as_tensor of the mapping"),
    ("weightcache.memory.host", "HostBackend", "import_fd", "fd import + map + set access + tensor wrap"),
    ("weightcache.client._attach", None, "build_views", "views: build_views"),
)
STAGE_TIMES = {}
_stack = []
def _timed(name, fn):
    if getattr(fn, "stage_timer", False):
        return fn
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        key = f"{name} [{_stack[-1]}]" if _stack else name
        _stack.append(name)
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            STAGE_TIMES[key] = STAGE_TIMES.get(key, 0.0) + time.perf_counter() - t
            _stack.pop()
    wrapper.stage_timer = True
    return wrapper
def _gc_timer(phase, info, _t=[0.0]):
    if phase == "start":
        _t[0] = time.perf_counter()
    else:
        key = f"GC collection (generation {info['generation']})"
        STAGE_TIMES[key] = STAGE_TIMES.get(key, 0.0) + time.perf_counter() - _t[0]
def install_stage_timers():
    for mod, owner, attr, name in STAGES:
        m = sys.modules.get(mod)
        target = getattr(m, owner, None) if owner else m
        fn = getattr(target, attr, None) if target is not None else None
        if fn is not None and not isinstance(fn, type):
            setattr(target, attr, _timed(name, fn))
    if _gc_timer not in gc.callbacks:
        gc.callbacks.append(_gc_timer)
def stage_times_us():
    out = {k: round(v * 1e6, 1) for k, v in STAGE_TIMES.items()}
    STAGE_TIMES.clear()
    return out
"""

#: A fresh engine process's first attach: ``import weightcache``, then ``import torch`` and CUDA's
#: initialisation (the engine has them anyway), then the first ``attach()``, each timed apart, and split into stages
#: (:data:`STAGE_TIMERS`) as is the second.
COLD_ATTACH = STAGE_TIMERS + r"""
import json, sys, time
t0 = time.perf_counter()
import weightcache
t1 = time.perf_counter()
attach = weightcache.attach  # the lazy package imports the client here
t1b = time.perf_counter()
heavy = [m for m in ("weightcache.pipeline", "weightcache.quant", "weightcache.sharding", "weightcache.reader")
         if m in sys.modules]
import torch
device = sys.argv[2]
if device.startswith("cuda"):
    torch.cuda.init()
    torch.empty(1, device=device)
thread = getattr(sys.modules.get("weightcache.client._imports"), "_thread", None)
ahead_done = thread is not None and not thread.is_alive()
install_stage_timers()
t2 = time.perf_counter()
before = set(sys.modules)
w = attach("m", tp_size=int(sys.argv[3]), tp_rank=0, device=device, naming=sys.argv[4],
           socket_dir=sys.argv[1], fallback=False)
t3 = time.perf_counter()
first_stages = stage_times_us()
during = sorted(m for m in set(sys.modules) - before if "." not in m or m.startswith(("weightcache", "cuda")))
install_stage_timers()  # the modules the first attach imported (no import ahead: a CPU machine)
t4a = time.perf_counter()
w2 = attach("m", tp_size=int(sys.argv[3]), tp_rank=0, device=device, naming=sys.argv[4],
            socket_dir=sys.argv[1], fallback=False)
t4b = time.perf_counter()
second_stages = stage_times_us()
w2.close()
w.close()
out = {"import_weightcache_s": t1 - t0, "import_client_s": t1b - t1, "import_torch_and_cuda_s": t2 - t1b,
       "first_attach_s": t3 - t2, "second_attach_s": t4b - t4a, "imported_by_first_attach": during,
       "tensors": len(w.tensors), "source": w.source, "heavy_modules_at_import": heavy,
       "import_ahead": thread is not None, "import_ahead_done": ahead_done,
       "first_attach_stages_us": first_stages, "second_attach_stages_us": second_stages}
if sys.argv[5] == "verify":
    import os
    from weightcache import protocol
    from weightcache.session import Session
    s = Session(os.path.join(sys.argv[1], "0.sock"))
    t4 = time.perf_counter()
    reply = s.request(protocol.Verify("m"), timeout=300)
    out.update(verify_s=time.perf_counter() - t4, verify_mismatched=sum(len(r.mismatched) for r in reply.typed()))
print(json.dumps(out))
"""

#: The other order: torch and CUDA first (an engine that imports weightcache late), then the client's import
#: and at once the first ``attach()`` (no time for the CUDA attach path's import ahead), then a second.
COLD_ATTACH_TORCH_FIRST = r"""
import json, sys, time
import torch
device = sys.argv[2]
if device.startswith("cuda"):
    torch.cuda.init()
    torch.empty(1, device=device)
t0 = time.perf_counter()
import weightcache
attach = weightcache.attach
t1 = time.perf_counter()
before = set(sys.modules)
w = attach("m", tp_size=int(sys.argv[3]), tp_rank=0, device=device, naming=sys.argv[4],
           socket_dir=sys.argv[1], fallback=False)
t2 = time.perf_counter()
during = sorted(m for m in set(sys.modules) - before if "." not in m or m.startswith(("weightcache", "cuda")))
w2 = attach("m", tp_size=int(sys.argv[3]), tp_rank=0, device=device, naming=sys.argv[4],
            socket_dir=sys.argv[1], fallback=False)
t3 = time.perf_counter()
w2.close()
w.close()
print(json.dumps({"import_client_after_torch_s": t1 - t0, "first_attach_at_once_s": t2 - t1,
                  "second_attach_s": t3 - t2, "imported_by_first_attach": during}))
"""


#: What an engine's attach imports from weightcache, compiled once before the timed processes (``bytecode``).
CLIENT_MODULES = "import weightcache.client, weightcache.identity, weightcache.memory.cuda, weightcache.memory.host"


def _cold_attach(work: Path, device: str, tp: int, naming: str, samples: int, clients: dict[str, str],
                 bytecode: bool = True) -> dict:
    """``samples`` fresh processes per client and order, interleaved; ``{label: [{"client_first": {...},
    "torch_first": {...}}, ...]}`` (a failed process: ``{"error": stderr tail}`` in place of the lists).

    With ``bytecode`` the engines run from bytecode, as from an installed package: ``PYTHONDONTWRITEBYTECODE``
    is dropped and one untimed process first imports the client's modules (writing their ``__pycache__``);
    otherwise, under ``PYTHONDONTWRITEBYTECODE=1``, every timed process would compile the client from source.
    """
    out: dict[str, list] = {label: [] for label in clients}
    envs = {}
    for label, path in clients.items():
        env = envs[label] = service_env()
        if path:  # this client first on the path; the service already runs
            env["PYTHONPATH"] = os.pathsep.join([path, env["PYTHONPATH"]])
        if bytecode:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            subprocess.run([sys.executable, "-c", CLIENT_MODULES], env=env, capture_output=True, timeout=300)
    for i in range(samples):
        for label, path in clients.items():
            env = envs[label]
            sample = {}
            for order, script, extra in (("client_first", COLD_ATTACH, ["verify" if i == 0 else "-"]),
                                         ("torch_first", COLD_ATTACH_TORCH_FIRST, [])):
                r = subprocess.run([sys.executable, "-c", script, str(work), device, str(tp), naming, *extra],
                                   env=env, capture_output=True, text=True, timeout=300)
                if r.returncode != 0:
                    return {"error": f"{label} {order}: {r.stderr[-1500:]}"}
                sample[order] = json.loads(r.stdout.strip().splitlines()[-1])
            out[label].append(sample)
    return out


def _cold_stats(samples: list[dict]) -> dict:
    """:func:`stats` of each cold-attach time over ``samples`` (the torch-first second attach renamed apart)."""
    keys = ("import_weightcache_s", "import_client_s", "import_torch_and_cuda_s", "first_attach_s", "second_attach_s")
    c = {k: stats([x["client_first"][k] for x in samples]) for k in keys}
    c.update({k: stats([x["torch_first"][k] for x in samples])
              for k in ("import_client_after_torch_s", "first_attach_at_once_s")})
    c["second_attach_at_once_s"] = stats([x["torch_first"]["second_attach_s"] for x in samples])
    return c


def _stage_table(samples: list[dict]) -> tuple[dict, list[str]]:
    """Median µs per stage of the first and the second attach (client first) over ``samples``, and a markdown table.

    A stage a sample did not reach counts 0 in it. ``other`` is the attach's time outside every outermost stage
    (argument handling, the GC pause, the ``Attachment``); stages named ``x [y]`` ran inside ``y``, and GC
    collections inside whichever stage allocated.
    """
    cf = [x["client_first"] for x in samples]
    if not all("first_attach_stages_us" in x for x in cf):
        return {}, []
    out: dict[str, dict[str, float]] = {}
    for which in ("first", "second"):
        per = [dict(x[f"{which}_attach_stages_us"]) for x in cf]
        for x, p in zip(cf, per):
            top = sum(v for k, v in p.items() if " [" not in k and not k.startswith("GC "))
            p["other (outside the stages)"] = max(0.0, x[f"{which}_attach_s"] * 1e6 - top)
        for k in {k for p in per for k in p}:
            out.setdefault(k, {"first": 0.0, "second": 0.0})[which] = statistics.median(p.get(k, 0.0) for p in per)
    rows = ["| stage of `attach()` (client first) | first, µs | second, µs | first − second |", "|---|---|---|---|"]
    for k, v in sorted(out.items(), key=lambda kv: -kv[1]["first"]):
        rows.append(f"| {k} | {v['first']:.0f} | {v['second']:.0f} | {v['first'] - v['second']:+.0f} |")
    return out, rows


def _checkpoint(args: argparse.Namespace, gb: float) -> tuple[Path, str]:
    """Writes (or reuses) the benchmark's checkpoint and reads it into the page cache; returns it and its kind."""
    if args.fp8 != "none":
        from modelopt_fp8_checkpoint import LLAMA3_8B, PER_CHANNEL, PER_TENSOR, write_modelopt_fp8

        algo = PER_TENSOR if args.fp8 == "tensor" else PER_CHANNEL
        layers = max(1, round(LLAMA3_8B.layers * gb / 9.1))  # 9.1 GB at Llama-3-8B's 32 layers
        shape = LlamaShape(**{**LLAMA3_8B.__dict__, "layers": layers})
        ck = write_modelopt_fp8(Path(args.dir) / f"first-start-fp8-{args.fp8}-{layers}l", shape, algo)
        kind = f"ModelOpt {algo} Llama-3-8B-shaped ({layers} layers)"
    else:
        base = LLAMA2_7B if gb >= 2 else scaled(LLAMA2_7B, 4)
        ck = write_checkpoint(Path(args.dir) / f"first-start-{gb:g}gb", layers_for(int(gb * GB), base), "random")
        kind = "bf16 Llama-2-7B-shaped"
    warm_page_cache(ck)
    return ck, kind


def _run_instances(args: argparse.Namespace, ck: Path, kind: str, backend: str, namings: list[str], service: dict,
                   pycache: Path | None) -> int:
    """``--instances``: TP 1 (one instance) and TP ``args.tp`` (one instance per rank, started at once), interleaved
    per rep; reports each one's time to the last READY and its load rate (payload over the window from the first
    load's start to the last one's end) and the TP-N rate per byte against TP 1's."""
    res = {"versions": versions(), "device": args.device, "backend": backend, "checkpoint": kind, "tp": args.tp,
           "reps": args.reps, "cpus": len(os.sched_getaffinity(0)), "namings": {}}
    md = []
    for naming in namings:
        work = Path(tempfile.mkdtemp(prefix="wc-inst-"))
        try:
            models = {"m": {"path": ck, "naming": naming}}
            layouts = {tp: instance_configs(work / f"tp{tp}", models, backend, tp, **service)
                       for tp in (1, args.tp)}
            for tp, cfgs in layouts.items():  # warm-up: page cache, bytecode
                concurrent_start(cfgs, backend, 600, pycache)
            runs: dict[int, list] = {1: [], args.tp: []}
            for _ in range(args.reps):
                for tp, cfgs in layouts.items():
                    runs[tp].append(concurrent_start(cfgs, backend, 600, pycache))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        out = {}
        for tp, rs in runs.items():
            out[tp] = {k: stats([r[k] for r in rs]) for k in ("total", "load_window", "load_gbps")}
            out[tp]["payload_bytes"] = rs[0]["payload_bytes"]
            out[tp]["torch_free"] = all(r["torch_free"] for r in rs)
            out[tp]["instances"] = [{"ranks": x["ranks"], "payload_bytes": x["payload_bytes"]}
                                    for x in rs[0]["instances"]]
            out[tp]["instance_stages_s"] = {k: stats([x[k] for r in rs for x in r["instances"]])
                                            for k in (*STAGES, "total")}
            out[tp]["read_gbps_per_instance"] = stats([x["read_gbps"] for r in rs for x in r["instances"]])
        ratio = out[args.tp]["load_gbps"]["median"] / out[1]["load_gbps"]["median"]
        stage_rows = [f"| {k} | " + " | ".join(f"{out[tp]['instance_stages_s'][k]['median']:.3f}" for tp in out) + " |"
                      for k in (*STAGES, "total")]
        res["namings"][naming] = {"tp": out, "rate_vs_tp1": ratio}
        md += [f"### A node's instances started at once: {kind}, naming = \"{naming}\", TP 1 (one instance) and TP "
               f"{args.tp} (one instance per rank, all on GPU 0; {backend} backend, holder activator, "
               f"{res['cpus']} CPUs; median of {args.reps} (min–max), interleaved)", "",
               "| layout | payload GB | spawn to last READY s | load window s | load GB/s | read GB/s per instance | "
               "torch-free |", "|---|---|---|---|---|---|---|"]
        for tp, o in out.items():
            md.append(f"| TP {tp} ({tp} instance{'s' if tp > 1 else ''}) | {o['payload_bytes'] / GB:.2f} | "
                      f"{spread(o['total'])} | {spread(o['load_window'])} | {o['load_gbps']['median']:.1f} | "
                      f"{o['read_gbps_per_instance']['median']:.1f} | {'yes' if o['torch_free'] else 'NO'} |")
        md += ["", f"TP {args.tp} load rate per byte / TP 1's: {ratio:.2f}x (target: the same rate: "
                   f"{met(ratio >= 0.95)})", "",
               "each instance by stage (seconds, median over the instances and reps; total: its own spawn to its "
               "READY):", "", "| stage | " + " | ".join(f"TP {tp}" for tp in out) + " |",
               "|---|" + "---|" * len(out), *stage_rows, ""]
    emit(f"first_start_{args.device}_instances_tp{args.tp}_{'_'.join(namings)}", res, "\n".join(md))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if has_cuda() else "cpu")
    ap.add_argument("--size-gb", type=float, default=None, help="checkpoint size; default 15 (cuda) or 0.5 (cpu); "
                    "with --fp8 the layers of Llama-3-8B that give about this size (9.1 GB: all 32)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--read-threads", type=int, default=None, help="service.read_threads (default: the service's)")
    ap.add_argument("--activator", choices=("systemd", "holder"),
                    default="systemd" if shutil.which("systemd-socket-activate") else "holder")
    ap.add_argument("--naming", default="hf", help="comma-separated namings to start in turn: hf, vllm (default hf)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size; every rank on GPU 0 (default 1)")
    ap.add_argument("--instances", action="store_true",
                    help="with --tp N: one service per rank, all started at once (a node's instances), against one "
                         "service loading the whole checkpoint (TP 1) started the same way, interleaved")
    ap.add_argument("--fp8", choices=("none", "tensor", "channel"), default="none",
                    help="a ModelOpt FP8 checkpoint (per-tensor or per-channel scales) instead of bf16")
    ap.add_argument("--cold-attach", type=int, nargs="?", const=1, default=0, metavar="N",
                    help="after the last timed READY, N fresh processes (default 1) attach rank 0 in two orders "
                         "(imports timed apart)")
    ap.add_argument("--cold-attach-clients", default="", metavar="LABEL=DIR,...",
                    help="the clients the attaching processes run (PYTHONPATH first), interleaved; default: the "
                         "source tree's, labelled 'source'")
    ap.add_argument("--bytecode", choices=("cached", "environment"), default="cached",
                    help="cached: the service runs from bytecode the warm-up start wrote, as installed (default); "
                         "environment: as the environment says (PYTHONDONTWRITEBYTECODE=1: compiled at every start)")
    ap.add_argument("--dir", default=os.environ.get("BENCH_DATA_DIR", "/tmp/weightcache-bench"))
    ap.add_argument("--remove", action="store_true", help="delete the checkpoint afterwards (default: keep, reused)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    gb = args.size_gb if args.size_gb is not None else (15.0 if cuda else 0.5)
    backend = "cuda" if cuda else "host"
    namings = [n.strip() for n in args.naming.split(",") if n.strip()]
    t_write = time.monotonic()
    ck, kind = _checkpoint(args, gb)
    t_write = time.monotonic() - t_write
    service = {} if args.read_threads is None else {"read_threads": args.read_threads}
    results = {}
    pycache = Path(tempfile.mkdtemp(prefix="wc-pyc-")) if args.bytecode == "cached" else None
    if args.instances:
        try:
            return _run_instances(args, ck, kind, backend, namings, service, pycache)
        finally:
            if pycache is not None:
                shutil.rmtree(pycache, ignore_errors=True)
    try:
        for naming in namings:
            work = Path(tempfile.mkdtemp(prefix="wc-first-"))
            cfg = write_config(work / "weightcache.toml", {"m": {"path": ck, "naming": naming}}, backend, tp=args.tp,
                               **service)
            clients = dict(c.split("=", 1) for c in args.cold_attach_clients.split(",") if c) or {"source": ""}
            attach = ({"device": "cuda:0" if cuda else "cpu", "tp": args.tp, "naming": naming,
                       "samples": args.cold_attach, "clients": clients, "bytecode": pycache is not None}
                      if args.cold_attach else None)
            try:
                one_start(work, cfg, backend, args.activator, 600, pycache=pycache)  # warm-up: page cache, bytecode
                # The cold attach (torch's import alone is seconds) after the last timed start only.
                results[naming] = [one_start(work, cfg, backend, args.activator, 600,
                                             attach if i == args.reps - 1 else None, pycache=pycache)
                                   for i in range(args.reps)]
            finally:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        if pycache is not None:
            shutil.rmtree(pycache, ignore_errors=True)
        if args.remove:
            shutil.rmtree(ck, ignore_errors=True)
    target_s = 1.5 if args.fp8 == "none" else 2.0
    res = {"versions": versions(), "device": args.device, "backend": backend, "activator": args.activator,
           "checkpoint": kind, "size_gb": gb, "tp": args.tp, "reps": args.reps,
           "read_threads": args.read_threads or "default", "cpus": len(os.sched_getaffinity(0)),
           "checkpoint_write_and_warm_s": t_write, "target_s": target_s, "bytecode": args.bytecode, "namings": {}}
    from_bytecode = ("bytecode cached" if pycache is not None else
                     "bytecode as the environment has it" + (": compiled at every start"
                                                             if os.environ.get("PYTHONDONTWRITEBYTECODE") else ""))
    md = []
    for naming, runs in results.items():
        med = {k: stats([r[k] for r in runs]) for k in (*STAGES, "total", "read_gbps")}
        r = {"payload_bytes": runs[0]["payload_bytes"], "ranks": runs[0]["ranks"], "runs": runs, "stages_s": med,
             "torch_free": all(x["torch_free"] for x in runs),
             "torch_before_ready": any(x["torch_before_ready"] for x in runs),
             "met": med["total"]["median"] <= target_s}
        res["namings"][naming] = r
        md += [f"### First start to READY under socket activation: {kind}, naming = \"{naming}\", TP {args.tp} "
               f"({r['ranks']} rank(s) on GPU 0; {backend} backend, {args.activator} activator; "
               f"{r['payload_bytes'] / GB:.2f} GB in page cache, {res['cpus']} CPUs, read_threads "
               f"{res['read_threads']}; {from_bytecode}; median of {args.reps} fresh processes, (min–max))", "",
               "| stage | seconds |", "|---|---|"]
        for k in (*STAGES, "total"):
            name = {"total": "**total**", "digests": "digests (GPU kernel)" if cuda else "digests"}.get(k, k)
            md.append(f"| {name} | {spread(med[k])} |")
        md += ["", f"read rate over the read (ranks summed): {med['read_gbps']['median']:.1f} GB/s; filled without "
                   f"torch: {'yes' if r['torch_free'] else 'NO'}; torch imported before READY: "
                   f"{'YES' if r['torch_before_ready'] else 'no'}; target <= {target_s} s: {met(r['met'])}"]
        cold = [x["cold_attach"] for x in runs if "cold_attach" in x]
        if cold and "error" not in cold[0]:
            r["cold_attach"] = {}
            for label, samples in cold[0].items():
                r["cold_attach"][label] = c = _cold_stats(samples)
                first, tf = samples[0]["client_first"], samples[0]["torch_first"]
                med = {k: v["median"] * 1e3 for k, v in c.items()}
                md += ["", f"cold attach, client `{label}` (fresh processes, rank 0, {first['tensors']} tensors, "
                           f"median of {len(samples)}; import ahead: {'yes' if first['import_ahead'] else 'no'}; "
                           f"{'from bytecode' if args.bytecode == 'cached' else 'bytecode as the environment has it'}). "
                           f"Client first: `import weightcache` {med['import_weightcache_s']:.1f} ms + "
                           f"`weightcache.attach` (the client) {med['import_client_s']:.1f} ms, `import torch` + "
                           f"CUDA init {med['import_torch_and_cuda_s']:.0f} ms, first `attach()` "
                           f"{med['first_attach_s']:.1f} ms (importing {first['imported_by_first_attach']}), second "
                           f"{med['second_attach_s']:.1f} ms. Torch first: the client's import "
                           f"{med['import_client_after_torch_s']:.1f} ms, first `attach()` at once "
                           f"{med['first_attach_at_once_s']:.1f} ms (importing {tf['imported_by_first_attach']}), "
                           f"second {med['second_attach_at_once_s']:.1f} ms; pipeline modules loaded by the import: "
                           f"{first['heavy_modules_at_import'] or 'none'}"]
                c["stages_us"], table = _stage_table(samples)
                if table:
                    md += ["", f"the attaches of client `{label}` by stage (median of {len(samples)}; the import ahead "
                               f"done before the first: {sum(x['client_first']['import_ahead_done'] for x in samples)}"
                               f"/{len(samples)}):", "", *table, ""]
                if "verify_s" in first:
                    md += [f"`verify` of every rank (through the socket, the service's digests recomputed): "
                           f"{first['verify_s']:.3f} s, {first['verify_mismatched']} mismatched"]
        elif cold:
            md += ["", f"cold attach failed: {cold[0]['error'][-300:]}"]
        md.append("")
    if "hf" in results and len(results) > 1:
        hf = res["namings"]["hf"]["stages_s"]["total"]["median"]
        for naming in results:
            if naming != "hf":
                ratio = res["namings"][naming]["stages_s"]["total"]["median"] / hf
                res["namings"][naming]["vs_hf"] = ratio
                md.append(f"naming = \"{naming}\" / naming = \"hf\" (first start, medians): {ratio:.2f}x "
                          f"(target <= 1.10x: {met(ratio <= 1.10)})")
    tag = "_".join(namings) + (f"_tp{args.tp}" if args.tp > 1 else "") + ("" if args.fp8 == "none" else
                                                                          f"_fp8{args.fp8}")
    emit(f"first_start_{args.device}_{tag}", res, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
