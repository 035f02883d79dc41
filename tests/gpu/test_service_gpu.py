"""The service on the cuda backend, end to end (run by scripts/gpu-check on a GPU machine).

- Two engine processes attach a BERT checkpoint zero-copy on ``cuda:0`` and
  compute the same outputs as transformers' ``from_pretrained`` on the GPU.
- A write into an attached view is refused and the resident bytes verify.
- TP = 2 with both ranks' slabs on one GPU: the shards reassemble to the
  checkpoint byte for byte.
- A fresh engine's first CUDA attach finds the CUDA attach path imported
  ahead (``weightcache.client._imports``) and imports nothing itself; the
  thread loads the driver library without initialising the driver.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def _bert(dest: Path) -> Path:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=256, max_position_embeddings=64)
    BertModel(cfg).eval().save_pretrained(dest, safe_serialization=True)
    return dest


_ENGINE = r"""
import json, sys, torch
from transformers import BertConfig, BertModel
from weightcache import attach
path, sock, out = sys.argv[1:4]
w = attach(path, device="cuda:0", socket_dir=sock, fallback=False)
assert w.source == "daemon", w.fallback_reason
assert all(t.is_cuda for t in w.tensors.values())
with torch.device("cuda:0"):
    model = BertModel(BertConfig.from_pretrained(path)).eval()
ids = torch.arange(1, 33, device="cuda:0").reshape(2, 16) % 1000
with torch.inference_mode():
    y = torch.func.functional_call(model, {k: v for k, v in w.tensors.items() if k in dict(model.named_parameters()) or k in dict(model.named_buffers())}, (ids,)).last_hidden_state
torch.save(y.cpu(), out)
print(json.dumps({"ptr": int(next(iter(w.tensors.values())).data_ptr()), "n": len(w.tensors)}))
"""

_WRITER = r"""
import sys, torch
from weightcache import attach
w = attach(sys.argv[1], device="cuda:0", socket_dir=sys.argv[2], fallback=False)
t = next(t for n, t in w.tensors.items() if t.dtype == torch.float32 and t.dim() == 2)
print("attached", flush=True)
try:
    t.copy_(torch.zeros_like(t, device="cpu"))
    torch.cuda.synchronize()
    print("write went through", flush=True)
except Exception as e:
    print("refused:", type(e).__name__, str(e).splitlines()[0], flush=True)
"""


def _service(work: Path, models: dict):
    import importlib.util

    spec = importlib.util.spec_from_file_location("wc_integration_conftest", ROOT / "tests/service_harness.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ServiceProcess(work, {"service": {"backend": "cuda"}, "models": models}, gpu=0, backend="cuda").start()


def test_two_engine_processes_zero_copy_match_from_pretrained(tmp_path):
    from transformers import BertModel

    ck = _bert(tmp_path / "bert")
    work = Path(tempfile.mkdtemp(prefix="wc-gpu-", dir="/tmp"))
    svc = _service(work, {"bert": {"path": str(ck)}})
    try:
        svc.wait_settled()
        outs = []
        for i in range(2):
            r = subprocess.run([sys.executable, "-c", _ENGINE, str(ck), svc.socket_dir, str(tmp_path / f"y{i}.pt")],
                               capture_output=True, text=True, timeout=300, env=dict(os.environ))
            assert r.returncode == 0, r.stderr[-3000:]
            outs.append(torch.load(tmp_path / f"y{i}.pt"))
        ref_model = BertModel.from_pretrained(ck).cuda().eval()
        ids = torch.arange(1, 33, device="cuda:0").reshape(2, 16) % 1000
        with torch.inference_mode():
            ref = ref_model(ids).last_hidden_state.cpu()
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(outs[0], ref)
        # A write into a read-only view is refused; the service's bytes verify.
        r = subprocess.run([sys.executable, "-c", _WRITER, str(ck), svc.socket_dir], capture_output=True, text=True,
                           timeout=300)
        assert "attached" in r.stdout and "write went through" not in r.stdout, r.stdout + r.stderr[-2000:]
        from weightcache import protocol

        res = svc.request(protocol.Verify("bert")).results
        assert res and all(x["mismatched"] == [] for x in res), res
        assert svc.slab("bert")["state"] == "ready"
    finally:
        svc.kill()


def test_tp2_both_ranks_on_one_gpu_reassemble(tmp_path):
    from tiny_models import build_tiny_model, checkpoint_tensors, reassemble
    from weightcache import attach

    ck = build_tiny_model(tmp_path / "qwen2", "qwen2")
    work = Path(tempfile.mkdtemp(prefix="wc-gpu-", dir="/tmp"))
    svc = _service(work, {"q": {"path": str(ck), "naming": "vllm", "layouts": [{"tp": 2, "gpus": [0, 0]}]}})
    try:
        svc.wait_settled()
        ranks = []
        for rank in range(2):
            w = attach(str(ck), tp_size=2, tp_rank=rank, naming="vllm", device="cuda:0", socket_dir=svc.socket_dir,
                       fallback=False)
            assert w.source == "daemon"
            ranks.append((w.manifest, {k: v.cpu() for k, v in w.tensors.items()}))
            w.close()
        full = reassemble(ranks)
        ref = checkpoint_tensors(ck)
        compared = 0
        for name, t in ref.items():
            if name in full:
                assert torch.equal(full[name], t), name
                compared += 1
        assert compared >= len(ref) - 1  # a tied lm_head is an alias, not a tensor of its own
    finally:
        svc.kill()


#: A fresh engine: the client first (the CUDA attach path starts importing on a thread), torch and CUDA, then the
#: first attach; prints the modules that attach imported, whether the thread ran, and the tensors' bytes.
_COLD_ENGINE = r"""
import hashlib, json, sys
import weightcache
attach = weightcache.attach
import torch
from weightcache.client import _imports as attach_imports
device = sys.argv[3]
if device.startswith("cuda"):
    torch.cuda.init()
ahead = attach_imports._thread is not None
assert attach_imports.wait(120)
before = set(sys.modules)
w = attach(sys.argv[1], device=device, socket_dir=sys.argv[2], fallback=False)
during = sorted(set(sys.modules) - before)
got = {k: hashlib.sha256(v.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
       for k, v in w.tensors.items() if v.numel()}
print(json.dumps([ahead, during, w.source, got]))
"""


def test_first_cuda_attach_finds_its_imports_done(tmp_path):
    """On a GPU machine (an NVIDIA device node, no ``WEIGHTCACHE_IMPORT_AHEAD`` override) the client's import
    starts importing the CUDA attach path; once done, the first attach imports no module of its own and its
    tensors are the checkpoint's bytes."""
    from tiny_models import build_tiny_model, checkpoint_tensors

    ck = build_tiny_model(tmp_path / "llama", "llama")
    work = Path(tempfile.mkdtemp(prefix="wc-gpu-", dir="/tmp"))
    svc = _service(work, {"l": {"path": str(ck)}})
    try:
        svc.wait_settled()
        env = {k: v for k, v in os.environ.items() if k != "WEIGHTCACHE_IMPORT_AHEAD"}
        r = subprocess.run([sys.executable, "-c", _COLD_ENGINE, str(ck), svc.socket_dir, "cuda:0"],
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        ahead, during, source, got = json.loads(r.stdout.strip().splitlines()[-1])
        assert ahead and source == "daemon"
        assert not [m for m in during if m.startswith(("cuda", "weightcache"))], during
        ref = checkpoint_tensors(ck)
        compared = 0
        for name, digest in got.items():
            if name in ref:
                assert digest == hashlib.sha256(ref[name].contiguous().view(torch.uint8).numpy().tobytes()).hexdigest(), \
                    name
                compared += 1
        assert compared >= len(ref) - 1  # a tied lm_head is an alias, not a tensor of its own
    finally:
        svc.kill()


#: A fresh process that imports the client and waits for the import ahead: the driver library is loaded and its
#: entry points resolved (``load_driver``), the driver not initialised (``cuDeviceGetCount`` answers
#: ``CUDA_ERROR_NOT_INITIALIZED`` until someone calls ``cuInit``), torch not imported.
_AHEAD_ONLY = r"""
import json, logging, sys
logging.basicConfig(level=logging.DEBUG)  # the thread says what it loaded
import weightcache
weightcache.attach
from weightcache.client import _imports as attach_imports
assert attach_imports.wait(120)
from cuda.bindings import driver as cu
err, _ = cu.cuDeviceGetCount()
version = cu.cuDriverGetVersion()[1]
print(json.dumps([attach_imports._thread is not None, err.name, version, "torch" in sys.modules]))
"""


def test_the_import_ahead_loads_the_driver_library_without_initialising_it():
    """What makes a fork after the client's import safe for CUDA: no ``cuInit`` on the thread, only the library."""
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTCACHE_IMPORT_AHEAD"}
    r = subprocess.run([sys.executable, "-c", _AHEAD_ONLY], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    ahead, err, version, torch_imported = json.loads(r.stdout.strip().splitlines()[-1])
    assert ahead and not torch_imported
    assert err == "CUDA_ERROR_NOT_INITIALIZED"
    assert f"driver library loaded ahead: CUDA {version}" in r.stderr, r.stderr[-3000:]
