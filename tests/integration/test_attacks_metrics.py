"""Issue 25, lower: the metrics endpoint and the ``metrics`` command.

- One slow connection to the single-threaded endpoint (any local user may
  connect: it is TCP) stalled every scrape for as long as it trickled bytes.
  Now each connection has a thread, at most ``max_connections`` at once (one
  more takes the slot of the connection waiting longest for its request), and
  a connection is cut after its time budget.
- ``weightcache metrics --config FILE`` ignored that file's ``socket_dir``.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

torch = pytest.importorskip("torch")

from service_harness import make_config, record_figures, service_env, to_toml  # noqa: E402
from checkpoints import llama_checkpoint  # noqa: E402
from weightcache import metrics, metrics_http  # noqa: E402

pytestmark = pytest.mark.timeout(120)

#: What a slow client sends, one byte per 0.2 s (2,000 s for all of it).
TRICKLED = b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"x" * 10_000


def _trickle(addr: tuple[str, int], stop: threading.Event, out: list) -> None:
    """A slow client: sends one byte of a request line every 0.2 s; notes when the server cut it off."""
    s = socket.create_connection(addr, timeout=30)
    sent = 0
    with contextlib.suppress(OSError):  # the endpoint cut the trickler off: the caller checks `sent` and `rest`
        for b in TRICKLED:
            if stop.is_set():
                break
            s.sendall(bytes([b]))
            sent += 1
            time.sleep(0.2)
    s.settimeout(30)
    try:
        rest = s.recv(65536)
    except OSError:
        rest = b""
    out.append((sent, rest))
    s.close()


def test_slow_metrics_connections_do_not_stall_the_scrape(daemon, tmp_path):
    """Three connections trickle a request one byte per 0.2 s. Before: the endpoint served one connection at a
    time, so the scrape waited for them. Now the scrape is answered meanwhile (the node's series, the service's
    instance listening), a fifth connection beyond max_connections=4 takes the slot of the slow one that has waited
    longest and is answered, and each slow one is cut after the 2 s budget or for the fifth (it sees the
    connection end although it is still sending)."""
    svc = daemon(make_config({"ok": llama_checkpoint(tmp_path / "ok", seed=7)}))
    svc.wait_settled()
    listener = metrics_http.bind("127.0.0.1:0")
    server = metrics_http.MetricsServer(listener, metrics.registry(svc.socket_dir, lambda: [0], 5.0),
                                        max_connections=4, budget_s=2.0)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    addr = listener.getsockname()[:2]
    stop, cut = threading.Event(), []
    slow = [threading.Thread(target=_trickle, args=(addr, stop, cut)) for _ in range(3)]
    try:
        for t in slow:
            t.start()
        time.sleep(0.3)  # the three are accepted and trickling
        with urllib.request.urlopen(f"http://{addr[0]}:{addr[1]}/metrics", timeout=10) as r:
            body = r.read().decode()
        assert 'weightcache_socket_listening{gpu="0"} 1.0' in body
        extra = [socket.create_connection(addr, timeout=10) for _ in range(2)]  # the 4th takes the last slot
        time.sleep(0.3)
        # The 5th, every slot busy: it takes the slot of the first trickler (waiting longest) and is answered.
        extra[1].sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        extra[1].settimeout(10)
        assert extra[1].recv(12) in (b"HTTP/1.0 200", b"HTTP/1.1 200")
        for s in extra:
            s.close()
        for t in slow:
            t.join(30)
        assert len(cut) == 3
        assert all(rest == b"" or rest.startswith(b"HTTP/1.") for _, rest in cut), cut
        assert all(sent < len(TRICKLED) for sent, _ in cut), cut  # cut off by the budget, not let finish
    finally:
        stop.set()
        server.shutdown()
        listener.close()
    record_figures("attack.metrics_slow_clients", "3 connections trickle bytes to the metrics endpoint",
                   "a scrape is answered meanwhile; one connection past max_connections takes the slot of the one "
                   "waiting longest for its request; the slow ones cut at the connection budget", clients=6, faults_injected=3)


def test_metrics_command_uses_the_socket_dir_of_its_config(daemon, tmp_path):
    """``weightcache metrics --config FILE`` reports the instances in FILE's socket_dir (before: the default
    configuration's, so a node with its config elsewhere showed nothing listening)."""
    svc = daemon(make_config({"ok": llama_checkpoint(tmp_path / "ok", seed=7)}))
    svc.wait_settled()
    cfg = tmp_path / "other.toml"
    cfg.write_text(to_toml({"service": {"socket_dir": svc.socket_dir}, "models": {}}))
    proc = subprocess.run([sys.executable, "-m", "weightcache", "metrics", "--config", str(cfg)],
                          env=service_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert 'weightcache_socket_listening{gpu="0"} 1.0' in proc.stdout, proc.stdout[-2000:]
