"""The control channel: small JSON frames over TCP, each authenticated with the fleet's HMAC.

A frame is a 4-byte big-endian length, then a 32-byte HMAC-SHA256, then a UTF-8 JSON object. The server
speaks first with an unauthenticated ``hello`` carrying a fresh random nonce; every later frame's HMAC
covers its kind (``request``, ``reply``, ``done``, ``ack``), the *other side's* nonce and the body, so a
frame recorded on one connection is refused on any other (no replay), and each side authenticates the
other: a source without the secret cannot answer a request any more than a receiver without it can ask.

The exchange (docs/design.md, "Peer seeding")::

    source  -> hello   {v, nonce_s}
    receiver-> request {nonce_r, model, tp_size, tp_rank, samples}        HMAC(request, nonce_s)
    source  -> reply   {ok, reason | agent_md, descs, manifest, key, digest, samples}  HMAC(reply, nonce_r)
    receiver-> done    {ok, reason}                                        HMAC(done, nonce_s)
    source  -> ack     {ok}                                                HMAC(ack, nonce_r)

The source holds its NIXL registration from ``reply`` until ``done`` (or until the connection closes or
its timeout passes); the receiver commits what it read only after ``ack``.

Forbidden imports: torch, weightcache.daemon, nixl.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any

from ._secret import Secret

#: Largest frame either side accepts (a reply: a manifest of 150k tensors is some MiB; base64 adds a third).
MAX_FRAME_BYTES = 64 * 1024 * 1024
#: Largest frame a source reads from a peer it has not authenticated yet, and of every receiver's frame (a
#: request with 64 samples is a few KiB): a stranger cannot make it hold more.
MAX_REQUEST_BYTES = 1024 * 1024
VERSION = 1
_LEN = struct.Struct(">I")
_NO_MAC = bytes(32)


class ChannelError(Exception):
    """The exchange failed; ``reason`` is one of ``auth``, ``disconnected``, ``timeout``, ``protocol``,
    ``unreachable`` (the reasons of the metrics and the journal)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Channel:
    """One side of one control connection.

    Args:
        sock (`socket.socket`): connected, blocking, with the timeout the caller wants per frame (seconds).
        secret (`Secret`): the fleet's secrets.
        server (`bool`): the source's side (sends ``hello`` first).
    """

    def __init__(self, sock: socket.socket, secret: Secret, server: bool) -> None:
        self.sock = sock
        self.secret = secret
        self.nonce = os.urandom(16)
        self.peer_nonce = b""
        self.server = server

    def open(self) -> None:
        """The handshake: the server sends its nonce, the client reads it.

        Raises:
            ChannelError: ``disconnected``, ``timeout``, ``protocol``.
        """
        if self.server:
            self._write(_NO_MAC, {"kind": "hello", "v": VERSION, "nonce": self.nonce.hex()})
            return
        _, body = self._read()
        try:
            if body.get("kind") != "hello" or body.get("v") != VERSION:
                raise ValueError(body.get("kind"))
            self.peer_nonce = bytes.fromhex(body["nonce"])
        except (KeyError, ValueError, TypeError) as e:
            raise ChannelError("protocol", f"the peer's hello is not a weightcache seeding hello v{VERSION}: "
                                           f"{e!r}") from None

    def send(self, kind: str, body: dict[str, Any]) -> None:
        """Sends one authenticated frame of ``kind`` (a ``request`` also carries this side's nonce).

        Raises:
            ChannelError: ``disconnected``, ``timeout``.
        """
        body = {**body, "kind": kind}
        if kind == "request":
            body["nonce"] = self.nonce.hex()
        raw = _encode(body)
        self._write_raw(self.secret.sign(kind.encode(), self.peer_nonce, raw), raw)

    def recv(self, kind: str) -> dict[str, Any]:
        """Reads one frame of ``kind`` and checks its HMAC (a ``request`` also gives the peer's nonce). The
        source's side reads at most :data:`MAX_REQUEST_BYTES` a frame, the receiver's :data:`MAX_FRAME_BYTES`.

        Raises:
            ChannelError: ``auth`` (no secret of this node made the HMAC), ``protocol`` (another kind),
                ``disconnected``, ``timeout``.
        """
        mac, raw = self._read_raw(MAX_REQUEST_BYTES if self.server else MAX_FRAME_BYTES)
        if mac == _NO_MAC:  # the other side could not authenticate us: its word, unauthenticated, for the log
            body = _decode(raw)
            if body.get("kind") == "refused" and body.get("reason") == "auth":
                raise ChannelError("auth", "the peer refused this node's signature: the two nodes share no "
                                           f"secret ({self.secret.path or 'the secret'})")
            raise ChannelError("protocol", f"an unsigned {body.get('kind')!r} frame")
        if kind == "request":
            try:
                peek = json.loads(raw)
                self.peer_nonce = bytes.fromhex(peek["nonce"])
            except (ValueError, KeyError, TypeError):
                raise ChannelError("protocol", "a request without a nonce") from None
        if not self.secret.verify(mac, kind.encode(), self.nonce, raw):
            raise ChannelError("auth", f"the peer's {kind} is not signed with this fleet's secret "
                                       f"({self.secret.path or 'the secret'}): another fleet, or a stale secret")
        body = _decode(raw)
        if body.get("kind") != kind:
            raise ChannelError("protocol", f"expected a {kind}, got {body.get('kind')!r}")
        return body

    def refuse_auth(self) -> None:
        """Tells the other side, unsigned, that its frame was not signed with a secret of this node (best effort).

        The frame carries no information an attacker could use: the receiver treats it as a refusal, which it
        would reach anyway (its own load).
        """
        try:
            self._write(_NO_MAC, {"kind": "refused", "reason": "auth"})
        except ChannelError:
            pass

    # --- framing -------------------------------------------------------------

    def _write(self, mac: bytes, body: dict[str, Any]) -> None:
        self._write_raw(mac, _encode(body))

    def _write_raw(self, mac: bytes, raw: bytes) -> None:
        try:
            self.sock.sendall(_LEN.pack(len(mac) + len(raw)) + mac + raw)
        except TimeoutError:
            raise ChannelError("timeout", "the peer did not read in time") from None
        except OSError as e:
            raise ChannelError("disconnected", f"the peer went away: {e}") from None

    def _read(self) -> tuple[bytes, dict[str, Any]]:
        mac, raw = self._read_raw()
        return mac, _decode(raw)

    def _read_raw(self, limit: int = MAX_FRAME_BYTES) -> tuple[bytes, bytes]:
        n = _LEN.unpack(self._exactly(4))[0]
        if not 32 <= n <= limit:
            raise ChannelError("protocol", f"a frame of {n} bytes (limit {limit})")
        data = self._exactly(n)
        return data[:32], data[32:]

    def _exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            except TimeoutError:
                raise ChannelError("timeout", "the peer did not answer in time") from None
            except OSError as e:
                raise ChannelError("disconnected", f"the peer went away: {e}") from None
            if not chunk:
                raise ChannelError("disconnected", "the peer closed the connection")
            buf += chunk
        return bytes(buf)


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ChannelError("protocol", f"a frame that is not JSON: {e!r}") from None
    if not isinstance(body, dict):
        raise ChannelError("protocol", "a frame that is not a JSON object")
    return body


def parse_address(text: str, default_port: int | None = None) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) -> ``(host, port)``.

    Raises:
        ValueError: no port (and no ``default_port``), or a port outside 1..65535.
    """
    host, sep, port = text.rpartition(":")
    if not sep or "]" in port:
        if default_port is None:
            raise ValueError(f"{text!r}: expected host:port")
        host, port = text, str(default_port)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r}: expected host:port with a port 1..65535")
    return host, int(port)
