"""A cap on the fds in flight to all uids together, half of ``RLIMIT_NOFILE`` by default, shared fairly (issue 38,
P11): per-uid caps did not bound the sum (5 uids x 4,096 stopped every other attach at the kernel's limit). Past
the cap a uid still gets its share (the cap over the uids with fds in flight); the one that filled it gets
``resource_exhausted`` (``limit=max_fds_in_flight``) without fds."""

from __future__ import annotations

import dataclasses
import os
import resource
import socket

from daemon_helpers import Clock, fd_serving_transport
from wire_helpers import frame, read_reply
from weightcache import protocol
from weightcache.daemon.limits import Limits
from weightcache.daemon.transport import Callbacks, Transport

HELLO = {"type": "hello", "protocol_version": protocol.PROTOCOL_VERSION}
ATTACH = {"type": "attach", "model": "m"}


def _pump(tr, n: int = 5) -> None:
    for _ in range(n):
        tr.poll(0.01)


def _replies(s: socket.socket, n: int) -> tuple[list[tuple[str, str | None]], int]:
    """The first ``n`` replies' (type, limit) and the fds that came with them (fds arrive with whichever read
    picks up their frame's first byte)."""
    out, received = [], 0
    for _ in range(n):
        obj, fds = read_reply(s)
        out.append((obj["type"], obj.get("details", {}).get("limit")))
        received += len(fds)
        for fd in fds:
            os.close(fd)
    return out, received


def test_the_uid_that_fills_the_cap_is_refused_and_another_gets_its_share(tmp_path):
    path = str(tmp_path / "a.sock")
    tr, listener, (r, w) = fd_serving_transport(
        path, Limits.defaults(max_fds_in_flight_per_uid=1000, max_unread_replies=64, max_fds_in_flight=8))
    socks = []
    try:
        def connect(uid: int) -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            s.settimeout(5)
            socks.append(s)
            _pump(tr)
            (c,) = [c for c in tr.clients.values() if c.peer.uid == os.getuid()]
            c.peer = dataclasses.replace(c.peer, uid=uid)  # another uid, as SO_PEERCRED would say
            return s

        a = connect(5001)
        a.sendall(frame(HELLO) + frame(ATTACH) * 6)  # never reads until the end
        _pump(tr, 10)
        b = connect(5002)
        b.sendall(frame(HELLO) + frame(ATTACH) * 3)
        _pump(tr, 10)
        (got_a, fds_a), (got_b, fds_b) = _replies(a, 7), _replies(b, 4)
        assert got_a[1:] == [("attach_reply", None)] * 4 + [("error", "max_fds_in_flight")] * 2 and fds_a == 8, got_a
        # b's share past the cap: 8 // 2 uids = 4 fds, two replies; the third refused.
        assert got_b[1:] == [("attach_reply", None)] * 2 + [("error", "max_fds_in_flight")] and fds_b == 4, got_b
    finally:
        for s in socks:
            s.close()
        tr.close_all("test over")
        listener.close()
        os.close(r)
        os.close(w)


def test_the_default_is_half_of_rlimit_nofile(tmp_path):
    """0 (the default) is half the process's soft RLIMIT_NOFILE: one uid alone stops there."""
    assert Limits.defaults().max_fds_in_flight == 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    path = str(tmp_path / "d.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    tr = Transport(listener, Callbacks(lambda c, m, fds=(): None, lambda c: None, lambda c: None),
                   Limits.defaults(max_fds_in_flight_per_uid=1 << 20), Clock(0.0), trusted_uids=frozenset())
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        assert tr.outbox._over_all_uids(5001, 32, tr.limits.max_fds_in_flight) is None
        tr.outbox.fds_in_flight[5001] = 32
        refused = tr.outbox._over_all_uids(5001, 2, tr.limits.max_fds_in_flight)
        assert (refused.details["limit"], refused.details["value"]) == ("max_fds_in_flight", 32)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        listener.close()


def test_shares_stop_short_of_twice_the_cap(tmp_path):
    """Uids arriving one after another each get the share of their moment (the cap over the uids then): the
    sum stops at twice the cap less a sixteenth, short of the kernel's RLIMIT_NOFILE."""
    path = str(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    tr = Transport(listener, Callbacks(lambda c, m, fds=(): None, lambda c: None, lambda c: None),
                   Limits.defaults(max_fds_in_flight_per_uid=1 << 20, max_fds_in_flight=160), Clock(0.0),
                   trusted_uids=frozenset())
    try:
        for uid in range(5000, 5100):
            while tr.outbox._over_all_uids(uid, 2, tr.limits.max_fds_in_flight) is None:
                tr.outbox.fds_in_flight[uid] += 2
        assert sum(tr.outbox.fds_in_flight.values()) <= 2 * 160 - 10
        assert tr.outbox.fds_in_flight[5000] == 160 and tr.outbox.fds_in_flight[5001] == 80  # the first fills, the next shares
    finally:
        listener.close()
