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

Fd ownership: fds received from a client are closed at once (requests carry
none); fds queued with a reply are dups, closed once the kernel has them or
when the client is dropped.

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

import collections
import contextlib
import errno
import logging
import os
import selectors
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Callable

from .. import protocol
from ..errors import RemoteProtocolError, ResourceExhausted
from ..fdpass import recv_with_fds, send_some
from ..journal import event
from .limits import MAX_REQUEST_BYTES, Limits
from .lograte import warn_peer
from .outbox import Outbox, unread_bytes
from .state import Peer

log = logging.getLogger(__name__)

RECV_BYTES = 256 * 1024
#: Requests of one connection served in a row; then the others' turn (each loop pass gives every
#: connection with requests waiting one more turn). A connection pipelining many requests was served to
#: the end of what it had sent, so one uid's connections could hold every other engine's attach for seconds.
REQUESTS_PER_TURN = 4
MAX_FDS_IN = protocol.MAX_FDS_PER_FRAME
#: ``SO_PEERGROUPS`` (Linux >= 4.13, asm-generic/socket.h); Python 3.11's socket module lacks the name.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
#: Room for the peer's supplementary groups (NGROUPS_MAX is 65536 gids of 4 bytes).
_PEERGROUPS_BYTES = 65536 * 4


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the peer, from ``SO_PEERCRED``."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """The peer's supplementary gids at ``connect()``, from ``SO_PEERGROUPS`` (what the kernel checked).

    These are the groups the peer process really holds (``docker --group-add``,
    Kubernetes ``supplementalGroups``, a group dropped with ``setgroups``),
    not what ``/etc/group`` lists for its user name. Python's ``getsockopt``
    takes at most 1024 bytes (256 groups); a peer with more is asked again
    through libc with room for ``NGROUPS_MAX``.
    """
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)
    except OSError as e:
        if e.errno != errno.ERANGE:
            raise
        raw = _peergroups_libc(sock.fileno())
    return struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])


def _peergroups_libc(fd: int) -> bytes:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(_PEERGROUPS_BYTES)
    n = ctypes.c_uint32(_PEERGROUPS_BYTES)
    if libc.getsockopt(fd, socket.SOL_SOCKET, SO_PEERGROUPS, buf, ctypes.byref(n)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return buf.raw[: n.value]


@dataclass(eq=False)
class Client:
    """One accepted connection: socket, protocol state, the state's :class:`Peer`, and the outbox.

    ``outbox`` holds ``[memoryview of bytes not yet written, dup'ed fds to
    attach to their first byte]`` per frame; ``outbox_bytes`` and
    ``outbox_fds`` their totals. ``paused``: reading stopped until the client
    reads its replies (a cap of :class:`Limits` was reached).
    ``partial_since``: ``time.monotonic()`` at which an incomplete request
    frame started to wait, else None. ``yielded``: it was served
    :data:`REQUESTS_PER_TURN` requests in a row and has more buffered; reading
    stops until its next turn (:meth:`Transport.poll`).
    """

    sock: socket.socket
    conn: protocol.Connection
    peer: Peer
    closed: bool = False
    outbox: collections.deque = field(default_factory=collections.deque)
    outbox_bytes: int = 0
    outbox_fds: int = 0
    paused: bool = False
    partial_since: float | None = None
    #: This client's share of :attr:`Transport.buffered_bytes`.
    counted_bytes: int = 0
    #: Reading stopped while a request of it runs off the loop (``verify``): see :meth:`Transport.hold`.
    held: bool = False
    yielded: bool = False
    #: Fds handed to the kernel on this connection since the peer was last seen to have read everything.
    inflight_fds: int = 0

    @classmethod
    def accepted(cls, sock: socket.socket) -> "Client | None":
        """The client of a socket just accepted (made non-inheritable and non-blocking, its peer's credentials
        read); None, with ``sock`` closed, when the credentials cannot be read (the peer is gone)."""
        sock.set_inheritable(False)
        try:
            pid, uid, gid = peer_credentials(sock)
            groups = peer_groups(sock)
        except OSError:
            sock.close()
            return None
        sock.setblocking(False)  # replies queue in the client's outbox; a slow reader blocks no one
        return cls(sock, protocol.Connection(protocol.SERVER, MAX_REQUEST_BYTES), Peer(pid, uid, gid, groups=groups))

    def cap_reached(self, lim: Limits) -> tuple[str, int, int] | None:
        """The first per-connection cap of ``lim`` this client has reached: ``(limit, value, actual)``, else None."""
        waiting = len(self.peer.waiting)
        parked_fds = waiting * protocol.AttachReply.FD_COUNT  # what the parked attaches will hold when answered
        for name, value, actual in (("max_unread_replies", lim.max_unread_replies, len(self.outbox) + waiting),
                                    ("max_queued_bytes", lim.max_queued_bytes, self.outbox_bytes),
                                    ("max_held_fds", lim.max_held_fds, self.outbox_fds + parked_fds)):
            if actual >= value:
                return name, value, actual
        return None



@dataclass(frozen=True)
class Callbacks:
    """What a :class:`Transport` calls, one record so that its constructor stays short.

    Attributes:
        on_message (`callable`): ``(client, message) -> None`` for each request.
        on_close (`callable`): ``(client) -> None`` once per closed connection.
        on_open (`callable`): ``(client) -> None`` once per accepted connection.
        on_unsent (`callable`, *optional*): ``(client, message) -> None`` for a
            reply whose fds were not sent (it went out as ``resource_exhausted``):
            the caller ends the lease it granted.
    """

    on_message: Callable[[Client, protocol.Message], None]
    on_close: Callable[[Client], None]
    on_open: Callable[[Client], None]
    on_unsent: Callable[[Client, protocol.Message], None] | None = None


class Transport(Outbox):
    """The listener and the clients, multiplexed with ``selectors``.

    The send path (outboxes, fds in flight per uid) is :class:`~weightcache.daemon.outbox.Outbox`'s.

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
        self.on_unsent = callbacks.on_unsent
        #: uid -> fds queued or sent to its connections that the peer may not have read.
        self.fds_in_flight: collections.Counter = collections.Counter()
        #: Dropped connections whose peer still has fds of ours to read (counted in fds_in_flight).
        self.lingering: list[Client] = []
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
        if self.lingering:
            self._settle_lingering()

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
            c = Client.accepted(sock)
            if c is None:
                continue
            uid = c.peer.uid
            self.clients[sock.fileno()] = c
            self.sel.register(sock, selectors.EVENT_READ, c)
            self.on_open(c)
            trusted = uid in self.trusted_uids
            if not trusted and len(self.clients) + len(self.lingering) > self.limits.max_connections:
                self.exhausted(c, "max_connections", self.limits.max_connections,
                               len(self.clients) + len(self.lingering), close=True)
                continue
            same_uid = 0 if trusted else sum(o.peer.uid == uid for o in (*self.clients.values(), *self.lingering))
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
        if fds:
            for fd in fds:
                os.close(fd)
            self.violation(c, RemoteProtocolError("requests carry no fds; fds sent to the service are refused"))
            return
        c.conn.receive(data)
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
            msg, _ = ev  # no fds: _recv refused any before they reached the protocol
            served += 1
            cap = c.cap_reached(self.limits)
            if cap is None:
                self.on_message(c, msg)
            else:  # answered, not dropped: the client learns which request was refused and why
                self.exhausted(c, *cap, close=False)
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
        for _, fds, _ in c.outbox:
            for fd in fds:
                os.close(fd)
        if c.outbox_fds:
            self._forget(c.peer.uid, c.outbox_fds)
        c.outbox.clear()
        c.outbox_bytes = c.outbox_fds = 0
        self.buffered_bytes -= c.counted_bytes
        c.counted_bytes = 0
        self.on_close(c)
        try:
            self.sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        self.clients.pop(c.sock.fileno(), None)
        lingers = False
        if c.inflight_fds:  # the peer may still hold our fds unread: keep counting them until it reads or closes
            try:
                lingers = unread_bytes(c.sock) > 0
            except OSError:
                lingers = False
        if lingers:
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RDWR)
            self.lingering.append(c)
        else:
            if c.inflight_fds:
                self._forget(c.peer.uid, c.inflight_fds)
            c.inflight_fds = 0
            c.sock.close()
        if self._accept_paused and not self.stopping:
            self._accept_paused = False
            self.sel.register(self.listener, selectors.EVENT_READ, "listen")
            log.info("accept resumed clients=%d", len(self.clients))
        log.debug("connection closed peer_pid=%d reason=%s", c.peer.pid, reason)

