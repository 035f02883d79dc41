"""More models than the budget holds (issue 24): a real ``weightcache serve`` on the host backend.

On the host backend the tiers are the same memory, so what these tests check is
the memory budget and the eviction policy: which slab leaves, that a leased one
never does, what an attach that needs room gets, that the bytes an engine maps
after a switch equal the checkpoint's, and that the budget is never exceeded
(``status`` sampled on another connection during the switches).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")

from service_harness import FdStoreStandIn, make_config, poll_until, service_env, to_toml  # noqa: E402
from checkpoints import compare_bytes, one_tensor_checkpoint, ONE_TENSOR_N, ONE_TENSOR_SLAB, read_checkpoint  # noqa: E402
from weightcache import attach, protocol  # noqa: E402
from weightcache.session import Session  # noqa: E402
from weightcache.errors import InsufficientMemory, LeaseBusy  # noqa: E402

pytestmark = pytest.mark.timeout(180)

#: Elements of each model's one tensor: 2 MiB of float32, so a slab is 2 MiB and a page.
N, SLAB = ONE_TENSOR_N, ONE_TENSOR_SLAB


def _ckpt(dest, seed: int):
    return one_tensor_checkpoint(dest, seed)


def _tiers(svc) -> dict[str, str]:
    return {s["model"]: f"{s['state']}/{s['tier']}" for s in svc.status()["slabs"]}


def _attach(svc, model: str):
    return attach(model, socket_dir=svc.socket_dir, fallback=False, timeout=60)


def _unleased(svc, model: str) -> None:
    """Waits until the service has ended every lease on ``model`` (a closed client's release is its own
    connection's business: another connection's request may be read first)."""
    poll_until(lambda: not svc.slab(model)["leases"], f"the leases on {model} to end")


class Sampler:
    """Reads ``status`` on its own connection until stopped; keeps the highest budget use seen and checks
    each sample against the budget (slabs on the GPU tier, and the service's own ``gpu_bytes``)."""

    def __init__(self, svc) -> None:
        self.svc, self.samples, self.worst = svc, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        s = self.svc.session(10)
        try:
            while not self._stop.is_set():
                st = s.request(protocol.Status()).status
                on_gpu = sum(sl["resident_bytes"] for sl in st["slabs"] if sl["tier"] == "gpu")
                mem = st["memory"]
                self.samples += 1
                if max(on_gpu, mem["gpu_bytes"]) > mem["budget_bytes"]:
                    self.worst.append((on_gpu, mem["gpu_bytes"], mem["budget_bytes"], st["status_line"]))
        finally:
            s.close()

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        assert self.samples > 0 and not self.worst, self.worst


@pytest.mark.parametrize("host_tier", [0, 4 * SLAB], ids=["no-host-tier", "host-tier"])
def test_attach_switches_between_two_models_under_a_budget_of_one(daemon, tmp_path, host_tier):
    cks = {"a": _ckpt(tmp_path / "a", 1), "b": _ckpt(tmp_path / "b", 2)}
    # The same priority: a load never displaces a slab of a higher priority than its own model's (issue 38, P6).
    svc = daemon(make_config({"a": cks["a"], "b": cks["b"]},
                             memory_budget_bytes=SLAB + SLAB // 2, host_tier_bytes=host_tier))
    st = svc.wait_settled()
    assert st["memory"]["budget_bytes"] == SLAB + SLAB // 2 and st["memory"]["host_tier_bytes"] == host_tier
    assert _tiers(svc) == {"a": "ready/gpu", "b": "on_disk/disk"}  # configuration order at start, up to the budget
    away = "hosted/host" if host_tier else "on_disk/disk"
    with Sampler(svc):
        b = _attach(svc, "b")  # demand load: a leaves the GPU
        try:
            assert _tiers(svc) == {"a": away, "b": "ready/gpu"}
            compare_bytes(b.tensors, read_checkpoint(cks["b"]))
        finally:
            b.close()
        _unleased(svc, "b")
        a = _attach(svc, "a")  # and back: promoted from the host tier, or loaded again
        try:
            assert _tiers(svc) == {"a": "ready/gpu", "b": away}
            compare_bytes(a.tensors, read_checkpoint(cks["a"]))
        finally:
            a.close()
    log = svc.log()
    assert ("demoted model=a" in log) == bool(host_tier) and ("promoted model=a" in log) == bool(host_tier)
    assert ("shelved model=a" in log) != bool(host_tier)


def test_a_leased_slab_is_never_evicted_and_the_attach_gets_insufficient_memory(daemon, tmp_path):
    cks = {"a": _ckpt(tmp_path / "a", 1), "b": _ckpt(tmp_path / "b", 2)}
    svc = daemon(make_config({"a": cks["a"], "b": cks["b"]}, memory_budget_bytes=SLAB + SLAB // 2))
    svc.wait_settled()
    a = _attach(svc, "a")
    try:
        lease = svc.slab("a")["leases"][0]
        with pytest.raises(InsufficientMemory) as ei:
            _attach(svc, "b")
        d = ei.value.details
        assert d["budget_bytes"] == SLAB + SLAB // 2 and d["need_bytes"] == SLAB and d["model"] == "b"
        assert d["leases"] == [{"slab": "a/tp1/rank0", "lease_id": lease["lease_id"], "pid": lease["pid"],
                                "uid": lease["uid"]}]
        assert [r["slab"] for r in d["resident"]] == ["a/tp1/rank0"]
        assert _tiers(svc) == {"a": "ready/gpu", "b": "on_disk/disk"}  # nothing resident lost
        compare_bytes(a.tensors, read_checkpoint(cks["a"]))
    finally:
        a.close()
    _unleased(svc, "a")  # released: the same attach now makes room
    b = _attach(svc, "b")
    try:
        compare_bytes(b.tensors, read_checkpoint(cks["b"]))
        assert _tiers(svc) == {"a": "on_disk/disk", "b": "ready/gpu"}
    finally:
        b.close()


def test_pin_and_priority_decide_the_order(daemon, tmp_path):
    names = {"p": {"pin": True}, "hi": {"priority": 5}, "lo": {}, "x": {}}
    cks = {n: _ckpt(tmp_path / n, i) for i, n in enumerate(names)}
    svc = daemon(make_config({n: {"path": cks[n], **extra} for n, extra in names.items()},
                             memory_budget_bytes=3 * SLAB + SLAB // 2))
    svc.wait_settled()
    # Start-up: pinned first, then by priority, then as configured, until the budget is full.
    assert _tiers(svc) == {"p": "ready/gpu", "hi": "ready/gpu", "lo": "ready/gpu", "x": "on_disk/disk"}
    _attach(svc, "x").close()  # lo leaves (lowest priority), though hi was used less recently
    _unleased(svc, "x")
    assert _tiers(svc) == {"p": "ready/gpu", "hi": "ready/gpu", "lo": "on_disk/disk", "x": "ready/gpu"}
    _attach(svc, "lo").close()  # x (priority 0) leaves, hi stays, p never moves
    assert _tiers(svc) == {"p": "ready/gpu", "hi": "ready/gpu", "lo": "ready/gpu", "x": "on_disk/disk"}


def test_status_json_and_metrics_show_tiers(daemon, tmp_path):
    cks = {"a": _ckpt(tmp_path / "a", 1), "b": _ckpt(tmp_path / "b", 2)}
    svc = daemon(make_config({"a": cks["a"], "b": {"path": cks["b"], "preload": "host"}},
                             memory_budget_bytes=SLAB + SLAB // 2, host_tier_bytes=2 * SLAB))
    svc.wait_settled()
    out = subprocess.run([sys.executable, "-m", "weightcache", "status", "--json", "--socket-dir", svc.socket_dir],
                         capture_output=True, text=True, env=service_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    (inst,) = doc["gpus"]
    slabs = {s["model"]: s for s in inst["slabs"]}
    assert (slabs["a"]["tier"], slabs["b"]["tier"]) == ("gpu", "host")
    assert slabs["b"]["host_bytes"] == SLAB and slabs["b"]["state"] == "hosted"
    assert inst["memory"]["gpu_bytes"] == SLAB and inst["memory"]["host_used_bytes"] == SLAB
    from weightcache import metrics

    status, counters = svc.request(protocol.Metrics()).typed()
    fam = metrics._Families()
    metrics._add_instance(fam, metrics.Instance(0, True, "active", status, counters))
    got = {(name, s.labels.get("model"), s.labels.get("tier")): s.value for name, f in fam.f.items()
           for s in f.samples}
    assert got[("weightcache_slab_tier", "a", "gpu")] == 1 and got[("weightcache_slab_tier", "a", "host")] == 0
    assert got[("weightcache_slab_tier", "b", "host")] == 1 and got[("weightcache_slab_tier", "b", "gpu")] == 0
    assert got[("weightcache_memory_budget_bytes", None, None)] == SLAB + SLAB // 2
    assert got[("weightcache_host_tier_used_bytes", None, None)] == SLAB


def test_reload_lowering_the_budget_demotes_only_unleased_slabs(daemon, tmp_path):
    cks = {"a": _ckpt(tmp_path / "a", 1), "b": _ckpt(tmp_path / "b", 2)}
    cfg = make_config({"a": cks["a"], "b": cks["b"]}, memory_budget_bytes=4 * SLAB)
    svc = daemon(cfg)
    svc.wait_settled()
    assert _tiers(svc) == {"a": "ready/gpu", "b": "ready/gpu"}
    a = _attach(svc, "a")
    try:
        cfg["service"]["memory_budget_bytes"] = SLAB + SLAB // 2
        svc.write_config(cfg)
        reply = svc.request(protocol.Reload())
        assert _tiers(svc) == {"a": "ready/gpu", "b": "on_disk/disk"}
        assert reply.moved == ["b/tp1/rank0 -> disk"], reply  # issue 39: the report says what the budget moved
        cfg["service"]["memory_budget_bytes"] = SLAB // 2  # below the leased slab: it stays all the same
        svc.write_config(cfg)
        svc.request(protocol.Reload())
        assert _tiers(svc) == {"a": "ready/gpu", "b": "on_disk/disk"}
        assert svc.status()["memory"]["budget_bytes"] == SLAB // 2
        compare_bytes(a.tensors, read_checkpoint(cks["a"]))
    finally:
        a.close()
    assert "over memory budget" in svc.log()


def test_preload_host_then_attach_promotes_and_evict_to_moves_by_hand(daemon, tmp_path):
    cks = {"a": _ckpt(tmp_path / "a", 1), "b": _ckpt(tmp_path / "b", 2)}
    svc = daemon(make_config({"a": cks["a"], "b": {"path": cks["b"], "preload": "host"}},
                             memory_budget_bytes=SLAB + SLAB // 2, host_tier_bytes=2 * SLAB))
    svc.wait_settled()
    assert _tiers(svc) == {"a": "ready/gpu", "b": "hosted/host"}
    b = _attach(svc, "b")  # promoted from the host tier; a demoted there
    try:
        assert _tiers(svc) == {"a": "hosted/host", "b": "ready/gpu"}
        compare_bytes(b.tensors, read_checkpoint(cks["b"]))
        with pytest.raises(LeaseBusy):  # a leased slab is not moved by hand either
            svc.request(protocol.Evict("b", to="host"))
    finally:
        b.close()
    _unleased(svc, "b")
    del b  # and unmaps it: a slab an engine still maps counts against the budget once evicted (issue 38, P2)
    gc.collect()
    env = service_env()
    for args, want in ((["b", "--to", "disk"], {"a": "hosted/host", "b": "on_disk/disk"}),
                       (["a", "--to", "disk"], {"a": "on_disk/disk", "b": "on_disk/disk"})):
        out = subprocess.run([sys.executable, "-m", "weightcache", "evict", *args, "--socket-dir", svc.socket_dir],
                             capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0 and f"moved {args[0]}/tp1/rank0 to disk" in out.stdout, out.stdout + out.stderr
        assert _tiers(svc) == want
    out = subprocess.run([sys.executable, "-m", "weightcache", "preload", "a", "--socket-dir", svc.socket_dir],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert _tiers(svc) == {"a": "ready/gpu", "b": "on_disk/disk"}
    svc.request(protocol.Evict("a", to="host"))
    assert _tiers(svc) == {"a": "hosted/host", "b": "on_disk/disk"}
    a = _attach(svc, "a")
    try:
        compare_bytes(a.tensors, read_checkpoint(cks["a"]))
    finally:
        a.close()


# --- a slow demotion copy (as CUDA's GPU -> pinned host copy), injected on the host backend ----------------

_SLOW_DEMOTE = '''
import os
from weightcache.memory import host as _host

_demote = _host.HostBackend.demote


def demote(self, sealed, label):
    fd = os.open(os.environ["WC_TEST_DEMOTE_GATE"], os.O_RDWR)  # opens at once; the read blocks until a byte
    try:
        with open(os.environ["WC_TEST_DEMOTE_LOG"], "a") as f:
            f.write(label + "\\n")
        os.read(fd, 1)
    finally:
        os.close(fd)
    return _demote(self, sealed, label)


_host.HostBackend.demote = demote
'''


def _slow_demote_env(tmp_path):
    """``env=`` for a service whose every demotion copy blocks until :func:`_let_demotion_finish` (a
    ``sitecustomize`` wraps ``HostBackend.demote``, which the service runs on a worker thread, with a read of
    a FIFO); each demotion appends its slab's label to the returned log once it is under way."""
    from service_harness import SERVICE_DIR

    site = tmp_path / "slow-demote-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SLOW_DEMOTE)
    gate, started = tmp_path / "demote.gate", tmp_path / "demotions.log"
    os.mkfifo(gate)
    started.write_text("")
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(SERVICE_DIR)]), "WC_TEST_DEMOTE_GATE": str(gate),
           "WC_TEST_DEMOTE_LOG": str(started)}
    return env, gate, started


def _let_demotion_finish(gate) -> None:
    fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)  # the blocked copy holds the FIFO open
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)


class _InThread:
    """Runs ``fn()`` on a thread; ``result()`` joins and returns its value (or raises its exception)."""

    def __init__(self, fn) -> None:
        self.value, self.error, self.done = None, None, threading.Event()

        def run() -> None:
            try:
                self.value = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in result()
                self.error = e
            finally:
                self.done.set()

        threading.Thread(target=run, daemon=True).start()

    def result(self, timeout: float = 60.0):
        assert self.done.wait(timeout), "the request did not return"
        if self.error is not None:
            raise self.error
        return self.value


def test_a_slow_demotion_blocks_no_other_client(daemon, tmp_path):
    """The copy of a demotion runs off the serving loop: while it is provably under way (blocked on a gate),
    ``status`` and an attach to another resident model are answered; then the switch completes with bytes
    equal to disk and the budget never exceeded. The same for ``evict --to host``."""
    cks = {n: _ckpt(tmp_path / n, i) for i, n in enumerate("abc", 1)}
    env, gate, started = _slow_demote_env(tmp_path)
    svc = daemon(make_config({"a": cks["a"], "b": cks["b"], "c": cks["c"]},
                             memory_budget_bytes=2 * SLAB + SLAB // 2, host_tier_bytes=4 * SLAB), env=env)
    svc.wait_settled()
    assert _tiers(svc) == {"a": "ready/gpu", "b": "ready/gpu", "c": "on_disk/disk"}
    with Sampler(svc):
        switch = _InThread(lambda: _attach(svc, "c"))  # room for c: a (least recently used) is demoted
        poll_until(lambda: started.read_text() == "a/tp1/rank0\n", "the demotion of a to start")
        st = {s["model"]: s for s in svc.status()["slabs"]}
        assert (st["a"]["state"], st["a"]["tier"], st["c"]["state"]) == ("ready", "gpu", "loading")
        assert (st["a"]["demoting"], st["b"]["demoting"]) == (True, False)  # the copy under way shows
        b = _attach(svc, "b")  # answered while a's copy is blocked
        try:
            compare_bytes(b.tensors, read_checkpoint(cks["b"]))
            assert not switch.done.is_set() and started.read_text() == "a/tp1/rank0\n"  # still under way
        finally:
            b.close()
        _let_demotion_finish(gate)
        c = switch.result()
        try:
            compare_bytes(c.tensors, read_checkpoint(cks["c"]))
            assert _tiers(svc) == {"a": "hosted/host", "b": "ready/gpu", "c": "ready/gpu"}
        finally:
            c.close()
        _unleased(svc, "b")
        _unleased(svc, "c")
        moved = _InThread(lambda: svc.request(protocol.Evict("b", to="host"), timeout=60))
        poll_until(lambda: started.read_text().endswith("b/tp1/rank0\n"), "the demotion of b to start")
        assert (svc.slab("b")["state"], svc.slab("b")["demoting"]) == ("ready", True)
        c = _attach(svc, "c")  # answered while b's copy is blocked
        try:
            compare_bytes(c.tensors, read_checkpoint(cks["c"]))
            assert not moved.done.is_set()
        finally:
            c.close()
        _let_demotion_finish(gate)
        assert moved.result().evicted == ["b/tp1/rank0"]
        assert _tiers(svc)["b"] == "hosted/host" and svc.slab("b")["demoting"] is False
    b = _attach(svc, "b")  # promoted back into the room b left
    try:
        compare_bytes(b.tensors, read_checkpoint(cks["b"]))
    finally:
        b.close()
    log = svc.log()
    assert "demoted model=a" in log and "demoted model=b" in log and "reason=evict --to host" in log


class Drain:
    """Reads the stand-in fd store's notify socket on a thread, as systemd always does (a datagram queue of
    ``net.unix.max_dgram_qlen`` = 10 left unread drops the service's next notifications, FDSTORE=1 ones with
    them), keeping stored fds
    by name as :meth:`FdStoreStandIn.collect` does and closing those ``FDSTOREREMOVE=1`` names, as systemd does
    (a slab the service let go of counts in its budget until nothing holds it, issue 38 P2)."""

    def __init__(self, store: FdStoreStandIn) -> None:
        self.store, self.stop = store, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.store.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                msg, fds, _, _ = socket.recv_fds(self.store.sock, 65536, 4)
            except TimeoutError:
                continue
            fields = dict(line.split("=", 1) for line in msg.decode().splitlines() if "=" in line)
            if fields.get("FDSTOREREMOVE") == "1":  # as systemd does: the stored fd is closed at once
                gone = self.store.fds.pop(fields.get("FDNAME", ""), None)
                if gone is not None:
                    os.close(gone)
            for fd in fds:
                if fields.get("FDSTORE") == "1" and fields["FDNAME"] not in self.store.fds:
                    self.store.fds[fields["FDNAME"]] = fd
                else:
                    os.close(fd)

    def __enter__(self) -> "Drain":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)


def test_a_restart_keeps_the_host_tier_through_the_fd_store(tmp_path):
    cks = {"a": _ckpt(tmp_path / "a", 1), "b": _ckpt(tmp_path / "b", 2)}
    cfg, listen, log = tmp_path / "weightcache.toml", tmp_path / "0.sock", tmp_path / "service.log"
    cfg.write_text(to_toml(make_config({"a": cks["a"], "b": {"path": cks["b"], "preload": "host"}},
                                       memory_budget_bytes=SLAB + SLAB // 2, host_tier_bytes=2 * SLAB)))

    def tiers() -> dict[str, str]:
        s = Session(str(listen), timeout=10)
        try:
            return {x["model"]: f"{x['state']}/{x['tier']}" for x in s.request(protocol.Status()).status["slabs"]}
        finally:
            s.close()

    with FdStoreStandIn(tmp_path / "notify.sock") as store:
        first = store.serve(cfg, listen, log)
        with Drain(store):
            poll_until(lambda: len(store.fds) == 4, "a's slab, b's host-tier copy and their manifest files stored")
            first.send_signal(signal.SIGTERM)
            assert first.wait(timeout=30) == 0, log.read_text()
        stored = dict(store.fds)
        assert sorted(n.split("-", 1)[0] for n in stored) == ["host", "manifest", "manifest", "slab"]
        second = store.serve(cfg, listen, log)
        with Drain(store):
            poll_until(lambda: listen.exists() and tiers() == {"a": "ready/gpu", "b": "hosted/host"},
                       "the restarted service to take both tiers back", 90)
            assert "loaded model=" not in log.read_text().split("serving gpu=0")[-1]  # nothing read from disk
            b = attach("b", socket_dir=str(tmp_path), fallback=False, timeout=60)  # promoted from the kept copy
            try:
                compare_bytes(b.tensors, read_checkpoint(cks["b"]))
            finally:
                b.close()
            assert "loaded model=" not in log.read_text().split("serving gpu=0")[-1]
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=30) == 0, log.read_text()


def test_after_a_crash_the_budget_keeps_an_adopted_slab_as_leased(tmp_path):
    """Issue 39: after a restart, engines that attached before it may still map an adopted slab; evict refused
    it without --force, but the budget demoted it to make room (on CUDA that frees nothing they map). After a
    crash (SIGKILL: nothing recorded) the budget keeps it and the attach that needs its room is refused, naming
    the unknown leases; after a clean stop with no lease on it (the restart above) it moves as before.

    Once a strict xfail (a's memfd counted as held elsewhere for good after the evict): the harness left a copy
    of some stored fds open in the service at the test process's numbers (tests/unit/test_listen_fds_wrapper.py)."""
    cks = {"a": _ckpt(tmp_path / "a", 1), "b": _ckpt(tmp_path / "b", 2)}
    cfg, listen, log = tmp_path / "weightcache.toml", tmp_path / "0.sock", tmp_path / "service.log"
    cfg.write_text(to_toml(make_config({"a": cks["a"], "b": {"path": cks["b"], "preload": "host"}},
                                       memory_budget_bytes=SLAB + SLAB // 2, host_tier_bytes=2 * SLAB)))
    with FdStoreStandIn(tmp_path / "notify.sock") as store:
        first = store.serve(cfg, listen, log)
        with Drain(store):
            poll_until(lambda: len(store.fds) == 4, "a's slab, b's host-tier copy and their manifest files stored")
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=30)
        listen.unlink()  # the killed process left its socket file; wait for the new one
        second = store.serve(cfg, listen, log)
        with Drain(store):
            poll_until(lambda: listen.exists(), "the restarted service's socket", 90)
            with pytest.raises(InsufficientMemory) as e:
                attach("b", socket_dir=str(tmp_path), fallback=False, timeout=60)
            assert "unknown ones: adopted after a restart" in e.value.message and "evict --force" in e.value.message
            s = Session(str(listen), timeout=10)
            try:
                st = {x["model"]: (x["state"], x["tier"]) for x in s.request(protocol.Status()).status["slabs"]}
                assert st == {"a": ("ready", "gpu"), "b": ("hosted", "host")}, st
                s.request(protocol.Evict("a", True, ""))  # the operator knows no engine maps it any more
                # a's memfd counts in the budget until nothing holds it (issue 38, P2)
                seen = []
                poll_until(lambda: seen.append(s.request(protocol.Status()).status["memory"]) or
                           seen[-1]["held_elsewhere_bytes"] == 0, "a's slab and manifest file to be freed", period_s=0.5,
                           detail=lambda: f"{seen[-1]} fds {sorted(store.fds)}")
            finally:
                s.close()
            b = attach("b", socket_dir=str(tmp_path), fallback=False, timeout=60)
            b.close()
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=30) == 0, log.read_text()


def test_check_config_names_what_waits_when_the_budget_is_exceeded(capsys, tmp_path):
    from weightcache.cli import main

    cks = {n: _ckpt(tmp_path / n, i) for i, n in enumerate(("p", "hi", "lo", "x"))}
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(to_toml(make_config({"p": {"path": cks["p"], "pin": True}, "hi": {"path": cks["hi"], "priority": 5},
                                        "lo": cks["lo"], "x": {"path": cks["x"], "preload": "host"}},
                                       memory_budget_bytes=2 * SLAB + SLAB // 2, host_tier_bytes=SLAB)))
    capsys.readouterr()
    assert main(["check-config", "--config", str(cfg), "--as-user", "root"]) == 0
    err = capsys.readouterr().err
    assert "exceed memory_budget_bytes" in err and "lo/tp1/rank0 (disk), x/tp1/rank0 (host tier)" in err, err


def test_a_slab_larger_than_the_whole_budget_is_an_error_everywhere(daemon, tmp_path, capsys):
    """New-user walk: check-config passed, status promised the next attach would load it, preload exited 0."""
    from weightcache.cli import main

    budget = 1024 * 1024  # the smallest budget; each slab is SLAB (2 MiB + a page)
    cks = {"big": _ckpt(tmp_path / "big", 1)}
    config = make_config({"big": cks["big"]}, memory_budget_bytes=budget)
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(to_toml(config))
    capsys.readouterr()
    assert main(["check-config", "--config", str(cfg), "--as-user", "root"]) == 1
    err = capsys.readouterr().err
    assert (f"error: model big tp=1 rank=0 (GPU 0, defined in {cfg}): its slab of {SLAB} bytes" in err
            and f"larger than memory_budget_bytes = {budget}" in err), err
    assert "exceed memory_budget_bytes" not in err, err  # the error, not also the wait-for-an-attach warning

    svc = daemon(config)
    svc.wait_settled()
    with pytest.raises(InsufficientMemory) as ei:
        _attach(svc, "big")
    assert "raise memory_budget_bytes" in ei.value.message and "release a lease" not in ei.value.message
    assert ei.value.details["need_bytes"] == SLAB and ei.value.details["budget_bytes"] == budget
    capsys.readouterr()
    assert main(["status", "--socket-dir", svc.socket_dir]) == 0
    out = capsys.readouterr().out
    assert "on_disk: larger than memory_budget_bytes" in out and "the next attach loads it" not in out, out
    assert main(["preload", "big", "--socket-dir", svc.socket_dir]) == 1
    assert "big tp=1 rank=0 was not loaded (on_disk): insufficient_memory" in capsys.readouterr().err
    assert main(["wait", "big", "--socket-dir", svc.socket_dir]) == 1
