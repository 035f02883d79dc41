"""ModelOpt FP8 through the service and the client on the cuda backend (scripts/gpu-check).

Per-tensor and per-channel checkpoints, TP = 1 (``hf``) and TP = 2 (``vllm``,
both ranks on GPU 0): an ordinary load (the pipeline into private GPU memory),
the missing-service fallback, an attach and a second attach (``fallback=False``)
give bit-identical tensors and identical greedy tokens (2 prompts x 16) with
``torch._scaled_mm`` in the reference engine.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
PROMPTS = [[1, 5, 9, 33], [7, 7, 100, 2, 64]]


def _conftest():
    spec = importlib.util.spec_from_file_location("wc_integration_conftest", ROOT / "tests/service_harness.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fp8_cuda_service(tmp_path_factory):
    from fp8_fixtures import PER_CHANNEL, PER_TENSOR, write_fp8_checkpoint

    base = tmp_path_factory.mktemp("fp8gpu")
    cks = {algo: write_fp8_checkpoint(base / algo, algo) for algo in (PER_TENSOR, PER_CHANNEL)}
    models = {}
    for algo, path in cks.items():
        models[f"{algo.lower()}_hf"] = {"path": str(path), "naming": "hf", "layouts": [{"tp": 1, "gpus": [0]}]}
        models[f"{algo.lower()}_vllm"] = {"path": str(path), "naming": "vllm", "layouts": [{"tp": 2, "gpus": [0, 0]}]}
    work = Path(tempfile.mkdtemp(prefix="wc-fp8g-", dir="/tmp"))
    svc = _conftest().ServiceProcess(work, {"service": {"backend": "cuda"}, "models": models}, gpu=0,
                                     backend="cuda").start()
    svc.wait_settled()
    yield cks, svc
    svc.kill()


@pytest.mark.parametrize("algo", ["FP8", "FP8_PER_CHANNEL_PER_TOKEN"])
@pytest.mark.parametrize("tp,naming", [(1, "hf"), (2, "vllm")])
def test_fp8_ordinary_fallback_attach_attach_on_cuda(fp8_cuda_service, algo, tp, naming):
    from reference_engine import ReferenceLlama
    from weightcache import attach
    from weightcache.client import load_from_disk
    from weightcache.config import ModelConfig
    from weightcache.manifest import build_views

    cks, svc = fp8_cuda_service
    path = cks[algo]
    loads = {"ordinary": [], "fallback": [], "attach": [], "attach2": []}
    keep = []
    for rank in range(tp):
        man, slab = load_from_disk(ModelConfig("m", str(path), naming=naming), tp, rank, "cuda:0")
        loads["ordinary"].append((build_views(slab, man), {r.name: r.layout for r in man.tensors}))
        fb = attach(str(path), tp_size=tp, tp_rank=rank, naming=naming, device="cuda:0",
                    socket_dir="/nonexistent-wc", fallback=True)
        assert fb.source == "disk"
        loads["fallback"].append((fb.tensors, fb.layouts))
        for key in ("attach", "attach2"):
            w = attach(str(path), tp_size=tp, tp_rank=rank, naming=naming, device="cuda:0",
                       socket_dir=svc.socket_dir, fallback=False)
            assert w.source == "daemon", w.fallback_reason
            keep.append(w)
            loads[key].append((w.tensors, w.layouts))
    try:
        for key in ("fallback", "attach", "attach2"):
            for (t_ref, l_ref), (t, lay) in zip(loads["ordinary"], loads[key]):
                assert set(t) == set(t_ref)
                for name in t_ref:
                    a, b = t_ref[name], t[name]
                    assert b.is_cuda and (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), name
                    fp8 = a.dtype == torch.float8_e4m3fn
                    assert torch.equal(a.view(torch.uint8) if fp8 else a, b.view(torch.uint8) if fp8 else b), (key, name)
                assert lay == l_ref
        cfg = json.loads((path / "config.json").read_text())
        tokens = {k: [ReferenceLlama(cfg, [t for t, _ in r], [l for _, l in r]).generate(p, 16) for p in PROMPTS]
                  for k, r in loads.items()}
        assert all(len(t) == 16 for t in tokens["ordinary"])
        assert tokens["fallback"] == tokens["attach"] == tokens["attach2"] == tokens["ordinary"], tokens
        from weightcache import protocol

        res = svc.request(protocol.Verify(f"{algo.lower()}_{naming}")).results
        assert res and all(r["mismatched"] == [] for r in res), res
    finally:
        for w in keep:
            w.close()


@pytest.mark.parametrize("algo", ["FP8", "FP8_PER_CHANNEL_PER_TOKEN"])
@pytest.mark.parametrize("tp,naming", [(1, "hf"), (2, "vllm")])
def test_gpu_processing_gives_the_cpu_bytes(fp8_cuda_service, algo, tp, naming):
    """Sharding, fusion and FP8 requantization on the GPU produce the CPU pipeline's bytes."""
    from weightcache.client import load_from_disk
    from weightcache.config import ModelConfig

    cks, _ = fp8_cuda_service
    for rank in range(tp):
        mc = ModelConfig("m", str(cks[algo]), naming=naming)
        man_g, slab_g = load_from_disk(mc, tp, rank, "cuda:0")
        man_c, slab_c = load_from_disk(mc, tp, rank, "cpu")
        assert [r.name for r in man_g.tensors] == [r.name for r in man_c.tensors]
        for rg, rc in zip(man_g.tensors, man_c.tensors):
            assert (rg.offset_bytes, rg.size_bytes) == (rc.offset_bytes, rc.size_bytes)
            g = slab_g[rg.offset_bytes: rg.offset_bytes + rg.size_bytes].cpu()
            c = slab_c[rc.offset_bytes: rc.offset_bytes + rc.size_bytes]
            assert torch.equal(g, c), (rank, rg.name)
