"""The send path of the transport: each client's outbox, and the fds in flight per uid.

Owns :class:`Outbox`, the object that :class:`~weightcache.daemon.transport.Transport`
holds to queue replies (with dups of their fds), write what each socket takes,
and count the fds the kernel holds for a peer that has not read them yet
(``fds_in_flight`` per uid, ``lingering`` dropped connections): a reply whose
fds would take a uid past ``max_fds_in_flight_per_uid``, or whose ``sendmsg``
the kernel refuses (``ETOOMANYREFS``, ``ENOMEM``...), goes out as
``resource_exhausted`` without fds and ``on_unsent`` undoes its lease
(:mod:`weightcache.daemon.transport` explains why).

Forbidden imports: threading, torch, weightcache.pipeline, weightcache.memory,
weightcache.daemon.handlers, weightcache.daemon.loads, weightcache.daemon.fdstore,
weightcache.daemon.ticker, weightcache.daemon.loop, weightcache.daemon.transport.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import logging
import os
import resource
import socket
import struct
import termios
from typing import Callable

from .. import protocol
from ..errors import ResourceExhausted, WeightcacheError
from ..fdpass import send_some
from ..journal import event
from .clients import Client
from .limits import Limits
from .lograte import warn_peer

log = logging.getLogger("weightcache.daemon.transport")  # the transport's logger, as before the split


def unread_bytes(sock: socket.socket) -> int:
    """``SIOCOUTQ`` of a Unix stream socket: memory of what was sent and the peer has not read (0: all read)."""
    raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    return struct.unpack("i", raw)[0]


class Outbox:
    """The send path and fds-in-flight accounting of a :class:`~weightcache.daemon.transport.Transport` (module
    docstring).

    Args:
        clients (`dict[int, Client]`): the transport's open connections by socket fd (read here, never changed).
        trusted_uids (`frozenset[int]`): uids exempt from ``max_fds_in_flight_per_uid``.
        drop (`callable`): ``(client, reason) -> None``, the transport's: closes a connection whose send failed
            (it calls :meth:`discard` and :meth:`retire`).
        on_unsent (`callable`, *optional*): ``(client, message) -> None`` for a reply whose fds were not sent.
    """

    def __init__(self, clients: dict[int, Client], trusted_uids: frozenset[int],
                 drop: Callable[[Client, str], None],
                 on_unsent: Callable[[Client, protocol.Message], None] | None = None) -> None:
        self.clients = clients
        self.trusted_uids = trusted_uids
        self.drop = drop
        self.on_unsent = on_unsent
        #: uid -> fds queued or sent to its connections that the peer may not have read.
        self.fds_in_flight: collections.Counter = collections.Counter()
        #: Dropped connections whose peer still has fds of ours to read (counted in fds_in_flight).
        self.lingering: list[Client] = []

    def _over_all_uids(self, uid: int, n: int, max_fds_in_flight: int) -> ResourceExhausted | None:
        """The refusal of ``n`` more fds for ``uid`` under ``max_fds_in_flight`` (all uids together; 0:
        half of ``RLIMIT_NOFILE``, the kernel's limit for them all, read at each check), else None.

        Per-uid caps do not bound the sum: 5 uids x 4,096 stopped every other attach at the kernel's
        ``ETOOMANYREFS`` (16 at the unit's limit; issue 38, P11). Past the cap a uid still gets its share, the
        cap over the uids with fds in flight (itself included), so no uid can starve the others by filling
        it; the shares stop at twice the cap less a sixteenth (``RLIMIT_NOFILE`` less a reserve for root and
        the service user, who are exempt), so the kernel's limit is not reached by the socket group.
        """
        cap = max_fds_in_flight or resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2
        if sum(self.fds_in_flight.values()) + n <= cap:
            return None
        for u in {c.peer.uid for c in self.clients.values() if c.inflight_fds}:
            self._refresh_in_flight(u)
        total, mine = sum(self.fds_in_flight.values()), self.fds_in_flight.get(uid, 0)
        share = cap // len(set(self.fds_in_flight) | {uid})
        if total + n <= cap or (mine + n <= share and total + n <= 2 * cap - cap // 16):
            return None
        return ResourceExhausted(
            f"reply withheld: the service's fds in flight to all uids are at their cap {cap} (half its "
            f"RLIMIT_NOFILE; {total} sent and not yet read) and uid {uid} holds {mine}, over its share {share}; "
            f"read your replies and close the fds you do not use", limit="max_fds_in_flight", value=cap,
            actual=total, share=share)

    def _forget(self, uid: int, n: int) -> None:
        self.fds_in_flight[uid] -= n
        if self.fds_in_flight[uid] <= 0:
            del self.fds_in_flight[uid]

    def settle_lingering(self) -> None:
        """Closes the dropped connections whose peer has read (or closed) what they carried."""
        keep = []
        for c in self.lingering:
            try:
                done = unread_bytes(c.sock) == 0
            except OSError:
                done = True
            if done:
                self._forget(c.peer.uid, c.inflight_fds)
                c.inflight_fds = 0
                c.sock.close()
            else:
                keep.append(c)
        self.lingering = keep

    def _refresh_in_flight(self, uid: int) -> int:
        """Forgets the fds that ``uid``'s peers have read (``SIOCOUTQ`` 0); returns what it still has in flight."""
        for c in self.clients.values():
            if c.peer.uid == uid and c.inflight_fds:
                try:
                    read_all = unread_bytes(c.sock) == 0
                except OSError:
                    continue
                if read_all:
                    self._forget(uid, c.inflight_fds)
                    c.inflight_fds = 0
        if self.lingering:
            self.settle_lingering()
        return self.fds_in_flight.get(uid, 0)

    def send(self, c: Client, msg: protocol.Message, fds: tuple[int, ...] | list[int], limits: Limits) -> bool:
        """Queues ``msg`` (and dups of ``fds``) in the client's outbox and writes what the socket takes.

        A client that does not read its replies only fills its own outbox, which
        the caps of :class:`~weightcache.daemon.limits.Limits` bound (checked before each request).
        ``limits``: the caps in force (the loop replaces them on a reload): ``max_fds_in_flight_per_uid``
        and ``max_fds_in_flight`` (all uids together), for uids not trusted. Returns False if the client was
        dropped.
        """
        if c.closed:
            return False
        if fds and c.peer.uid not in self.trusted_uids:
            cap, uid = limits.max_fds_in_flight_per_uid, c.peer.uid
            if self.fds_in_flight.get(uid, 0) + len(fds) > cap and self._refresh_in_flight(uid) + len(fds) > cap:
                return self._without_fds(c, msg, ResourceExhausted(
                    f"reply withheld: service.max_fds_in_flight_per_uid = {cap} reached (uid {uid} has "
                    f"{self.fds_in_flight.get(uid, 0)} fds sent and not yet read); read your replies and close "
                    f"the fds you do not use, or ask the operator to raise service.max_fds_in_flight_per_uid",
                    limit="max_fds_in_flight_per_uid", value=cap, actual=self.fds_in_flight.get(uid, 0)))
            refused = self._over_all_uids(uid, len(fds), limits.max_fds_in_flight)
            if refused is not None:
                return self._without_fds(c, msg, refused)
        try:
            data, fds = c.conn.send(msg, fds)
        except WeightcacheError as e:  # a reply over the frame cap: the client learns why, the service goes on
            warn_peer(log, c.peer.pid, c.peer.uid, "reply not sent peer_pid=%d peer_uid=%d type=%s error=%s",
                      c.peer.pid, c.peer.uid, msg.tag(), e.message,
                      extra=event("rejected", error_code=e.code, peer_uid=c.peer.uid))
            if fds and self.on_unsent is not None:
                self.on_unsent(c, msg)
            return self._queue(c, protocol.Error.from_exc(e))
        dups: list[int] = []
        try:
            for fd in fds:
                dups.append(os.dup(fd))
        except OSError as e:  # out of fds: this connection goes, with the dups it holds, so that others are served
            for fd in dups:
                os.close(fd)
            # Said to the client and logged: it was dropped at DEBUG level, and every engine of a node out of
            # fds saw only "closed the connection". Answering without fds and keeping it instead kept the
            # service at its limit (accept paused) while attackers held their dups (test_attacks_inflight).
            warn_peer(log, c.peer.pid, c.peer.uid, "dropped connection peer_pid=%d peer_uid=%d code=resource_exhausted "
                      "limit=service_fds error=%s held_fds=%d", c.peer.pid, c.peer.uid, e.strerror, c.outbox_fds,
                      extra=event("rejected", error_code="resource_exhausted", peer_uid=c.peer.uid,
                                  limit="service_fds"))
            if not c.outbox and not c.closed:  # best effort, and never in the middle of a half-sent frame
                err = ResourceExhausted(
                    f"connection closed: the service could not duplicate this reply's fds ({e.strerror}): it holds "
                    f"too many files; retry, and ask the operator to check the service's LimitNOFILE= and its "
                    f"open connections", limit="service_fds", value=0, actual=len(fds))
                with contextlib.suppress(OSError):
                    send_some(c.sock, protocol.encode(protocol.Error.from_exc(err)))
            self.drop(c, f"dup failed: {e.strerror}")
            return False
        c.outbox.append([memoryview(data), dups, msg])
        c.outbox_bytes += len(data)
        c.outbox_fds += len(dups)
        if dups:
            self.fds_in_flight[c.peer.uid] += len(dups)
        return self.flush(c)

    def _queue(self, c: Client, msg: protocol.Message) -> bool:
        """Queues a reply without fds (an error) and writes what the socket takes."""
        try:
            data, _ = c.conn.send(msg, ())
        except WeightcacheError as e:
            self.drop(c, f"send failed: {e}")
            return False
        c.outbox.append([memoryview(data), [], msg])
        c.outbox_bytes += len(data)
        return self.flush(c)

    def _without_fds(self, c: Client, msg: protocol.Message, err: WeightcacheError) -> bool:
        """Sends ``err`` instead of ``msg`` (whose fds cannot go); ``on_unsent`` undoes what ``msg`` granted."""
        warn_peer(log, c.peer.pid, c.peer.uid,
                  "reply withheld peer_pid=%d peer_uid=%d type=%s code=%s limit=%s", c.peer.pid, c.peer.uid,
                  msg.tag(), err.code, err.details.get("limit"),
                  extra=event("rejected", error_code=err.code, peer_uid=c.peer.uid, limit=err.details.get("limit")))
        if self.on_unsent is not None:
            self.on_unsent(c, msg)
        return self._queue(c, protocol.Error.from_exc(err))

    def flush(self, c: Client) -> bool:
        """Writes queued frames until the socket would block; returns False if the client was dropped (the
        transport then resumes reading a paused client and re-arms its selector)."""
        while c.outbox:
            data, fds, msg = c.outbox[0]
            try:
                n = send_some(c.sock, data, fds)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                if fds and e.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                    # ETOOMANYREFS (the service's user has too many fds in flight), ENOMEM, ENOBUFS: nothing of
                    # this frame went out; answer it without fds, keep the connection.
                    self._unsend(c, msg, fds, e)
                    continue
                if e.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                    warn_peer(log, c.peer.pid, c.peer.uid, "send failed peer_pid=%d peer_uid=%d error=%s",
                              c.peer.pid, c.peer.uid, e.strerror or e,
                              extra=event("rejected", error_code="send_failed", peer_uid=c.peer.uid))
                self.drop(c, f"send failed: {e}")
                return False
            for fd in fds:  # the kernel has its own references now
                os.close(fd)
            c.outbox_fds -= len(fds)
            c.inflight_fds += len(fds)
            c.outbox_bytes -= n
            if n < len(data):
                c.outbox[0] = [data[n:], [], None]
                break
            c.outbox.popleft()
        return True

    def _unsend(self, c: Client, msg: protocol.Message | None, fds: list[int], e: OSError) -> None:
        """Replaces the head frame (whose ``sendmsg`` failed with ``e`` before any byte went) by an error."""
        warn_peer(log, c.peer.pid, c.peer.uid,
                  "send failed peer_pid=%d peer_uid=%d fds=%d error=%s fds_in_flight_uid=%d; answered "
                  "resource_exhausted instead", c.peer.pid, c.peer.uid, len(fds), e.strerror or e,
                  self.fds_in_flight.get(c.peer.uid, 0),
                  extra=event("rejected", error_code="resource_exhausted", peer_uid=c.peer.uid,
                              limit="kernel_fds_in_flight"))
        data, _, _ = c.outbox.popleft()
        for fd in fds:
            os.close(fd)
        c.outbox_fds -= len(fds)
        c.outbox_bytes -= len(data)
        self._forget(c.peer.uid, len(fds))
        if msg is not None and self.on_unsent is not None:
            self.on_unsent(c, msg)
        err = protocol.Error.from_exc(ResourceExhausted(
            f"reply withheld: the kernel refused to pass its fds ({e.strerror or e}): the service's user has too "
            f"many fds in flight (sent to clients that have not read them); retry once they are read",
            limit="kernel_fds_in_flight", value=0, actual=self.fds_in_flight.get(c.peer.uid, 0)))
        raw, _ = c.conn.send(err, ())
        c.outbox.appendleft([memoryview(raw), [], err])
        c.outbox_bytes += len(raw)

    def discard(self, c: Client) -> None:
        """Closes the frames ``c`` (being dropped) did not send: their dup'ed fds, no longer in flight."""
        for _, fds, _ in c.outbox:
            for fd in fds:
                os.close(fd)
        if c.outbox_fds:
            self._forget(c.peer.uid, c.outbox_fds)
        c.outbox.clear()
        c.outbox_bytes = c.outbox_fds = 0

    def retire(self, c: Client) -> None:
        """Closes the socket of ``c`` (dropped), or keeps it shut down but counted in :attr:`lingering` while its
        peer may still hold our fds unread (until it reads or closes them)."""
        lingers = False
        if c.inflight_fds:
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
