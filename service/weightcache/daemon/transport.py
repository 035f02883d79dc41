"""Sockets: the listener, one connection per client, their outboxes and backpressure.

Owns everything that touches a client socket: ``accept`` (and pausing it when
the process runs out of fds), ``SO_PEERCRED``, reads with ``MSG_CMSG_CLOEXEC``
through :mod:`weightcache.fdpass`, framing through
:class:`weightcache.protocol.Connection`, each client's outbox of frames not
yet written (with dup'ed fds), protocol violations and closing, and the
caps of :class:`~weightcache.daemon.limits.Limits`: unread replies, queued
bytes and held fds per connection (over them the next request is answered
``resource_exhausted`` and reading pauses until the client reads), bytes of
incomplete requests across all connections, connections per uid, and the
idle time of an incomplete frame (over those: ``resource_exhausted``, then
the connection is closed), connections of all uids together
(``max_connections``), and the fds in flight per uid
(``max_fds_in_flight_per_uid``, below). It decides nothing about requests:
each decoded message goes to the ``on_message`` callback; a closed connection
goes to ``on_close`` (which ends its leases).

Fd ownership: fds received from a client wait in its connection until their frame
is whole (only ``publish`` carries any; a frame that does not declare them is a
violation, and they are closed), then go with the request to ``on_message`` and
are closed when it returns (a handler keeps a dup); fds queued with a reply are
dups, closed once the kernel has them or when the client is dropped.

Fds in flight: an fd sent with ``SCM_RIGHTS`` sits in the peer's receive queue
until the peer reads it, and the kernel charges it to the *sender's* user
(the service's) and refuses every further ``SCM_RIGHTS`` send of that user
(``ETOOMANYREFS``) once they pass its ``RLIMIT_NOFILE``. So the transport
counts, per client uid, the fds it queued or sent and the peer may not have
read: a connection's count drops to zero when ``SIOCOUTQ`` says the peer has
read every byte sent (checked only when the uid is at its cap). A reply whose
fds would take the uid past ``max_fds_in_flight_per_uid`` goes out as
``resource_exhausted`` without fds (``on_unsent`` undoes its lease); a send
that fails all the same (``ETOOMANYREFS``, ``ENOMEM``...) is answered the same
way, logged at WARNING with the peer, and never closes anyone else's
connection. A dropped connection whose peer has not read its fds yet is kept
(shut down, but still counted) until the peer reads or closes them.

Forbidden imports: threading, torch, weightcache.pipeline, weightcache.memory,
weightcache.daemon.handlers, weightcache.daemon.loads, weightcache.daemon.fdstore,
weightcache.daemon.ticker, weightcache.daemon.loop.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import time
from dataclasses import dataclass
from typing import Callable

from .. import protocol
from ..errors import RemoteProtocolError, ResourceExhausted
from ..fdpass import recv_with_fds, send_some
from ..journal import event
from .clients import Client
from .limits import Limits
from .lograte import warn_peer
from .outbox import Outbox

log = logging.getLogger(__name__)

RECV_BYTES = 256 * 1024
#: Requests of one connection served in a row; then the others' turn (each loop pass gives every
#: connection with requests waiting one more turn). A connection pipelining many requests was served to
#: the end of what it had sent, so one uid's connections could hold every other engine's attach for seconds.
REQUESTS_PER_TURN = 4
#: Connections accepted in one pass of the loop before the ready connections are served (their requests,
#: their EOFs). An unbounded accept loop never ended while engines reconnected as fast as it answered them (a
#: CPU-starved node: 64 clients in an attach/close loop), and the connections they had closed piled up unread
#: until the service ran out of fds (2,577 sockets held for 64 clients; at 1,024 fds every client was dropped).
ACCEPTS_PER_PASS = 64
MAX_FDS_IN = protocol.MAX_FDS_PER_FRAME


@dataclass(frozen=True)
class Callbacks:
    """What a :class:`Transport` calls, one record so that its constructor stays short.

    Attributes:
        on_message (`callable`): ``(client, message, fds) -> None`` for each request; ``fds`` (a tuple, empty
            but for ``publish``) are the transport's, closed once the call returns: keep a dup.
        on_close (`callable`): ``(client) -> None`` once per closed connection.
        on_open (`callable`): ``(client) -> None`` once per accepted connection.
        on_unsent (`callable`, *optional*): ``(client, message) -> None`` for a
            reply whose fds were not sent (it went out as ``resource_exhausted``):
            the caller ends the lease it granted.
    """

    on_message: Callable[[Client, protocol.Message, tuple[int, ...]], None]
    on_close: Callable[[Client], None]
    on_open: Callable[[Client], None]
    on_unsent: Callable[[Client, protocol.Message], None] | None = None


class Transport:
    """The listener and the clients, multiplexed with ``selectors``.

    The send path (outboxes, fds in flight per uid) is its :attr:`outbox`, an
    :class:`~weightcache.daemon.outbox.Outbox`.

    Args:
        listener (`socket.socket`): the listening Unix stream socket.
        callbacks (`Callbacks`): what the transport calls (``on_message``, ``on_close``, ``on_open``,
            ``on_unsent``).
        limits (`Limits`, *optional*): the caps (default: :meth:`Limits.defaults`).
        clock (`callable`, *optional*): monotonic seconds (``time.monotonic``).
        trusted_uids (`frozenset[int]`, *optional*): uids exempt from
            ``max_connections_per_uid``, ``max_connections`` and
            ``max_fds_in_flight_per_uid`` (root and the service user, who may
            do everything anyway); default: root and this process's uid.
    """

    def __init__(self, listener: socket.socket, callbacks: Callbacks, limits: Limits | None = None,
                 clock: Callable[[], float] = time.monotonic, trusted_uids: frozenset[int] | None = None) -> None:
        self.limits = limits or Limits.defaults()
        self.trusted_uids = frozenset({0, os.getuid()}) if trusted_uids is None else trusted_uids
        self.clock = clock
        #: Bytes of incomplete requests held across all connections.
        self.buffered_bytes = 0
        self._resume: list[Client] = []
        #: Connections that yielded with requests still buffered, served again at the end of the next pass.
        self._turns: list[Client] = []
        self.listener = listener
        listener.setblocking(False)
        self.on_open = callbacks.on_open
        self.on_message = callbacks.on_message
        self.on_close = callbacks.on_close
        self.sel = selectors.DefaultSelector()
        self.clients: dict[int, Client] = {}
        self.stopping = False
        self._accept_paused = False
        self._readers: dict[int, Callable[[], None]] = {}
        #: The send path: outboxes, fds in flight per uid, dropped connections that linger.
        self.outbox = Outbox(self.clients, self.trusted_uids, self.drop, callbacks.on_unsent)

    def start(self) -> None:
        """Starts accepting."""
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Calls ``callback()`` whenever ``fd`` (e.g. a wake-up pipe) is readable."""
        self.sel.register(fd, selectors.EVENT_READ, "reader")
        self._readers[fd] = callback

    def poll(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds (none while a resumed client waits) and serves what became ready."""
        for key, events in self.sel.select(0 if self._resume or self._turns else timeout):
            if key.data == "listen":
                self._accept()
            elif key.data == "reader":
                self._readers[key.fd]()
            else:
                if events & selectors.EVENT_WRITE and not self.flush(key.data):
                    continue
                if events & selectors.EVENT_READ:
                    self._recv(key.data)
        while self._resume:  # clients whose replies were read: serve what they sent meanwhile
            c = self._resume.pop()
            if not c.closed:
                self._process(c)
        self._serve_turns()

    def _yield_turn(self, c: Client) -> None:
        """``c`` was served :data:`REQUESTS_PER_TURN` requests in a row and has more: the others go first. It is
        not read meanwhile (the kernel's socket buffer holds what it sends, not the service's memory)."""
        c.yielded = True
        self._turns.append(c)
        self._want(c)

    def _serve_turns(self) -> None:
        """Gives each connection that yielded at the last pass one more turn, in the order they yielded."""
        turns, self._turns = self._turns, []
        for c in dict.fromkeys(turns):
            if c.closed or not c.yielded:
                continue
            c.yielded = False
            self._want(c)
            self._process(c)

    def expire(self, now: float) -> None:
        """Closes connections whose incomplete request frame waited past ``partial_frame_timeout_s``."""
        limit = self.limits.partial_frame_timeout_s
        for c in [c for c in self.clients.values() if c.partial_since is not None and now - c.partial_since > limit]:
            self.exhausted(c, "partial_frame_timeout_s", limit, round(now - c.partial_since, 3), close=True)
        if self.outbox.lingering:
            self.outbox.settle_lingering()

    def close_all(self, reason: str) -> None:
        """Drops every client (service stopping)."""
        self.stopping = True
        for c in list(self.clients.values()):
            self.drop(c, reason)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_PASS):  # the rest wait in the backlog for the next pass
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
            c = Client.accepted(sock)
            if c is None:
                continue
            uid = c.peer.uid
            self.clients[sock.fileno()] = c
            self.sel.register(sock, selectors.EVENT_READ, c)
            self.on_open(c)
            trusted = uid in self.trusted_uids
            lingering = len(self.outbox.lingering)
            if not trusted and len(self.clients) + lingering > self.limits.max_connections:
                self.exhausted(c, "max_connections", self.limits.max_connections,
                               len(self.clients) + lingering, close=True)
                continue
            same_uid = 0 if trusted else sum(o.peer.uid == uid for o in (*self.clients.values(), *self.outbox.lingering))
            if same_uid > self.limits.max_connections_per_uid:
                self.exhausted(c, "max_connections_per_uid", self.limits.max_connections_per_uid, same_uid,
                               close=True)
                continue
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
        # Only ``publish`` carries fds (its frame declares them; the protocol matches them by count and refuses
        # any other): they wait in the connection until their frame is whole, and every path closes them.
        c.conn.receive(data, fds)
        if c.conn.held_fds > MAX_FDS_IN:  # fds piling up ahead of a frame that never declares them
            self.violation(c, RemoteProtocolError(f"{c.conn.held_fds} fds arrived ahead of one frame; a frame "
                                                  f"carries at most {MAX_FDS_IN}"))
            return
        self._process(c)

    def _process(self, c: Client) -> None:
        """Serves ``c``'s buffered requests, :data:`REQUESTS_PER_TURN` in a row, until none is left or a cap pauses it."""
        served = 0
        while not c.closed and not c.paused:
            if served == REQUESTS_PER_TURN and c.conn.buffered_bytes:
                self._yield_turn(c)
                break
            try:
                ev = c.conn.next_message()
            except RemoteProtocolError as e:
                self.violation(c, e)
                return
            if ev is protocol.NEED_DATA:
                break
            msg, fds = ev
            served += 1
            cap = c.cap_reached(self.limits)
            try:
                if cap is None:
                    self.on_message(c, msg, tuple(fds))  # a handler dups what it keeps
                else:  # answered, not dropped: the client learns which request was refused and why
                    self.exhausted(c, *cap, close=False)
            finally:
                for fd in fds:
                    os.close(fd)
        if c.closed:
            return
        # A yielded client's whole requests wait for its turn, at most one read's worth (it is not read meanwhile):
        # they do not count against max_buffered_bytes, which is about incomplete ones. The incomplete frame
        # after them, if any, does count, from the pass it yields.
        counted = c.conn.incomplete_bytes if c.yielded else c.conn.buffered_bytes
        self.buffered_bytes += counted - c.counted_bytes
        c.counted_bytes = counted
        # Its partial_frame_timeout_s runs once its turns are over: it cannot send the rest while it is not read.
        incomplete = c.conn.buffered_bytes > 0 and not c.paused and not c.yielded
        if not incomplete:
            c.partial_since = None
        elif c.partial_since is None:
            c.partial_since = self.clock()
        if (incomplete or (counted and c.yielded)) and self.buffered_bytes > self.limits.max_buffered_bytes:
            self.exhausted(c, "max_buffered_bytes", self.limits.max_buffered_bytes, self.buffered_bytes, close=True)

    def exhausted(self, c: Client, limit: str, value: float, actual: float, close: bool) -> None:
        """Answers ``c`` with ``resource_exhausted`` naming ``limit``; pauses reading, or closes when ``close``."""
        warn_peer(log, c.peer.pid, c.peer.uid,
                  "rejected request peer_pid=%d peer_uid=%d code=resource_exhausted limit=%s value=%s actual=%s",
                  c.peer.pid, c.peer.uid, limit, value, actual,
                  extra=event("rejected", error_code="resource_exhausted", peer_uid=c.peer.uid, limit=limit))
        err = protocol.Error.from_exc(ResourceExhausted(
            f"{'connection closed' if close else 'request refused'}: service.{limit} = {value} reached "
            f"(this client is at {actual}); read your replies, close idle connections, or ask the operator "
            f"to raise service.{limit}", limit=limit, value=value, actual=actual))
        if close:
            if not c.outbox and not c.closed:  # best effort, and never in the middle of a half-sent frame
                with contextlib.suppress(OSError):
                    send_some(c.sock, protocol.encode(err))
            self.drop(c, f"{limit} reached")
            return
        c.paused = True
        self._want(c)
        self.send(c, err)

    def violation(self, c: Client, e: RemoteProtocolError) -> None:
        """Answers a protocol violation with its error (best effort) and closes the connection."""
        warn_peer(log, c.peer.pid, c.peer.uid, "rejected frame peer_pid=%d peer_uid=%d code=%s error=%s",
                  c.peer.pid, c.peer.uid, e.code, e.message, extra=event("rejected", error_code=e.code))
        for fd in c.conn.take_all_fds():
            os.close(fd)
        if not c.outbox and not c.closed:  # best effort, and never in the middle of a half-sent frame
            with contextlib.suppress(OSError):
                send_some(c.sock, protocol.encode(protocol.Error.from_exc(e)))
        self.drop(c, "protocol violation")

    def send(self, c: Client, msg: protocol.Message, fds: tuple[int, ...] | list[int] = ()) -> bool:
        """Queues ``msg`` (and dups of ``fds``) in the client's outbox and writes what the socket takes
        (:meth:`Outbox.send <weightcache.daemon.outbox.Outbox.send>`). Returns False if the client was dropped."""
        return self._written(c, self.outbox.send(c, msg, fds, self.limits))

    def flush(self, c: Client) -> bool:
        """Writes ``c``'s queued frames until the socket would block; returns False if the client was dropped."""
        return self._written(c, self.outbox.flush(c))

    def _written(self, c: Client, sent: bool) -> bool:
        """After a write to ``c`` (``sent``: not dropped): a client paused by a cap it no longer reaches is served
        again, and its selector wants what it needs now."""
        if sent:
            if c.paused and not c.held and c.cap_reached(self.limits) is None:
                c.paused = False
                self._resume.append(c)  # served by poll(), never from inside a handler's send
            self._want(c)
        return sent

    def hold(self, c: Client) -> None:
        """Stops serving ``c``'s requests until :meth:`release` (one of them runs off the loop)."""
        c.held = c.paused = True
        self._want(c)

    def release(self, c: Client) -> None:
        """Serves ``c`` again after :meth:`hold` (unless a cap still holds it)."""
        if c.closed:
            return
        c.held = False
        if c.cap_reached(self.limits) is None:
            c.paused = False
            self._resume.append(c)
        self._want(c)

    def _want(self, c: Client) -> None:
        """Registers ``c`` for what it needs: reading unless paused, writing while its outbox holds frames."""
        want = (0 if c.paused or c.yielded else selectors.EVENT_READ) | (selectors.EVENT_WRITE if c.outbox else 0)
        try:
            if not want:
                self.sel.unregister(c.sock)
                return
            if c.sock.fileno() not in self.sel.get_map():
                self.sel.register(c.sock, want, c)
                return
            if self.sel.get_key(c.sock).events != want:
                self.sel.modify(c.sock, want, c)
        except (KeyError, ValueError):
            pass

    def drop(self, c: Client, reason: str) -> None:
        """Closes a connection: its unsent frames and fds go, ``on_close`` ends its leases."""
        if c.closed:
            return
        c.closed = True
        for fd in c.conn.take_all_fds():
            os.close(fd)
        self.outbox.discard(c)
        self.buffered_bytes -= c.counted_bytes
        c.counted_bytes = 0
        self.on_close(c)
        try:
            self.sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        self.clients.pop(c.sock.fileno(), None)
        self.outbox.retire(c)  # the peer may still hold our fds unread: counted until it reads or closes them
        if self._accept_paused and not self.stopping:
            self._accept_paused = False
            self.sel.register(self.listener, selectors.EVENT_READ, "listen")
            log.info("accept resumed clients=%d", len(self.clients))
        log.debug("connection closed peer_pid=%d reason=%s", c.peer.pid, reason)

