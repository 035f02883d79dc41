"""Issue 38, P4 and P6: who may displace whom in the memory budget, against a live service (as an unprivileged
uid), the attacker a socket-group member of another uid.

Before: three ``wait_ms=0`` attaches of an open model by a uid off ``secret``'s allow list shelved ``secret``
(its owner's attach 0.001 -> 0.136 s median under thrash, 83 loads in 25 s); a priority -1000 model evicted
priority 0, 500 and 1000 slabs. Now a demand load displaces only slabs of at most its model's priority that the
requester may attach, and one uid's loads displace others at most 8 times a minute.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from attackers import (NOBODY, SERVICE_UID, back_to_baseline, baseline_figures, fork_as,  # noqa: E402
                       open_socket_to_all, reap, result)
from weightcache import protocol  # noqa: E402
from service_harness import make_config, poll_until, record_figures  # noqa: E402
from checkpoints import compare_bytes, one_tensor_checkpoint, ONE_TENSOR_N, ONE_TENSOR_SLAB, read_checkpoint  # noqa: E402
from weightcache import attach  # noqa: E402
from weightcache.errors import WeightcacheError  # noqa: E402

pytestmark = pytest.mark.timeout(240)

N, SLAB = ONE_TENSOR_N, ONE_TENSOR_SLAB
OWNER = 61200


@pytest.fixture
def shared_dir():
    d = tempfile.mkdtemp(prefix="wc-budget-", dir="/tmp")  # other uids read the checkpoints (the key check)
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _ckpt(dest: Path, seed: int) -> Path:
    ck = one_tensor_checkpoint(dest, seed)
    for p in [ck, *ck.iterdir()]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return ck


def _tiers(svc) -> dict[str, str]:
    return {s["model"]: f"{s['state']}/{s['tier']}" for s in svc.status()["slabs"]}


def _attach_each(socket_dir: str, models: list[str]) -> dict:
    """As the attacker: attaches each of ``models`` in turn (waiting for its load), releasing it at once."""
    out = []
    for m in models:
        try:
            with attach(m, socket_dir=socket_dir, fallback=False, timeout=20):
                out.append("ok")
        except WeightcacheError as e:
            out.append(e.code)
    return {"outcomes": out}


def test_a_stranger_never_displaces_a_restricted_or_higher_priority_slab(daemon, shared_dir):
    cks = {n: _ckpt(shared_dir / n, i) for i, n in enumerate(("secret", "high", "low"))}
    svc = daemon(make_config({"secret": {"path": cks["secret"], "allow_users": [str(OWNER)]},
                              "high": {"path": cks["high"], "priority": 500},
                              "low": {"path": cks["low"], "priority": -1000, "preload": "disk"}},
                             memory_budget_bytes=2 * SLAB + SLAB // 2), run_as=SERVICE_UID)
    svc.wait_settled()
    open_socket_to_all(svc)
    assert _tiers(svc) == {"secret": "ready/gpu", "high": "ready/gpu", "low": "on_disk/disk"}
    before = svc.snapshot()
    pid, r = fork_as(NOBODY, NOBODY, [], _attach_each, svc.socket_dir, ["low", "low", "low"])
    try:
        got = result(r)
        with attach("high", socket_dir=svc.socket_dir, fallback=False, timeout=1.0) as w:  # root, meanwhile
            compared = compare_bytes(w.tensors, read_checkpoint(cks["high"]))
    finally:
        reap(pid, r)
    assert got["outcomes"] == ["insufficient_memory"] * 3, got
    assert _tiers(svc) == {"secret": "ready/gpu", "high": "ready/gpu", "low": "on_disk/disk"}
    after = back_to_baseline(svc, before)
    record_figures("attack.budget_displacement", "a uid off secret's allow list attaches a priority -1000 model "
                   "3 times", "service as uid 64000; each attach insufficient_memory; secret (restricted) and high "
                   "(priority 500) stay ready on the GPU; a well-behaved attach within 1 s; fds and RSS back",
                   clients=3, faults_injected=3, bytes_compared=compared, **baseline_figures(before, after))


def test_one_uids_loads_displace_others_at_most_8_times_a_minute(daemon, shared_dir):
    cks = {n: _ckpt(shared_dir / n, i) for i, n in enumerate(("one", "two"))}
    svc = daemon(make_config({"one": cks["one"], "two": {"path": cks["two"], "preload": "disk"}},
                             memory_budget_bytes=SLAB + SLAB // 2), run_as=SERVICE_UID)
    svc.wait_settled()
    open_socket_to_all(svc)
    pid, r = fork_as(NOBODY, NOBODY, [], _attach_each, svc.socket_dir, ["two", "one"] * 6)
    try:
        got = result(r, timeout=120)
    finally:
        reap(pid, r)
    # Each attach loads its model in place of the other: 8 displacing loads, then free room only (two is
    # refused, one is still resident and attaches).
    assert got["outcomes"] == ["ok"] * 8 + ["insufficient_memory", "ok"] * 2, got
    poll_until(lambda: all(not s["leases"] for s in svc.status()["slabs"]), "the leases to end")
    with attach("two", socket_dir=svc.socket_dir, fallback=False, timeout=20) as w:  # root: no such limit
        assert w.source == "daemon"
        compared = compare_bytes(w.tensors, read_checkpoint(cks["two"]))
    record_figures("attack.budget_thrash", "one uid switches between two models under a budget of one, 12 times",
                   "service as uid 64000; 8 loads displace the other model, then that uid's loads take free room "
                   "only (insufficient_memory); root's attach still displaces", clients=2, faults_injected=12,
                   bytes_compared=compared, displacing_loads=8)


def _attach_and_hold(socket_dir: str, models: list[str]) -> dict:
    """As the attacker: attaches each of ``models`` and keeps every lease (until the parent kills it)."""
    out = []
    for m in models:
        try:
            _HELD.append(attach(m, socket_dir=socket_dir, fallback=False, timeout=20))
            out.append("ok")
        except WeightcacheError as e:
            out.append(e.code)
    return {"outcomes": out}


_HELD: list = []


def _secret_keeps_its_room(svc) -> None:
    """The attacker (nobody) attaches and holds ``open1`` and ``open2``: its second load is
    ``insufficient_memory`` (``secret``'s room is held back); then ``secret``'s owner attaches it, and the attacker
    keeps what it holds."""
    pid, r = fork_as(NOBODY, NOBODY, [], _attach_and_hold, svc.socket_dir, ["open1", "open2"])
    try:
        got = result(r)
        assert got["outcomes"] == ["ok", "insufficient_memory"], got
        opid, orr = fork_as(OWNER, OWNER, [], _attach_each, svc.socket_dir, ["secret"])
        try:
            owner = result(orr)
        finally:
            reap(opid, orr)
        assert owner["outcomes"] == ["ok"], owner
        assert _tiers(svc)["open1"] == "ready/gpu"
    finally:
        reap(pid, r)


def test_leases_of_uids_off_a_restricted_models_lists_do_not_keep_it_out(daemon, shared_dir):
    """P3. ``secret`` (allow list: OWNER) was loaded, then shelved; the attacker (nobody) attaches and holds
    open models. Before: its loads filled the budget and its leases kept ``secret`` out (20/20
    ``insufficient_memory``). Now ``secret``'s room is held back from the attacker's loads: the one that would
    take it is refused, and the owner's attach loads ``secret``."""
    cks = {n: _ckpt(shared_dir / n, i) for i, n in enumerate(("secret", "open1", "open2"))}
    svc = daemon(make_config({"secret": {"path": cks["secret"], "allow_users": [str(OWNER)]},
                              "open1": {"path": cks["open1"], "preload": "disk"},
                              "open2": {"path": cks["open2"], "preload": "disk"}},
                             memory_budget_bytes=2 * SLAB + SLAB // 2), run_as=SERVICE_UID)
    svc.wait_settled()
    open_socket_to_all(svc)
    svc.request(protocol.Evict("secret", to="disk"))
    assert _tiers(svc)["secret"] == "on_disk/disk"
    _secret_keeps_its_room(svc)
    record_figures("attack.budget_reserve", "a uid off secret's allow list loads and holds open models while secret "
                   "waits on disk", "service as uid 64000; the load that would take secret's room is "
                   "insufficient_memory; secret's owner (another uid) attaches it", clients=3, faults_injected=2)


def test_a_restricted_model_never_loaded_keeps_its_room_too(daemon, shared_dir):
    """P3 for a model never planned. ``secret`` (allow list: OWNER, ``preload = "disk"``) has never been loaded;
    the attacker (nobody) attaches and holds open models. Before: no plan had sized ``secret``, so nothing was held
    back; the attacker's loads took the whole budget (both ``ok``) and its leases kept ``secret`` out (its owner's
    attach ``insufficient_memory``). Now the loader plans ``secret`` without loading it at start (its size
    shows in ``status``), its room is held back: the attacker's second load is refused and the owner's attach
    loads ``secret``."""
    cks = {n: _ckpt(shared_dir / n, i) for i, n in enumerate(("secret", "open1", "open2"))}
    svc = daemon(make_config({"secret": {"path": cks["secret"], "allow_users": [str(OWNER)], "preload": "disk"},
                              "open1": {"path": cks["open1"], "preload": "disk"},
                              "open2": {"path": cks["open2"], "preload": "disk"}},
                             memory_budget_bytes=2 * SLAB + SLAB // 2), run_as=SERVICE_UID)
    svc.wait_settled()
    open_socket_to_all(svc)
    poll_until(lambda: svc.slab("secret")["total_bytes"] == N * 4, "secret's plan without a load",
               detail=lambda: f"{svc.slab('secret')}\n{svc.log()}")
    assert _tiers(svc) == {"secret": "on_disk/disk", "open1": "on_disk/disk", "open2": "on_disk/disk"}
    assert svc.slab("open1")["total_bytes"] == 0  # open models are not planned ahead: nobody is kept out of them
    _secret_keeps_its_room(svc)
