"""Faults on the host backend: dead clients, a dead service, bad and changed checkpoints, writes.

Every scenario runs a real ``weightcache serve`` subprocess (``conftest.py``)
and real engines (this process, or child processes), and checks bytes, error
codes, leases, and the service's fds and RSS from ``/proc``. Figures go to
``.cache/reliability.json`` (``scripts/reliability-report``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from service_harness import ServiceProcess, make_config, poll_until, record_figures, service_env  # noqa: E402
from wire_helpers import doomed_client  # noqa: E402
from checkpoints import big_checkpoint, compare_bytes, llama_checkpoint, llama_config, llama_tensors, read_checkpoint, write_checkpoint  # noqa: E402
from weightcache import attach, protocol  # noqa: E402
from weightcache.client import read_manifest_file  # noqa: E402
from weightcache.errors import WeightcacheError  # noqa: E402
from weightcache.memory.host import F_GET_SEALS, F_SEAL_GROW, F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_WRITE  # noqa: E402

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
RSS_SLACK_BYTES = 16 * MiB

def _kill(p: subprocess.Popen) -> None:
    """SIGKILL a client and reap it."""
    p.send_signal(signal.SIGKILL)
    assert p.wait(30) == -signal.SIGKILL


_poll = poll_until


def _lease_pids(svc) -> set[int]:
    return {le["pid"] for sl in svc.status()["slabs"] for le in sl["leases"]}


# --- clients killed ----------------------------------------------------------------


def test_client_killed_while_waiting_and_mid_attach(daemon, tmp_path):
    """A client SIGKILLed while waiting for a load, and right after its attach reply (fd unread):
    no lease remains, the service's fds and RSS come back to their baseline, other engines are served."""
    t0 = time.monotonic()
    big = big_checkpoint(256 * MiB)
    try:
        small = llama_checkpoint(tmp_path / "small", seed=1)
        svc = daemon({"big": big, "small": small})

        # 1. Killed while waiting for a load (the model is still loading when it dies).
        waiter = doomed_client(svc, "big", wait_ms=120_000)
        assert svc.slab("big")["state"] in ("pending", "loading"), "precondition: big must still be loading"
        with ThreadPoolExecutor(2) as ex:
            f_big = ex.submit(attach, str(big), socket_dir=svc.socket_dir, fallback=False, timeout=120)
            f_small = ex.submit(attach, str(small), socket_dir=svc.socket_dir, fallback=False, timeout=120)
            _kill(waiter)
            w_big, w_small = f_big.result(), f_small.result()
        assert (w_big.source, w_small.source) == ("daemon", "daemon")
        compared = compare_bytes(w_big.tensors, read_checkpoint(big))
        ref_small = read_checkpoint(small)
        compared += compare_bytes(w_small.tensors, ref_small)
        snap = svc.snapshot(others=2)
        assert _lease_pids(svc) == {os.getpid()}
        assert snap["leases"] == 2
        w_big.close()

        base = svc.snapshot(others=1)  # w_small stays attached through the kills below
        assert base["leases"] == 1
        assert base["fds"]["socket"] == 3  # listener, w_small's connection, ours
        # Two sealed slabs, each: the owned fd + the dup that Python's mmap keeps (no trackfd before 3.13),
        # + the slab's manifest file (protocol 3: sent beside the slab on every attach).
        assert base["fds"]["memfd"] == 6

        # 2. Killed mid-attach: its attach reply, with the slab fd, sits unread in its socket.
        kills = 5
        for _ in range(kills):
            p = doomed_client(svc, "small", wait_ms=10_000)
            _poll(lambda: p.pid in _lease_pids(svc), "the doomed client's lease")
            _kill(p)
        after = svc.snapshot(others=1)
        assert after["leases"] == 1 and _lease_pids(svc) == {os.getpid()}
        assert after["fds"] == base["fds"], (base["fds"], after["fds"])
        assert after["rss_bytes"] - base["rss_bytes"] < RSS_SLACK_BYTES
        compared += compare_bytes(w_small.tensors, ref_small)  # the other engine is unaffected
        verify = svc.request(protocol.Verify("small")).results
        assert verify[0]["mismatched"] == [] and verify[0]["tensors"] > 0
        w_small.close()
        final = svc.snapshot()
        assert final["leases"] == 0 and final["fds"]["socket"] == 2
    finally:
        shutil.rmtree(big, ignore_errors=True)
    record_figures(
        "faults.client_killed", "Client SIGKILLed while waiting for a load and mid-attach",
        "no lease left (status), service fd counts by kind equal before/after, RSS growth < 16 MiB, "
        "other engines' bytes equal the checkpoint, verify clean",
        clients=2 + kills + 3, faults_injected=1 + kills, bytes_compared=compared,
        duration_s=round(time.monotonic() - t0, 2), rss_delta_bytes=after["rss_bytes"] - base["rss_bytes"],
        service_fds=sum(after["fds"].values()))


# --- service killed ----------------------------------------------------------------


def test_second_service_on_a_live_socket_path_is_refused_and_never_removes_another_ones(daemon, tmp_path):
    """A second ``serve`` on the path a live service listens on exits 78 naming the path and leaves the
    socket alone (it used to unlink it and bind its own); a service stopped after its path was taken over
    leaves the newer socket in place; the stale socket of a SIGKILLed service is still replaced."""
    svc = daemon({"a": llama_checkpoint(tmp_path / "a", seed=13)})
    first_socket = os.stat(svc.socket_path).st_ino
    second = subprocess.Popen(
        [sys.executable, "-m", "weightcache", "serve", "--gpu", "0", "--config", str(svc.config_path),
         "--listen", svc.socket_path, "--backend", "host"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=service_env())
    try:
        out, err = second.communicate(timeout=90)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    assert second.returncode == 78, err
    assert f"{svc.socket_path}: another weightcache instance is serving on this socket" in err
    assert os.stat(svc.socket_path).st_ino == first_socket and svc.answers()

    os.unlink(svc.socket_path)  # the path taken over while the first still runs
    other = ServiceProcess(tmp_path / "other", svc.config_path, socket_dir=Path(svc.socket_dir))
    try:
        other.start()
        assert svc.stop() == 0
        assert os.path.exists(svc.socket_path) and other.answers()  # the first did not remove the second's
        other.kill()
        assert os.path.exists(svc.socket_path)  # stale: nobody listens
        other.start()  # replaces it, as a restart after a crash must
        assert other.answers()
    finally:
        other.kill()


def test_service_killed_engines_keep_tensors_and_restart_serves(daemon, tmp_path):
    """SIGKILL of the service: a request in flight fails with daemon_unavailable; attached engines'
    tensors stay valid and byte-identical; the restarted service serves again."""
    t0 = time.monotonic()
    a, b = llama_checkpoint(tmp_path / "a", seed=11), llama_checkpoint(tmp_path / "b", seed=12)
    ref_a, ref_b = read_checkpoint(a), read_checkpoint(b)
    big = big_checkpoint(256 * MiB)
    try:
        svc = daemon({"big": big, "a": a, "b": b})
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(attach, str(a), socket_dir=svc.socket_dir, fallback=False, timeout=120)
            _poll(lambda: svc.status()["clients"] >= 2, "the waiting client's connection")
            assert svc.slab("a")["state"] in ("pending", "loading"), "precondition: a must still be waiting"
            svc.kill()
            with pytest.raises(WeightcacheError) as ei:
                fut.result()
        assert ei.value.code == "daemon_unavailable"
    finally:
        shutil.rmtree(big, ignore_errors=True)

    svc.write_config(make_config({"a": a, "b": b}))
    svc.start()
    svc.wait_settled()
    wa = attach(str(a), socket_dir=svc.socket_dir, fallback=False)
    wb = attach("b", socket_dir=svc.socket_dir, fallback=False)  # by name
    assert (wa.source, wb.source) == ("daemon", "daemon")
    norm_before = wa.tensors["model.norm.weight"].sum().item()
    svc.kill()
    compared = compare_bytes(wa.tensors, ref_a) + compare_bytes(wb.tensors, ref_b)
    assert wa.tensors["model.norm.weight"].sum().item() == norm_before
    x = torch.ones(3, 64)
    assert torch.equal(x @ wa.tensors["model.layers.0.self_attn.q_proj.weight"].T,
                       x @ ref_a["model.layers.0.self_attn.q_proj.weight"].T)

    with pytest.raises(WeightcacheError) as ei:
        attach(str(a), socket_dir=svc.socket_dir, fallback=False)
    assert ei.value.code == "daemon_unavailable"
    wd = attach(str(a), socket_dir=svc.socket_dir, fallback=True)
    assert wd.source == "disk" and wd.fallback_reason.startswith("daemon_unavailable")
    compared += compare_bytes(wd.tensors, ref_a)

    svc.start()
    svc.wait_settled()
    wa2 = attach(str(a), socket_dir=svc.socket_dir, fallback=False)
    assert wa2.source == "daemon"
    compared += compare_bytes(wa2.tensors, ref_a) + compare_bytes(wa.tensors, ref_a)
    assert svc.snapshot(others=1)["leases"] == 1
    for w in (wa, wb, wd, wa2):
        w.close()
    record_figures(
        "faults.service_killed", "Service SIGKILLed while engines are attached, then restarted",
        "in-flight attach fails with daemon_unavailable; attached tensors byte-identical to the checkpoint "
        "after the kill; fallback=False -> daemon_unavailable, fallback=True -> disk, same bytes; restart serves",
        clients=5, faults_injected=2, bytes_compared=compared, service_starts=svc.starts,
        duration_s=round(time.monotonic() - t0, 2))


# --- bad checkpoints ---------------------------------------------------------------


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8: 8 + n])


def _last_tensor(path: Path) -> str:
    _, h = _header(path)
    return max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])


def _shard(ck: Path, i: int, n: int = 2) -> Path:
    return ck / f"model-{i:05d}-of-{n:05d}.safetensors"


def _build_bad(root: Path) -> tuple[dict[str, Path], dict[str, tuple[str, str, str | None]]]:
    """Checkpoints with one fault each, and (code, file name, tensor) the error must name."""
    cks: dict[str, Path] = {}
    want: dict[str, tuple[str, str, str | None]] = {}
    for i, name in enumerate(("good", "truncated", "header_garbage", "header_length", "missing_file",
                              "index_names_absent_tensor", "data_corrupt", "unlisted_shard")):
        cks[name] = llama_checkpoint(root / name, seed=100 + i, files=3 if name == "unlisted_shard" else 2)

    f = _shard(cks["truncated"], 2)
    victim = _last_tensor(f)
    os.truncate(f, f.stat().st_size - 16)
    want["truncated"] = ("checkpoint_corrupt", f.name, victim)

    f = _shard(cks["header_garbage"], 1)
    n, _ = _header(f)
    with open(f, "r+b") as fh:
        fh.seek(8)
        fh.write(b"{\"oops" + b"\xff" * (n - 6))
    want["header_garbage"] = ("checkpoint_corrupt", f.name, None)

    f = _shard(cks["header_length"], 2)
    with open(f, "r+b") as fh:
        fh.write(struct.pack("<Q", 1 << 40))
    want["header_length"] = ("checkpoint_corrupt", f.name, None)

    f = _shard(cks["missing_file"], 2)
    f.unlink()
    want["missing_file"] = ("checkpoint_not_found", f.name, None)

    idx = cks["index_names_absent_tensor"] / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    doc["weight_map"]["model.layers.7.mlp.up_proj.weight"] = _shard(cks["index_names_absent_tensor"], 1).name
    idx.write_text(json.dumps(doc))
    want["index_names_absent_tensor"] = ("checkpoint_not_found", _shard(cks["index_names_absent_tensor"], 1).name,
                                         "model.layers.7.mlp.up_proj.weight")

    t = llama_tensors(seed=120)
    t["model.layers.1.self_attn.q_proj.weight"] = torch.randn(32, 64)  # config says [64, 64]
    cks["shape_mismatch"] = write_checkpoint(root / "shape_mismatch", t, llama_config(), files=2)
    fname = json.loads((cks["shape_mismatch"] / "model.safetensors.index.json").read_text())[
        "weight_map"]["model.layers.1.self_attn.q_proj.weight"]
    want["shape_mismatch"] = ("shape_mismatch", fname, "model.layers.1.self_attn.q_proj.weight")

    # Data bytes flipped inside one tensor (length unchanged): loads; served as read.
    f = _shard(cks["data_corrupt"], 1)
    n, h = _header(f)
    name = sorted(k for k in h if k != "__metadata__")[0]
    begin = 8 + n + h[name]["data_offsets"][0]
    with open(f, "r+b") as fh:
        fh.seek(begin)
        flipped = bytes(x ^ 0x5A for x in fh.read(64))
        fh.seek(begin)
        fh.write(flipped)

    # A third shard on disk that the index does not list.
    idx = cks["unlisted_shard"] / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    third = _shard(cks["unlisted_shard"], 3, 3).name
    doc["weight_map"] = {k: v for k, v in doc["weight_map"].items() if v != third}
    idx.write_text(json.dumps(doc))
    want["unlisted_shard"] = ("checkpoint_corrupt", third, None)
    return cks, want


@pytest.fixture(scope="module")
def bad_service(module_daemon, tmp_path_factory):
    cks, want = _build_bad(tmp_path_factory.mktemp("bad"))
    svc = module_daemon(cks)
    svc.wait_settled()
    return svc, cks, want


FAILING = ["truncated", "header_garbage", "header_length", "missing_file", "index_names_absent_tensor",
           "shape_mismatch"]


@pytest.mark.parametrize("name", FAILING)
def test_bad_checkpoint_fails_alone_naming_file_and_tensor(bad_service, name):
    """That model fails with an error naming the file (and the tensor when one is at fault);
    attaching it gives model_load_failed with the cause; the good model still serves."""
    svc, cks, want = bad_service
    code, fname, tensor = want[name]
    sl = svc.slab(name)
    assert sl["state"] == "failed"
    err = sl["error"]
    assert err["code"] == code
    assert Path(err["details"]["file"]).name == fname
    if tensor is not None:
        assert err["details"]["tensor"] == tensor
    with pytest.raises(WeightcacheError) as ei:
        attach(name, socket_dir=svc.socket_dir, fallback=False)  # by name: the service's verdict
    assert ei.value.code == "model_load_failed"
    assert ei.value.details["cause"] == code
    assert Path(ei.value.details["cause_details"]["file"]).name == fname
    with pytest.raises(WeightcacheError) as ei:
        attach(str(cks[name]), socket_dir=svc.socket_dir, fallback=True)  # the disk is just as bad
    assert ei.value.code in (code, "model_load_failed")
    good = attach(str(cks["good"]), socket_dir=svc.socket_dir, fallback=False)
    assert good.source == "daemon"
    n = compare_bytes(good.tensors, read_checkpoint(cks["good"]))
    good.close()
    assert svc.alive()
    record_figures(
        f"faults.bad_checkpoint.{name}", f"Bad checkpoint: {name.replace('_', ' ')}",
        f"status and attach name {code} with the file (and tensor); other models serve identical bytes",
        clients=3, faults_injected=1, bytes_compared=n)


def test_data_corruption_is_served_as_read_and_verify_is_clean(bad_service):
    """Flipped data bytes (same length) cannot be detected without a checksum in the format:
    the slab holds exactly what the file holds, the key matches, and verify proves residency."""
    svc, cks, _ = bad_service
    w = attach(str(cks["data_corrupt"]), socket_dir=svc.socket_dir, fallback=False)
    assert w.source == "daemon"
    n = compare_bytes(w.tensors, read_checkpoint(cks["data_corrupt"]))
    w.close()
    res = svc.request(protocol.Verify("data_corrupt")).results
    assert res[0]["mismatched"] == [] and res[0]["tensors"] > 0
    record_figures(
        "faults.bad_checkpoint.data_corrupt", "Bad checkpoint: data bytes changed before the load",
        "served bytes equal the file's bytes as read (safetensors has no checksum); verify clean",
        clients=1, faults_injected=1, bytes_compared=n)


def test_shard_missing_from_index_fails(bad_service):
    svc, _, want = bad_service
    sl = svc.slab("unlisted_shard")
    assert sl["state"] == "failed"
    assert Path(sl["error"]["details"]["file"]).name == want["unlisted_shard"][1]


# --- checkpoint changed after the load ---------------------------------------------


def _copy_times(src_stat: os.stat_result, path: Path) -> None:
    os.utime(path, ns=(src_stat.st_atime_ns, src_stat.st_mtime_ns))


def _replace(ck: Path, seed: int) -> None:
    """Same names, shapes and dtypes, different values, new inodes, old mtimes."""
    new = write_checkpoint(ck.parent / (ck.name + ".new"), llama_tensors(seed), llama_config(), files=2)
    for f in sorted(ck.glob("*.safetensors")):
        st = f.stat()
        assert (new / f.name).read_bytes()[:8 + _header(f)[0]] == f.read_bytes()[:8 + _header(f)[0]]
        _copy_times(st, new / f.name)
        os.replace(new / f.name, f)
    shutil.rmtree(new)


def _overwrite_in_place(ck: Path, seed: int) -> None:
    """Same inode: new values written over the old bytes, mtime put back."""
    new = write_checkpoint(ck.parent / (ck.name + ".new"), llama_tensors(seed), llama_config(), files=2)
    for f in sorted(ck.glob("*.safetensors")):
        st = f.stat()
        with open(f, "r+b") as fh:
            fh.write((new / f.name).read_bytes())
        _copy_times(st, f)
        assert f.stat().st_ino == st.st_ino
    shutil.rmtree(new)


def _edit_header(ck: Path, seed: int) -> None:
    """Same length header, one dtype F32 -> I32 (the bytes now mean something else), mtime put back."""
    f = _shard(ck, 1)
    st = f.stat()
    raw = bytearray(f.read_bytes())
    n, _ = _header(f)
    i = raw.index(b'"F32"', 8, 8 + n)
    raw[i: i + 5] = b'"I32"'
    with open(f, "r+b") as fh:
        fh.write(raw)
    _copy_times(st, f)


# The engine checks a file's identity by stat() (Checkpoint.identity_diff): a header edit shows as
# the ctime the write moved, without re-hashing the header.
CHANGES = {"replaced": (_replace, {"inode", "ctime_ns"}), "overwritten": (_overwrite_in_place, {"ctime_ns"}),
           "header_edited": (_edit_header, {"ctime_ns"})}


@pytest.fixture(scope="module")
def changed_service(module_daemon, tmp_path_factory):
    root = tmp_path_factory.mktemp("changed")
    cks = {k: llama_checkpoint(root / k, seed=200 + i) for i, k in enumerate(CHANGES)}
    old = {k: read_checkpoint(p) for k, p in cks.items()}
    svc = module_daemon(cks)
    svc.wait_settled()
    return svc, cks, old


@pytest.mark.parametrize("kind", list(CHANGES))
def test_changed_checkpoint_never_serves_old_bytes(changed_service, kind):
    """Same layout, different values, mtime copied back: a new attach never gets the old bytes
    (cache_key_mismatch naming the fields with fallback=False, the new disk bytes with fallback=True,
    and the new bytes from the service after evict + preload)."""
    svc, cks, old = changed_service
    ck = cks[kind]
    change, fields = CHANGES[kind]
    w_old = attach(str(ck), socket_dir=svc.socket_dir, fallback=False)
    compared = compare_bytes(w_old.tensors, old[kind])
    change(ck, seed=300)
    new = read_checkpoint(ck)
    assert any(new[k].dtype != old[kind][k].dtype or not torch.equal(
        new[k].reshape(-1).view(torch.uint8), old[kind][k].reshape(-1).view(torch.uint8)) for k in new)

    with pytest.raises(WeightcacheError) as ei:
        attach(str(ck), socket_dir=svc.socket_dir, fallback=False)
    assert ei.value.code == "cache_key_mismatch"
    got = {fld.rsplit(".", 1)[-1] for fld in ei.value.details["fields"]}
    assert fields <= got, got
    assert all(fld.startswith("checkpoint.files.") for fld in ei.value.details["fields"])

    w = attach(str(ck), socket_dir=svc.socket_dir, fallback=True)
    assert w.source == "disk" and w.fallback_reason.startswith("cache_key_mismatch")
    compared += compare_bytes(w.tensors, new)
    compared += compare_bytes(w_old.tensors, old[kind])  # the engine attached before keeps its bytes
    w.close()
    w_old.close()

    assert svc.request(protocol.Evict(kind, force=False)).evicted
    svc.request(protocol.Preload(kind))
    svc.wait_settled()
    w = attach(str(ck), socket_dir=svc.socket_dir, fallback=False)
    assert w.source == "daemon"
    compared += compare_bytes(w.tensors, new)
    w.close()
    record_figures(
        f"faults.checkpoint_changed.{kind}", f"Checkpoint {kind.replace('_', ' ')} after the load, mtime copied",
        "fallback=False -> cache_key_mismatch naming " + ", ".join(sorted(fields)) +
        "; fallback=True -> new disk bytes; after evict + preload the service serves the new bytes",
        clients=5, faults_injected=1, bytes_compared=compared)


# --- writes into attached tensors, and the seal ------------------------------------


WRITER = r"""
import sys, torch
from weightcache import attach
w = attach(sys.argv[1], socket_dir=sys.argv[2], fallback=False)
t = w.tensors["model.layers.0.mlp.down_proj.weight"]
print("attached", w.source, flush=True)
if sys.argv[3] == "setitem":
    t[0, 0] = 12345.0
else:
    t.add_(1.0)
print("write went through", flush=True)
"""


@pytest.fixture(scope="module")
def two_models(module_daemon, tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    a, b = llama_checkpoint(root / "a", seed=21), llama_checkpoint(root / "b", seed=22)
    svc = module_daemon({"a": a, "b": b})
    svc.wait_settled()
    return svc, a, b


@pytest.mark.parametrize("how", ["setitem", "add_"])
def test_engine_write_into_attached_tensor_is_refused(two_models, how):
    """The engine's write faults (the child dies with SIGSEGV/SIGBUS); the service's digests
    still verify and a new attach gets the checkpoint's bytes."""
    svc, a, _ = two_models
    p = subprocess.run([sys.executable, "-c", WRITER, str(a), svc.socket_dir, how], capture_output=True, text=True,
                       env=service_env(), timeout=120)
    assert "attached daemon" in p.stdout, p.stderr
    assert "write went through" not in p.stdout
    assert p.returncode in (-signal.SIGSEGV, -signal.SIGBUS), (p.returncode, p.stderr[-2000:])
    res = svc.request(protocol.Verify("a")).results
    assert res[0]["mismatched"] == [] and res[0]["tensors"] > 0
    w = attach(str(a), socket_dir=svc.socket_dir, fallback=False)
    n = compare_bytes(w.tensors, read_checkpoint(a))
    w.close()
    record_figures(
        f"faults.engine_write_refused.{how}", f"Engine writes into an attached tensor ({how})",
        "the writer dies with SIGSEGV/SIGBUS; service verify clean; new attach byte-identical",
        clients=2, faults_injected=1, bytes_compared=n, writer_exit=p.returncode)


def test_host_seal_forbids_every_writable_path(two_models):
    """On the host backend no holder of the fd can change the bytes: writable shared mmap, write(2),
    ftruncate, reopening /proc/self/fd RW and mprotect all fail; a private COW map changes nothing.
    (So `verify` detecting a read-write remap can only be shown on the cuda backend: tests/gpu.)"""
    svc, a, _ = two_models
    s = svc.session()
    try:
        reply = s.request(protocol.Attach(model="a"))
        fd, manifest_fd = s.last_fds
        size = read_manifest_file(manifest_fd, reply.manifest_size_bytes).slab_size_bytes
        size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        for sealed_fd in (fd, manifest_fd):  # the manifest file beside the slab is sealed the same way
            seals = __import__("fcntl").fcntl(sealed_fd, F_GET_SEALS)
            assert seals & (F_SEAL_WRITE | F_SEAL_SEAL | F_SEAL_GROW | F_SEAL_SHRINK) == (
                F_SEAL_WRITE | F_SEAL_SEAL | F_SEAL_GROW | F_SEAL_SHRINK)
        os.close(manifest_fd)
        refused = 0
        with pytest.raises(PermissionError):
            mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        refused += 1
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        refused += 1
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        refused += 1
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"x", 0)
        finally:
            os.close(rw)
        refused += 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        try:
            assert libc.mprotect(addr, size, mmap.PROT_READ | mmap.PROT_WRITE) == -1
            assert ctypes.get_errno() == errno.EACCES
            refused += 1
        finally:
            libc.munmap(addr, size)
        private = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        private[:4096] = b"\xee" * 4096  # copy-on-write: this process's pages only
        private.close()
        os.close(fd)
    finally:
        s.close()
    res = svc.request(protocol.Verify("a")).results
    assert res[0]["mismatched"] == []
    w = attach(str(a), socket_dir=svc.socket_dir, fallback=False)
    n = compare_bytes(w.tensors, read_checkpoint(a))
    w.close()
    record_figures(
        "faults.host_seal", "Host backend: the sealed memfd refuses every writable path",
        "seals W|S|G|S set; writable MAP_SHARED mmap, pwrite, ftruncate, /proc/self/fd reopen + pwrite -> EPERM; "
        "mprotect(RW) -> EACCES; private COW write leaves service bytes and verify unchanged",
        clients=2, faults_injected=refused + 1, bytes_compared=n)


def test_two_engines_different_models_never_mix(two_models):
    """Engines asking for different models (by path and by name, concurrently) always get their own bytes."""
    svc, a, b = two_models
    ref = {"a": read_checkpoint(a), "b": read_checkpoint(b)}
    path = {"a": str(a), "b": str(b)}
    for k in ref["a"]:
        assert not torch.equal(ref["a"][k], ref["b"][k])  # a mix-up would show
    rounds = 8

    def engine(model: str, i: int) -> int:
        w = attach(path[model] if i % 2 else model, socket_dir=svc.socket_dir, fallback=False)
        try:
            assert w.source == "daemon" and w.manifest.model == model
            return compare_bytes(w.tensors, ref[model])
        finally:
            w.close()

    with ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(engine, m, i) for i in range(rounds) for m in ("a", "b")]
        compared = sum(f.result() for f in futs)
    record_figures(
        "faults.two_models_isolated", "Two engines, two models on one GPU",
        "each attach (by path and by name, 4 threads) gets its own model's manifest and bytes",
        clients=2 * rounds, bytes_compared=compared)
