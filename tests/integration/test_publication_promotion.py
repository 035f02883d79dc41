"""Issue 35: a publication whose promotion from the host tier fails its digests leaves the service.

Against a real ``weightcache serve`` (host backend) over its socket. On the host backend both tiers are one memfd
and a promotion copies nothing; test_guards_integrity's ``sitecustomize`` (``WC_TEST_COPY_TIERS``) makes the
demotion and the promotion copy as the CUDA backend's do, and flips one bit of the host-tier copy of the
publication as it is sealed, after the digests recorded at its commit: the promotion of that copy finds the
changed tensor.

A publication cannot be loaded again from the checkpoint (only its engine makes it), so a failed promotion drops
it as the budget drops one: the attach that asked for it is answered ``model_not_found`` with
``publication = "none"`` and ``cause = "digest_mismatch"`` (the engine loads and publishes it again), the slot leaves ``status`` and ``list`` (no ``failed`` publication beside the next one),
its host copy leaves the fd store, the journal has a ``publication_dropped`` line and the
``weightcache_publications_dropped`` counter counts it (reason ``digest_mismatch``); the model is back to
``waiting_for_engine`` alone, and the next publication is created and attached cleanly, bytes equal.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from service_harness import FdStoreStandIn, make_config, poll_until, service_env, to_toml  # noqa: E402
from test_guards_integrity import _flip_env  # noqa: E402
from test_waiting_for_engine import SLAB, _key, _plain, _processed, _tiers, _tiny  # noqa: E402
from weightcache import attach, errors, protocol  # noqa: E402
from weightcache.client import attach_published, publish  # noqa: E402
from weightcache.session import Session  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "flipped-in-host-tier"])
def test_a_publication_that_fails_its_promotion_is_dropped_and_published_again(daemon, tmp_path, corrupt):
    """Budget of two slabs: the publication and ``a`` fill it; an attach of ``b`` demotes the publication (least
    recently used) to the host tier, where its copy is flipped (``corrupt``). The ``attach_published`` that promotes
    it is refused and the publication is gone (intact: promoted, bytes equal); the engine's next publication is
    created, attached, bytes equal."""
    ck = _tiny(tmp_path / "ck")
    cks = {"a": _plain(tmp_path / "a", 1), "b": _plain(tmp_path / "b", 2)}
    env, flipped = _flip_env(tmp_path, "host-tier:m/" if corrupt else "no-such-label", 12345, copy_tiers=True)
    svc = daemon(make_config({"m": {"path": str(ck), "naming": "vllm"}, "a": cks["a"],
                              "b": {"path": str(cks["b"]), "preload": "disk"}},
                             memory_budget_bytes=2 * SLAB + SLAB // 2, host_tier_bytes=4 * SLAB), env=env)
    svc.wait_settled()
    tensors = _processed(ck)
    first = publish(str(ck), _key(), tensors, socket_dir=svc.socket_dir)
    assert first.created
    with attach(str(cks["a"]), socket_dir=svc.socket_dir, fallback=False, timeout=30) as w:
        pass  # a is used after the publication: the publication is the least recently used
    del w
    gc.collect()
    poll_until(lambda: not svc.slab("a")["leases"], "a's lease to end")
    with attach(str(cks["b"]), socket_dir=svc.socket_dir, fallback=False, timeout=30) as w:
        pass
    del w  # its views map b's slab: the budget counts a slab something maps until they go
    gc.collect()
    poll_until(lambda: not svc.slab("b")["leases"], "b's lease to end")
    assert _tiers(svc) == {"m": "waiting_for_engine/disk", "a": "ready/gpu", "b": "ready/gpu", "m+pub": "hosted/host"}
    assert flipped.read_text() == (f"host-tier:{first.label}\n" if corrupt else "")
    if not corrupt:
        with attach_published(str(ck), _key(), socket_dir=svc.socket_dir) as w:
            assert torch.equal(w.tensors["w2"], tensors["w2"])
        assert "promoted model=m" in svc.log() and "copied=yes" in svc.log()
        return

    # the engine is told none is held (it loads and publishes again at once), and why
    with pytest.raises(errors.ModelNotFound) as e:
        attach_published(str(ck), _key(), socket_dir=svc.socket_dir, timeout=60)
    assert (e.value.details["publication"], e.value.details["cause"]) == ("none", "digest_mismatch"), e.value.details
    assert "differ from their digests after the promotion" in e.value.message, e.value.message
    assert "publishes it again" in e.value.message and "evict" not in e.value.message, e.value.message
    assert "promoted model=m" not in svc.log()
    # gone, not failed: status, list and the STATUS line show the model waiting for its engine alone
    poll_until(lambda: "m+pub" not in _tiers(svc), "the failed publication to leave the service", 30,
               detail=svc.log)
    st = svc.status()
    assert [(s["state"], bool(s.get("publication"))) for s in st["slabs"] if s["model"] == "m"] == [
        ("waiting_for_engine", False)], st["slabs"]
    assert "failed" not in {s["state"] for s in st["slabs"]}, st["slabs"]
    assert "(published)" not in st["status_line"] and "failed" not in st["status_line"], st["status_line"]
    out = subprocess.run([sys.executable, "-m", "weightcache", "list", "--socket-dir", svc.socket_dir],
                         capture_output=True, text=True, timeout=60, env=service_env(), check=False)
    rows = out.stdout.splitlines()[1:]
    assert [r.split()[1:5] for r in rows if r.split()[1] == "m"] == [["m", "1", "0", "waiting_for_engine"]], out.stdout
    # its host copy is closed (the service holds no fd of it any more; under systemd it also left the fd store)
    def host_copies() -> list[str]:
        fds = f"/proc/{svc.proc.pid}/fd"
        out = []
        for fd in os.listdir(fds):
            with contextlib.suppress(OSError):
                out.append(os.readlink(f"{fds}/{fd}"))
        return [t for t in out if f"host-tier:{first.label}" in t]

    poll_until(lambda: not host_copies(), "the dropped publication's host copy to be closed", 30, detail=svc.log)
    log = svc.log()
    assert (f"publication dropped model=m tp_size=1 rank=0 slab={first.label} reason=digest_mismatch" in log
            and "its model waits for its engine" in log), log
    counters = svc.request(protocol.Metrics()).counters
    assert {"model": "m", "tp_size": 1, "tp_rank": 0, "reason": "digest_mismatch", "count": 1} in \
        counters["publications_dropped"], counters["publications_dropped"]
    if not os.path.isdir("/run/systemd/system"):  # `weightcache metrics` asks only running units under systemd
        text = subprocess.run([sys.executable, "-m", "weightcache", "metrics", "--socket-dir", svc.socket_dir],
                              capture_output=True, text=True, timeout=60, env=service_env(), check=False).stdout
        assert ('weightcache_publications_dropped_total{gpu="0",gpu_uuid="",model="m",reason="digest_mismatch",'
                'tp_rank="0",tp_size="1"} 1.0' in text), text[-3000:]
    with pytest.raises(errors.ModelNotFound) as e:
        attach_published(str(ck), _key(), socket_dir=svc.socket_dir)
    assert e.value.details["publication"] == "none"  # the engine loads and publishes again

    # the next engine start publishes again, cleanly: one publication, ready, attached by key
    again = publish(str(ck), _key(), tensors, socket_dir=svc.socket_dir)
    assert again.created
    with attach_published(str(ck), _key(), socket_dir=svc.socket_dir) as w:
        assert torch.equal(w.tensors["w2"], tensors["w2"])
    pubs = [s for s in svc.status()["slabs"] if s.get("publication")]
    assert [(s["state"], s["tier"]) for s in pubs] == [("ready", "gpu")], pubs


def _status(listen) -> dict | None:
    if not os.path.exists(listen):
        return None
    try:
        s = Session(str(listen), timeout=10)
    except errors.DaemonUnavailable:
        return None
    try:
        return s.request(protocol.Status()).status
    finally:
        s.close()


def test_the_dropped_publications_host_copy_leaves_the_fd_store_and_no_restart_brings_it_back(tmp_path):
    """Under systemd's fd store (stood in for): the publication's host copy is stored when it is demoted
    (``evict --to host``: ``host-<id>``), removed (``FDSTOREREMOVE``) when its failed promotion drops it; a restart
    of the service then brings nothing of it back, and the model waits for its engine."""
    ck = _tiny(tmp_path / "ck")
    env, flipped = _flip_env(tmp_path, "host-tier:m/", 12345, copy_tiers=True)
    cfg, listen, log = tmp_path / "weightcache.toml", tmp_path / "0.sock", tmp_path / "serve.log"
    cfg.write_text(to_toml(make_config({"m": {"path": str(ck), "naming": "vllm"}},
                                       memory_budget_bytes=2 * SLAB, host_tier_bytes=2 * SLAB)))
    sock = str(tmp_path)

    def tiers(proc) -> dict[str, str]:
        assert proc.poll() is None, log.read_text()
        store.drain()
        st = _status(listen) or {"slabs": []}
        return {s["model"] + ("+pub" if s.get("publication") else ""): f"{s['state']}/{s['tier']}"
                for s in st["slabs"]}

    def request(msg):
        s = Session(str(listen), timeout=30)
        try:
            return s.request(msg)
        finally:
            s.close()

    with FdStoreStandIn(tmp_path / "notify") as store:
        first = store.serve(cfg, listen, log, env=env)
        poll_until(lambda: tiers(first).get("m") == "waiting_for_engine/disk", "the service to settle", 60,
                   detail=log.read_text)
        pub = publish(str(ck), _key(), _processed(ck), socket_dir=sock)
        assert request(protocol.Evict("m", to="host")).evicted == [pub.label]
        poll_until(lambda: tiers(first).get("m+pub") == "hosted/host", "the publication to reach the host tier", 30,
                   detail=log.read_text)
        assert flipped.read_text() == f"host-tier:{pub.label}\n"
        store.drain()
        hosts = [n for n in store.fds if n.startswith("host-")]
        assert len(hosts) == 1 and "manifest-" + hosts[0].removeprefix("host-") in store.fds, sorted(store.fds)
        sid = hosts[0].removeprefix("host-")
        with pytest.raises(errors.ModelNotFound) as e:
            attach_published(str(ck), _key(), socket_dir=sock, timeout=60)
        assert e.value.details["cause"] == "digest_mismatch", e.value.details
        poll_until(lambda: "m+pub" not in tiers(first), "the publication to be dropped", 30, detail=log.read_text)
        poll_until(lambda: not [n for n in (store.drain(), store.fds)[1] if n.endswith(sid)],
                   "the publication's fd store entries to be removed", 30, detail=log.read_text)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0, log.read_text()
        store.drain()
        second = store.serve(cfg, listen, log)
        poll_until(lambda: tiers(second).get("m") == "waiting_for_engine/disk", "the restarted service to settle", 60,
                   detail=log.read_text)
        assert tiers(second) == {"m": "waiting_for_engine/disk"}
        with pytest.raises(errors.ModelNotFound) as e:
            attach_published(str(ck), _key(), socket_dir=sock)
        assert e.value.details["publication"] == "none"
