"""The engine's connection to one service instance: find its socket, connect, send requests, read replies.

:class:`Session` is a blocking client over :mod:`weightcache.protocol` (the
connection is the lease: closing it ends every lease taken on it). Used by
:func:`weightcache.attach` and by the operator's tools (:mod:`weightcache.cli`,
:mod:`weightcache.metrics`), which need nothing else of the client.

Forbidden imports: torch, numpy, asyncio, weightcache.config, weightcache.daemon, weightcache.pipeline,
weightcache.quant, weightcache.sharding, weightcache.reader, weightcache.memory.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import socket
import stat
import struct
import time
from typing import Any

from . import protocol
from .errors import DaemonUnavailable, RemoteProtocolError, from_wire
from .fdpass import recv_with_fds, send_some

log = logging.getLogger(__name__)

DEFAULT_SOCKET_DIR = "/run/weightcache"
#: First read of a reply, in bytes; the rest of a larger frame is read with one exact-size recv.
#: Below glibc's 128 KiB mmap threshold: a 1 MiB recvmsg buffer costs ~40 µs per read in
#: mmap/munmap and page faults, more than reading a 66 KB manifest frame in two reads.
_RECV = 64 * 1024


def resolve_socket_dir(explicit: str | None = None) -> str:
    """``explicit``, else ``$WEIGHTCACHE_SOCKET_DIR``, else ``/run/weightcache``."""
    return explicit or os.environ.get("WEIGHTCACHE_SOCKET_DIR") or DEFAULT_SOCKET_DIR


def listening_gpus(socket_dir: str) -> list[int]:
    """The GPU indices of the ``<N>.sock`` sockets in ``socket_dir``, increasing ([] when it cannot be read)."""
    try:
        names = os.listdir(socket_dir)
    except OSError:
        return []
    return sorted(int(n[:-5]) for n in names if n.endswith(".sock") and n[:-5].isdigit())


#: Pause between ``connect`` attempts while the service's backlog is full (seconds, first and largest).
_BACKLOG_PAUSE_S = (0.001, 0.05)


def _connect(sock: socket.socket, path: str, deadline: float) -> None:
    """``connect``, waiting while the listen backlog is full (``EAGAIN``) until ``deadline`` (monotonic s).

    A full backlog means the service is busy (starting, or many engines
    connecting at once), not absent: the kernel answers ``EAGAIN`` at once on
    a Unix socket instead of waiting, so this waits for it, backing off from
    1 ms to 50 ms. It is part of connecting within the caller's timeout, not a
    retry of a request; the first wait is logged as a WARNING, each attempt at
    DEBUG, and the number of waits once connected.
    """
    pause, waits = _BACKLOG_PAUSE_S[0], 0
    while True:
        try:
            sock.connect(path)
            if waits:
                log.info("connected after a full backlog socket=%s waits=%d", path, waits)
            return
        except BlockingIOError:
            if time.monotonic() + pause > deadline:
                raise socket.timeout(f"the service's listen backlog stayed full for {waits} attempts") from None
            if not waits:
                log.warning("service backlog full, waiting socket=%s", path)
            waits += 1
            log.debug("connect again after a full backlog socket=%s attempt=%d pause_ms=%.0f", path, waits,
                      pause * 1e3)
            time.sleep(pause)
            pause = min(pause * 2, _BACKLOG_PAUSE_S[1])


def _denied_text(path: str, e: OSError) -> str:
    """Why connecting to ``path`` gave ``EACCES``: who we are, the socket's group, and the fix."""
    uid = os.geteuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    try:
        gid = os.stat(path).st_gid
        group = grp.getgrgid(gid).gr_name
    except (OSError, KeyError):  # the directory is not searchable either, or the gid has no name
        group = "weightcache-clients"
    return (f"no weightcache service at {path}: {e.strerror}: user {user} (uid {uid}) may not connect; the socket "
            f"admits root and group {group}: add the user to it (usermod -aG {group} {user}, then log in again) "
            f"or run the engine with that group")


def sockets_in(where: str) -> tuple[str, list[int]]:
    """Which instance sockets the socket directory ``where`` has, for an error message, and their GPU indices.

    Returns:
        `tuple[str, list[int]]`: ``("<where> has the sockets of instances [0, 1]", [0, 1])``, or ``"no instance
        has a socket in <where>"`` / ``"the socket directory <where> does not exist"`` with ``[]``.
    """
    if not os.path.isdir(where):
        return f"the socket directory {where} does not exist", []
    listening = listening_gpus(where)
    if not listening:
        return f"no instance has a socket in {where}", []
    return f"{where} has the sockets of instances {listening}", listening


def _missing_text(path: str, e: OSError) -> tuple[str, dict[str, Any]]:
    """Why connecting to ``path`` gave ``ENOENT``, and the details: which sockets its directory has instead.

    An engine asks the instance of its device's GPU (0 on CPU); a model placed on
    another instance, or another socket directory, is the usual cause.
    """
    where = os.path.dirname(path) or "."
    found, listening = sockets_in(where)
    text = f"no weightcache service at {path}: {e.strerror}; {found}"
    if listening:
        text += (": an engine asks the instance of its device's GPU (0 on CPU), where the model's layout places its "
                 "rank; pass gpu= to attach() (vLLM: \"gpu\" in --model-loader-extra-config) to ask another")
    elif not os.path.isdir(where):
        text += " (attach's socket_dir, $WEIGHTCACHE_SOCKET_DIR, the config's [service] socket_dir)"
    return text, {"listening": listening}


def _not_a_socket(path: str) -> str | None:
    """What ``path`` is when it exists and is not a socket (``regular file``, ``directory``...), else None.

    Connecting to such a path fails with ``ECONNREFUSED``, as to a socket left by a stopped service.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    return "a regular file" if stat.S_ISREG(mode) else "a directory" if stat.S_ISDIR(mode) else "not a socket file"


#: The service's user when ``$WEIGHTCACHE_SERVICE_USER`` does not name one: the package's sysusers user, checked
#: for the sockets of :data:`DEFAULT_SOCKET_DIR` where this machine's passwd knows it.
DEFAULT_SERVICE_USER = "weightcache"


def expected_server_uids(path: str) -> tuple[set[int], str] | None:
    """The uids the listening socket ``path`` may belong to (``SO_PEERCRED`` of the server), and whom they name.

    Root (systemd binds and listens on a socket-activated one), this process's
    own uid (a service it started itself), and the service user:
    ``$WEIGHTCACHE_SERVICE_USER`` (a name or a uid), else, for a socket in
    ``/run/weightcache``, ``weightcache`` where this machine's passwd has it.
    ``None`` when no service user is known (no check): an engine container
    without the user in its passwd sets ``WEIGHTCACHE_SERVICE_USER`` to the
    service's uid.
    """
    name = os.environ.get("WEIGHTCACHE_SERVICE_USER", "").strip()
    if name.isdigit():
        return {0, os.geteuid(), int(name)}, f"uid {name}"
    if not name and os.path.dirname(os.path.abspath(path)) != DEFAULT_SOCKET_DIR:
        return None
    try:
        uid = pwd.getpwnam(name or DEFAULT_SERVICE_USER).pw_uid
    except KeyError:
        if name:
            return {0, os.geteuid()}, f"user {name} (not in this machine's passwd)"
        return None
    return {0, os.geteuid(), uid}, f"user {name or DEFAULT_SERVICE_USER} (uid {uid})"


def _check_server(sock: socket.socket, path: str) -> None:
    """Refuses a listening socket bound by someone other than the service (:func:`expected_server_uids`).

    Whoever can write the socket directory (a uid-0 process in a container
    that mounts it read-write) can replace the socket, and the next engine's
    attach would map what it sends (issue 38, P10).

    Raises:
        DaemonUnavailable (`daemon_unavailable`): the server's uid is not one of them; ``details`` carry
            ``server_uid``, ``server_pid`` and ``expected``.
    """
    expected = expected_server_uids(path)
    if expected is None:
        return
    uids, who = expected
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid in uids:
        return
    try:
        owner = f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        owner = f"uid {uid}"
    raise DaemonUnavailable(
        f"refusing {path}: it was bound by {owner}, pid {pid}, not by root or the service's {who}; something "
        f"else replaced the socket (set WEIGHTCACHE_SERVICE_USER if the service runs as another user)",
        socket=path, server_uid=uid, server_pid=pid, expected=who)


class Session:
    """A blocking client connection to one service socket (one per attach).

    The connection is the lease: closing it ends every lease taken on it.

    Args:
        path (`str`): the service's socket, e.g. ``/run/weightcache/0.sock``.
        timeout (`float`): seconds for connecting, and for each call's replies (one deadline per
            :meth:`replies`, however the bytes arrive).

    Raises:
        DaemonUnavailable (`daemon_unavailable`): nothing listens, connection
            refused, or no reply in time. No socket file at ``path``:
            ``details["listening"]`` lists the instances whose sockets its
            directory has (the message says which to ask). A socket bound by
            someone other than root, this process's user or the service user
            (:func:`expected_server_uids`): ``details["server_uid"]``.
    """

    def __init__(self, path: str, timeout: float = 30.0, client: str = "", hello: bool = True) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        try:
            _connect(self.sock, path, time.monotonic() + timeout)
        except PermissionError as e:
            self.sock.close()
            raise DaemonUnavailable(_denied_text(path, e), socket=path) from None
        except FileNotFoundError as e:
            self.sock.close()
            text, details = _missing_text(path, e)
            raise DaemonUnavailable(text, socket=path, **details) from None
        except (socket.timeout, OSError) as e:
            self.sock.close()
            if isinstance(e, ConnectionRefusedError) and (kind := _not_a_socket(path)) is not None:
                raise DaemonUnavailable(
                    f"no weightcache service at {path}: it is {kind}, not a socket; nothing serves there (check the "
                    f"socket directory: attach's socket_dir, $WEIGHTCACHE_SOCKET_DIR, the config's [service] "
                    f"socket_dir; a service started on that path replaces a regular file)", socket=path,
                    file_type=kind) from None
            raise DaemonUnavailable(f"no weightcache service at {path}: {e.strerror or e}", socket=path) from None
        try:
            _check_server(self.sock, path)
        except BaseException:
            self.sock.close()
            raise
        self.timeout = timeout
        self.conn = protocol.Connection(protocol.CLIENT)
        self.client = client or f"pid={os.getpid()}"
        self.hello = self.request(self.hello_message()) if hello else None

    def hello_message(self) -> protocol.Hello:
        return protocol.Hello(protocol.PROTOCOL_VERSION, self.client)

    def pipeline(self, msgs: list[protocol.Message], timeout: float | None = None) -> list[Any]:
        """Sends ``msgs`` in one write, then reads one reply each, in order.

        Saves a round trip per message (``hello`` + ``attach`` in one go). The
        fds of the last reply are in ``self.last_fds``.

        Raises:
            DaemonUnavailable: the service closed the connection or timed out.
            WeightcacheError: the first typed error among the replies.
        """
        self.send(msgs)
        return self.replies(len(msgs), timeout)

    def send(self, msgs: list[protocol.Message]) -> None:
        """Writes ``msgs`` in one write without waiting for replies (see :meth:`replies`).

        Raises:
            DaemonUnavailable: the service went away.
        """
        data = b"".join(self.conn.send(m)[0] for m in msgs)
        try:
            self.sock.sendall(data)
        except OSError as e:
            raise DaemonUnavailable(f"weightcache service at {self.path} went away: {e}", socket=self.path) from None

    def send_with_fds(self, msg: protocol.Message, fds: list[int] | tuple[int, ...]) -> None:
        """Writes ``msg`` with ``fds`` (``SCM_RIGHTS`` on the frame's first byte; the fds stay the caller's), without
        waiting for the reply (see :meth:`replies`).

        Raises:
            LocalProtocolError (`local_protocol_violation`): ``msg`` carries another number of fds.
            DaemonUnavailable: the service went away.
        """
        data, fds = self.conn.send(msg, fds)
        try:
            n = send_some(self.sock, data, fds)
            self.sock.sendall(data[n:])
        except OSError as e:
            raise DaemonUnavailable(f"weightcache service at {self.path} went away: {e}", socket=self.path) from None

    def replies(self, count: int, timeout: float | None = None) -> list[Any]:
        """Reads ``count`` replies to what :meth:`send` wrote (fds of the last one in ``self.last_fds``).

        Raises:
            DaemonUnavailable: the service closed the connection or timed out.
            WeightcacheError: the first typed error among the replies.
        """
        deadline = time.monotonic() + max(0.001, self.timeout if timeout is None else timeout)
        replies = []
        for _ in range(count):
            reply, fds = self._read_message(deadline)
            if isinstance(reply, protocol.Error):
                for fd in fds:
                    os.close(fd)
                raise from_wire(reply.code, reply.message, reply.details)
            self.last_fds = fds
            replies.append(reply)
        return replies

    def request(self, msg: protocol.Message, timeout: float | None = None) -> Any:
        """Sends ``msg`` and returns the reply message (fds in ``self.last_fds``).

        Raises:
            DaemonUnavailable: the service closed the connection or timed out.
            WeightcacheError: the typed error the service replied with.
        """
        return self.pipeline([msg], timeout)[0]

    def _read_message(self, deadline: float) -> tuple[protocol.Message, list[int]]:
        """The next message, read by ``deadline`` (monotonic s): one deadline for the whole reply, however
        the bytes trickle in (a per-``recv`` timeout let 1 byte a second hold a 5 s attach for minutes)."""
        while True:
            try:
                ev = self.conn.next_message()
            except RemoteProtocolError:
                for fd in self.conn.take_all_fds():
                    os.close(fd)
                raise
            if ev is not protocol.NEED_DATA:
                return ev
            try:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout()
                self.sock.settimeout(left)
                data, fds = recv_with_fds(self.sock, self.conn.bytes_wanted(_RECV), protocol.MAX_FDS_PER_FRAME)
            except socket.timeout:
                raise DaemonUnavailable(f"weightcache service at {self.path} did not answer in time",
                                        socket=self.path) from None
            except OSError as e:
                raise DaemonUnavailable(f"weightcache service at {self.path} went away: {e}",
                                        socket=self.path) from None
            if not data and not fds:
                raise DaemonUnavailable(f"weightcache service at {self.path} closed the connection",
                                        socket=self.path)
            self.conn.receive(data, fds)

    def close(self) -> None:
        for fd in self.conn.take_all_fds():
            os.close(fd)
        self.sock.close()
