"""Lingering connections count toward their uid's connection cap (issue 38, P1): a connection the service dropped
while its peer keeps our fds unread holds a socket in the service like a live one. Before, two uids held 4,096
of them (``max_connections``) and every other uid's connection was reset."""

from __future__ import annotations

import os
import socket

from daemon_helpers import fd_serving_transport
from wire_helpers import frame, read_reply
from weightcache import protocol
from weightcache.daemon.limits import Limits

HELLO = {"type": "hello", "protocol_version": protocol.PROTOCOL_VERSION}


def _pump(tr, n: int = 5) -> None:
    for _ in range(n):
        tr.poll(0.01)


def test_lingering_connections_count_toward_the_uid_cap(tmp_path):
    path = str(tmp_path / "l.sock")
    tr, listener, (r, w) = fd_serving_transport(path, Limits.defaults(max_connections_per_uid=3), backlog=16)
    held = []
    try:
        for _ in range(3):  # three connections of this uid, each dropped with 2 fds unread: lingering
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            s.sendall(frame(HELLO) + frame({"type": "attach", "model": "m"}))
            held.append(s)
            _pump(tr, 10)
            for c in list(tr.clients.values()):
                tr.drop(c, "test")
        assert len(tr.outbox.lingering) == 3 and not tr.clients
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.settimeout(5)
        held.append(s)
        _pump(tr, 5)
        obj, fds = read_reply(s)
        assert obj["type"] == "error" and obj["code"] == "resource_exhausted", obj
        assert obj["details"]["limit"] == "max_connections_per_uid" and obj["details"]["actual"] == 4
        for h in held[:3]:  # the peer closes its lingering ends: its uid may connect again
            h.close()
        tr.expire(0.0)
        assert not tr.outbox.lingering
        s2 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s2.connect(path)
        s2.settimeout(5)
        held.append(s2)
        s2.sendall(frame(HELLO))
        _pump(tr, 5)
        obj, _ = read_reply(s2)
        assert obj["type"] == "hello_reply", obj
    finally:
        for h in held:
            h.close()
        tr.close_all("test over")
        listener.close()
        os.close(r)
        os.close(w)
