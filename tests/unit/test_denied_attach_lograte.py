"""Denied attaches and operator requests are rate-limited like the transport's warnings (issue 38, P13): one
connection's refused attaches wrote a WARNING each (2,132 lines/s measured); now :data:`lograte.BURST` lines per
peer and interval, then one ``suppressed warnings`` summary."""

from __future__ import annotations

import logging

import pytest

from weightcache.config import ModelConfig, Placement
from weightcache.daemon import access, lograte
from weightcache.daemon.state import Peer, Slot
from weightcache.errors import AccessDenied


def test_a_flood_of_denied_attaches_writes_a_burst_then_one_summary(monkeypatch, caplog):
    now = [50.0]
    monkeypatch.setattr(lograte, "_clock", lambda: now[0])
    monkeypatch.setattr(lograte, "_seen", {})
    caplog.set_level(logging.WARNING)
    policy = access.Policy(service_uid=999)
    slot = Slot(Placement(ModelConfig("m", "/nonexistent", allow_users=("1",)), 1, 0, 0))
    attacker, other = Peer(7, 2004, 100), Peer(8, 2005, 100)
    for _ in range(1000):
        with pytest.raises(AccessDenied):
            access.check_attach(attacker, slot, policy)
        with pytest.raises(AccessDenied):
            access.check_operator(attacker, policy, "evict", "m")
    with pytest.raises(AccessDenied):
        access.check_attach(other, slot, policy)  # another peer still gets its line
    lines = [r.getMessage() for r in caplog.records]
    assert sum("peer_uid=2004" in x for x in lines) == lograte.BURST, lines
    assert sum("peer_uid=2005" in x for x in lines) == 1
    now[0] += lograte.INTERVAL_S
    lograte.flush()
    assert [r.getMessage() for r in caplog.records if "suppressed" in r.getMessage()] == [
        f"suppressed warnings peer_pid=7 peer_uid=2004 count={2000 - lograte.BURST} interval_s=10"]
