"""What the attack tests share: a well-behaved engine, flooding, forked attackers of another uid, baselines.

Attackers that must not share the test's uid (the per-uid caps, the allow
lists) run in a forked child that drops to ``nobody`` (and to chosen
supplementary groups): the interpreter lives under /root, which other users
cannot execute, so the child is a fork of this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

from service_harness import compare_bytes, proc_fds, read_reply  # noqa: F401 - proc_fds re-exported
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
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        assert time.monotonic() < deadline, "forked attacker did not report"
        chunk = os.read(r, 65536)
        if not chunk:
            break
        buf += chunk
    return json.loads(buf)


def reap(pid: int, r: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    os.close(r)


def back_to_baseline(svc, before: dict, extra_memfds: int = 0) -> dict:
    """Asserts fds by kind equal ``before`` (plus ``extra_memfds`` for slabs loaded meanwhile) and RSS within slack."""
    after = svc.snapshot()
    want = dict(before["fds"])
    if extra_memfds:
        want["memfd"] = want.get("memfd", 0) + extra_memfds
    assert dict(after["fds"]) == want, (dict(after["fds"]), want)
    assert after["rss_bytes"] - before["rss_bytes"] < RSS_SLACK_BYTES, (after["rss_bytes"], before["rss_bytes"])
    assert after["leases"] == 0
    return after
