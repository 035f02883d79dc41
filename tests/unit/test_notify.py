"""notify.py: the datagram systemd receives, through systemd-python and through the fallback.

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

BACKENDS = ["fallback"] + (["systemd-python"] if notify._sd_daemon is not None else [])


@pytest.fixture(params=BACKENDS)
def manager(request, tmp_path, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setattr(notify, "_sd_daemon", None)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_send_error_is_false_not_raised(backend, tmp_path, monkeypatch):
    if backend == "fallback":
        monkeypatch.setattr(notify, "_sd_daemon", None)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens.sock"))
    assert notify.notify("WATCHDOG=1") is False


def test_round_up_and_ceil_div():
    assert [round_up(n, 4) for n in (0, 1, 3, 4, 5, 8)] == [0, 4, 4, 4, 8, 8]
    assert [ceil_div(n, 4) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]


def test_blake2b_hex_lengths_are_the_names_in_use():
    assert len(blake2b_hex(b"x")) == 32 and len(blake2b_hex(b"x", digest_size=8)) == 16
    assert blake2b_hex(b"") == "cae66941d9efbd404e4d88758ea67670"
