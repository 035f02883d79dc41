"""ModelOpt FP8 through the service and the client (host backend).

For per-tensor and per-channel checkpoints at TP = 1 (``hf`` names) and
TP = 2 (``vllm`` fused names, both ranks on one instance): an ordinary load
(the pipeline into private memory), the client's missing-service fallback,
an attach and a second attach (both ``fallback=False``) give bit-identical
tensors and identical greedy tokens (2 prompts x 16) in the reference engine.
An unsupported scheme fails alone; the other models keep serving.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from service_harness import ServiceProcess
from fp8_fixtures import PER_CHANNEL, PER_TENSOR, set_quant_config, write_fp8_checkpoint
from reference_engine import ReferenceLlama
from weightcache import attach, errors
from weightcache.client import load_from_disk
from weightcache.config import ModelConfig

PROMPTS = [[1, 5, 9, 33], [7, 7, 100, 2, 64]]
CASES = [(1, "hf"), (2, "vllm")]


@pytest.fixture(scope="module")
def fp8_service(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8")
    cks = {algo: write_fp8_checkpoint(base / algo, algo) for algo in (PER_TENSOR, PER_CHANNEL)}
    bad = base / "nvfp4"
    shutil.copytree(cks[PER_TENSOR], bad)
    set_quant_config(bad, hf_quant_config={"producer": {"name": "modelopt", "version": "0.29.0"},
                                           "quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}},
                     quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"]})
    models = {"bad": {"path": str(bad)}}
    for algo, path in cks.items():
        models[f"{algo.lower()}_hf"] = {"path": str(path), "naming": "hf", "layouts": [{"tp": 1, "gpus": [0]}]}
        models[f"{algo.lower()}_vllm"] = {"path": str(path), "naming": "vllm", "layouts": [{"tp": 2, "gpus": [0, 0]}]}
    work = Path(tempfile.mkdtemp(prefix="wc-fp8-", dir="/tmp"))
    svc = ServiceProcess(work, {"service": {"backend": "host"}, "models": models}, gpu=0).start()
    svc.wait_settled()
    yield cks, bad, svc
    svc.kill()


def _engine(path: Path, ranks) -> ReferenceLlama:
    cfg = json.loads((path / "config.json").read_text())
    return ReferenceLlama(cfg, [t for t, _ in ranks], [lay for _, lay in ranks])


@pytest.mark.parametrize("algo", [PER_TENSOR, PER_CHANNEL])
@pytest.mark.parametrize("tp,naming", CASES)
def test_ordinary_fallback_attach_attach_identical(fp8_service, algo, tp, naming):
    cks, _, svc = fp8_service
    path = cks[algo]
    loads = {"ordinary": [], "fallback": [], "attach": [], "attach2": []}
    keep = []
    for rank in range(tp):
        man, slab = load_from_disk(ModelConfig("m", str(path), naming=naming), tp, rank, "cpu")
        from weightcache.manifest import build_views

        loads["ordinary"].append((build_views(slab, man), {r.name: r.layout for r in man.tensors}))
        fb = attach(str(path), tp_size=tp, tp_rank=rank, naming=naming, socket_dir="/nonexistent-wc", fallback=True)
        assert fb.source == "disk" and fb.fallback_reason.startswith("daemon_unavailable")
        loads["fallback"].append((fb.tensors, fb.layouts))
        for key in ("attach", "attach2"):
            w = attach(str(path), tp_size=tp, tp_rank=rank, naming=naming, socket_dir=svc.socket_dir, fallback=False)
            assert w.source == "daemon"
            keep.append(w)
            loads[key].append((w.tensors, w.layouts))
    try:
        ref = loads["ordinary"]
        for key in ("fallback", "attach", "attach2"):
            for (t_ref, l_ref), (t, lay) in zip(ref, loads[key]):
                assert set(t) == set(t_ref), key
                for name in t_ref:
                    a, b = t_ref[name], t[name]
                    assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), (key, name)
                    assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                       b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), (key, name)
                assert lay == l_ref
        tokens = {key: [_engine(path, ranks).generate(p, 16) for p in PROMPTS] for key, ranks in loads.items()}
        assert all(len(t) == 16 for t in tokens["ordinary"])
        assert tokens["fallback"] == tokens["attach"] == tokens["attach2"] == tokens["ordinary"]
        # Both attachments read the same memory and left it unchanged.
        verified = svc.request(__import__("weightcache.protocol", fromlist=["Verify"]).Verify(
            f"{algo.lower()}_{naming}"))
        assert all(r["mismatched"] == [] and r["state"] == "ready" for r in verified.results)
    finally:
        for w in keep:
            w.close()


def test_unsupported_scheme_fails_alone(fp8_service):
    cks, bad, svc = fp8_service
    with pytest.raises(errors.UnsupportedQuantization) as e:
        attach(str(bad), socket_dir=svc.socket_dir, fallback=True)  # whatever fallback says
    assert e.value.code == "unsupported_quantization" and "NVFP4" in e.value.message
    slab = svc.slab("bad")
    assert slab["state"] == "failed" and slab["error"]["code"] == "unsupported_quantization"
    with attach(str(cks[PER_TENSOR]), socket_dir=svc.socket_dir, fallback=False) as w:
        assert w.source == "daemon"


def test_other_kernel_target_rejected(fp8_service):
    cks, _, svc = fp8_service
    with pytest.raises(errors.UnsupportedQuantization) as e:
        attach(str(cks[PER_CHANNEL]), kernel="marlin", socket_dir=svc.socket_dir, fallback=True)
    assert "marlin" in e.value.message
