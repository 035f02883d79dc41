"""Shared pieces of the issue-6 benchmarks: synthetic checkpoints, statistics, service plumbing.

Synthetic checkpoints are real sharded safetensors directories (8-byte
little-endian header length, JSON header with ``data_offsets``, data) with
Llama shapes and Hugging Face names, plus ``config.json`` and
``model.safetensors.index.json``. Data is either random (a 64 MiB
``os.urandom`` block written over and over: read speed does not depend on
the values) or sparse (the files are ``ftruncate``d past the header: holes
read as zeros and cost no disk; used where only the layout matters, as for
attach and restart).

Benchmarks print markdown and write a JSON file of their results; ``benchmarks/run``
collects them.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: The service tree the benchmarks run (``BENCH_SERVICE_DIR``: another commit's ``service/``, for a before/after
#: in one run).
SERVICE_DIR = Path(os.environ.get("BENCH_SERVICE_DIR") or ROOT / "service")
if str(SERVICE_DIR) not in sys.path:
    sys.path.insert(0, str(SERVICE_DIR))

GB = 1e9
GiB = 1 << 30


@dataclass(frozen=True)
class LlamaShape:
    """Dimensions of a Llama-family model (``config.json`` keys in comments)."""

    hidden: int        # hidden_size
    inter: int         # intermediate_size
    heads: int         # num_attention_heads
    kv_heads: int      # num_key_value_heads
    head_dim: int      # head_dim
    layers: int        # num_hidden_layers
    vocab: int         # vocab_size

    def config(self) -> dict[str, Any]:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": self.hidden,
                "intermediate_size": self.inter, "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "vocab_size": self.vocab, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                "torch_dtype": "bfloat16"}

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` in checkpoint order (embedding, layers, norm, lm_head)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [(p + "input_layernorm.weight", (h,)),
                    (p + "self_attn.q_proj.weight", (q, h)),
                    (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.weight", (kv, h)),
                    (p + "self_attn.o_proj.weight", (h, q)),
                    (p + "post_attention_layernorm.weight", (h,)),
                    (p + "mlp.gate_proj.weight", (self.inter, h)),
                    (p + "mlp.up_proj.weight", (self.inter, h)),
                    (p + "mlp.down_proj.weight", (h, self.inter))]
        out += [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]
        return out

    def bytes(self, itemsize: int = 2) -> int:
        total = 0
        for _, shape in self.tensors():
            n = itemsize
            for d in shape:
                n *= d
            total += n
        return total


#: Llama-2-7B: 291 tensors in HF naming, 195 in vLLM naming, 12.55 GiB in BF16.
LLAMA2_7B = LlamaShape(4096, 11008, 32, 32, 128, 32, 32000)
#: One tensor-parallel rank of Llama-2-70B at TP 8, as its own checkpoint (723 tensors, 16.1 GiB BF16):
#: q/k/v/gate/up are the rank's rows, o/down its columns, embedding and lm_head its vocab rows.
LLAMA2_70B_TP8_RANK = LlamaShape(8192, 28672 // 8, 64 // 8, 8 // 8, 128, 80, 32000 // 8)


def scaled(shape: LlamaShape, factor: int) -> LlamaShape:
    """Same tensor count, every width divided by ``factor`` (CPU-sized runs)."""
    return LlamaShape(max(64, shape.hidden // factor), max(64, shape.inter // factor), shape.heads,
                      shape.kv_heads, max(8, shape.head_dim // factor), shape.layers, max(64, shape.vocab // factor))


def layers_for(target_bytes: int, base: LlamaShape) -> LlamaShape:
    """``base`` with the number of layers that brings it closest to ``target_bytes`` (at least 1)."""
    one = LlamaShape(**{**base.__dict__, "layers": 1}).bytes()
    zero = LlamaShape(**{**base.__dict__, "layers": 0}).bytes()
    n = max(1, round((target_bytes - zero) / (one - zero)))
    return LlamaShape(**{**base.__dict__, "layers": n})


def _header(entries: list[tuple[str, tuple[int, ...], int]]) -> tuple[bytes, int]:
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape, n in entries:
        meta[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, off


def write_checkpoint(dest: Path, shape: LlamaShape, fill: str = "random", max_file_bytes: int = 4 * 10**9) -> Path:
    """Writes a BF16 Llama checkpoint of ``shape`` into ``dest``; reuses a complete earlier one.

    Args:
        fill (`str`): ``"random"`` (real bytes on disk) or ``"sparse"`` (holes).
        max_file_bytes (`int`): shard size limit; shards hold whole tensors in order.
    """
    dest = Path(dest)
    marker = dest / ".complete"
    want = json.dumps({"shape": shape.__dict__, "fill": fill, "max": max_file_bytes})
    if marker.exists() and marker.read_text() == want:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    for f in dest.iterdir():
        f.unlink()
    shards: list[list[tuple[str, tuple[int, ...], int]]] = [[]]
    size = 0
    for name, shp in shape.tensors():
        n = 2
        for d in shp:
            n *= d
        if shards[-1] and size + n > max_file_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shp, n))
        size += n
    block = os.urandom(64 << 20) if fill == "random" else b""
    weight_map = {}
    for i, entries in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        hdr, data = _header(entries)
        with open(dest / fname, "wb") as f:
            f.write(len(hdr).to_bytes(8, "little") + hdr)
            if fill == "random":
                left = data
                while left:
                    k = min(left, len(block))
                    f.write(memoryview(block)[:k])
                    left -= k
            else:
                f.truncate(8 + len(hdr) + data)
        weight_map.update({name: fname for name, _, _ in entries})
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": shape.bytes()},
                                                                   "weight_map": weight_map}))
    (dest / "config.json").write_text(json.dumps(shape.config()))
    marker.write_text(want)
    return dest


def warm_page_cache(path: Path, threads: int = 16) -> float:
    """Reads every file of ``path`` once (so later reads come from the page cache); returns seconds."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = []
    for f in sorted(Path(path).glob("*.safetensors")):
        size = f.stat().st_size
        step = 256 << 20
        jobs += [(str(f), off, min(step, size - off)) for off in range(0, size, step)]

    def read(job: tuple[str, int, int]) -> None:
        p, off, n = job
        fd = os.open(p, os.O_RDONLY)
        try:
            buf = bytearray(min(n, 16 << 20))
            mv = memoryview(buf)
            done = 0
            while done < n:
                got = os.preadv(fd, [mv[: min(len(buf), n - done)]], off + done)
                if got <= 0:
                    break
                done += got
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(read, jobs))
    return time.perf_counter() - t0


def stats(xs: list[float]) -> dict[str, float]:
    """Median, p10/p90 (or min/max for few samples), p99, min, max and count of ``xs``."""
    s = sorted(xs)
    n = len(s)

    def pct(p: float) -> float:
        if n == 1:
            return s[0]
        k = (n - 1) * p
        lo = int(k)
        hi = min(lo + 1, n - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"n": n, "median": statistics.median(s), "p10": pct(0.10), "p90": pct(0.90), "p99": pct(0.99),
            "min": s[0], "max": s[-1]}


def spread(s: dict[str, float]) -> str:
    """``median (min–max)`` of a :func:`stats` result, 3 decimals, for a results table."""
    return f"{s['median']:.3f} ({s['min']:.3f}–{s['max']:.3f})"


def met(ok: bool) -> str:
    """A target's verdict for a results table: ``met`` or ``MISSED``."""
    return "met" if ok else "MISSED"


def service_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for service/client subprocesses: source tree first, no systemd variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "WATCHDOG_USEC",
                        "WEIGHTCACHE_SOCKET_DIR", "WEIGHTCACHE_CONFIG")}
    env["PYTHONPATH"] = os.pathsep.join([str(SERVICE_DIR)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def write_config(path: Path, models: dict[str, dict[str, Any]], backend: str, tp: int = 1, **service: Any) -> Path:
    """A weightcache TOML with ``models`` ({name: {path, naming, ...}}), every rank of TP ``tp`` on GPU 0."""
    lines = ["[service]", f'backend = "{backend}"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in service.items()]
    for name, m in models.items():
        lines.append(f'\n[models."{name}"]')
        for k, v in m.items():
            lines.append(f"{k} = {json.dumps(str(v) if isinstance(v, Path) else v)}")
        lines.append(f"layouts = [{{ tp = {tp}, gpus = {[0] * tp} }}]")
    Path(path).write_text("\n".join(lines) + "\n")
    return Path(path)


def wait_ready(sock_path: str, proc: subprocess.Popen, timeout_s: float, log_path: Path | None = None,
               poll_s: float = 0.2) -> dict:
    """Polls ``status`` on ``sock_path`` every ``poll_s`` seconds until every slab is ready; returns the status
    dict."""
    from weightcache import protocol
    from weightcache.errors import WeightcacheError
    from weightcache.session import Session

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            tail = log_path.read_text()[-4000:] if log_path and log_path.exists() else ""
            raise RuntimeError(f"service exited with {proc.returncode}\n{tail}")
        try:
            s = Session(sock_path, timeout=5.0)
            try:
                st = s.request(protocol.Status()).status
            finally:
                s.close()
            states = [x["state"] for x in st["slabs"]]
            if states and all(x == "ready" for x in states):
                return st
            if any(x == "failed" for x in states):
                raise RuntimeError(f"a model failed to load: {json.dumps(st['slabs'])[:2000]}")
        except (WeightcacheError, OSError):
            pass
        if time.monotonic() > deadline:
            tail = log_path.read_text()[-4000:] if log_path and log_path.exists() else ""
            raise RuntimeError(f"service not ready after {timeout_s} s\n{tail}")
        time.sleep(poll_s)


def unix_listener(path: str) -> socket.socket:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(128)
    return s


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def versions() -> dict[str, str]:
    import platform

    out = {"python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch_cuda"] = str(torch.version.cuda)
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import safetensors

        out["safetensors"] = safetensors.__version__
    except ImportError:
        pass
    try:
        import cuda.bindings

        out["cuda_bindings"] = cuda.bindings.__version__
    except ImportError:
        pass
    out["cpus"] = str(os.cpu_count())
    return out


def patch_timers(patches: list[tuple[Any, str, str]], acc: dict[str, float]) -> list[tuple[Any, str, Any]]:
    """Wraps ``owner.attr`` for each ``(owner, attr, name)`` so that its calls add their seconds to ``acc[name]``.

    Class methods stay class methods; an attribute ``owner`` lacks is skipped (an
    older client). Returns ``(owner, attr, original)`` for restoring them.
    """
    import functools

    def timed(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    saved = []
    for owner, attr, name in patches:
        orig = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if orig is None:
            continue
        wrapped = classmethod(timed(name, orig.__func__)) if isinstance(orig, classmethod) else timed(name, orig)
        saved.append((owner, attr, orig))
        setattr(owner, attr, wrapped)
    return saved


def emit(name: str, result: dict[str, Any], markdown: str) -> None:
    """Prints ``markdown`` and writes ``result`` to ``$BENCH_JSON_DIR/<name>.json`` when set."""
    print(markdown, flush=True)
    d = os.environ.get("BENCH_JSON_DIR")
    if d:
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
        (Path(d) / f"{name}.md").write_text(markdown + "\n")


def bench_engine_key(version: str, cap: tuple[int, int]) -> dict:
    """A publication's engine key for the publication benchmarks (TP 1; ``version`` makes each publication its
    own slab; ``cap``: the GPU's compute capability)."""
    return {"engine": "bench", "engine_version": version, "architecture": "Bench", "dtype": "bfloat16",
            "quantization": {"method": "", "config_blake2b": ""},
            "parallel": {"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "dp_size": 1, "dp_rank": 0,
                         "ep_size": 1, "ep_rank": 0},
            "draft": "", "kernels": {}, "compute_capability": f"{cap[0]}.{cap[1]}"}


def move_into_home(tensors: dict, device: str) -> tuple[Any, dict]:
    """What vLLM's publishing load does to the model it built (``WeightcachePublishLoader._own_load``): every
    tensor moved into one VMM allocation of this process laid out as the slab (``allocate_home``,
    ``move_storages``). Returns (the home, the tensors by name, now views of it); the callers drop their own."""
    import torch
    from torch import nn

    from weightcache.client import allocate_home
    from weightcache.integrations.params import move_storages

    holder = nn.ParameterDict({f"p{i}": nn.Parameter(t, requires_grad=False) for i, t in enumerate(tensors.values())})
    names = dict(zip(holder.keys(), tensors.keys()))
    got = allocate_home({names[k]: p for k, p in holder.items()}, device=device)
    if got is None:
        raise RuntimeError(f"no room on {device} for the publication home")
    home, copies = got
    move_storages(holder, home.tensor, copies)
    torch.cuda.empty_cache()
    return home, {names[k]: p.detach() for k, p in holder.items()}
