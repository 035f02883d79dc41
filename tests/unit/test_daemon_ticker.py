"""The ticker's notifications in-process: a fake ``send`` records what systemd would receive."""

from __future__ import annotations

from weightcache.config import ModelConfig, Placement
from weightcache.daemon.state import ServiceState
from weightcache.daemon.ticker import EXTEND_TIMEOUT_S, Ticker
from weightcache.errors import ModelNotFound


def _ticker(watchdog_s: float = 0):
    st = ServiceState(0, "host", {}, [Placement(ModelConfig(n, f"/srv/{n}"), 1, 0, 0) for n in ("a", "b")])
    sent: list[str] = []
    return st, Ticker(st, sent.append, watchdog_s), sent


def test_extend_while_loading_then_ready_once():
    st, t, sent = _ticker()
    t.tick(100.0)
    assert sent == [f"STATUS=loading a/tp1/rank0: planning; 0/2 ready\nEXTEND_TIMEOUT_USEC={int(EXTEND_TIMEOUT_S * 1e6)}"]
    sent.clear()
    t.tick(100.5)  # nothing changed, nothing due
    assert sent == []
    t.tick(100.0 + EXTEND_TIMEOUT_S / 3)
    assert sent == [f"EXTEND_TIMEOUT_USEC={int(EXTEND_TIMEOUT_S * 1e6)}"]
    sent.clear()
    a, b = st.slots
    a.start(0.0)
    a.fail(ModelNotFound("gone"))
    b.start(0.0)
    b.loaded(None, None, None)
    st.loads_done = 2
    t.tick(200.0)
    line = "ready: 1/2 slabs resident; failed: a/tp1/rank0 (model_not_found)"
    assert sent == [f"STATUS={line}\nEXTEND_TIMEOUT_USEC={int(EXTEND_TIMEOUT_S * 1e6)}", f"READY=1\nSTATUS={line}"]
    sent.clear()
    t.tick(300.0)
    assert sent == []  # READY=1 once; no more EXTEND_TIMEOUT after it


def test_watchdog_pings_at_its_interval():
    st, t, sent = _ticker(watchdog_s=5.0)
    t.tick(100.0)
    t.tick(102.0)
    t.tick(105.5)
    assert [m for m in sent if m == "WATCHDOG=1"] == ["WATCHDOG=1", "WATCHDOG=1"]
