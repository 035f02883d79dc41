"""Issue 25, attacks 1 and 2: what a client makes the service hold in the kernel, and lease floods.

1. fds in flight: a uid pipelines attaches on many connections and never
   reads. The replies' fds sit in its receive queues, charged by the kernel to
   the *service's* user; past that user's ``RLIMIT_NOFILE`` every ``SCM_RIGHTS``
   send fails (``ETOOMANYREFS``), so every other client's attach failed. The
   service runs as its own unprivileged uid here (:data:`attackers.SERVICE_UID`,
   without ``CAP_SYS_ADMIN``/``CAP_SYS_RESOURCE``: root is exempt from the
   limit), with ``RLIMIT_NOFILE`` scaled from the unit's 65,536 to 1,024 and
   ``max_fds_in_flight_per_uid`` from 4,096 to 256 (the same 1/16).
2. leases: one connection attaching in a loop (reading its replies, closing
   the fds) held 286,144 leases in 56 s and made ``status``/``list``/``metrics``
   replies pass the 16 MiB frame cap for everyone.

Each test asserts the typed error the attacker gets, a well-behaved client of
another uid attaching within 1 s during the attack (bytes equal), and fds and
RSS back to their baseline afterwards (figures: docs/reliability.md).
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import socket
import struct
import termios
import time

import pytest

torch = pytest.importorskip("torch")

from attackers import (NOBODY, SERVICE_UID, back_to_baseline, baseline_figures, fork_as, flood,  # noqa: E402
                       ok_attach, open_socket_to_all, reap, replies, result)
from service_harness import make_config, proc_fds, record_figures  # noqa: E402
from wire_helpers import HELLO, frame, raw_connect  # noqa: E402
from checkpoints import llama_checkpoint, read_checkpoint  # noqa: E402
from weightcache import protocol  # noqa: E402
from weightcache.session import Session  # noqa: E402
from weightcache.errors import WeightcacheError  # noqa: E402

pytestmark = pytest.mark.timeout(180)

#: RLIMIT_NOFILE of the service in these tests (the unit's is 65,536): the kernel's cap on its fds in flight.
NOFILE = 1024
#: What a forked attacker keeps open (unread) until the parent kills it.
_HELD: list = []


@pytest.fixture
def ok_ck(tmp_path):
    ck = llama_checkpoint(tmp_path / "ok", seed=7)
    return ck, read_checkpoint(ck)


def _queued(socks: list[socket.socket]) -> int:
    """Bytes waiting in the receive queues of ``socks`` (``FIONREAD``)."""
    total = 0
    for s in socks:
        raw = fcntl.ioctl(s.fileno(), termios.FIONREAD, b"\0\0\0\0")
        total += struct.unpack("i", raw)[0]
    return total


def _drain(s: socket.socket, nbytes: int) -> tuple[int, list[dict]]:
    """Reads exactly ``nbytes`` from ``s``; returns the fds that came with them (closed) and the whole replies."""
    buf, fds = b"", 0
    while len(buf) < nbytes:
        data, anc, _, _ = s.recvmsg(nbytes - len(buf), socket.CMSG_SPACE(64 * 4), socket.MSG_CMSG_CLOEXEC)
        if not data:
            break
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) // 4 * 4])
                fds += len(got)
                for fd in got:
                    os.close(fd)
        buf += data
    out = []
    while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
        n = struct.unpack(">I", buf[:4])[0]
        out.append(json.loads(buf[4:4 + n]))
        buf = buf[4 + n:]
    return fds, out


def _pipeline_never_read(path: str, conns: int, attaches: int, stable_w: int, go_r: int) -> dict:
    """As the attacker: ``conns`` connections each send hello and ``attaches`` attaches, and read nothing.

    Once the service stopped answering (the receive queues stopped growing for 0.5 s, at most 30 s) every
    reply it sent is queued unread, with its fds in flight: writes ``stable_w``, waits for ``go_r``, then
    reads exactly what was queued and reports the fds that were in flight and the replies by outcome.
    """
    socks = []
    for _ in range(conns):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        socks.append(s)
    burst = frame(HELLO) + frame({"type": "attach", "model": "ok"}) * attaches
    sent = sum(flood(s, burst, len(burst)) for s in socks)
    last, stable_since, deadline = -1, time.monotonic(), time.monotonic() + 30
    while time.monotonic() < deadline:
        now = _queued(socks)
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since > 0.5:
            break
        time.sleep(0.05)
    queued = [_queued([s]) for s in socks]
    os.write(stable_w, b"s")
    os.read(go_r, 1)
    codes: dict = {}
    in_flight = 0
    for s, n in zip(socks, queued):
        s.setblocking(True)
        fds, got = _drain(s, n)
        in_flight += fds
        for o in got:
            key = o["type"] if o["type"] != "error" else f"{o['code']}:{o['details'].get('limit')}"
            codes[key] = codes.get(key, 0) + 1
    _HELD.extend(socks)  # kept open until the parent kills this process
    return {"sent_bytes": sent, "queued_bytes": sum(queued), "fds_in_flight": in_flight, "codes": codes}


def _attack(svc, conns: int, attaches: int, during) -> tuple[dict, object]:
    """Runs :func:`_pipeline_never_read` as nobody; calls ``during()`` while its fds are in flight, unread.
    Returns the attacker's report and what ``during()`` returned."""
    stable_r, stable_w = os.pipe()
    go_r, go_w = os.pipe()
    pid, r = fork_as(NOBODY, NOBODY, [], _pipeline_never_read, svc.socket_path, conns, attaches, stable_w, go_r)
    try:
        ready, _, _ = select.select([stable_r, r], [], [], 60)
        assert stable_r in ready, result(r)
        got = during()
        os.write(go_w, b"g")
        report = result(r)
    finally:
        reap(pid, r)
        for fd in (stable_r, stable_w, go_r, go_w):
            os.close(fd)
    assert "crash" not in report, report
    return report, got


def test_fds_in_flight_of_one_uid_cannot_block_other_attaches(daemon, ok_ck):
    """Attack 1. nobody opens 16 connections, pipelines 3,000 attaches on each and reads nothing. Before: the
    service (uid 64000, RLIMIT_NOFILE 1,024) sent replies until the kernel held 1,024 of its fds in nobody's
    receive queues; every later SCM_RIGHTS send failed with ETOOMANYREFS and the well-behaved attach got its
    connection closed without a reply. Now nobody's unread fds stop at max_fds_in_flight_per_uid (256): the
    replies past it are resource_exhausted without fds (and without a lease), and the well-behaved attach gets
    its bytes while the attacker's fds are still in flight."""
    ok, expected = ok_ck
    svc = daemon(make_config({"ok": ok}, max_fds_in_flight_per_uid=256), nofile=NOFILE, run_as=SERVICE_UID)
    svc.wait_settled()
    open_socket_to_all(svc)
    before = svc.snapshot()

    def during() -> tuple[int, int]:
        compared = ok_attach(svc, expected) + ok_attach(svc, expected)
        assert svc.alive()
        return compared, sum(proc_fds(svc.pid).values()) - sum(before["fds"].values())

    seen, (compared, during_fds) = _attack(svc, 16, 3000, during)
    assert seen["codes"].get("resource_exhausted:max_fds_in_flight_per_uid", 0) >= 1, seen["codes"]
    assert 0 < seen["fds_in_flight"] <= 256, seen  # never more in flight than the cap
    assert seen["fds_in_flight"] == 2 * seen["codes"]["attach_reply"], seen
    assert "resource_exhausted:kernel_fds_in_flight" not in seen["codes"], seen["codes"]
    compared += ok_attach(svc, expected)
    after = back_to_baseline(svc, before)
    record_figures("attack.fds_in_flight", "16 connections of one uid pipeline 3,000 attaches each, never read",
                   "service as uid 64000 (RLIMIT_NOFILE=1024, no CAP_SYS_ADMIN); the attacker's unread fds stop at "
                   "max_fds_in_flight_per_uid=256, later replies resource_exhausted without fds; a well-behaved "
                   "attach (another uid) within 1 s while they are in flight; fds and RSS back",
                   clients=22, faults_injected=20, bytes_compared=compared, fds_held_max=during_fds,
                   attacker_fds_in_flight_max=seen["fds_in_flight"], **baseline_figures(before, after))


def test_a_send_the_kernel_refuses_is_answered_and_logged(daemon, ok_ck):
    """Send failures never cost another client its reply. With max_fds_in_flight_per_uid and max_fds_in_flight set
    above the service's RLIMIT_NOFILE (a misconfiguration), nobody's unread fds do reach the kernel's limit: the well-behaved attach
    then gets resource_exhausted (limit kernel_fds_in_flight) as its reply instead of a closed connection, the
    failure is logged at WARNING with the peer, and once the attacker is gone the same client attaches."""
    ok, expected = ok_ck
    svc = daemon(make_config({"ok": ok}, max_fds_in_flight_per_uid=100_000, max_fds_in_flight=100_000),
                 nofile=NOFILE, run_as=SERVICE_UID)
    svc.wait_settled()
    open_socket_to_all(svc)
    before = svc.snapshot()

    def during() -> None:
        s = Session(svc.socket_path, timeout=10)
        with pytest.raises(WeightcacheError) as e:
            s.request(protocol.Attach("ok"))
        assert (e.value.code, e.value.details["limit"]) == ("resource_exhausted", "kernel_fds_in_flight")
        assert s.request(protocol.Status()).status["slabs"][0]["state"] == "ready"  # the connection stays
        s.close()

    seen, _ = _attack(svc, 16, 3000, during)
    assert seen["fds_in_flight"] >= NOFILE - 64, seen  # the kernel's limit was reached
    assert "WARNING" in svc.log() and "send failed peer_pid=" in svc.log()
    compared = ok_attach(svc, expected)
    after = back_to_baseline(svc, before)
    record_figures("attack.send_refused", "the kernel refuses SCM_RIGHTS (ETOOMANYREFS) for another client",
                   "the client gets resource_exhausted (kernel_fds_in_flight) as its reply, its connection stays, "
                   "WARNING with the peer in the log; attaches again once the attacker is gone; fds and RSS back",
                   clients=18, faults_injected=16, bytes_compared=compared, **baseline_figures(before, after))


def test_leases_are_capped_per_connection_and_per_uid(daemon, ok_ck):
    """Attack 2. Before: one connection attaching in a loop held 286,144 leases and status/list/metrics passed
    the frame cap. Now a connection holds at most max_leases_per_connection (32 here), a uid at most
    max_leases_per_uid (48 here); the attach past either is resource_exhausted naming it; status, list and
    metrics stay small (the leases are summarised), and a well-behaved attach of another uid works."""
    ok, expected = ok_ck
    svc = daemon(make_config({"ok": ok}, max_leases_per_connection=32, max_leases_per_uid=48))
    svc.wait_settled()
    open_socket_to_all(svc)
    before = svc.snapshot()
    pid, r = fork_as(NOBODY, NOBODY, [], _lease_loop, svc.socket_path, 3, 40)
    try:
        got = result(r)
        assert "crash" not in got, got
        compared = ok_attach(svc, expected)  # root: exempt from the per-uid cap, not from the per-connection one
        st = svc.status()
        slab = st["slabs"][0]
        assert slab["lease_count"] == 48 and len(slab["leases"]) == protocol.MAX_LEASES_SHOWN  # the attacker's
        assert [(h["uid"], h["pid"], h["count"]) for h in slab["lease_holders"]] == [(NOBODY, pid, 48)]
    finally:
        reap(pid, r)
    assert got["per_conn"][0] == {"ok": 32, "resource_exhausted:max_leases_per_connection": 8}, got
    assert got["per_conn"][1] == {"ok": 16, "resource_exhausted:max_leases_per_uid": 24}, got
    assert got["per_conn"][2] == {"resource_exhausted:max_leases_per_uid": 40}, got
    compared += ok_attach(svc, expected)
    after = back_to_baseline(svc, before)
    record_figures("attack.lease_flood", "one uid attaches in a loop on 3 connections, keeping every lease",
                   "32 leases per connection (max_leases_per_connection), 48 per uid (max_leases_per_uid), the rest "
                   "resource_exhausted naming the cap; status lists at most 32 leases plus counts per uid and pid; "
                   "a well-behaved attach within 1 s; fds and RSS back",
                   clients=5, faults_injected=3, bytes_compared=compared, **baseline_figures(before, after))


def _lease_loop(path: str, conns: int, attaches: int) -> dict:
    """As the attacker: ``conns`` connections in turn attach ``attaches`` times each, closing each fd, keeping
    every lease. Returns per connection the count of each outcome."""
    out, sessions = [], []
    for _ in range(conns):
        s = Session(path, timeout=10)
        sessions.append(s)
        counts: dict = {}
        for _ in range(attaches):
            try:
                s.request(protocol.Attach("ok"))
                for fd in s.last_fds:
                    os.close(fd)
                key = "ok"
            except WeightcacheError as e:
                key = f"{e.code}:{e.details.get('limit')}"
            counts[key] = counts.get(key, 0) + 1
        out.append(counts)
    _HELD.extend(sessions)
    return {"per_conn": out}


def test_status_list_and_metrics_stay_under_the_frame_cap(daemon, ok_ck):
    """Many leases (2,000 here, on 8 connections of root) make status, list and metrics carry a summary: at most
    MAX_LEASES_SHOWN leases listed, the total and the counts per uid and pid; every reply stays far under the
    16 MiB frame cap whatever the count."""
    ok, expected = ok_ck
    svc = daemon(make_config({"ok": ok}))
    svc.wait_settled()
    sessions = []
    for _ in range(8):
        s = Session(svc.socket_path, timeout=30)
        for _ in range(250):
            s.request(protocol.Attach("ok"))
            for fd in s.last_fds:
                os.close(fd)
        sessions.append(s)
    probe = raw_connect(svc.socket_path)
    probe.sendall(frame(HELLO) + frame({"type": "status"}) + frame({"type": "list"}) + frame({"type": "metrics"}))
    sizes = {}
    for _ in range(4):
        head = probe.recv(4, socket.MSG_WAITALL)
        n = struct.unpack(">I", head)[0]
        body = b""
        while len(body) < n:
            body += probe.recv(n - len(body))
        obj = __import__("json").loads(body)
        sizes[obj["type"]] = n
        if obj["type"] == "status_reply":
            slab = obj["status"]["slabs"][0]
            assert slab["lease_count"] == 2000 and len(slab["leases"]) == protocol.MAX_LEASES_SHOWN
            assert sum(h["count"] for h in slab["lease_holders"]) == 2000
    probe.close()
    assert all(n < 256 * 1024 for n in sizes.values()), sizes
    for s in sessions:
        s.close()
    ok_attach(svc, expected)
    record_figures("attack.status_size", "2,000 leases on one slab: status, list and metrics replies",
                   "at most 32 leases listed plus the total and counts per uid and pid; each reply under 256 KiB",
                   clients=10, faults_injected=0, **{f"{k}_bytes": v for k, v in sizes.items()})
