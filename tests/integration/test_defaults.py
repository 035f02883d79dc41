"""The operator's defaults (issue 15): what a CPU node, a config without
``backend``, an unreadable checkpoint and ``dtype = "auto"`` meet.

The backend tests run ``weightcache serve`` the way the unit does (no
``--backend``) with a test-owned ``$NOTIFY_SOCKET``, in this venv, which has
``cuda-bindings`` installed (the ``test`` extra) and, on CI, no NVIDIA driver:
the same driver-less probe the packaged runtime meets on a CPU node.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from checkpoints import minilm_path  # noqa: E402
import torch
from safetensors.torch import load_file, save_file

from as_user import as_nobody
from service_harness import ServiceProcess, make_config, poll_until, service_env
from weightcache import attach, errors, identity, sharding
from weightcache.checkpoint import Checkpoint
from weightcache.config import ModelConfig
from weightcache.memory import probe_cuda
from weightcache.spec import RankRequest

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
WEIGHTCACHE = str(Path(PY).with_name("weightcache"))


def _no_driver() -> None:
    import cuda.bindings  # noqa: F401 - the test extra installs it: the point is a driver-less node WITH the bindings

    if probe_cuda().usable:
        pytest.skip("this node has a working CUDA driver; the driver-less default is checked on CPU nodes (CI)")


class _Serve:
    """``weightcache serve --gpu 0`` with no ``--backend``, a notify socket and a log."""

    def __init__(self, tmp: Path, config_text: str) -> None:
        self.tmp = tmp
        self.cfg = tmp / "weightcache.toml"
        self.cfg.write_text(config_text)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(tmp / "notify.sock"))
        self.notify.settimeout(0.2)
        self.svc = ServiceProcess(tmp, self.cfg, 0, backend="", env={"NOTIFY_SOCKET": str(tmp / "notify.sock")})
        self.proc = self.svc.launch().proc
        self.messages: list[str] = []

    def wait_for(self, line: str, timeout: float = 90.0) -> None:
        def seen() -> bool:
            try:
                self.messages += self.notify.recv(65536).decode().split("\n")
            except socket.timeout:
                assert self.proc.poll() is None, f"no {line!r} from the service: {self.messages}\n{self.log()}"
            return any(m.startswith(line) for m in self.messages)

        poll_until(seen, f"{line!r} from the service", timeout, 0,
                   detail=lambda: f"{self.messages}\n{self.log()}")

    def log(self) -> str:
        return self.svc.log()

    def stop(self) -> None:
        self.svc.stop()
        self.notify.close()


@pytest.fixture
def serve():
    started: list[_Serve] = []
    short = Path(__import__("tempfile").mkdtemp(prefix="wcd-", dir="/tmp"))

    def start(config_text: str) -> _Serve:
        s = _Serve(short, config_text)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
    shutil.rmtree(short, ignore_errors=True)


@pytest.mark.timeout(180)
def test_cpu_node_without_backend_key_serves_from_host_memory(serve):
    """No ``backend`` in the config, cuda-bindings installed, no driver: host memory, no crash, and the reason."""
    _no_driver()
    svc = serve(f'[models.minilm]\npath = "{minilm_path()}"\n')
    svc.wait_for("READY=1")
    with attach(str(minilm_path()), socket_dir=str(svc.tmp), fallback=False, timeout=60) as w:
        assert w.source == "daemon"
        ref = load_file(minilm_path() / "model.safetensors")
        assert all(torch.equal(w.tensors[k], ref[k]) for k in ref)
    status = subprocess.run([WEIGHTCACHE, "status", "--json", "--socket-dir", str(svc.tmp)], capture_output=True,
                            text=True, timeout=60, env=service_env())
    import json

    assert json.loads(status.stdout)["gpus"][0]["backend"] == "host"
    assert "backend selected backend=host" in svc.log()
    assert svc.proc.poll() is None


@pytest.mark.timeout(120)
def test_explicit_cuda_without_driver_is_a_configuration_error(serve):
    """``backend = "cuda"`` on a driver-less node: exit 78, STATUS= naming the cause, no traceback."""
    _no_driver()
    svc = serve(f'[service]\nbackend = "cuda"\n\n[models.minilm]\npath = "{minilm_path()}"\n')
    assert svc.proc.wait(90) == 78
    svc.wait_for("STATUS=configuration rejected", timeout=5)
    status = next(m for m in svc.messages if m.startswith("STATUS="))
    assert "libcuda.so.1" in status and 'backend = "host"' in status, status
    assert "code=config_invalid" in svc.log() and "Traceback" not in svc.log()


# --- permissions --------------------------------------------------------------


@pytest.fixture
def unreadable_ck():
    """A copy of MiniLM in a world-searchable directory whose weights file is mode 0600 (owner root)."""
    d = Path(__import__("tempfile").mkdtemp(prefix="wcp-", dir="/tmp"))
    d.chmod(0o755)
    ck = d / "minilm"
    shutil.copytree(minilm_path(), ck)
    for p in [ck, *ck.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    (ck / "model.safetensors").chmod(0o600)
    yield ck
    shutil.rmtree(d, ignore_errors=True)


def test_unreadable_checkpoint_file_is_a_named_permission_error(unreadable_ck):
    with as_nobody(), pytest.raises(errors.CheckpointUnreadable) as e:
        Checkpoint(unreadable_ck)
    assert e.value.code == "checkpoint_unreadable"
    assert (e.value.details["file"], e.value.details["user"]) == (str(unreadable_ck / "model.safetensors"), "nobody")


def test_unsearchable_checkpoint_directory_is_not_reported_missing(unreadable_ck):
    unreadable_ck.chmod(0o700)
    with as_nobody(), pytest.raises(errors.CheckpointUnreadable) as e:
        Checkpoint(unreadable_ck)
    assert e.value.details["file"] == str(unreadable_ck)


def test_check_config_as_root_checks_as_the_service_user(unreadable_ck, tmp_path):
    """Root passes the file; ``--as-user nobody`` (what root does by default with ``weightcache``) does not."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    cfg = unreadable_ck.parent / "weightcache.toml"
    cfg.write_text(f'[models.minilm]\npath = "{unreadable_ck}"\n')
    cfg.chmod(0o644)
    run = [PY, "-m", "weightcache", "check-config", "--config", str(cfg)]
    as_root = subprocess.run(run + ["--as-user", "root"], capture_output=True, text=True, timeout=120,
                             env=service_env())
    assert as_root.returncode == 0, as_root.stderr
    as_user = subprocess.run(run + ["--as-user", "nobody"], capture_output=True, text=True, timeout=120,
                             env=service_env(), cwd="/")
    assert as_user.returncode == 1, as_user.stdout + as_user.stderr
    assert "checkpoint_unreadable" in as_user.stderr and "Traceback" not in as_user.stderr
    assert str(unreadable_ck / "model.safetensors") in as_user.stderr and "user nobody" in as_user.stderr


def test_check_config_as_another_user_passes_a_readable_checkpoint(unreadable_ck):
    """A checkpoint the user may read passes ``--as-user nobody`` even when nobody may not read this
    interpreter's own files (a source tree's Python under ``/root``, mode 0700): numpy, which safetensors'
    header check imports on first use, failed to import in the child and every readable model was reported
    ``checkpoint_corrupt`` ('safetensors rejects ...: Importing the numpy C-extensions failed')."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    (unreadable_ck / "model.safetensors").chmod(0o644)
    cfg = unreadable_ck.parent / "weightcache.toml"
    cfg.write_text(f'[models.minilm]\npath = "{unreadable_ck}"\n')
    cfg.chmod(0o644)
    r = subprocess.run([PY, "-m", "weightcache", "check-config", "--config", str(cfg), "--as-user", "nobody"],
                       capture_output=True, text=True, timeout=120, env=service_env(), cwd="/")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checkpoint_corrupt" not in r.stdout + r.stderr and "104 tensors" in r.stdout, r.stdout + r.stderr


def test_check_config_as_another_user_reports_an_impossible_path():
    """Run by root, the checks happen in a child as the service user: its findings must reach the
    terminal (a path too long to stat once ended the child silently with status 1)."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    with tempfile.TemporaryDirectory(prefix="wc-long-") as d:  # pytest's tmp_path is root-only
        os.chmod(d, 0o755)
        cfg = Path(d) / "weightcache.toml"
        cfg.write_text(f'[models.long]\npath = "/{"a" * 5000}"\n')
        cfg.chmod(0o644)
        r = subprocess.run([PY, "-m", "weightcache", "check-config", "--config", str(cfg), "--as-user", "nobody"],
                           capture_output=True, text=True, timeout=120, env=service_env(), cwd="/")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "model long tp=1 rank=0" in r.stderr and "checkpoint_not_found" in r.stderr, r.stderr
    assert "File name too long" in r.stderr and "Traceback" not in r.stderr


# --- dtype --------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_dtype_auto_attaches_the_slab_configured_float32(daemon):
    """MiniLM is stored float32: ``dtype = "float32"`` and ``auto`` are one cache key, both ways."""
    svc = daemon(make_config({"minilm": {"path": minilm_path(), "dtype": "float32"}}))
    svc.wait_settled()
    ref = load_file(minilm_path() / "model.safetensors")
    with attach(str(minilm_path()), socket_dir=svc.socket_dir, fallback=False, timeout=60) as w:  # dtype="auto"
        assert w.source == "daemon" and w.manifest.key["dtype"] == "auto"
        assert all(torch.equal(w.tensors[k], ref[k]) for k in ref)
    with pytest.raises(errors.ModelNotFound):  # bfloat16 would be other bytes: not this slab
        attach(str(minilm_path()), socket_dir=svc.socket_dir, fallback=False, timeout=10, dtype="bfloat16")


@pytest.mark.timeout(180)
def test_explicit_float32_attaches_the_slab_configured_auto(daemon):
    svc = daemon(make_config({"minilm": minilm_path()}))
    svc.wait_settled()
    with attach(str(minilm_path()), socket_dir=svc.socket_dir, fallback=False, timeout=60, dtype="float32") as w:
        assert w.source == "daemon"


def test_effective_dtype_of_a_mixed_checkpoint(tmp_path):
    """A bfloat16 + float32 checkpoint: float32 casts the bfloat16 tensor, so it is its own key; auto stays auto."""
    ck = tmp_path / "mixed"
    ck.mkdir()
    save_file({"a": torch.zeros(2, 2, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.float32),
               "ids": torch.arange(2)}, str(ck / "model.safetensors"))
    (ck / "config.json").write_text("{}")
    c = Checkpoint(ck)
    assert identity.effective_dtype("auto", sharding.cast_dtypes(c, 1, 0, "hf")) == "auto"
    assert identity.effective_dtype("float32", sharding.cast_dtypes(c, 1, 0, "hf")) == "float32"
    assert identity.effective_dtype("bfloat16", sharding.cast_dtypes(c, 1, 0, "hf")) == "bfloat16"
    m = ModelConfig("mixed", str(ck), dtype="float32")
    assert not identity.dtype_matches(RankRequest(m, 1, 0), "auto")
    save_file({"a": torch.zeros(2, 2, dtype=torch.float32), "ids": torch.arange(2)}, str(ck / "model.safetensors"))
    assert identity.dtype_matches(RankRequest(m, 1, 0), "auto")
    assert identity.effective_dtype("float32", sharding.cast_dtypes(Checkpoint(ck), 1, 0, "hf")) == "auto"


# --- the command line without the runtime -----------------------------------


def test_help_and_version_import_no_torch():
    """``--help`` and ``--version`` on an interpreter where torch, numpy and safetensors cannot be imported."""
    block = "import sys\nfor m in ('torch', 'numpy', 'safetensors'):\n    sys.modules[m] = None\n"
    for argv in (["--help"], ["--version"], ["check-config", "--help"], ["status", "--help"]):
        r = subprocess.run([PY, "-c", block + "from weightcache.cli import main\nsys.exit(main(sys.argv[1:]))",
                            *argv], capture_output=True, text=True, timeout=60, env=service_env())
        assert r.returncode == 0, (argv, r.stderr)
        assert "usage:" in r.stdout or r.stdout.startswith("weightcache "), (argv, r.stdout)


def test_wrapper_runs_help_on_system_python_without_the_runtime(tmp_path):
    """/usr/bin/weightcache with no runtime: --help, --version and socket commands run; serve says what is missing."""
    env = service_env({"WEIGHTCACHE_PYTHON": str(tmp_path / "no-runtime" / "python")})
    for argv in (["--version"], ["serve", "--help"]):
        r = subprocess.run(["sh", str(ROOT / "packaging" / "weightcache.sh"), *argv], capture_output=True, text=True,
                           timeout=60, env=env)
        assert r.returncode == 0, (argv, r.stderr)
    r = subprocess.run(["sh", str(ROOT / "packaging" / "weightcache.sh"), "status", "--socket-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 3, r.stderr  # no service: the command ran, it did not fail on the runtime
    r = subprocess.run(["sh", str(ROOT / "packaging" / "weightcache.sh"), "serve", "--gpu", "0"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 78 and "runtime missing" in r.stderr


def test_setup_runtime_picks_the_torch_build_from_the_node():
    """Without a driver: the CPU torch from the CPU index and no cuda-bindings; --cuda: both as pinned."""
    script = [str(ROOT / "packaging" / "weightcache-setup-runtime"), "--dry-run",
              "--requirements", str(ROOT / "packaging" / "runtime-requirements.txt"), "--prefix", "/nonexistent/v"]
    forced = {flag: subprocess.run(["sh", *script, flag], capture_output=True, text=True, timeout=60)
              for flag in ("--cpu", "--cuda")}
    assert all(r.returncode == 0 for r in forced.values()), forced
    cpu, cuda = forced["--cpu"].stdout, forced["--cuda"].stdout
    assert "torch==2.13.0" in cpu and "cuda-bindings" not in cpu and "--index-url" in cpu
    assert "torch==2.13.0" in cuda and "cuda-bindings==" in cuda and "--index-url" not in cuda
    detected = subprocess.run(["sh", *script], capture_output=True, text=True, timeout=60)
    has_driver = os.path.exists("/proc/driver/nvidia/version") or "libcuda.so.1" in subprocess.run(
        ["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout
    assert detected.stdout.startswith(f"torch build: {'cuda' if has_driver else 'cpu'} ("), detected.stdout
    assert not os.path.exists("/nonexistent/v")


def test_status_with_no_models_says_so(tmp_path):
    """The shipped example (every model commented out): status names the config, not the target."""
    cfg = tmp_path / "weightcache.toml"
    shutil.copy(ROOT / "examples" / "weightcache.toml", cfg)
    r = subprocess.run([WEIGHTCACHE, "status", "--socket-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=60, env=service_env({"WEIGHTCACHE_CONFIG": str(cfg)}))
    assert r.returncode == 3
    assert f"no model is configured in {cfg}" in r.stderr and "weightcache.target started" not in r.stderr, r.stderr


@pytest.mark.parametrize("kind", ["utf16", "directory", "missing"])
def test_config_that_cannot_be_read_is_exit_78_for_serve_and_2_for_the_cli(tmp_path, kind):
    cfg = tmp_path / "weightcache.toml"
    if kind == "utf16":
        cfg.write_text('[service]\nbackend = "host"\n', encoding="utf-16")
    elif kind == "directory":
        cfg.mkdir()
    serve = subprocess.run([WEIGHTCACHE, "serve", "--gpu", "0", "--config", str(cfg), "--listen",
                            str(tmp_path / "0.sock")], capture_output=True, text=True, timeout=120, env=service_env())
    assert serve.returncode == 78 and "code=config_invalid" in serve.stderr, serve.stderr
    check = subprocess.run([WEIGHTCACHE, "check-config", "--config", str(cfg), "--as-user", "root"],
                           capture_output=True, text=True, timeout=120, env=service_env())
    assert check.returncode == 2 and check.stderr.startswith(f"weightcache: {cfg}: "), check.stderr
    assert "Traceback" not in serve.stderr + check.stderr
