"""File descriptors over Unix sockets (``SCM_RIGHTS``), for the daemon and the client.

Receives use ``MSG_CMSG_CLOEXEC`` and treat ``MSG_CTRUNC`` (more fds than the
control buffer holds) as a protocol violation, closing whatever did arrive.
The caller owns every fd returned.
"""

from __future__ import annotations

import array
import os
import socket

from .errors import RemoteProtocolError

# Plain ints: ``socket.MSG_*`` are ``IntFlag`` members, and ``|``/``&`` on them run the enum module's Python code
# (about 2 µs a call, 20-30 µs the first time in a process, as in an engine's first attach).
_RECV_FLAGS = int(socket.MSG_CMSG_CLOEXEC)
_CTRUNC = int(socket.MSG_CTRUNC)
_SEND_FLAGS = int(socket.MSG_DONTWAIT) | int(socket.MSG_NOSIGNAL)


def recv_with_fds(sock: socket.socket, bufsize: int, max_fds: int, flags: int = 0) -> tuple[bytes, list[int]]:
    """One ``recvmsg``: returns ``(data, fds)``; ``(b"", [])`` at EOF.

    Raises:
        RemoteProtocolError (`protocol_violation`): the control data was
            truncated (the received fds are closed first).
        OSError: from ``recvmsg`` (``BlockingIOError``, timeouts...).
    """
    data, anc, msg_flags, _ = sock.recvmsg(bufsize, socket.CMSG_SPACE(max_fds * 4), _RECV_FLAGS | int(flags))
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            fds.extend(arr)
    if msg_flags & _CTRUNC:
        for fd in fds:
            os.close(fd)
        raise RemoteProtocolError(f"control data truncated: more than {max_fds} fds arrived with one read")
    return data, fds


def send_some(sock: socket.socket, data: bytes | memoryview, fds: list[int] | tuple[int, ...] = ()) -> int:
    """One non-blocking ``sendmsg``; ``fds`` travel with the first byte. Returns the bytes written.

    Raises:
        BlockingIOError: the socket buffer is full (nothing was written).
        OSError: the peer is gone (``MSG_NOSIGNAL``: no SIGPIPE).
    """
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    return sock.sendmsg([data], anc, _SEND_FLAGS)
