"""The serving loop's effects in-process: ``verify`` runs off the loop (an evict meanwhile does not unmap the
slab under it), and a reload hands the new caps and operator groups on.

A :class:`~weightcache.daemon.loop.Daemon` is built in-process on the host
backend (no ``serve()``); the hashing is made to wait on an event so that the
test decides when it ends. While it waits, the loop's own work goes on, and a
forced evict of the slab being hashed only closes it once the verify is done.
"""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from service_harness import poll_until
from wire_helpers import read_reply
from checkpoints import write_checkpoint
from weightcache import protocol
from weightcache.config import Config, ModelConfig
from weightcache.daemon import handlers
from weightcache.daemon.loop import Daemon
from weightcache.daemon.state import Peer
from weightcache.daemon.clients import Client
from weightcache.memory.host import HostBackend

pytestmark = pytest.mark.timeout(60)


def test_evict_during_verify_closes_the_slab_after_the_hashing(tmp_path, monkeypatch):
    ck = write_checkpoint(tmp_path / "ck", {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "0.sock"))
    listener.listen(4)
    d = Daemon(Config(models={"m": ModelConfig("m", str(ck))}), 0, HostBackend(), listener)
    slot = d.state.slots[0]
    d.loader.start()
    d.loader.submit(slot)
    def sealed() -> bool:
        d._drain_loader()
        return slot.sealed is not None

    poll_until(sealed, "the load to seal its slab", 30, 0.01)
    sealed, closed = slot.sealed, []
    real_close = sealed.close
    sealed.close = lambda: (closed.append(True), real_close())

    hashing, finish = threading.Event(), threading.Event()
    real_verify = handlers.pipeline.verify

    def slow_verify(manifest, slab):
        hashing.set()
        finish.wait(30)
        return real_verify(manifest, slab)

    monkeypatch.setattr(handlers.pipeline, "verify", slow_verify)
    (a, b), (a2, b2) = socket.socketpair(), socket.socketpair()
    c, other = (Client(s, protocol.Connection(protocol.SERVER), Peer(1, 0, 0)) for s in (a, a2))
    c.conn.state = other.conn.state = protocol.READY
    d._on_message(c, protocol.Verify("m"))
    assert hashing.wait(10) and c.held  # on a worker thread; this client's later requests wait
    d._on_message(other, protocol.Status())  # the loop is free: another client is answered at once
    b2.settimeout(5)
    assert read_reply(b2)[0]["type"] == "status_reply"
    out = handlers.handle(d.ctx, Peer(2, 0, 0), protocol.Evict("m", force=True))
    for eff in out.effects:
        d._effect(c, eff)
    assert not closed  # the verify still reads it
    finish.set()
    def was_closed() -> bool:
        d._drain_loader()
        return bool(closed)

    poll_until(was_closed, "the evicted slab to be closed", 10, 0.01)
    assert not c.held
    b.settimeout(5)
    reply, _ = read_reply(b)
    assert reply["type"] == "verify_reply"
    assert [(r["model"], r["state"], r["mismatched"]) for r in reply["results"]] == [("m", "ready", [])]
    d.loader.stop()
    for s in (a, b, a2, b2, listener):
        s.close()


def test_a_reload_applies_the_caps_and_the_operator_groups(tmp_path):
    """The Reconfigure effect of a reload hands the new [service] caps to the transport and the new operator
    groups to the handlers' policy (a member of the new group may evict at once)."""
    import dataclasses

    from weightcache.config import ServiceConfig
    from weightcache.daemon.effects import Reconfigure

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "0.sock"))
    d = Daemon(Config(), 0, HostBackend(), listener)
    peer = Peer(1, 54321, 54321, groups=(4242,))
    assert d.transport.limits.max_unread_replies == ServiceConfig().max_unread_replies
    assert handlers.handle(d.ctx, peer, protocol.Preload("x")).replies[0].msg.code == "access_denied"
    new = Config(service=dataclasses.replace(ServiceConfig(), max_unread_replies=3, operator_groups=("4242",)))
    d._reconfigure(None, Reconfigure(new))
    assert d.transport.limits.max_unread_replies == 3
    assert handlers.handle(d.ctx, peer, protocol.Preload("x")).replies[0].msg.code == "model_not_found"  # allowed
    listener.close()
