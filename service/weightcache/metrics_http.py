"""``weightcache serve-metrics``: answers ``GET /metrics`` on the TCP socket systemd passes.

Owns the HTTP side of ``weightcache-metrics.service``: it takes the listening
socket of ``weightcache-metrics.socket`` (``$LISTEN_FDS``; loopback
``127.0.0.1:9661`` by default, ``[metrics]`` in the config moves it, see
weightcache.toml(5)), or binds ``--listen HOST:PORT`` when run by hand, and
answers each ``GET /metrics`` with :func:`weightcache.metrics.exposition`,
asking the running instances at that moment (never starting one: see
:mod:`weightcache.metrics`).

Any local user can connect (TCP), so one slow client must not stall the
scrapes: each connection is served on a thread of its own, at most
:data:`MAX_CONNECTIONS` at once, each read waits at most :data:`REQUEST_TIMEOUT_S`,
and a connection is cut after :data:`CONNECTION_BUDGET_S` in all however it
trickles its bytes. A connection that arrives while every slot is taken gets
the slot of the connection that has waited longest for its request (that one
is cut, unanswered), so connections that never send a request (any local user
can open ``MAX_CONNECTIONS`` of them, again each time they are cut) cannot
refuse the scrape; when every slot is answering a request it waits up to
:data:`REQUEST_TIMEOUT_S` for one.
What the endpoint shows of restricted models is decided by the service
(``restricted-N``, no name or path: :func:`weightcache.daemon.handlers.restricted_aliases`).

With ``[metrics] web_config`` (:mod:`weightcache.metrics_web`, Prometheus' web config file) each
accepted connection is wrapped in TLS and its handshake done on the connection's own thread (within
:data:`REQUEST_TIMEOUT_S`: a client that never completes it holds a slot as one that never sends a
request does); with ``basic_auth_users`` every path answers 401 without valid credentials.

Forbidden imports: torch, weightcache.daemon, weightcache.memory, weightcache.pipeline.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from . import metrics, notify
from .metrics_web import REALM, WebConfigFile

log = logging.getLogger(__name__)

#: Seconds one read of a connection may wait (request line, headers).
REQUEST_TIMEOUT_S = 5.0
#: Seconds one connection may last in all, request and reply: a client trickling its bytes is cut off then.
CONNECTION_BUDGET_S = 15.0
#: Connections served at once (a thread each); one more takes the slot of the one waiting longest for its request.
MAX_CONNECTIONS = 16
#: Seconds between two warnings about connections cut or refused (each says how many since the last):
#: any local user can open connections, and one warning each would flood the journal.
WARN_INTERVAL_S = 60.0
INDEX = b"weightcache metrics: GET /metrics (Prometheus text format). See weightcache.systemd(7).\n"


class _Handler(BaseHTTPRequestHandler):
    timeout = REQUEST_TIMEOUT_S
    server_version = "weightcache-metrics"

    def handle_one_request(self) -> None:
        self.server.waiting(self.connection)  # until its request line and headers are in
        super().handle_one_request()

    def parse_request(self) -> bool:
        try:
            return super().parse_request()  # reads the headers
        finally:
            self.server.answering(self.connection)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        web = self.server.web.current() if self.server.web is not None else None
        if web is not None and not web.authorized(self.headers.get("Authorization")):
            self.send_response(401)
            self.send_header("WWW-Authenticate", f'Basic realm="{REALM}", charset="UTF-8"')
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            body = b"unauthorized: basic_auth_users of the endpoint's web config file\n"
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        path = urlsplit(self.path).path
        if path == "/metrics":
            self._reply(200, metrics.exposition(self.server.registry), CONTENT_TYPE_LATEST)
        elif path == "/":
            self._reply(200, INDEX, "text/plain; charset=utf-8")
        else:
            self._reply(404, b"not found: try /metrics\n", "text/plain; charset=utf-8")

    def _reply(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: object) -> None:
        log.debug("http %s peer=%s", fmt % args, self.client_address[0] if self.client_address else "")


def _cut(request: socket.socket) -> None:
    """Ends a connection past its :data:`CONNECTION_BUDGET_S`: its thread's next read sees EOF."""
    try:
        # The socket's own shutdown, also for a TLS connection: SSLSocket.shutdown would drop its SSL
        # object under a handshake or read running on the connection's thread.
        socket.socket.shutdown(request, socket.SHUT_RDWR)
    except OSError:
        pass


class MetricsServer(socketserver.ThreadingMixIn, HTTPServer):
    """An ``http.server`` on an already listening socket, a thread per connection; ``registry`` is what
    ``/metrics`` shows.

    Args:
        listener (`socket.socket`): a listening TCP socket (from systemd, or bound by :func:`bind`).
        reg (`CollectorRegistry`): see :func:`weightcache.metrics.registry`.
        max_connections (`int`, *optional*): connections served at once (:data:`MAX_CONNECTIONS`).
        budget_s (`float`, *optional*): seconds one connection may last (:data:`CONNECTION_BUDGET_S`).
        web (`WebConfigFile`, *optional*): TLS and basic authentication (``[metrics] web_config``); None:
            plain HTTP, anyone who can connect may read.
    """

    daemon_threads = True
    block_on_close = False

    def __init__(self, listener: socket.socket, reg: CollectorRegistry, max_connections: int = MAX_CONNECTIONS,
                 budget_s: float = CONNECTION_BUDGET_S, web: WebConfigFile | None = None) -> None:
        # BaseServer's, not TCPServer's: that one creates a socket of its own, which the unit's
        # RestrictAddressFamilies=AF_UNIX refuses (and which would only be closed again).
        socketserver.BaseServer.__init__(self, listener.getsockname()[:2], _Handler)
        self.socket = listener
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])
        self.registry = reg
        self.web = web
        self.budget_s = budget_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections
        #: Connections waiting for their request, longest first (dict order: insertion), under ``_lock``.
        self._waiting: dict[socket.socket, None] = {}
        self._lock = threading.Lock()
        self._dropped = {"cut": 0, "refused": 0}  # since the last warning (serve_forever's thread only)
        self._warned_at = -WARN_INTERVAL_S

    def _warn_dropped(self, what: str, peer: str) -> None:
        """Counts a connection cut or refused at max_connections; a warning at most every WARN_INTERVAL_S."""
        self._dropped[what] += 1
        now = time.monotonic()
        if now - self._warned_at >= WARN_INTERVAL_S:
            log.warning("metrics connections dropped reason=max-connections max_connections=%d cut=%d refused=%d "
                        "last_peer=%s: a connection arriving with every slot taken takes the slot of the one "
                        "waiting longest for its request (cut), or is refused when all are answering",
                        self.max_connections, self._dropped["cut"], self._dropped["refused"], peer)
            self._dropped = {"cut": 0, "refused": 0}
            self._warned_at = now

    def waiting(self, request: socket.socket) -> None:
        """Notes that ``request`` waits for a request (accepted, or kept alive after a reply)."""
        with self._lock:
            self._waiting.setdefault(request, None)

    def answering(self, request: socket.socket) -> None:
        """Notes that ``request`` has sent its request line and headers: it keeps its slot."""
        with self._lock:
            self._waiting.pop(request, None)

    def _evict_longest_waiting(self) -> bool:
        """Cuts the connection that has waited longest for its request; False when none waits."""
        with self._lock:
            if not self._waiting:
                return False
            victim = next(iter(self._waiting))
            del self._waiting[victim]
        _cut(victim)  # its thread's read sees EOF: it ends and frees its slot
        return True

    def process_request(self, request: socket.socket, client_address: tuple) -> None:
        """Serves ``request`` on a thread of its own. With every slot taken, it cuts the connection that has
        waited longest for its request and takes its slot; when all are answering requests, it waits up to
        :data:`REQUEST_TIMEOUT_S` for one, then closes ``request``."""
        peer = client_address[0] if client_address else ""
        if not self._slots.acquire(blocking=False):
            if self._evict_longest_waiting():
                self._warn_dropped("cut", peer)
            if not self._slots.acquire(timeout=REQUEST_TIMEOUT_S):
                self._warn_dropped("refused", peer)
                self.shutdown_request(request)
                return
        self.waiting(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.answering(request)
            self._slots.release()
            raise

    def get_request(self) -> tuple[socket.socket, tuple]:
        """Accepts a connection; wrapped in TLS (its handshake not yet done) when the web config has TLS."""
        request, addr = self.socket.accept()
        ctx = self.web.current().ssl_context if self.web is not None else None
        if ctx is not None:
            try:
                request = ctx.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
            except (OSError, ValueError):
                request.close()
                raise OSError("TLS wrap failed") from None
        return request, addr

    def finish_request(self, request: socket.socket, client_address: tuple) -> None:
        """Completes the TLS handshake (on the connection's thread, within :data:`REQUEST_TIMEOUT_S`), then
        serves the requests; a failed handshake (plain HTTP to a TLS endpoint, an untrusted client
        certificate) ends the connection with a debug line."""
        if isinstance(request, ssl.SSLSocket):
            try:
                request.settimeout(REQUEST_TIMEOUT_S)
                request.do_handshake()
            except (OSError, ValueError) as e:
                log.debug("metrics TLS handshake failed peer=%s: %s", client_address[0] if client_address else "", e)
                return
        super().finish_request(request, client_address)

    def handle_error(self, request: socket.socket, client_address: tuple) -> None:
        """A connection that failed: a network or TLS error at debug level (any local user can cause them);
        anything else is a bug, logged with its traceback."""
        err = sys.exc_info()[1]
        peer = client_address[0] if client_address else ""
        if isinstance(err, OSError):
            log.debug("metrics connection ended peer=%s: %s", peer, err)
        else:
            log.error("metrics connection failed peer=%s", peer, exc_info=err)

    def process_request_thread(self, request: socket.socket, client_address: tuple) -> None:
        timer = threading.Timer(self.budget_s, _cut, (request,))
        timer.daemon = True
        timer.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            timer.cancel()
            self.answering(request)
            self._slots.release()


def bind(listen: str) -> socket.socket:
    """A listening socket on ``HOST:PORT`` (``[::1]:PORT`` for IPv6).

    Raises:
        ValueError: ``listen`` is not ``HOST:PORT`` with a port number.
        OSError: the address cannot be bound (in use, not local).
    """
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--listen {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:9661")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, int(port)))
    s.listen(16)
    return s


def listener_from_systemd() -> socket.socket | None:
    """The socket ``weightcache-metrics.socket`` passed (``FileDescriptorName=metrics``), or None."""
    fds = notify.listen_fds()
    mine = fds.pop("metrics", []) or fds.pop("unknown", [])
    for extra in mine[1:] + [fd for rest in fds.values() for fd in rest]:
        socket.socket(fileno=extra).close()
    return socket.socket(fileno=mine[0]) if mine else None


def serve(listener: socket.socket, reg: CollectorRegistry, web: WebConfigFile | None = None) -> None:
    """Answers requests on ``listener`` until the process is stopped (SIGTERM); ``web``: see :class:`MetricsServer`."""
    server = MetricsServer(listener, reg, web=web)
    cfg = web.current() if web is not None else None
    log.info("serving metrics address=%s tls=%s basic_auth_users=%d web_config=%s", listener.getsockname(),
             cfg is not None and cfg.ssl_context is not None, len(cfg.users) if cfg else 0, web.path if web else "")
    server.serve_forever()
