"""The ``cuda`` memory backend on a real GPU (skipped without CUDA or cuda-bindings).

Cross-process cases run a second Python process that receives the slab's fd
through ``pass_fds`` or ``SCM_RIGHTS``, as an engine does.
"""

from __future__ import annotations

import fcntl
import gc
import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

torch = pytest.importorskip("torch")
pytest.importorskip("cuda.bindings.driver")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible", allow_module_level=True)

from weightcache.errors import ManifestSlabMismatch, OutOfMemory  # noqa: E402
from weightcache.memory import get_backend  # noqa: E402
from weightcache.memory.cuda_driver import gpu_uuid  # noqa: E402

SERVICE_DIR = Path(__file__).resolve().parents[2] / "service"
MiB = 1 << 20
GPU = 0


def _digest(t) -> str:
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()


def _pattern(n: int, seed: int):
    g = torch.Generator(device=f"cuda:{GPU}")
    g.manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=f"cuda:{GPU}", generator=g)


def _run_child(code: str, *args: str, pass_fds=()) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SERVICE_DIR), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        pass_fds=pass_fds,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"child failed rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def backend():
    return get_backend("cuda", GPU)


# Imports a slab read-only, reads it, then tries a copy and a kernel write into it.
IMPORT_AND_WRITE_CHILD = """
import hashlib, json, os, sys
import torch
from weightcache.memory.cuda import CudaBackend

fd, size = int(sys.argv[1]), int(sys.argv[2])
slab = CudaBackend(0).import_fd(fd, size, "cuda:0")
os.fstat(fd)  # the import did not take the fd
os.close(fd)
out = {
    "digest": hashlib.sha256(slab.tensor.cpu().numpy().tobytes()).hexdigest(),
    "device": str(slab.tensor.device),
    "size": slab.tensor.numel(),
}
try:
    slab.tensor[:4096].copy_(torch.zeros(4096, dtype=torch.uint8))
    torch.cuda.synchronize()
    out["copy_error"] = None
except RuntimeError as e:
    out["copy_error"] = str(e).splitlines()[0]
try:
    slab.tensor[:4096].fill_(0xAB)
    torch.cuda.synchronize()
    out["kernel_error"] = None
except RuntimeError as e:
    out["kernel_error"] = str(e).splitlines()[0]
print(json.dumps(out), flush=True)
os._exit(0)  # the context is poisoned by the faulting kernel; skip teardown
"""

# Creates, fills and seals a slab, sends its fd over a socket, then tries to write
# into its own sealed view, and exits.
CREATOR_CHILD = """
import hashlib, json, os, socket, sys
import torch
from weightcache.memory.cuda import CudaBackend

sock_fd, size, seed = (int(a) for a in sys.argv[1:4])
w = CudaBackend(0).allocate(size, "creator-child")
g = torch.Generator(device="cuda:0")
g.manual_seed(seed)
w.tensor.copy_(torch.randint(0, 256, (w.size_bytes,), dtype=torch.uint8, device="cuda:0", generator=g))
s = w.seal()
digest = hashlib.sha256(s.tensor.cpu().numpy().tobytes()).hexdigest()
sock = socket.socket(fileno=sock_fd)
socket.send_fds(sock, [json.dumps({"size_bytes": s.size_bytes}).encode()], [s.fd])
try:
    s.tensor[:4096].fill_(1)
    torch.cuda.synchronize()
    err = None
except RuntimeError as e:
    err = str(e).splitlines()[0]
print(json.dumps({"digest": digest, "owner_read_only": s.owner_read_only, "owner_kernel_error": err}), flush=True)
os._exit(0)
"""


def test_allocate_fill_seal_import_in_process(backend):
    gran = backend.granularity
    w = backend.allocate(64 * MiB + 12345, "model-a/tp1/rank0")
    assert w.size_bytes % gran == 0 and 64 * MiB + 12345 <= w.size_bytes < 64 * MiB + 12345 + gran
    assert w.tensor.device == torch.device("cuda", GPU)
    assert w.tensor.dtype == torch.uint8 and w.tensor.shape == (w.size_bytes,)

    pattern = _pattern(w.size_bytes, seed=1)
    w.tensor.copy_(pattern)
    s = w.seal()
    assert w.tensor is None
    assert s.size_bytes == w.size_bytes
    assert s.owner_read_only is True
    assert os.fstat(s.fd) is not None
    assert fcntl.fcntl(s.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    assert torch.equal(s.tensor, pattern)

    r = backend.import_fd(s.fd, s.size_bytes, f"cuda:{GPU}")
    assert r.tensor.data_ptr() != s.tensor.data_ptr()
    assert r.tensor.device == torch.device("cuda", GPU) and r.tensor.shape == (s.size_bytes,)
    assert torch.equal(r.tensor, pattern)
    os.fstat(s.fd)  # import_fd did not consume the fd

    # A view keeps the mapping alive after close(); the mapping goes with the last view.
    mapping = weakref.ref(r._mapping)
    view = r.tensor[1000:3000]
    r.close()
    assert mapping() is not None
    assert torch.equal(view, pattern[1000:3000])
    del view
    gc.collect()
    assert mapping() is None

    # adopt() takes ownership of its fd (as from systemd's fd store).
    fd2 = os.dup(s.fd)
    a = backend.adopt(fd2, s.size_bytes)
    assert torch.equal(a.tensor, pattern)
    a.close()
    with pytest.raises(OSError):
        os.fstat(fd2)

    s.close()
    assert s.fd == -1 and s.tensor is None


def test_import_larger_than_allocation_fails_cleanly(backend):
    w = backend.allocate(4 * MiB, "small")
    s = w.seal()
    try:
        free0 = backend.mem_info()[0]
        with pytest.raises(ManifestSlabMismatch) as ei:  # a received fd the driver refuses: the sender's fault
            backend.import_fd(s.fd, s.size_bytes * 4, f"cuda:{GPU}")
        assert ei.value.details["call"] == "cuMemMap"
        assert backend.mem_info()[0] == free0
    finally:
        s.close()


def test_import_in_other_process_reads_bytes_and_refuses_writes(backend):
    w = backend.allocate(32 * MiB, "model-b/tp1/rank0")
    pattern = _pattern(w.size_bytes, seed=2)
    w.tensor.copy_(pattern)
    s = w.seal()
    try:
        want = _digest(s.tensor)
        out = _run_child(IMPORT_AND_WRITE_CHILD, str(s.fd), str(s.size_bytes), pass_fds=(s.fd,))
        assert out["digest"] == want
        assert out["device"] == "cuda:0" and out["size"] == s.size_bytes
        assert out["copy_error"] is not None, "a copy into the PROT_READ mapping succeeded"
        assert out["kernel_error"] is not None, "a kernel write into the PROT_READ mapping succeeded"
        # The owner's bytes are intact.
        assert torch.equal(s.tensor, pattern)
        assert _digest(s.tensor) == want
    finally:
        s.close()


def test_slab_outlives_its_creator_while_an_fd_is_held(backend):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    size = 16 * MiB
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SERVICE_DIR), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CREATOR_CHILD), str(theirs.fileno()), str(size), "3"],
        pass_fds=(theirs.fileno(),),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    try:
        ours.settimeout(180)
        msg, fds, _, _ = socket.recv_fds(ours, 4096, 1)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        ours.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert len(fds) == 1
    child = json.loads(stdout.strip().splitlines()[-1])
    assert child["owner_read_only"] is True
    assert child["owner_kernel_error"] is not None, "the owner wrote into its sealed view"

    # The creator is gone; only our fd keeps the allocation alive.
    fd = fds[0]
    try:
        size_bytes = json.loads(msg)["size_bytes"]
        r = backend.import_fd(fd, size_bytes, f"cuda:{GPU}")
    finally:
        os.close(fd)
    assert _digest(r.tensor) == child["digest"]
    assert torch.equal(r.tensor, _pattern(size_bytes, seed=3))
    r.close()


def test_abort_frees_the_allocation(backend):
    # Warm-up: the first fill_ loads its kernel module, which takes device memory too.
    warm = backend.allocate(2 * MiB, "warm-up")
    warm.tensor.fill_(3)
    warm.abort()
    torch.cuda.synchronize()
    free0 = backend.mem_info()[0]
    w = backend.allocate(1 << 30, "aborted")
    assert free0 - backend.mem_info()[0] >= 1 << 30
    w.tensor.fill_(3)
    stale_view = w.tensor[:16]  # noqa: F841 - abort must free even while a view exists
    w.abort()
    assert w.tensor is None
    assert abs(backend.mem_info()[0] - free0) <= backend.granularity


def test_out_of_memory_raises_and_leaves_nothing(backend):
    free0, total = backend.mem_info()
    with pytest.raises(OutOfMemory) as ei:
        backend.allocate(total * 2, "too-big/tp1/rank0")
    assert ei.value.code == "out_of_memory"
    assert ei.value.details["size_bytes"] >= total * 2
    assert ei.value.details["model"] == "too-big/tp1/rank0"
    assert backend.mem_info()[0] == free0


def test_device_info_matches_torch(backend):
    info = backend.device_info()
    major, minor = torch.cuda.get_device_capability(GPU)
    assert info["backend"] == "cuda"
    assert info["compute_capability"] == f"{major}.{minor}"
    assert info["gpu_uuid"].startswith("GPU-") and len(info["gpu_uuid"]) == 40
    assert info["gpu_uuid"] == gpu_uuid(GPU)
    torch_uuid = str(torch.cuda.get_device_properties(GPU).uuid)
    assert info["gpu_uuid"].removeprefix("GPU-") == torch_uuid.removeprefix("GPU-")
