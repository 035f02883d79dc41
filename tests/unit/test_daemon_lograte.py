"""Warnings about one peer are rate-limited (issue 25: one connection wrote 14,207 warning lines per second)."""

import logging

from weightcache.daemon import lograte


def test_each_peer_gets_a_burst_per_interval_then_one_summary(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(lograte, "_clock", lambda: now[0])
    monkeypatch.setattr(lograte, "_seen", {})
    log = logging.getLogger("weightcache.test")
    caplog.set_level(logging.WARNING)
    written = [lograte.warn_peer(log, 7, 1000, "rejected %d", i) for i in range(1000)]
    other = lograte.warn_peer(log, 8, 1000, "another peer")
    assert sum(written) == lograte.BURST and other  # a flood costs its own peer, not the next one
    assert len(caplog.records) == lograte.BURST + 1
    now[0] += lograte.INTERVAL_S
    lograte.flush()
    summary = [r.getMessage() for r in caplog.records if "suppressed" in r.getMessage()]
    assert summary == [f"suppressed warnings peer_pid=7 peer_uid=1000 count={1000 - lograte.BURST} "
                       f"interval_s={lograte.INTERVAL_S:.0f}"]
    assert lograte.warn_peer(log, 7, 1000, "again") and not lograte._seen.get((8, 1000))
