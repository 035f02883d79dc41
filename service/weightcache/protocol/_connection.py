"""One side of a connection, sans-I/O (in the manner of h11): buffering, fd matching and the state machine.

:meth:`Connection.receive` buffers what the caller read,
:meth:`Connection.next_message` returns a message or :data:`NEED_DATA`,
:meth:`Connection.send` returns the bytes (and fds) for the caller to write.
On a stream socket the fds arrive with whichever read picks up the frame's
first byte, so fds are matched to frames by count, never by read boundary.
It never opens or closes an fd; the I/O code owns them.

Forbidden imports: socket, selectors, asyncio, torch, weightcache.memory, weightcache.client,
weightcache.daemon.
"""

from __future__ import annotations

from ..errors import LocalProtocolError, RemoteProtocolError
from ._codec import CLIENT, CLOSED, IN, LENGTH_PREFIX, MAX_FRAME_BYTES, OUT, START, TRANSITIONS, decode, encode
from ._messages import Message


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


#: Returned by :meth:`Connection.next_message` when no whole frame is buffered.
NEED_DATA = _NeedData()


class Connection:
    """One side of a connection: framing, fd matching and the state machine.

    Args:
        role (`str`): :data:`CLIENT` or :data:`SERVER`.
        max_frame_bytes (`int`, *optional*): largest frame accepted from the
            peer (the service reads requests with a far smaller cap than
            :data:`MAX_FRAME_BYTES`).

    Any protocol error moves the connection to :data:`CLOSED`; the caller then
    sends the error (if it can), closes every fd from :meth:`take_all_fds`,
    and closes the socket.

    Example:
        >>> srv = Connection(SERVER)
        >>> data, fds = Connection(CLIENT).send(Hello(PROTOCOL_VERSION))
        >>> srv.receive(data)
        >>> srv.next_message()
        (Hello(protocol_version=3, client=''), [])
    """

    def __init__(self, role: str, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.role = role
        self.max_frame_bytes = max_frame_bytes
        self.state = START
        self._buf = bytearray()
        self._fds: list[int] = []
        #: :attr:`incomplete_bytes` as last worked out; None after :meth:`receive` (taking whole frames from
        #: the front never changes it).
        self._tail: int | None = 0

    def receive(self, data: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
        """Buffers bytes and fds just read from the socket. ``b""`` means EOF."""
        if not data and not fds:
            self.state = CLOSED
            return
        self._buf += data
        self._fds.extend(fds)
        self._tail = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes received but not yet returned as messages (an incomplete frame, or frames not yet taken)."""
        return len(self._buf)

    @property
    def incomplete_bytes(self) -> int:
        """Bytes of the incomplete frame at the end of the buffer, after its whole frames (0 when it ends on a
        frame boundary); from a length prefix over ``max_frame_bytes`` on, the rest of the buffer (an error once
        :meth:`next_message` reaches it). Worked out once per :meth:`receive`."""
        if self._tail is None:
            pos, end = 0, len(self._buf)
            while end - pos >= 4:
                (n,) = LENGTH_PREFIX.unpack_from(self._buf, pos)
                if n > self.max_frame_bytes or end - pos < 4 + n:
                    break
                pos += 4 + n
            self._tail = end - pos
        return self._tail

    @property
    def held_fds(self) -> int:
        """How many fds were received and not yet matched to a whole frame."""
        return len(self._fds)

    def take_all_fds(self) -> list[int]:
        """Hands back every fd received but not yet matched to a frame."""
        fds, self._fds = self._fds, []
        return fds

    def bytes_wanted(self, default: int) -> int:
        """How many more bytes complete the next frame (``default`` while its length is unknown).

        A hint for sizing the next read: one ``recv`` of exactly the rest of a
        large frame, instead of a huge buffer on every read.
        """
        if len(self._buf) < 4:
            return default
        (n,) = LENGTH_PREFIX.unpack_from(self._buf)
        return max(1, min(4 + n - len(self._buf), self.max_frame_bytes))

    def _transition(self, direction: str, tag: str, exc: type) -> None:
        nxt = TRANSITIONS.get((self.role, self.state, direction, tag))
        if nxt is None:
            state = self.state
            self.state = CLOSED
            raise exc(f"message {tag!r} not allowed in state {state!r} ({self.role}, {direction})", type=tag)
        self.state = nxt

    def next_message(self) -> tuple[Message, list[int]] | _NeedData:
        """Returns ``(message, fds)`` for the next whole frame, or :data:`NEED_DATA`.

        Raises:
            RemoteProtocolError (`protocol_violation`): oversize frame, invalid
                frame, fewer fds than declared, or a message not allowed now.
        """
        if self.state == CLOSED and not self._buf:
            return NEED_DATA
        if len(self._buf) < 4:
            return NEED_DATA
        (n,) = LENGTH_PREFIX.unpack_from(self._buf)
        if n > self.max_frame_bytes:
            self.state = CLOSED
            raise RemoteProtocolError(f"frame length {n} exceeds the {self.max_frame_bytes}-byte limit",
                                      size_bytes=n)
        if len(self._buf) < 4 + n:
            return NEED_DATA
        body = bytes(self._buf[4 : 4 + n])
        del self._buf[: 4 + n]
        try:
            msg, fd_count = decode(body, ignore_unknown=self.role == CLIENT)  # replies: docs/protocol.md
        except RemoteProtocolError:
            self.state = CLOSED
            raise
        if fd_count > len(self._fds):
            self.state = CLOSED
            raise RemoteProtocolError(f"frame {msg.tag()!r} declares {fd_count} fds, {len(self._fds)} arrived")
        fds, self._fds = self._fds[:fd_count], self._fds[fd_count:]
        if self._fds and not self._buf:
            # fds arrived that no frame declared
            self.state = CLOSED
            self._fds = fds + self._fds
            raise RemoteProtocolError(f"{len(self._fds) - len(fds)} unexpected fds arrived with frame {msg.tag()!r}")
        try:
            self._transition(IN, msg.tag(), RemoteProtocolError)
        except RemoteProtocolError:
            self._fds = fds + self._fds
            raise
        return msg, fds

    def send(self, msg: Message, fds: list[int] | tuple[int, ...] = ()) -> tuple[bytes, list[int]]:
        """Returns ``(frame bytes, fds)`` to write for ``msg``.

        Raises:
            LocalProtocolError (`local_protocol_violation`): wrong number of fds,
                or a message not allowed in the current state.
        """
        if len(fds) != msg.FD_COUNT:
            raise LocalProtocolError(f"message {msg.tag()!r} carries {msg.FD_COUNT} fds, {len(fds)} given")
        self._transition(OUT, msg.tag(), LocalProtocolError)
        return encode(msg), list(fds)
