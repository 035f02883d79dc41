"""Issue 38 on the cuda backend: P10 (the client believes only a real slab) and what the driver tells about P2.

P10: a slab fd an ``attach_reply`` carries is checked before it is mapped. On CUDA the check is
``check_vmm_fd`` (``fstat``: an open file of NVIDIA's character device, major 195; anything else refused before
the driver sees it) and the driver's own refusal (``cuMemImportFromShareableHandle``/``cuMemMap``), both as
``manifest_slab_mismatch``; ``tests/unit/test_cuda_fd_check.py`` covers the part without a GPU.

P2 on CUDA is not built: the service cannot tell when an engine's imported VMM handle is gone. The last test
records what the driver does tell (device free memory while another process maps a slab whose exporter let go
of it, and after that process exits) into ``.cache/p2_cuda.json`` for the design; its assertions are what the
host backend's P2 relies on (the memory stays allocated while mapped elsewhere, and is freed after).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

torch = pytest.importorskip("torch")
pytest.importorskip("cuda.bindings.driver")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible", allow_module_level=True)

from weightcache.errors import ManifestSlabMismatch  # noqa: E402
from weightcache.memory import get_backend  # noqa: E402
from weightcache.memory.cuda_mapping import NVIDIA_MAJOR, check_vmm_fd  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
GPU = 0


@pytest.fixture(scope="module")
def backend():
    return get_backend("cuda", GPU)


def _sealed(backend, size: int):
    w = backend.allocate(size, "trust/tp1/rank0")
    w.tensor.fill_(7)
    return w.seal()


def test_an_exported_handle_passes_the_check_and_is_what_the_check_expects(backend, record_property):
    s = _sealed(backend, 8 * MiB)
    try:
        st = os.fstat(s.fd)
        what = {"readlink": os.readlink(f"/proc/self/fd/{s.fd}"), "mode": oct(st.st_mode),
                "rdev": f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"}
        record_property("exported_handle", json.dumps(what))
        print("exported VMM handle:", what)
        check_vmm_fd(s.fd, s.size_bytes)
        # What the check's first rule expects (if not, the handle passed by another rule: say which in the report)
        assert stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == NVIDIA_MAJOR, what
        r = backend.import_fd(s.fd, s.size_bytes, f"cuda:{GPU}")  # the real import still works
        assert int(r.tensor[:4096].sum()) == 7 * 4096
        r.close()
    finally:
        s.close()


def _fifo(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    return os.open(tmp_path / "fifo", os.O_RDWR | os.O_NONBLOCK)


def _memfd(tmp_path):
    fd = os.memfd_create("slab", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 8 * MiB)
    return fd


@pytest.mark.parametrize("make,by", [
    (_fifo, "the check"),
    (lambda tmp_path: socket.socketpair()[0].detach(), "the check"),
    (lambda tmp_path: os.open("/dev/zero", os.O_RDONLY), "the check"),
    (_memfd, "the check"),
    (lambda tmp_path: os.eventfd(0), "the driver"),  # an anonymous file: only the driver can tell
    (lambda tmp_path: os.open("/dev/nvidiactl", os.O_RDWR), "the driver"),  # NVIDIA's, but no exported handle
], ids=["fifo", "socket", "dev-zero", "memfd", "eventfd", "nvidiactl"])
def test_an_fd_that_is_no_vmm_handle_is_a_mismatch_never_a_device_error(backend, tmp_path, make, by):
    fd = make(tmp_path)
    try:
        with pytest.raises(ManifestSlabMismatch) as e:
            backend.import_fd(fd, 8 * MiB, f"cuda:{GPU}")
    finally:
        os.close(fd)
    assert e.value.code == "manifest_slab_mismatch"
    if by == "the driver":
        assert e.value.message.startswith("the slab fd received was refused by the CUDA driver"), e.value.message
    else:
        assert "not a CUDA VMM handle" in e.value.message, e.value.message


def test_a_handle_smaller_than_the_manifest_says_is_a_mismatch(backend):
    s = _sealed(backend, 4 * MiB)
    try:
        with pytest.raises(ManifestSlabMismatch) as e:
            backend.import_fd(s.fd, s.size_bytes + 64 * MiB, f"cuda:{GPU}")
        assert e.value.details["call"] == "cuMemMap", e.value.details
    finally:
        s.close()


# Receives a slab fd, maps it, says so, then waits for a line on stdin before exiting.
_HOLDER = """
import json, os, socket, sys
from weightcache.memory.cuda import CudaBackend
sock = socket.socket(fileno=int(sys.argv[1]))
msg, fds, _, _ = socket.recv_fds(sock, 1024, 1)
size = json.loads(msg)["size_bytes"]
slab = CudaBackend(0).import_fd(fds[0], size, "cuda:0")
os.close(fds[0])
print(json.dumps({"mapped": int(slab.tensor[:16].sum())}), flush=True)
sys.stdin.readline()
os._exit(0)
"""


def _free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(GPU)[0]


def test_what_the_driver_tells_when_an_engine_keeps_a_slab_the_service_let_go_of(backend):
    """P2 on CUDA, the facts a design needs: the exporter closes its fd and unmaps while another process maps
    the slab; device free memory stays down by the slab's size until that process exits."""
    size = 1024 * MiB
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "service"), os.environ.get("PYTHONPATH", "")]))
    a, b = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_HOLDER), str(b.fileno())], pass_fds=(b.fileno(),),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    b.close()
    figures: dict = {}
    try:
        base = _free_bytes()
        s = _sealed(backend, size)
        figures["allocated_drop"] = base - _free_bytes()
        socket.send_fds(a, [json.dumps({"size_bytes": s.size_bytes}).encode()], [s.fd])
        assert json.loads(child.stdout.readline())["mapped"] == 7 * 16
        after_child_maps = _free_bytes()
        s.close()  # the service lets go: its fd and its own mapping
        import gc

        gc.collect()
        time.sleep(0.5)
        figures["released_but_mapped_drop"] = base - _free_bytes()
        figures["child_map_extra"] = base - after_child_maps - figures["allocated_drop"]
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=60)
        time.sleep(0.5)
        figures["after_exit_drop"] = base - _free_bytes()
    finally:
        if child.poll() is None:
            child.kill()
        a.close()
    out = ROOT / ".cache" / "p2_cuda.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"slab_bytes": size, **figures}, indent=1))
    print("P2 on CUDA:", figures)
    assert figures["released_but_mapped_drop"] >= size * 0.9, figures  # still allocated: mapped elsewhere
    assert figures["after_exit_drop"] < size * 0.1, figures  # freed once nothing maps it


# An engine that attaches in copy mode (its lease and its import end at once) and runs on until stdin closes.
_COPY_ENGINE = """
import json, sys
from weightcache import attach
w = attach(sys.argv[1], device="cuda:0", socket_dir=sys.argv[2], mode="copy", fallback=False)
print(json.dumps({"source": w.source, "n": len(w.tensors)}), flush=True)
sys.stdin.read()
"""


def test_the_service_counts_an_evicted_cuda_slab_until_its_receivers_exit(tmp_path):
    """P2 on CUDA through the service: an engine received the slab's fd (copy mode: no lease left), the slab is
    evicted; ``held_elsewhere_bytes`` counts it until that engine exits, then 0."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("wc_harness", ROOT / "tests/service_harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import write_checkpoint

    from weightcache import protocol

    ck = write_checkpoint(tmp_path / "ck", {"w": torch.randn(1024, 1024)})
    svc = harness.ServiceProcess(tmp_path, {"service": {"backend": "cuda"}, "models": {"m": {"path": str(ck)}}},
                                 gpu=0, backend="cuda").start()
    try:
        svc.wait_settled()
        size = svc.slab("m")["resident_bytes"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "service"), os.environ.get("PYTHONPATH", "")]))
        engine = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_COPY_ENGINE), str(ck), svc.socket_dir],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert json.loads(engine.stdout.readline())["source"] == "daemon"
            harness.poll_until(lambda: not svc.slab("m")["leases"], "the copy-mode lease to end")
            svc.request(protocol.Evict("m", False, ""))
            assert svc.status()["memory"]["held_elsewhere_bytes"] == size
        finally:
            engine.stdin.close()
            engine.wait(timeout=60)
        harness.poll_until(lambda: svc.status()["memory"]["held_elsewhere_bytes"] == 0, "the engine's exit to count")
    finally:
        svc.stop()
