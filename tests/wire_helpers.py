"""Helpers that speak the wire by hand: a raw connection, a frame, a reply read with its fds.

For the tests that send what no client would (fuzzing, attacks, malformed frames) and must see the
service's reply frame as it is. The frame format is docs/protocol.md's: a 4-byte big-endian length,
then UTF-8 JSON (and, in replies, an optional NUL byte and a binary payload).
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import weakref
from typing import Any


def raw_connect(socket_path: str, timeout: float = 10.0) -> socket.socket:
    """A connected Unix stream socket, no ``hello`` sent."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(timeout)
    s.connect(socket_path)
    return s


def frame(obj: Any) -> bytes:
    """A frame: 4-byte big-endian length + JSON (``obj`` may already be bytes)."""
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


_UNREAD: "weakref.WeakKeyDictionary[socket.socket, bytes]" = weakref.WeakKeyDictionary()


def read_reply(s: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """Reads one frame; returns ``(json, fds)``, or ``(None, fds)`` on EOF/reset.

    A binary payload (after the JSON and a NUL byte) is returned under ``"payload"``.
    Bytes of later frames that arrived with this one are kept for the next call
    on the same socket (pipelined requests get their replies back to back).
    """
    buf, fds = _UNREAD.pop(s, b""), []
    try:
        while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", buf[:4])[0]:
            data, anc, _, _ = s.recvmsg(1 << 20, socket.CMSG_SPACE(8 * 4), socket.MSG_CMSG_CLOEXEC)
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += list(struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) // 4 * 4]))
            if not data:
                return None, fds
            buf += data
    except (ConnectionResetError, BrokenPipeError):
        return None, fds
    n = struct.unpack(">I", buf[:4])[0]
    if len(buf) > 4 + n:
        _UNREAD[s] = buf[4 + n:]
    body, nul, payload = buf[4: 4 + n].partition(b"\x00")
    obj = json.loads(body)
    if nul:
        obj["payload"] = payload
    return obj, fds


HELLO = {"type": "hello", "protocol_version": 3, "client": "tests"}

# A client that sends hello + attach and then never reads (nor takes the fd): the test SIGKILLs it.
_DOOMED_CLIENT = r"""
import json, socket, struct, sys, time
path, model, wait_ms = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
def send(o):
    b = json.dumps(o).encode()
    s.sendall(struct.pack(">I", len(b)) + b)
send({"type": "hello", "protocol_version": 3, "client": "doomed"})
n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
s.recv(n, socket.MSG_WAITALL)
send({"type": "attach", "model": model, "wait_ms": wait_ms})
print("sent", flush=True)
time.sleep(3600)
"""


def doomed_client(svc: Any, model: str, wait_ms: int) -> subprocess.Popen:
    """Starts a raw client that sends ``hello`` and ``attach(model, wait_ms)``, then never reads.

    Returns once the attach is on the wire; the caller kills it (``SIGKILL``) and reaps it.
    """
    p = subprocess.Popen([sys.executable, "-c", _DOOMED_CLIENT, svc.socket_path, model, str(wait_ms)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "sent"
    return p
