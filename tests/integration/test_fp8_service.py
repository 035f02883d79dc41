"""ModelOpt FP8 through the service and the client (host backend).

For per-tensor and per-channel checkpoints at TP = 1 (``hf`` names) and
TP = 2 (``vllm`` fused names, both ranks on one instance): an ordinary load
(the pipeline into private memory), the client's missing-service fallback,
an attach and a second attach (both ``fallback=False``) give bit-identical
tensors and identical greedy tokens (2 prompts x 16) in the reference engine.
An unsupported scheme fails alone; the other models keep serving.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from service_harness import ServiceProcess
from fp8_fixtures import (PER_CHANNEL, PER_TENSOR, check_four_loads, fp8_service_models, set_quant_config,
                          write_fp8_checkpoint)
from weightcache import attach, errors

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
    models = {"bad": {"path": str(bad)}, **fp8_service_models(cks)}
    work = Path(tempfile.mkdtemp(prefix="wc-fp8-", dir="/tmp"))
    svc = ServiceProcess(work, {"service": {"backend": "host"}, "models": models}, gpu=0).start()
    svc.wait_settled()
    yield cks, bad, svc
    svc.kill()


@pytest.mark.parametrize("algo", [PER_TENSOR, PER_CHANNEL])
@pytest.mark.parametrize("tp,naming", CASES)
def test_ordinary_fallback_attach_attach_identical(fp8_service, algo, tp, naming):
    cks, _, svc = fp8_service
    check_four_loads(cks[algo], algo, tp, naming, "cpu", svc)


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
