"""One accepted connection: :class:`Client` (socket, protocol state, peer, outbox), and the peer's credentials.

Owns :class:`Client`, the record that :mod:`weightcache.daemon.transport`
(reading, caps, closing) and :mod:`weightcache.daemon.outbox` (the send path)
both work on, and reading the peer's identity from the socket:
:func:`peer_credentials` (``SO_PEERCRED``) and :func:`peer_groups`
(``SO_PEERGROUPS``, the supplementary groups the peer really holds).

Forbidden imports: threading, torch, weightcache.pipeline, weightcache.memory,
weightcache.daemon.transport, weightcache.daemon.outbox, weightcache.daemon.handlers,
weightcache.daemon.loads, weightcache.daemon.fdstore, weightcache.daemon.ticker, weightcache.daemon.loop.
"""

from __future__ import annotations

import collections
import errno
import os
import socket
import struct
from dataclasses import dataclass, field

from .. import protocol
from .limits import MAX_REQUEST_BYTES, Limits
from .state import Peer

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
    import ctypes  # only for a peer with more than 256 groups

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
    :data:`~weightcache.daemon.transport.REQUESTS_PER_TURN` requests in a row and has more buffered; reading
    stops until its next turn (:meth:`~weightcache.daemon.transport.Transport.poll`).
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
    #: This client's share of :attr:`~weightcache.daemon.transport.Transport.buffered_bytes`.
    counted_bytes: int = 0
    #: Reading stopped while a request of it runs off the loop (``verify``): see
    #: :meth:`~weightcache.daemon.transport.Transport.hold`.
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
