"""``insufficient_memory`` shows a requester what ``status`` shows it (issue 38, P5): a restricted model's slab is
one unnamed sum of bytes, its leases left out; other uids' leases keep their id, with pid and uid hidden. Before,
the refusal and the slab's ``status`` error named the restricted model and every lease holder's pid and uid."""

from __future__ import annotations

import json

import pytest

from weightcache import protocol
from weightcache.config import ModelConfig, Placement
from weightcache.daemon import handlers
from weightcache.daemon.effects import Context
from weightcache.daemon.state import Lease, Peer, ServiceState, SlotState
from weightcache.daemon.tiers import Tiers
from weightcache.errors import InsufficientMemory

ME, OTHER, OWNER = 2000, 2001, 2002


class Fake:
    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes

    def close(self) -> None:
        pass


def _refused():
    models = [ModelConfig("secret", "/m/secret", allow_users=(str(OWNER),)), ModelConfig("open", "/m/open"),
              ModelConfig("mine", "/m/mine")]
    st = ServiceState(0, "cuda", {}, [Placement(m, 1, 0, 0) for m in models], service_uid=999)
    secret, open_, mine = st.slots
    for s, pid, uid, lease in ((secret, 31, OWNER, 5), (open_, 32, OTHER, 6)):
        s.state, s.sealed, s.manifest_file = SlotState.READY, Fake(6), Fake(1)
        s.leases[lease] = Lease(lease, s, pid, uid, uid, 0.0, "zero_copy")
    mine.state = SlotState.LOADING
    _, refusal = Tiers(12, 0, lambda sealed, label: None).admit(st, mine, 6, evict=True)
    assert refusal is not None and "secret" in refusal.message  # the operator's view: everything
    mine.state, mine.refusal = SlotState.ON_DISK, refusal
    ctx = Context(st, lambda: (0, 100))
    return ctx, mine


def test_a_refused_attach_names_only_what_status_shows_the_requester():
    ctx, mine = _refused()
    peer = Peer(41, ME, ME)
    with pytest.raises(InsufficientMemory) as got:
        handlers.answer_attach(ctx, peer, protocol.Attach("mine"), mine)
    e = got.value
    told = e.message + json.dumps(e.details)
    assert e.code == "insufficient_memory"
    assert "secret" not in told and "31" not in told and str(OWNER) not in told, told
    assert str(OTHER) not in told and "pid 32" not in told, told
    assert [r["slab"] for r in e.details["resident"]] == ["open/tp1/rank0", "other models"]
    assert e.details["resident"][1]["size_bytes"] == 6
    assert e.details["leases"] == [{"slab": "open/tp1/rank0", "lease_id": 6, "pid": -1, "uid": -1}]
    (reply,) = handlers.handle(ctx, peer, protocol.Status()).replies
    (slab,) = [s for s in reply.msg.status["slabs"] if s["model"] == "mine"]
    assert "secret" not in json.dumps(slab["error"]) and str(OTHER) not in json.dumps(slab["error"])


def test_root_and_the_owner_see_their_own():
    ctx, mine = _refused()
    with_all = handlers._refusal_for(ctx, Peer(1, 0, 0), mine.refusal)
    assert "secret" in with_all.message and "pid 32 uid 2001" in with_all.message
    owner = handlers._refusal_for(ctx, Peer(51, OWNER, OWNER), mine.refusal)
    assert "secret/tp1/rank0" in owner.message and "pid 31 uid 2002" in owner.message  # its own lease
    assert "pid 32" not in owner.message
