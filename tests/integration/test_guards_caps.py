"""Guard: the per-uid connection cap lets in exactly ``max_connections_per_uid`` connections (issue 40).

A client of uid ``nobody`` (a forked child, tests/attackers.py) opens
connections one at a time, each waiting for the answer to its ``hello`` before
the next, so the service has counted every earlier one. The first
``max_connections_per_uid`` are served; every later one is refused with
``resource_exhausted`` naming the cap, and closed. Closing one served
connection makes room for exactly one more. (The attack test of issue 16
accepts any count of refusals from 1 to 8, so a cap that let one connection
too many in passed it.)
"""

from __future__ import annotations

import socket
import time

import pytest

from attackers import NOBODY, fork_as, open_socket_to_all, reap, result  # noqa: E402
from service_harness import make_config  # noqa: E402
from wire_helpers import HELLO, frame, read_reply  # noqa: E402
from checkpoints import toy_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CAP = 5


def _hello(path: str) -> tuple[socket.socket, str]:
    """A new connection's fate after ``hello``: ``served``, or the error code and the cap it names."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(path)
    try:
        s.sendall(frame(HELLO))
    except (BrokenPipeError, ConnectionResetError):  # refused at accept: its error is already queued to us
        pass
    obj, fds = read_reply(s)
    assert not fds
    if obj is None:
        return s, "closed"
    if obj["type"] == "error":
        return s, f"{obj['code']}:{obj.get('details', {}).get('limit')}"
    return s, "served"


def _wait_counted(s: socket.socket, clients: int) -> None:
    """Asks ``status`` on ``s`` until the service counts ``clients`` connections (it has seen a close)."""
    deadline = time.monotonic() + 20
    while True:
        s.sendall(frame({"type": "status"}))
        obj, _ = read_reply(s)
        if obj["status"]["clients"] == clients:
            return
        assert time.monotonic() < deadline, obj["status"]["clients"]
        time.sleep(0.01)


def _connect_past_the_cap(path: str, extra: int) -> dict:
    """Runs as ``nobody``: ``CAP + extra`` connections kept open, then one served closed and two more."""
    held, fates = [], []
    for _ in range(CAP + extra):
        s, fate = _hello(path)
        fates.append(fate)
        if fate == "served":
            held.append(s)
        else:
            s.close()
    held.pop().close()  # one served connection leaves...
    _wait_counted(held[0], len(held))
    after = []
    for _ in range(2):  # ... and makes room for exactly one
        s, fate = _hello(path)
        after.append(fate)
        if fate == "served":
            held.append(s)
    return {"fates": fates, "after_one_left": after}


def test_exactly_max_connections_per_uid_connections_of_one_uid_are_served(daemon, tmp_path):
    """Invariant: with ``max_connections_per_uid = N``, one uid's connections 1..N are served and N+1, N+2, ...
    are refused with resource_exhausted (limit max_connections_per_uid): the new connection counts itself."""
    toy_checkpoint(tmp_path / "ck")
    svc = daemon(make_config({"m": tmp_path / "ck"}, max_connections_per_uid=CAP))
    open_socket_to_all(svc)
    refused = "resource_exhausted:max_connections_per_uid"
    pid, r = fork_as(NOBODY, NOBODY, [], _connect_past_the_cap, svc.socket_path, 3)
    try:
        res = result(r)
    finally:
        reap(pid, r)
    assert "crash" not in res, res
    assert res["fates"] == ["served"] * CAP + [refused] * 3
    assert res["after_one_left"] == ["served", refused]
    assert svc.alive()
