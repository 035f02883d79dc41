"""``fdpass``: one ``recvmsg`` with ``SCM_RIGHTS`` (close-on-exec fds), truncated control data refused."""

from __future__ import annotations

import os
import socket

import pytest

from weightcache.errors import RemoteProtocolError
from weightcache.fdpass import recv_with_fds, send_some


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_fds_travel_with_the_bytes_close_on_exec(pair, tmp_path):
    a, b = pair
    f = tmp_path / "f"
    f.write_bytes(b"slab")
    fd = os.open(f, os.O_RDONLY)
    try:
        assert send_some(a, b"hello", [fd]) == 5
    finally:
        os.close(fd)
    data, fds = recv_with_fds(b, 64, 4)
    try:
        assert data == b"hello" and len(fds) == 1
        assert os.pread(fds[0], 4, 0) == b"slab"
        assert not os.get_inheritable(fds[0])
    finally:
        for x in fds:
            os.close(x)


def test_more_fds_than_the_buffer_holds_is_a_protocol_violation(pair, tmp_path):
    a, b = pair
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(3)]
    try:
        send_some(a, b"x", fds)
    finally:
        for x in fds:
            os.close(x)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(RemoteProtocolError) as e:
        recv_with_fds(b, 64, 1)
    assert "truncated" in e.value.message
    assert len(os.listdir("/proc/self/fd")) == before  # what did arrive was closed


def test_extra_flags_are_passed_on(pair):
    """The daemon's non-blocking read (``socket.MSG_DONTWAIT``, an ``IntFlag``) on an empty socket."""
    with pytest.raises(BlockingIOError):
        recv_with_fds(pair[1], 64, 1, socket.MSG_DONTWAIT)


def test_eof_is_empty(pair):
    a, b = pair
    a.shutdown(socket.SHUT_WR)
    assert recv_with_fds(b, 64, 1) == (b"", [])
