"""What the attack tests share: a well-behaved engine, flooding, forked attackers of another uid, baselines.

Attackers that must not share the test's uid (the per-uid caps, the allow
lists) run in a forked child that drops to ``nobody`` (and to chosen
supplementary groups): the interpreter lives under /root, which other users
cannot execute, so the child is a fork of this process.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time

from service_harness import poll_until, proc_fds  # noqa: F401 - proc_fds re-exported
from wire_helpers import read_reply  # noqa: F401 - proc_fds re-exported
from checkpoints import compare_bytes  # noqa: F401 - proc_fds re-exported
from weightcache import attach

MiB = 1 << 20
NOBODY = 65534
#: uid of the service in the tests where the kernel's per-user limits matter (no passwd entry needed).
SERVICE_UID = 64000
RSS_SLACK_BYTES = 16 * MiB


def ok_attach(svc, expected: dict) -> int:
    """A well-behaved engine: attaches ``ok`` within one second, bytes equal the checkpoint's."""
    with attach("ok", socket_dir=svc.socket_dir, fallback=False, timeout=1.0) as w:
        assert w.source == "daemon"
        return compare_bytes(w.tensors, expected)


def flood(s: socket.socket, data: bytes, limit_bytes: int) -> int:
    """Writes ``data`` repeatedly without blocking until the socket refuses more (or ``limit_bytes``)."""
    s.setblocking(False)
    sent = 0
    view = memoryview(data)
    while sent < limit_bytes:
        try:
            n = s.send(view[sent % len(data):])
        except BlockingIOError:
            break
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += n
    return sent


def send_quietly(s: socket.socket, data: bytes) -> None:
    """``sendall``; the service may close the connection first (that is the point)."""
    with contextlib.suppress(OSError):
        s.sendall(data)


def replies(s: socket.socket, timeout: float = 5.0) -> list[dict]:
    """Every reply readable on ``s`` until EOF or ``timeout`` of silence; closes the fds that came with them."""
    s.settimeout(timeout)
    out = []
    while True:
        try:
            obj, fds = read_reply(s)
        except (socket.timeout, TimeoutError):
            return out
        for fd in fds:
            os.close(fd)
        if obj is None:
            return out
        obj["fd_count"] = len(fds)
        out.append(obj)


def open_socket_to_all(svc) -> None:
    """Lets other uids reach the test's socket (the unit's SocketGroup does this on a node)."""
    for d in (os.path.dirname(svc.socket_dir), svc.socket_dir):
        os.chmod(d, 0o755)
    os.chmod(svc.socket_path, 0o666)


def fork_as(uid: int, gid: int, groups: list[int], fn, *args) -> tuple[int, int]:
    """Runs ``fn(*args)`` in a forked child with these ids; returns ``(pid, read end)`` of its JSON result pipe.

    The child writes ``fn``'s JSON result, then waits for stdin-less SIGTERM/SIGKILL from :func:`reap`.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no return from here
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            out = fn(*args)
        except BaseException as e:  # noqa: BLE001 - report anything to the parent
            out = {"crash": repr(e)}
        os.write(w, (json.dumps(out, default=str) + "\n").encode())
        os.close(w)
        time.sleep(3600)  # keep its sockets open until the parent kills it
        os._exit(0)
    os.close(w)
    return pid, r


def result(r: int, timeout: float = 60.0) -> dict:
    buf = bytearray()

    def reported() -> bool:
        chunk = os.read(r, 65536)
        buf.extend(chunk)
        return not chunk or buf.endswith(b"\n")

    poll_until(reported, "the forked attacker's report", timeout, 0)
    return json.loads(bytes(buf))


def reap(pid: int, r: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    os.close(r)


def back_to_baseline(svc, before: dict, extra_memfds: int = 0, extra_files: int = 0) -> dict:
    """Asserts fds by kind equal ``before`` (plus ``extra_memfds`` for slabs loaded meanwhile, plus
    ``extra_files``, negative for files a load held open at ``before``) and RSS within slack."""
    after = svc.snapshot()
    want = dict(before["fds"])
    if extra_memfds:
        want["memfd"] = want.get("memfd", 0) + extra_memfds
    if extra_files:
        want["file"] = want.get("file", 0) + extra_files
    assert dict(after["fds"]) == want, (dict(after["fds"]), want)
    assert after["rss_bytes"] - before["rss_bytes"] < RSS_SLACK_BYTES, (after["rss_bytes"], before["rss_bytes"])
    assert after["leases"] == 0
    return after


# --- a read that never returns (hung NFS), on the loader thread --------------------------------------------------

_HUNG_READS = '''
import os
from weightcache import checkpoint as _ck

_gates = dict(g.split("=", 1) for g in os.environ["WC_TEST_HUNG_READS"].split(os.pathsep) if g)
_read_side_file = _ck.Checkpoint.read_side_file


def read_side_file(self, name):
    gate = _gates.get(str(self.path))
    if gate and name == "config.json":
        fd = os.open(gate, os.O_RDWR)  # opens at once (Linux); the read blocks until the test writes a byte
        try:
            os.read(fd, 1)
        finally:
            os.close(fd)
    return _read_side_file(self, name)


_ck.Checkpoint.read_side_file = read_side_file
'''


def hung_read_env(tmp_path, *checkpoints) -> dict:
    """``env=`` for a service whose read of ``config.json`` in each of ``checkpoints`` blocks (as on a hung NFS
    mount) until :func:`release_read` (the service itself refuses a FIFO side file, so the hang is injected:
    a ``sitecustomize`` wraps :meth:`weightcache.checkpoint.Checkpoint.read_side_file`, which the loader
    thread calls, with a read of a FIFO ``<checkpoint>.gate``)."""
    from service_harness import SERVICE_DIR

    site = tmp_path / "hung-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_HUNG_READS)
    gates = []
    for ck in checkpoints:
        gate = ck.parent / (ck.name + ".gate")
        os.mkfifo(gate)
        gates.append(f"{os.path.realpath(ck)}={gate}")
    return {"PYTHONPATH": os.pathsep.join([str(site), str(SERVICE_DIR)]), "WC_TEST_HUNG_READS": os.pathsep.join(gates)}


def release_read(ck, timeout: float = 30.0) -> None:
    """Lets the read of :func:`hung_read_env` on ``ck`` return (once the loader has started it)."""
    gate = ck.parent / (ck.name + ".gate")

    def opened() -> int | None:
        try:
            return os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:  # ENXIO: the loader has not opened it yet
            assert e.errno == errno.ENXIO, e
            return None

    fd = poll_until(opened, "the loader to open the gate of the hung read", timeout, 0.01)
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)


def wait_read_hung(pid: int, ck, timeout: float = 60.0) -> int:
    """Waits until service ``pid`` is blocked in the hung read of ``ck`` (:func:`hung_read_env`); returns how
    many fds it holds under ``ck`` then (its directory fd and the gate), released when the read returns."""
    gate = str(ck.parent / (ck.name + ".gate"))

    def hung() -> int | None:
        links = []
        for name in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                links.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        if gate in links:  # the count is at least 1: the gate itself
            return sum(1 for x in links if x == gate or x == str(ck) or x.startswith(str(ck) + "/"))
        return None

    return poll_until(hung, "the service to start the hung read", timeout)


def baseline_figures(before: dict, after: dict) -> dict:
    """The service's fds (all kinds) and RSS before the attack and after it, for :func:`record_figures`."""
    return {"service_fds_before": sum(before["fds"].values()), "service_fds_after": sum(after["fds"].values()),
            "rss_before_bytes": before["rss_bytes"], "rss_after_bytes": after["rss_bytes"]}


_HUNG_CONFIG = '''
import os
from weightcache.config import _files as _config  # where the config reader lives

_gate = os.environ["WC_TEST_HUNG_CONFIG"].split("=", 1)
_read_bytes = _config._read_bytes


def _hung(path):
    if os.path.basename(str(path)) == _gate[0] and os.path.exists(_gate[1]):
        fd = os.open(_gate[1], os.O_RDWR)  # the read blocks until the test writes a byte
        try:
            os.read(fd, 1)
        finally:
            os.close(fd)
    return _read_bytes(path)


_config._read_bytes = _hung
'''


def hung_config_env(tmp_path, drop_in: str, gate) -> dict:
    """``env=`` for a service whose read of a config file named ``drop_in`` blocks (a hung mount) while FIFO
    ``gate`` exists, until a byte is written into it (:func:`release_read` style)."""
    from service_harness import SERVICE_DIR

    site = tmp_path / "hung-config-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_HUNG_CONFIG)
    return {"PYTHONPATH": os.pathsep.join([str(site), str(SERVICE_DIR)]),
            "WC_TEST_HUNG_CONFIG": f"{drop_in}={gate}"}
