"""notify.py: the datagram systemd receives, and a manager that does not read its socket.

A real ``AF_UNIX`` datagram socket stands in for ``$NOTIFY_SOCKET``; an fd passed with
``FDSTORE=1`` must arrive as an fd of the same pipe (bytes written through it are read
from the original end).
"""

from __future__ import annotations

import os
import socket

import pytest

from weightcache import notify
from weightcache.hashes import blake2b_hex
from weightcache.sizes import ceil_div, round_up

@pytest.fixture
def manager(tmp_path, monkeypatch):
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        s.settimeout(10)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield s


def test_state_arrives(manager):
    assert notify.notify("READY=1\nSTATUS=ready") is True
    assert manager.recv(4096) == b"READY=1\nSTATUS=ready"


def test_fd_arrives_as_the_same_pipe(manager):
    r, w = os.pipe()
    try:
        assert notify.notify("FDSTORE=1\nFDNAME=slab-0123", [r]) is True
        msg, fds, _, _ = socket.recv_fds(manager, 4096, 4)
        assert msg == b"FDSTORE=1\nFDNAME=slab-0123" and len(fds) == 1
        os.write(w, b"weights")
        assert os.read(fds[0], 16) == b"weights"
        os.close(fds[0])
    finally:
        os.close(r)
        os.close(w)


def test_no_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.notify("READY=1") is False


def test_send_error_is_false_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens.sock"))
    assert notify.notify("WATCHDOG=1") is False


#: Run in a child (a send that blocks holds the GIL in libsystemd: nothing in the process, pytest's timeout
#: included, would run again): argv[2] STATUS notifications and an FDSTORE to a socket nobody reads, each result,
#: what was dropped.
_UNREAD = """
import json, logging, os, socket, sys
logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(message)s")
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
os.environ["NOTIFY_SOCKET"] = sys.argv[1]
from weightcache import notify
r, w = os.pipe()
n = int(sys.argv[2])
sent = [notify.notify(f"STATUS=step {i}") for i in range(n)] + [notify.notify("FDSTORE=1\\nFDNAME=slab-x", [r])]
print(json.dumps({"sent": sent, "dropped": dict(notify.dropped)}))
"""


def test_a_manager_that_does_not_read_never_blocks_the_service(tmp_path):
    """Follow-up of issue 38: the service blocked in sd_notify (libsystemd's blocking send, the GIL held) once
    the notify socket held ``net.unix.max_dgram_qlen`` unread datagrams. Now the send never blocks: the
    datagrams past the queue's room are dropped, counted by their first key and logged (once per period)."""
    import json
    import subprocess
    import sys

    with open("/proc/sys/net/unix/max_dgram_qlen") as f:
        qlen = int(f.read())
    n = qlen + 10  # STATUS datagrams: more than the queue holds
    out = subprocess.run([sys.executable, "-c", _UNREAD, str(tmp_path / "unread.sock"), str(n)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                         check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    accepted = got["sent"].count(True)
    assert 1 <= accepted <= qlen + 1 and got["sent"] == [True] * accepted + [False] * (n + 1 - accepted), got
    assert got["dropped"] == {"STATUS": n - accepted, "FDSTORE": 1}, got
    warnings = [line for line in out.stderr.splitlines() if "notify dropped" in line]
    assert len(warnings) == 1 and "dropped_total=1" in warnings[0] and "the manager's socket is full" in warnings[0], \
        out.stderr


def test_round_up_and_ceil_div():
    assert [round_up(n, 4) for n in (0, 1, 3, 4, 5, 8)] == [0, 4, 4, 4, 8, 8]
    assert [ceil_div(n, 4) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]


def test_blake2b_hex_lengths_are_the_names_in_use():
    assert len(blake2b_hex(b"x")) == 32 and len(blake2b_hex(b"x", digest_size=8)) == 16
    assert blake2b_hex(b"") == "cae66941d9efbd404e4d88758ea67670"
