"""Connecting to a service socket path that exists but is not a socket.

A regular file or a directory at ``<socket dir>/<N>.sock`` refuses the connection (``ECONNREFUSED``) like a
socket left behind by a stopped service, and the error said only ``Connection refused``: nothing told a user
whose ``socket_dir`` points at the wrong directory (or whose script wrote a file there) what is at the path.
"""

from __future__ import annotations

import socket

import pytest

from weightcache.errors import DaemonUnavailable
from weightcache.session import Session


@pytest.mark.parametrize("kind", ["a regular file", "a directory"])
def test_a_path_that_is_not_a_socket_says_what_it_is(tmp_path, kind):
    path = tmp_path / "0.sock"
    if kind == "a directory":
        path.mkdir()
    else:
        path.write_bytes(b"")
    with pytest.raises(DaemonUnavailable) as e:
        Session(str(path), timeout=5)
    assert e.value.code == "daemon_unavailable" and e.value.retryable
    assert e.value.details == {"socket": str(path), "file_type": kind}
    assert e.value.message.startswith(f"no weightcache service at {path}: it is {kind}, not a socket; ")


def test_a_socket_nobody_listens_on_is_still_connection_refused(tmp_path):
    path = tmp_path / "0.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))  # bound, never listening: what a killed service leaves
    try:
        with pytest.raises(DaemonUnavailable) as e:
            Session(str(path), timeout=5)
    finally:
        s.close()
    assert e.value.details == {"socket": str(path)}
    assert e.value.message == f"no weightcache service at {path}: Connection refused"
