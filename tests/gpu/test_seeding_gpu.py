"""Peer seeding on the cuda backend (issue 37; run on a GPU machine, ``-m gpu``; needs NIXL).

Two real cuda services on GPU 0, each in its own socket directory (nothing locks a GPU index to one
instance: the socket path is the only per-instance resource, and each service here has its own; the second
gets no ``seed_listen``, so no port is shared either). The source loads a 1 GB Llama (float32, 4 files) to
its GPU and a small model to its host tier (``preload = "host"``: ``xxh3_128`` digests); both served to peers.

1. GPU -> GPU: a receiver whose checkpoint directory holds the headers and holes where the data was
   (reads give zeros) becomes READY from the source's GPU slab, READ as ``VRAM`` into its own GPU slab, the
   ``sum64`` digests checked on its GPU: ``source = peer``, bytes on ``cuda:0`` equal to the real
   checkpoint's, ``verify`` finds no mismatch, no NIXL registration left at either end.
   The small model's offer (host-tier memory, ``xxh3_128`` digests) cannot be checked in GPU memory: it is
   refused before the READ (``digest_kind``) and that receiver loads it from its own (real) files.
2. GPU -> host tier: a receiver with ``preload = "host"`` READs the source's GPU slab into a host memfd
   (``VRAM`` -> ``DRAM``, UCX's ``cuda_copy``), checks the ``sum64`` digests on the host (numpy): HOSTED,
   ``source = peer``; an attach on ``cuda:0`` promotes it (the ``sum64`` checked again on the GPU) with
   bytes equal to the checkpoint's.
3. host tier -> GPU: the source's GPU slab is demoted to its host tier (``sum64`` digests kept) and a new
   receiver READs it from the source's pinned memfd (``DRAM`` -> ``VRAM``) into its GPU slab.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not any(importlib.util.find_spec(n) for n in ("nixl_cu12", "nixl_cu13")),
                                 reason="NIXL (weightcache[seeding]) is not installed")]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _released(svc) -> None:
    held = re.findall(r"nixl_registrations=(\d+)", svc.log())
    assert held and held[-1] == "0", (held, svc.log()[-4000:])


def _slab(svc, model: str, states: tuple[str, ...], timeout: float = 180) -> dict:
    from service_harness import poll_until

    def settled():
        s = svc.slab(model)
        assert s["state"] != "failed", (s, svc.log()[-4000:])
        return s if s["state"] in states else None

    return poll_until(settled, f"{model} {states}", timeout, 0.1, detail=lambda: svc.log()[-4000:])


def _attached(svc, model: str, want: dict) -> int:
    from checkpoints import compare_bytes
    from weightcache import attach

    with attach(model, socket_dir=svc.socket_dir, device="cuda:0", fallback=False, timeout=120) as w:
        assert w.source == "daemon" and all(t.is_cuda for t in w.tensors.values())
        return compare_bytes(dict(w.tensors), want)


def test_cuda_services_seed_gpu_to_gpu_gpu_to_host_and_host_to_gpu(tmp_path):
    from checkpoints import headers_only_copy, llama_checkpoint, read_checkpoint
    from service_harness import start_service
    from weightcache import protocol

    big = llama_checkpoint(tmp_path / "big", files=4, hidden=1024, heads=8, kv_heads=2, inter=4096, vocab=8192,
                           layers=16)
    assert sum(f.stat().st_size for f in big.glob("*.safetensors")) > 10**9
    small = llama_checkpoint(tmp_path / "small", seed=3, files=1)
    bare = headers_only_copy(big, tmp_path / "bare")
    want = read_checkpoint(big)
    secret = tmp_path / "seed.secret"
    secret.write_text("b" * 64 + "\n")
    secret.chmod(0o600)
    port = _free_port()
    peer = f"127.0.0.1:{port}"
    short = Path(tempfile.mkdtemp(prefix="wcsg-", dir="/tmp"))  # unix socket paths are short
    started = []
    passed = False

    def svc(name: str, models: dict, **service):
        cfg = {"service": {"backend": "cuda", "seed_secret_file": str(secret), "host_tier_bytes": 4 << 30,
                           **service},
               "models": {m: {"layouts": [{"tp": 1, "gpus": [0]}], **t} for m, t in models.items()}}
        s = start_service(short / name, cfg, backend="cuda")
        started.append(s)
        return s

    try:
        a = svc("a", {"m": {"path": str(big), "serve_to_peers": True},
                      "h": {"path": str(small), "serve_to_peers": True, "preload": "host"}},
                seed_listen=peer)
        assert _slab(a, "m", ("ready",))["source"] == "checkpoint"
        _slab(a, "h", ("hosted",))

        # 1. GPU -> GPU; the host tier's xxh3 offer refused into GPU memory (digest_kind), its own files read.
        b = svc("b", {"m": {"path": str(bare)}, "h": {"path": str(small)}}, peers=[peer], seed_samples=0)
        m = _slab(b, "m", ("ready",))
        assert (m["source"], m.get("peer")) == ("peer", peer), b.log()[-4000:]
        h = _slab(b, "h", ("ready",))
        assert h["source"] == "checkpoint" and "reason=digest_kind" in b.log(), b.log()[-4000:]
        assert _attached(b, "m", want) > 10**9
        assert b.request(protocol.Verify("m")).results[0]["mismatched"] == []
        line = re.search(r"seeding: seeded model=m .*", b.log()).group(0)
        print("GPU->GPU:", line)
        _released(b)

        # 2. GPU -> host tier (VRAM -> DRAM), sum64 checked on the host; the attach promotes it.
        c = svc("c", {"m": {"path": str(bare), "preload": "host"}}, peers=[peer], seed_samples=0)
        m = _slab(c, "m", ("hosted",))
        assert (m["source"], m.get("peer")) == ("peer", peer), c.log()[-4000:]
        print("GPU->host:", re.search(r"seeding: seeded model=m .*", c.log()).group(0))
        _released(c)
        assert _attached(c, "m", want) > 10**9

        # 3. host tier -> GPU (DRAM -> VRAM): the source's slab demoted, its sum64 digests kept.
        a.request(protocol.Evict("m", to="host"))
        _slab(a, "m", ("hosted",))
        d = svc("d", {"m": {"path": str(bare)}}, peers=[peer], seed_samples=0)
        m = _slab(d, "m", ("ready",))
        assert (m["source"], m.get("peer")) == ("peer", peer), d.log()[-4000:]
        print("host->GPU:", re.search(r"seeding: seeded model=m .*", d.log()).group(0))
        assert _attached(d, "m", want) > 10**9
        _released(d)
        _released(a)
        served = json.dumps(re.findall(r"seeding: served model=\S+", a.log()))
        assert served.count("model=m") == 3, served
        passed = True
    finally:
        for s in started:
            s.kill()
        if passed:  # else the services' logs stay for a look (printed by the command in the report)
            shutil.rmtree(short, ignore_errors=True)
