"""The torch-free fill on the cuda backend (run by scripts/gpu-check on a GPU machine).

- In process: a bf16 checkpoint filled into a CUDA slab through
  :func:`weightcache.pipeline.fill` (cuda-bindings' pinned staging, stream
  and events; ``sum64`` digests by the NVRTC kernel) gives the bytes
  safetensors reads from disk and the manifest the torch pipeline gives,
  digests included; ``verify`` of the sealed slab passes, and after one byte
  of the slab is changed through a read-write mapping of its fd it names
  exactly that tensor; so does the ``O_DIRECT`` path.
- A service on the cuda backend whose ``import torch`` fails (a
  ``sys.meta_path`` hook) loads the same checkpoint to ``ready`` and an
  engine attaches it on ``cuda:0`` byte for byte.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import checkpoints  # noqa: E402 - tests/ is on sys.path (pyproject's pythonpath)

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]


def _harness():
    spec = importlib.util.spec_from_file_location("wc_harness_torch_free", ROOT / "tests/service_harness.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bf16_checkpoint(dest: Path) -> Path:
    h = _harness()
    # inter=2304: the MLP weights are 1.125 MiB, so a staged piece and an xxh3c chunk split them.
    tensors = {k: v.to(torch.bfloat16) for k, v in checkpoints.llama_tensors(seed=11, hidden=256, inter=2304, vocab=320).items()}
    cfg = {**checkpoints.llama_config(hidden=256, inter=2304, vocab=320), "torch_dtype": "bfloat16"}
    return checkpoints.write_checkpoint(dest, tensors, cfg, files=2)


@pytest.mark.parametrize("o_direct", [False, True])
def test_cuda_fill_without_torch_equals_the_torch_pipeline(tmp_path, o_direct):
    from weightcache import digest, pipeline
    from weightcache.reader import _loader as loader
    from weightcache.config import ModelConfig
    from weightcache.spec import RankRequest
    from weightcache.manifest import build_views
    from weightcache.memory.cuda import CudaBackend
    from weightcache.memory.cuda_mapping import _map_fd

    ck = _bf16_checkpoint(tmp_path / "ck")
    if o_direct:
        try:
            os.close(os.open(next(ck.glob("*.safetensors")), os.O_RDONLY | os.O_DIRECT))
        except OSError:
            pytest.skip(f"{tmp_path} does not support O_DIRECT")
    backend = CudaBackend(0)
    p = pipeline.plan(RankRequest(ModelConfig(name="m", path=str(ck)), 1, 0), backend.device_info())
    opts = loader.LoaderOptions(threads=3, staging_bytes=2 << 20, o_direct=o_direct)

    w = backend.allocate(p.slab_size_bytes, "m")
    filled = pipeline.fill(p, w, options=opts)
    sealed = w.seal()
    assert filled.torch_free is True
    stored = [r for r in filled.manifest.tensors if r.alias_of is None]
    assert all(r.digest.startswith("sum64:") for r in stored)
    for r in stored:  # the kernel's digests are torch's sum64 of the bytes on the GPU
        assert r.digest == digest.digest(sealed.tensor[r.offset_bytes : r.offset_bytes + r.size_bytes]), r.name
    assert pipeline.verify(filled.manifest, sealed) == []

    ref = checkpoints.read_checkpoint(ck)
    views = build_views(sealed.tensor, filled.manifest)
    assert sorted(views) == sorted(ref)
    for name, want in ref.items():
        assert views[name].is_cuda and torch.equal(views[name].cpu(), want), name

    w2 = backend.allocate(p.slab_size_bytes, "m-torch")
    want_manifest = pipeline.execute(p, w2.tensor, options=opts)
    assert filled.manifest.tensors == want_manifest.tensors  # the same records, digests included
    assert all(r.digest.startswith("sum64:") for r in want_manifest.tensors if r.alias_of is None)
    w2.abort()
    assert pipeline.verify(want_manifest, sealed) == []  # same bytes: the GPU's sum64 agrees too

    # One byte changed through a read-write mapping of the exported fd (the service's own view is read-only).
    victim = max(stored, key=lambda r: r.size_bytes)
    rw = _map_fd(backend._device(0), sealed.fd, sealed.size_bytes, read_only=False)
    at = victim.offset_bytes + victim.size_bytes - 1  # its last byte (the kernel's tail word)
    flip = rw.tensor()[at : at + 1]
    flip.bitwise_xor_(torch.ones(1, dtype=torch.uint8, device=flip.device))
    torch.cuda.synchronize()
    del flip
    rw.release()
    assert pipeline.verify(filled.manifest, sealed) == [victim.name]
    assert pipeline.verify(want_manifest, sealed) == [victim.name]
    sealed.close()


def test_cuda_service_reaches_ready_without_torch(tmp_path):
    from weightcache.client import attach

    h = _harness()
    ck = _bf16_checkpoint(tmp_path / "ck")
    env, log = h.blocked_torch_env(tmp_path)
    svc = h.ServiceProcess(tmp_path / "s", h.make_config({"m": ck}, backend="cuda"), gpu=0, backend="cuda",
                           env=env).start()
    try:
        slab = svc.wait_settled()["slabs"][0]
        assert slab["state"] == "ready", (slab, svc.log())
        attempts = h.torch_import_attempts(log)
        assert attempts == [], attempts[0]["stack"] if attempts else ""
        assert "torch_free=yes" in svc.log()
        w = attach("m", device="cuda:0", socket_dir=svc.socket_dir, fallback=False)
        try:
            assert w.source == "daemon"
            checkpoints.compare_bytes(dict(w.tensors), checkpoints.read_checkpoint(ck))
        finally:
            w.close()
    finally:
        svc.kill()
