"""The metrics endpoint's connection slots (weightcache.metrics_http): any local user may connect (TCP).

Every slot held by connections that never send a request (a user not even in the clients' group opening
``max_connections`` of them, again each time they are cut) closed every scrape at once, so Prometheus saw the
node down and every weightcache series stale. A connection that arrives while the slots are full now takes the
slot of the connection that has waited longest for its request.
"""

from __future__ import annotations

import socket
import threading
import urllib.request

import pytest

from weightcache import metrics, metrics_http

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def endpoint(tmp_path):
    listener = metrics_http.bind("127.0.0.1:0")
    server = metrics_http.MetricsServer(listener, metrics.registry(str(tmp_path), lambda: [0], 5.0),
                                        max_connections=4, budget_s=30.0)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    try:
        yield listener.getsockname()[:2]
    finally:
        server.shutdown()
        listener.close()


def _scrape(addr) -> str:
    with urllib.request.urlopen(f"http://{addr[0]}:{addr[1]}/metrics", timeout=20) as r:
        return r.read().decode()


def test_idle_connections_in_every_slot_do_not_refuse_the_scrape(endpoint):
    idle = [socket.create_connection(endpoint, timeout=20) for _ in range(4)]  # every slot, no request
    try:
        assert 'weightcache_socket_listening{gpu="0"} 0.0' in _scrape(endpoint)
        # The scrape took the slot of the connection that had waited longest: it was cut (EOF, no reply);
        # the three others still have theirs.
        assert idle[0].recv(100) == b""
        for s in idle[1:]:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(100)
    finally:
        for s in idle:
            s.close()
