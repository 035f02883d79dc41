"""Sockets: the listener, one connection per client, their outboxes and backpressure.

Owns everything that touches a client socket: ``accept`` (and pausing it when
the process runs out of fds), ``SO_PEERCRED``, reads with ``MSG_CMSG_CLOEXEC``
through :mod:`weightcache.fdpass`, framing through
:class:`weightcache.protocol.Connection`, each client's outbox of frames not
yet written (with dup'ed fds), the cap on unread replies
(:data:`MAX_OUTBOX_BYTES`), protocol violations and closing. It decides
nothing about requests: each decoded message goes to the ``on_message``
callback; a closed connection goes to ``on_close`` (which ends its leases).
Per-connection caps (held fds, partial-frame idle time, connections per uid)
belong here.

Fd ownership: fds received from a client are closed at once (requests carry
none); fds queued with a reply are dups, closed once the kernel has them or
when the client is dropped.

Forbidden imports: threading, torch, weightcache.pipeline, weightcache.memory,
weightcache.daemon.handlers, weightcache.daemon.loads, weightcache.daemon.fdstore,
weightcache.daemon.ticker, weightcache.daemon.loop.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import selectors
import socket
import struct
from dataclasses import dataclass, field
from typing import Callable

from .. import protocol
from ..errors import RemoteProtocolError, WeightcacheError
from ..fdpass import recv_with_fds, send_some
from ..journal import event
from .state import Peer

log = logging.getLogger(__name__)

RECV_BYTES = 256 * 1024
#: A client whose unread replies exceed this is dropped (its leases end).
MAX_OUTBOX_BYTES = 64 * 1024 * 1024
MAX_FDS_IN = protocol.MAX_FDS_PER_FRAME


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the peer, from ``SO_PEERCRED``."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


@dataclass(eq=False)
class Client:
    """One accepted connection: socket, protocol state, the state's :class:`Peer`, and the outbox.

    ``outbox`` holds ``[memoryview of bytes not yet written, dup'ed fds to
    attach to their first byte]`` per frame; ``outbox_bytes`` their total.
    """

    sock: socket.socket
    conn: protocol.Connection
    peer: Peer
    closed: bool = False
    outbox: collections.deque = field(default_factory=collections.deque)
    outbox_bytes: int = 0


class Transport:
    """The listener and the clients, multiplexed with ``selectors``.

    Args:
        listener (`socket.socket`): the listening Unix stream socket.
        on_message (`callable`): ``(client, message) -> None`` for each request.
        on_close (`callable`): ``(client) -> None`` once per closed connection.
        on_open (`callable`): ``(client) -> None`` once per accepted connection.
    """

    def __init__(self, listener: socket.socket, on_message: Callable[[Client, protocol.Message], None],
                 on_close: Callable[[Client], None], on_open: Callable[[Client], None]) -> None:
        self.listener = listener
        listener.setblocking(False)
        self.on_open = on_open
        self.on_message = on_message
        self.on_close = on_close
        self.sel = selectors.DefaultSelector()
        self.clients: dict[int, Client] = {}
        self.stopping = False
        self._accept_paused = False
        self._readers: dict[int, Callable[[], None]] = {}

    def start(self) -> None:
        """Starts accepting."""
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Calls ``callback()`` whenever ``fd`` (e.g. a wake-up pipe) is readable."""
        self.sel.register(fd, selectors.EVENT_READ, "reader")
        self._readers[fd] = callback

    def poll(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds and serves what became ready."""
        for key, events in self.sel.select(timeout):
            if key.data == "listen":
                self._accept()
            elif key.data == "reader":
                self._readers[key.fd]()
            else:
                if events & selectors.EVENT_WRITE and not self.flush(key.data):
                    continue
                if events & selectors.EVENT_READ:
                    self._recv(key.data)

    def close_all(self, reason: str) -> None:
        """Drops every client (service stopping)."""
        self.stopping = True
        for c in list(self.clients.values()):
            self.drop(c, reason)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                # Out of fds: leave new connections in the backlog until a client leaves
                # (re-armed in drop), rather than spinning on a readable listener or dying.
                log.warning("accept paused clients=%d error=%s", len(self.clients), e.strerror)
                self.sel.unregister(self.listener)
                self._accept_paused = True
                return
            sock.set_inheritable(False)
            try:
                pid, uid, gid = peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            sock.setblocking(False)  # replies queue in the client's outbox; a slow reader blocks no one
            c = Client(sock, protocol.Connection(protocol.SERVER), Peer(pid, uid, gid))
            self.clients[sock.fileno()] = c
            self.sel.register(sock, selectors.EVENT_READ, c)
            self.on_open(c)
            # A client writes its hello (and attach) right after connect: answer now rather than
            # one loop pass later (nothing is read if nothing arrived yet).
            self._recv(c)

    def _recv(self, c: Client) -> None:
        try:
            data, fds = recv_with_fds(c.sock, RECV_BYTES, MAX_FDS_IN, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except RemoteProtocolError as e:
            self.violation(c, e)
            return
        except OSError:
            self.drop(c, "recv failed")
            return
        if not data and not fds:
            self.drop(c, "peer closed")
            return
        if fds:
            for fd in fds:
                os.close(fd)
            self.violation(c, RemoteProtocolError("requests carry no fds; fds sent to the service are refused"))
            return
        c.conn.receive(data)
        while not c.closed:
            try:
                ev = c.conn.next_message()
            except RemoteProtocolError as e:
                self.violation(c, e)
                return
            if ev is protocol.NEED_DATA:
                return
            msg, _ = ev  # no fds: _recv refused any before they reached the protocol
            self.on_message(c, msg)

    def violation(self, c: Client, e: RemoteProtocolError) -> None:
        """Answers a protocol violation with its error (best effort) and closes the connection."""
        log.warning("rejected frame peer_pid=%d code=%s error=%s", c.peer.pid, e.code, e.message,
                    extra=event("rejected", error_code=e.code))
        for fd in c.conn.take_all_fds():
            os.close(fd)
        if not c.outbox and not c.closed:  # best effort, and never in the middle of a half-sent frame
            with contextlib.suppress(OSError):
                send_some(c.sock, protocol.encode(protocol.Error.from_exc(e)))
        self.drop(c, "protocol violation")

    def send(self, c: Client, msg: protocol.Message, fds: tuple[int, ...] | list[int] = ()) -> bool:
        """Queues ``msg`` (and dups of ``fds``) in the client's outbox and writes what the socket takes.

        A client that does not read its replies only fills its own outbox; past
        :data:`MAX_OUTBOX_BYTES` it is dropped. Returns False if the client was dropped.
        """
        if c.closed:
            return False
        try:
            data, fds = c.conn.send(msg, fds)
        except WeightcacheError as e:
            self.drop(c, f"send failed: {e}")
            return False
        c.outbox.append([memoryview(data), [os.dup(fd) for fd in fds]])
        c.outbox_bytes += len(data)
        if c.outbox_bytes > MAX_OUTBOX_BYTES:
            log.warning("dropped client peer_pid=%d reason=not-reading-replies queued_bytes=%d", c.peer.pid,
                        c.outbox_bytes, extra=event("rejected", size_bytes=c.outbox_bytes))
            self.drop(c, "outbox full")
            return False
        return self.flush(c)

    def flush(self, c: Client) -> bool:
        """Writes queued frames until the socket would block; returns False if the client was dropped."""
        while c.outbox:
            data, fds = c.outbox[0]
            try:
                n = send_some(c.sock, data, fds)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self.drop(c, f"send failed: {e}")
                return False
            for fd in fds:  # the kernel has its own references now
                os.close(fd)
            c.outbox_bytes -= n
            if n < len(data):
                c.outbox[0] = [data[n:], []]
                break
            c.outbox.popleft()
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if c.outbox else 0)
        try:
            if self.sel.get_key(c.sock).events != want:
                self.sel.modify(c.sock, want, c)
        except (KeyError, ValueError):
            pass
        return True

    def drop(self, c: Client, reason: str) -> None:
        """Closes a connection: its unsent frames and fds go, ``on_close`` ends its leases."""
        if c.closed:
            return
        c.closed = True
        for fd in c.conn.take_all_fds():
            os.close(fd)
        for _, fds in c.outbox:
            for fd in fds:
                os.close(fd)
        c.outbox.clear()
        c.outbox_bytes = 0
        self.on_close(c)
        try:
            self.sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        self.clients.pop(c.sock.fileno(), None)
        c.sock.close()
        if self._accept_paused and not self.stopping:
            self._accept_paused = False
            self.sel.register(self.listener, selectors.EVENT_READ, "listen")
            log.info("accept resumed clients=%d", len(self.clients))
        log.debug("connection closed peer_pid=%d reason=%s", c.peer.pid, reason)
