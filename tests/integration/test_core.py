"""The core service end to end on the real all-MiniLM-L6-v2 checkpoint (host backend).

The service runs under the real ``systemd-socket-activate`` with a notify
socket owned by the test; engines are separate processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkpoints import minilm_path  # noqa: E402
import torch
from safetensors.torch import load_file, save_file

from service_harness import poll_until, service_env
from weightcache import attach, errors

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
WEIGHTCACHE = str(Path(PY).with_name("weightcache"))
ACTIVATE = shutil.which("systemd-socket-activate")

pytestmark = pytest.mark.skipif(ACTIVATE is None, reason="systemd-socket-activate is not installed")


class Activated:
    """``systemd-socket-activate`` running ``weightcache serve`` with a test-owned notify socket."""

    def __init__(self, tmp: Path, models: dict[str, str], backend: str = "host") -> None:
        self.dir = tmp / "run"
        self.dir.mkdir()
        self.cfg = tmp / "weightcache.toml"
        text = f'[service]\nbackend = "{backend}"\n'
        for name, path in models.items():
            text += f'\n[models.{name}]\npath = "{path}"\n'
        self.cfg.write_text(text)
        self.notify_path = tmp / "notify.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        # PYTHONPATH: the source tree this test is in first (service_env), not the one the venv's editable
        # install points to (another worktree's, under a shared venv).
        env = dict(os.environ, NOTIFY_SOCKET=str(self.notify_path), WEIGHTCACHE_CONFIG=str(self.cfg),
                   PYTHONPATH=service_env()["PYTHONPATH"])
        self.log = open(tmp / "service.log", "w+")
        self.proc = subprocess.Popen([ACTIVATE, "-l", str(self.dir / "0.sock"), "--fdname=listen",
                                      "-E", "NOTIFY_SOCKET", "-E", "WEIGHTCACHE_CONFIG", "-E", "PYTHONPATH",
                                      WEIGHTCACHE, "serve",
                                      "--gpu", "0"], env=env, stderr=self.log)
        poll_until(lambda: (self.dir / "0.sock").exists(), "the activation socket to appear", 10)

    def messages(self, until: str | None = None, timeout: float = 30.0) -> list[str]:
        """The notify datagrams received: those queued now, or (``until``) up to one with a line containing it."""
        out: list[str] = []
        self.notify.settimeout(0.2)

        def received() -> bool:
            try:
                out.append(self.notify.recv(65536).decode())
            except socket.timeout:
                return until is None  # nothing more queued
            return until is not None and any(until in line for line in out[-1].split("\n"))

        poll_until(received, f"a notify line with {until!r}" if until else "the notify socket to drain", timeout, 0,
                   detail=lambda: f"{out}\n{self.log.name}")
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.notify.close()
        self.log.close()


@pytest.fixture
def service(tmp_path):
    started = []

    def start(models, backend="host"):
        s = Activated(tmp_path, models, backend)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def _engine(out: Path, socket_dir: Path | None, disk: bool = False, fallback: bool = False) -> dict:
    cmd = [PY, str(ROOT / "examples" / "minilm_engine.py"), str(minilm_path()), "--out", str(out)]
    if disk:
        cmd.append("--disk")
    else:
        cmd += ["--socket-dir", str(socket_dir), "--timeout", "60"]
        if not fallback:
            cmd.append("--no-fallback")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_minilm_disk_fallback_attach_and_second_process_identical(service, tmp_path):
    """Ordinary load, missing-service fallback, attach, attach from another process: same embeddings."""
    ref = _engine(tmp_path / "ref.st", None, disk=True)
    fb = _engine(tmp_path / "fb.st", tmp_path / "nowhere", fallback=True)
    assert fb["source"] == "disk" and fb["fallback_reason"].startswith("daemon_unavailable")
    svc = service({"minilm": str(minilm_path())})
    e1 = _engine(tmp_path / "e1.st", svc.dir)
    e2 = _engine(tmp_path / "e2.st", svc.dir)
    assert (ref["source"], e1["source"], e2["source"]) == ("transformers", "daemon", "daemon")
    assert e1["pid"] != e2["pid"]
    r = load_file(tmp_path / "ref.st")["embeddings"]
    assert r.shape == (3, 384)
    for name in ("fb.st", "e1.st", "e2.st"):
        assert torch.equal(load_file(tmp_path / name)["embeddings"], r), name


def test_attached_tensors_byte_identical_to_checkpoint_and_fallback(service, tmp_path):
    svc = service({"minilm": str(minilm_path())})
    ref = load_file(minilm_path() / "model.safetensors")
    with attach(str(minilm_path()), socket_dir=str(svc.dir), fallback=False, timeout=60) as w:
        assert w.source == "daemon" and w.fallback_reason is None
        assert set(w.tensors) == set(ref)
        for k, t in ref.items():
            assert w.tensors[k].dtype == t.dtype and torch.equal(w.tensors[k], t), k
        assert w.resident_bytes >= w.manifest.slab_size_bytes >= sum(t.numel() * t.element_size() for t in ref.values())
    fb = attach(str(minilm_path()), socket_dir=str(tmp_path / "none"), fallback=True)
    assert fb.source == "disk" and "daemon_unavailable" in fb.fallback_reason
    assert all(torch.equal(fb.tensors[k], ref[k]) for k in ref)
    cp = attach(str(minilm_path()), socket_dir=str(svc.dir), fallback=False, mode="copy")
    t = cp.tensors["pooler.dense.bias"]
    t.add_(1.0)  # private copy: writable, and the service's bytes are not touched
    with attach("minilm", socket_dir=str(svc.dir), fallback=False) as again:
        assert torch.equal(again.tensors["pooler.dense.bias"], ref["pooler.dense.bias"])


def test_socket_activation_status_then_ready_in_order(service):
    svc = service({"minilm": str(minilm_path())})
    time.sleep(0.3)
    with open(f"/proc/{svc.proc.pid}/cmdline", "rb") as f:
        assert b"systemd-socket-activate" in f.read(), "service started before the first connection"
    assert svc.messages() == []
    with attach("minilm", socket_dir=str(svc.dir), fallback=False, timeout=60) as w:
        assert w.source == "daemon"
    with open(f"/proc/{svc.proc.pid}/cmdline", "rb") as f:
        assert b"serve" in f.read()  # the same PID exec'd the service
    msgs = svc.messages(until="READY=1")
    lines = [line for m in msgs for line in m.split("\n")]
    # READY=1 comes once the load settled, in a datagram whose STATUS= says so; every STATUS= before it is
    # the load's progress or that same line (sent first, on its own, when the status changed).
    assert msgs[-1].split("\n") == ["READY=1", "STATUS=ready: 1/1 slabs resident"], lines
    before = [line.removeprefix("STATUS=") for m in msgs[:-1] for line in m.split("\n") if line.startswith("STATUS=")]
    assert before and before[-1] == "ready: 1/1 slabs resident", lines
    assert all(line.startswith("loading minilm/tp1/rank0: ") for line in before[:-1]), lines


def test_fallback_false_without_service_raises_daemon_unavailable(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(errors.DaemonUnavailable) as e:
        attach(str(minilm_path()), socket_dir=str(tmp_path), fallback=False, timeout=2)
    assert e.value.code == "daemon_unavailable" and str(tmp_path) in e.value.message
    assert time.monotonic() - t0 < 30  # returns, rather than hanging past the timeout


def test_different_checkpoint_at_same_path_is_cache_key_mismatch(service, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(minilm_path(), ck)
    svc = service({"minilm": str(ck)})
    with attach(str(ck), socket_dir=str(svc.dir), fallback=False, timeout=60) as w:
        assert w.source == "daemon"
    # Replace the checkpoint at the same path: same layout, different values, mtime copied.
    f = ck / "model.safetensors"
    st = f.stat()
    t = load_file(f)
    t["pooler.dense.bias"] = t["pooler.dense.bias"] + 1
    save_file(t, tmp_path / "new.safetensors", metadata={"format": "pt"})
    os.replace(tmp_path / "new.safetensors", f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(errors.CacheKeyMismatch) as e:
        attach(str(ck), socket_dir=str(svc.dir), fallback=False)
    fields = e.value.details["fields"]
    assert any(x.startswith("checkpoint.files.model.safetensors.") for x in fields), fields
    assert "checkpoint.files.model.safetensors.mtime_ns" not in fields
    fb = attach(str(ck), socket_dir=str(svc.dir), fallback=True)
    assert fb.source == "disk" and fb.fallback_reason.startswith("cache_key_mismatch")
    assert torch.equal(fb.tensors["pooler.dense.bias"], t["pooler.dense.bias"])


_WRITER = r"""
import sys, torch
from weightcache import attach
w = attach(sys.argv[1], socket_dir=sys.argv[2], fallback=False)
t = w.tensors["pooler.dense.bias"]
print("attached", flush=True)
t.fill_(42.0)
print("write went through", flush=True)
"""


def test_write_into_attached_view_is_refused_and_bytes_unchanged(service):
    svc = service({"minilm": str(minilm_path())})
    r = subprocess.run([PY, "-c", _WRITER, "minilm", str(svc.dir)], capture_output=True, text=True, timeout=120)
    assert "attached" in r.stdout and "write went through" not in r.stdout
    assert r.returncode in (-signal.SIGSEGV, -signal.SIGBUS), (r.returncode, r.stderr[-2000:])
    ref = load_file(minilm_path() / "model.safetensors")["pooler.dense.bias"]
    with attach("minilm", socket_dir=str(svc.dir), fallback=False) as w:
        assert torch.equal(w.tensors["pooler.dense.bias"], ref)
    v = subprocess.run([WEIGHTCACHE, "verify", "minilm", "--socket-dir", str(svc.dir)], capture_output=True,
                       text=True, timeout=60)
    assert v.returncode == 0 and "104 tensors match" in v.stdout, v.stdout + v.stderr


def test_malformed_toml_fails_clearly(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[models.a\npath = ")
    r = subprocess.run([WEIGHTCACHE, "serve", "--gpu", "0", "--config", str(cfg), "--listen", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 78  # EX_CONFIG: systemd does not restart it (RestartPreventExitStatus=78)
    assert str(cfg) in r.stderr and "invalid TOML" in r.stderr


def test_bad_models_fail_alone_and_bad_frames_drop_one_client(service, tmp_path):
    trunc = tmp_path / "trunc"
    shutil.copytree(minilm_path(), trunc)
    f = trunc / "model.safetensors"
    os.truncate(f, f.stat().st_size - 1000)
    svc = service({"good": str(minilm_path()), "missing": str(tmp_path / "absent"), "trunc": str(trunc)})
    with attach("good", socket_dir=str(svc.dir), fallback=False, timeout=60) as w:
        assert w.source == "daemon"
        # A malformed frame from another client: error reply, that connection closed.
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(svc.dir / "0.sock"))
        s.sendall(struct.pack(">I", 9) + b"not json!")
        data = s.recv(65536)
        body = json.loads(data[4:])
        assert body["type"] == "error" and body["code"] == "protocol_violation"
        assert s.recv(100) == b""
        s.close()
        # Unknown model, missing and truncated checkpoints: typed errors naming the cause.
        with pytest.raises(errors.ModelNotFound) as e:
            attach("nope", socket_dir=str(svc.dir), fallback=False)
        assert "good/tp1/rank0" in e.value.message
        with pytest.raises(errors.ModelLoadFailed) as e:
            attach("missing", socket_dir=str(svc.dir), fallback=False)
        assert e.value.details["cause"] == "checkpoint_not_found" and "absent" in e.value.message
        with pytest.raises(errors.ModelLoadFailed) as e:
            attach("trunc", socket_dir=str(svc.dir), fallback=False)
        assert e.value.details["cause"] == "checkpoint_corrupt" and str(f) in e.value.message
        # ... and the good model still serves, to the old and to new clients.
        ref = load_file(minilm_path() / "model.safetensors")
        assert torch.equal(w.tensors["embeddings.word_embeddings.weight"], ref["embeddings.word_embeddings.weight"])
        with attach("good", socket_dir=str(svc.dir), fallback=False) as w2:
            assert torch.equal(w2.tensors["pooler.dense.weight"], ref["pooler.dense.weight"])
    st = subprocess.run([WEIGHTCACHE, "status", "--json", "--socket-dir", str(svc.dir)], capture_output=True,
                        text=True, timeout=60)
    assert st.returncode == 1  # a model failed
    states = {s["model"]: s["state"] for s in json.loads(st.stdout)["gpus"][0]["slabs"]}
    assert states == {"good": "ready", "missing": "failed", "trunc": "failed"}
