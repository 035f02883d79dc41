"""ModelOpt FP8 through the service and the client on the cuda backend (scripts/gpu-check).

Per-tensor and per-channel checkpoints, TP = 1 (``hf``) and TP = 2 (``vllm``,
both ranks on GPU 0): an ordinary load (the pipeline into private GPU memory),
the missing-service fallback, an attach and a second attach (``fallback=False``)
give bit-identical tensors and identical greedy tokens (2 prompts x 16) with
``torch._scaled_mm`` in the reference engine.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
def _conftest():
    spec = importlib.util.spec_from_file_location("wc_integration_conftest", ROOT / "tests/service_harness.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fp8_cuda_service(tmp_path_factory):
    from fp8_fixtures import PER_CHANNEL, PER_TENSOR, fp8_service_models, write_fp8_checkpoint

    base = tmp_path_factory.mktemp("fp8gpu")
    cks = {algo: write_fp8_checkpoint(base / algo, algo) for algo in (PER_TENSOR, PER_CHANNEL)}
    models = fp8_service_models(cks)
    work = Path(tempfile.mkdtemp(prefix="wc-fp8g-", dir="/tmp"))
    svc = _conftest().ServiceProcess(work, {"service": {"backend": "cuda"}, "models": models}, gpu=0,
                                     backend="cuda").start()
    svc.wait_settled()
    yield cks, svc
    svc.kill()


@pytest.mark.parametrize("algo", ["FP8", "FP8_PER_CHANNEL_PER_TOKEN"])
@pytest.mark.parametrize("tp,naming", [(1, "hf"), (2, "vllm")])
def test_fp8_ordinary_fallback_attach_attach_on_cuda(fp8_cuda_service, algo, tp, naming):
    from fp8_fixtures import check_four_loads

    cks, svc = fp8_cuda_service
    check_four_loads(cks[algo], algo, tp, naming, "cuda:0", svc)


@pytest.mark.parametrize("algo", ["FP8", "FP8_PER_CHANNEL_PER_TOKEN"])
@pytest.mark.parametrize("tp,naming", [(1, "hf"), (2, "vllm")])
def test_gpu_processing_gives_the_cpu_bytes(fp8_cuda_service, algo, tp, naming):
    """Sharding, fusion and FP8 requantization on the GPU produce the CPU pipeline's bytes."""
    from weightcache.client import load_from_disk
    from weightcache.config import ModelConfig
    from weightcache.spec import RankRequest

    cks, _ = fp8_cuda_service
    for rank in range(tp):
        mc = ModelConfig("m", str(cks[algo]), naming=naming)
        man_g, slab_g = load_from_disk(RankRequest(mc, tp, rank), "cuda:0")
        man_c, slab_c = load_from_disk(RankRequest(mc, tp, rank), "cpu")
        assert [r.name for r in man_g.tensors] == [r.name for r in man_c.tensors]
        for rg, rc in zip(man_g.tensors, man_c.tensors):
            assert (rg.offset_bytes, rg.size_bytes) == (rc.offset_bytes, rc.size_bytes)
            g = slab_g[rg.offset_bytes: rg.offset_bytes + rg.size_bytes].cpu()
            c = slab_c[rc.offset_bytes: rc.offset_bytes + rc.size_bytes]
            assert torch.equal(g, c), (rank, rg.name)
