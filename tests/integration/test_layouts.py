"""Several layouts per GPU: every instance serves exactly the ranks placed on its GPU.

One config: model ``llama`` with ``tp = 1`` on GPU 0 and ``tp = 2`` on GPUs
0 and 1, model ``qwen`` with ``tp = 2`` on GPUs 1 and 2 (host backend, one
``weightcache serve --gpu N`` per GPU, sockets side by side).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from service_harness import ServiceProcess
from tiny_models import checkpoint_tensors, reassemble, tiny_llama, tiny_qwen2  # noqa: F401 (fixtures)
from weightcache import attach, errors


@pytest.fixture
def instances(tiny_llama, tiny_qwen2):
    work = Path(tempfile.mkdtemp(prefix="wc-lay-", dir="/tmp"))
    cfg = {"service": {"backend": "host"}, "models": {
        "llama": {"path": str(tiny_llama), "layouts": [{"tp": 1, "gpus": [0]}, {"tp": 2, "gpus": [0, 1]}]},
        "qwen": {"path": str(tiny_qwen2), "layouts": [{"tp": 2, "gpus": [1, 2]}]},
    }}
    procs = [ServiceProcess(work, cfg, gpu=g, backend="host").start() for g in (0, 1, 2)]
    for p in procs:
        p.wait_settled()
    yield work, procs
    for p in procs:
        p.kill()


def test_each_instance_serves_exactly_its_ranks(instances, tiny_llama, tiny_qwen2):
    work, procs = instances
    held = {p.gpu: sorted((s["model"], s["tp_size"], s["tp_rank"], s["state"]) for s in p.status()["slabs"])
            for p in procs}
    assert held == {
        0: [("llama", 1, 0, "ready"), ("llama", 2, 0, "ready")],
        1: [("llama", 2, 1, "ready"), ("qwen", 2, 0, "ready")],
        2: [("qwen", 2, 1, "ready")],
    }
    # Each engine rank attaches its own shard from its own GPU's instance...
    for model, path in (("llama", tiny_llama), ("qwen", tiny_qwen2)):
        gpus = (0, 1) if model == "llama" else (1, 2)
        ranks = []
        for rank, gpu in enumerate(gpus):
            w = attach(str(path), tp_size=2, tp_rank=rank, gpu=gpu, socket_dir=str(work), fallback=False)
            assert w.source == "daemon" and w.manifest.tp_rank == rank
            ranks.append((w.manifest, {k: v.clone() for k, v in w.tensors.items()}))
            w.close()
        full = reassemble(ranks)
        ref = checkpoint_tensors(path)
        for name, t in ref.items():
            if name == "lm_head.weight" and name not in full:
                continue
            assert torch.equal(full[name], t), (model, name)
    # ... and the TP = 1 layout of the same model sits beside the TP = 2 rank 0 on GPU 0.
    with attach(str(tiny_llama), gpu=0, socket_dir=str(work), fallback=False) as w1:
        ref = checkpoint_tensors(tiny_llama)
        assert all(torch.equal(w1.tensors[k], ref[k]) for k in ref)
    # A rank asked of the wrong GPU is not there.
    with pytest.raises(errors.ModelNotFound) as e:
        attach(str(tiny_llama), tp_size=2, tp_rank=1, gpu=0, socket_dir=str(work), fallback=False)
    assert "llama/tp2/rank0" in e.value.message
    # A layout nobody configured is a miss: the disk fallback builds it, and says why.
    w4 = attach(str(tiny_llama), tp_size=4, tp_rank=3, gpu=0, socket_dir=str(work), fallback=True)
    assert w4.source == "disk" and w4.fallback_reason.startswith("model_not_found")


def test_status_shows_every_instance(instances):
    work, _ = instances
    r = subprocess.run([sys.executable, "-m", "weightcache", "status", "--json", "--socket-dir", str(work)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    got = sorted((g["gpu"], s["model"], s["tp_size"], s["tp_rank"]) for g in out["gpus"] for s in g["slabs"])
    assert got == [(0, "llama", 1, 0), (0, "llama", 2, 0), (1, "llama", 2, 1), (1, "qwen", 2, 0), (2, "qwen", 2, 1)]
    human = subprocess.run([sys.executable, "-m", "weightcache", "status", "--socket-dir", str(work)],
                           capture_output=True, text=True, timeout=60).stdout
    for gpu in (0, 1, 2):
        assert f"GPU {gpu}" in human
