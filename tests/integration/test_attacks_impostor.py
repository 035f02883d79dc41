"""The client believes only a real service (issue 38, P10): an impostor at the socket path.

The impostor is a proxy in front of a real host-backend service: it passes the engine's ``hello`` and
``attach`` on, takes the service's real replies (a real manifest, a real sealed slab), and changes one thing
before the engine gets them: it trickles the bytes, swaps the slab fd for an unsealed copy, a FIFO, a socket,
a directory, ``/dev/zero`` or an empty memfd, sends a manifest over the size cap, or (as another uid) only
stands at the path. Before: a 5 s timeout held 37.7 s by a 1-byte trickle, the unsealed memfd was mapped
(its bytes changeable under the engine), the other fds raised raw ``OSError``/``ValueError`` through
``fallback=True``, and the impostor of another uid was served from.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from attackers import NOBODY, SERVICE_UID, fork_as, reap, result  # noqa: E402
from service_harness import record_figures  # noqa: E402
from wire_helpers import frame, raw_connect, read_reply  # noqa: E402
from checkpoints import compare_bytes, read_checkpoint, write_checkpoint  # noqa: E402
from weightcache import attach  # noqa: E402
from weightcache.errors import (  # noqa: E402
    DaemonUnavailable,
    ManifestInvalid,
    ManifestSlabMismatch,
    WeightcacheError,
)

pytestmark = pytest.mark.timeout(120)


def _send(conn: socket.socket, data: bytes, fds: list[int]) -> None:
    conn.sendmsg([data[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(memoryview(
        __import__("array").array("i", fds)).cast("B")))] if fds else [])
    conn.sendall(data[1:])


def _relay(conn: socket.socket, upstream: str, mutate) -> None:
    """One engine connection: its two requests to the real service, the two replies through ``mutate``."""
    up = raw_connect(upstream)
    try:
        for _ in range(2):
            obj, fds = read_reply(conn)
            if obj is None:
                return
            up.sendall(frame(obj))
        hello, fds = read_reply(up)  # the attach reply's fds may come with the hello reply's bytes
        reply, more = read_reply(up)
        fds += more
        mutate(conn, frame(hello) + frame(reply), reply, fds)
        conn.settimeout(30)
        while conn.recv(4096):  # until the engine closes (its lease)
            pass
    except OSError:
        pass
    finally:
        up.close()
        conn.close()


class Impostor:
    """Listens at ``path`` (this process's uid) and relays every connection through :func:`_relay`."""

    def __init__(self, path: str, upstream: str, mutate) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(16)
        self.upstream, self.mutate = upstream, mutate
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=_relay, args=(conn, self.upstream, self.mutate), daemon=True).start()

    def close(self) -> None:
        self.sock.close()


def _memfd(data: bytes, seals: int = 0) -> int:
    import fcntl

    fd = os.memfd_create("impostor", os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seals:
        fcntl.fcntl(fd, 1033, seals)
    return fd


def _swap_slab(make_fd):
    def mutate(conn, data, reply, fds):
        assert len(fds) == 2, reply
        slab, manifest = fds
        new = make_fd(slab)
        _send(conn, data, [new, manifest])
        for fd in (slab, manifest, new):
            os.close(fd)
    return mutate


def _unsealed_copy(slab: int) -> int:
    return _memfd(os.pread(slab, os.fstat(slab).st_size, 0))


def _fifo(tmp):
    def make(slab: int) -> int:
        p = os.path.join(tmp, f"fifo{time.monotonic_ns()}")
        os.mkfifo(p)
        return os.open(p, os.O_RDWR)
    return make


def _a_socket(slab: int) -> int:
    a, b = socket.socketpair()
    b.close()
    return a.detach()


def _a_directory(slab: int) -> int:
    return os.open("/", os.O_RDONLY | os.O_DIRECTORY)


def _dev_zero(slab: int) -> int:
    return os.open("/dev/zero", os.O_RDONLY)


def _empty_sealed(slab: int) -> int:
    return _memfd(b"", 0x1 | 0x2 | 0x4 | 0x8)


def _short_sealed(slab: int) -> int:
    return _memfd(os.pread(slab, 4096, 0), 0x1 | 0x2 | 0x4 | 0x8)


def _huge_manifest(conn, data, reply, fds):
    slab, manifest = fds
    big = _memfd(b"\0" * (40 << 20), 0x1 | 0x2 | 0x4 | 0x8)
    reply = dict(reply, manifest_size_bytes=40 << 20)
    hello_len = int.from_bytes(data[:4], "big") + 4
    _send(conn, data[:hello_len] + frame(reply), [slab, big])
    for fd in (slab, manifest, big):
        os.close(fd)


def _trickle(conn, data, reply, fds):
    _send(conn, data[:1], fds)
    for fd in fds:
        os.close(fd)
    for i in range(1, len(data)):
        time.sleep(0.2)
        conn.sendall(data[i:i + 1])


@pytest.fixture
def setup(daemon, tmp_path):
    g = torch.Generator().manual_seed(7)
    ck = write_checkpoint(tmp_path / "ck", {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)})
    svc = daemon({"ok": ck})
    svc.wait_settled()
    fake_dir = tmp_path / "fake"
    fake_dir.mkdir()
    return svc, ck, str(fake_dir), read_checkpoint(ck)


SWAPS = {"unsealed": lambda tmp: _unsealed_copy, "fifo": _fifo, "socket": lambda tmp: _a_socket,
         "directory": lambda tmp: _a_directory, "dev_zero": lambda tmp: _dev_zero,
         "empty": lambda tmp: _empty_sealed, "short": lambda tmp: _short_sealed}


@pytest.mark.parametrize("kind", sorted(SWAPS))
def test_a_slab_fd_that_is_not_a_sealed_memfd_of_the_manifests_size_is_refused(setup, kind):
    svc, ck, fake_dir, want = setup
    imp = Impostor(os.path.join(fake_dir, "0.sock"), svc.socket_path, _swap_slab(SWAPS[kind](fake_dir)))
    try:
        with pytest.raises(ManifestSlabMismatch) as e:
            attach(str(ck), socket_dir=fake_dir, fallback=False, timeout=10)
        assert e.value.code == "manifest_slab_mismatch"
        with attach(str(ck), socket_dir=fake_dir, fallback=True, timeout=10) as w:
            assert w.source == "disk" and w.fallback_reason.startswith("manifest_slab_mismatch")
            compare_bytes(w.tensors, want)
    finally:
        imp.close()


def test_a_manifest_over_the_cap_is_refused_unread(setup):
    svc, ck, fake_dir, want = setup
    imp = Impostor(os.path.join(fake_dir, "0.sock"), svc.socket_path, _huge_manifest)
    try:
        with pytest.raises(ManifestInvalid) as e:
            attach(str(ck), socket_dir=fake_dir, fallback=False, timeout=10)
        assert e.value.details["size_bytes"] == 40 << 20
        with attach(str(ck), socket_dir=fake_dir, fallback=True, timeout=10) as w:
            assert w.source == "disk" and w.fallback_reason.startswith("manifest_invalid")
    finally:
        imp.close()


def test_a_trickled_reply_ends_at_the_attachs_timeout(setup):
    """1 byte every 0.2 s: the attach's 2 s timeout is one deadline for the whole exchange. Before, each
    ``recv`` had its own timeout, and the reply (hundreds of bytes) held the engine for minutes."""
    svc, ck, fake_dir, want = setup
    imp = Impostor(os.path.join(fake_dir, "0.sock"), svc.socket_path, _trickle)
    try:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable):
            attach(str(ck), socket_dir=fake_dir, fallback=False, timeout=2)
        took = time.monotonic() - t0
        assert took < 3.5, took
        t0 = time.monotonic()
        with attach(str(ck), socket_dir=fake_dir, fallback=True, timeout=2) as w:
            assert w.source == "disk"
            compared = compare_bytes(w.tensors, want)
        assert time.monotonic() - t0 < 10
    finally:
        imp.close()
    record_figures("attack.impostor_trickle", "an impostor at the socket path trickles the real reply, 1 byte per "
                   "0.2 s", "attach(timeout=2): daemon_unavailable at the deadline (one deadline for the whole "
                   "exchange; 42.5 s before issue 38), fallback=True loads from disk", clients=2, faults_injected=1,
                   bytes_compared=compared, attach_s=round(took, 2))


def _impostor_as_nobody(path: str, upstream: str) -> dict:
    imp = Impostor(path, upstream, lambda conn, data, reply, fds: (_send(conn, data, fds), [os.close(f) for f in fds]))
    os.chmod(path, 0o777)
    return {"listening": path, "uid": os.getuid(), "fd": imp.sock.fileno()}


def test_a_socket_bound_by_another_uid_is_refused(setup, monkeypatch):
    """The impostor runs as ``nobody`` and relays the real service faithfully: with ``WEIGHTCACHE_SERVICE_USER``
    naming the service's uid, the engine refuses it (``daemon_unavailable`` naming uid 65534), then falls back
    to disk; the real service's own socket is accepted (root bound it here)."""
    svc, ck, _, want = setup
    fake_dir = tempfile.mkdtemp(prefix="wc-fake-", dir="/tmp")  # reachable by nobody
    os.chmod(fake_dir, 0o777)
    for d in (os.path.dirname(svc.socket_dir), svc.socket_dir):
        os.chmod(d, 0o755)
    os.chmod(svc.socket_path, 0o666)
    path = os.path.join(fake_dir, "0.sock")
    pid, r = fork_as(NOBODY, NOBODY, [], _impostor_as_nobody, path, svc.socket_path)
    try:
        assert result(r)["uid"] == NOBODY
        monkeypatch.setenv("WEIGHTCACHE_SERVICE_USER", str(SERVICE_UID))
        with pytest.raises(DaemonUnavailable) as e:
            attach(str(ck), socket_dir=fake_dir, fallback=False, timeout=10)
        assert e.value.details["server_uid"] == NOBODY and e.value.details["server_pid"] == pid
        with attach(str(ck), socket_dir=fake_dir, fallback=True, timeout=10) as w:
            assert w.source == "disk" and w.fallback_reason.startswith("daemon_unavailable")
        with attach(str(ck), socket_dir=svc.socket_dir, fallback=False, timeout=10) as w:  # root's socket
            compare_bytes(w.tensors, want)
        monkeypatch.delenv("WEIGHTCACHE_SERVICE_USER")
        with attach(str(ck), socket_dir=fake_dir, fallback=False, timeout=10) as w:  # no service user known here
            assert w.source == "daemon"
    finally:
        reap(pid, r)
        shutil.rmtree(fake_dir, ignore_errors=True)


def test_fallback_true_raises_only_weightcache_errors_whatever_the_impostor_sends(setup):
    """Every swap above, with ``fallback=True`` by name (no disk to fall back to): a typed error each time."""
    svc, ck, fake_dir, want = setup
    for kind, make in SWAPS.items():
        path = os.path.join(fake_dir, "0.sock")
        imp = Impostor(path, svc.socket_path, _swap_slab(make(fake_dir)))
        try:
            with pytest.raises(WeightcacheError):
                attach("ok", socket_dir=fake_dir, fallback=True, timeout=10)
        finally:
            imp.close()
            os.unlink(path)


def test_the_default_service_user_is_checked_only_in_the_default_socket_dir(monkeypatch):
    """Without ``WEIGHTCACHE_SERVICE_USER``: ``weightcache`` (where passwd has it) for ``/run/weightcache``
    only; a socket elsewhere (a test's, a developer's) is not checked; a numeric value is used as it is."""
    from weightcache import session

    monkeypatch.delenv("WEIGHTCACHE_SERVICE_USER", raising=False)
    assert session.expected_server_uids("/tmp/x/0.sock") is None
    monkeypatch.setattr(session.pwd, "getpwnam", lambda n: type("P", (), {"pw_uid": 990})())
    uids, who = session.expected_server_uids("/run/weightcache/0.sock")
    assert uids == {0, os.geteuid(), 990} and "990" in who
    monkeypatch.setenv("WEIGHTCACHE_SERVICE_USER", "4242")
    assert session.expected_server_uids("/tmp/x/0.sock")[0] == {0, os.geteuid(), 4242}


def _replace_reply(raw: bytes):
    def mutate(conn, data, reply, fds):
        hello_len = int.from_bytes(data[:4], "big") + 4
        _send(conn, data[:hello_len] + raw, fds)
        for fd in fds:
            os.close(fd)
    return mutate


GARBAGE = {
    "bytes": b"\x00\x00\x00\x10" + os.urandom(16),
    "deep_json": frame(b"[" * 200_000 + b"]" * 200_000),
    "not_an_object": frame(b"[1, 2, 3]"),
    "unknown_type": frame({"type": "no_such_reply"}),
    "unknown_error_code": frame({"type": "error", "code": "made_up", "message": "x", "details": {}}),
    "attach_reply_fields_wrong": frame({"type": "attach_reply", "lease_id": "x", "checkpoint_path": 3,
                                        "backend": "host", "manifest_size_bytes": -5}),
    "huge_length_prefix": b"\x7f\xff\xff\xff" + b"{",
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_fallback_true_raises_only_weightcache_errors_whatever_the_reply(setup, kind):
    """The attach reply replaced by garbage: with ``fallback=True`` by path, the disk load, its reason the remote
    ``protocol_violation``; never a bare exception, never the garbage's own claim (``made_up``)."""
    svc, ck, fake_dir, want = setup
    imp = Impostor(os.path.join(fake_dir, "0.sock"), svc.socket_path, _replace_reply(GARBAGE[kind]))
    try:
        with attach(str(ck), socket_dir=fake_dir, fallback=True, timeout=5) as w:
            assert (w.source, w.fallback_reason.split(":")[0]) == ("disk", "protocol_violation"), w.fallback_reason
            compare_bytes(w.tensors, want)
    finally:
        imp.close()
