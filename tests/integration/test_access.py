"""Access control: the socket's group decides who connects; per-model allow lists (``SO_PEERCRED``).

Needs root (creates throw-away system users and groups with useradd/groupadd,
removed at the end) and forks clients that drop to those users with
setgroups/setgid/setuid: the interpreter lives under /root, which other users
cannot execute, so the client runs in a forked copy of this process (it only
imports, maps and hashes: no torch kernels run after the fork).
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from service_harness import record_figures  # noqa: E402
from checkpoints import llama_checkpoint, read_checkpoint  # noqa: E402
from weightcache import attach  # noqa: E402
from weightcache.errors import WeightcacheError  # noqa: E402

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("groupadd"),
                       reason="needs root and useradd/groupadd to create test users"),
]

CLIENTS, READERS = "wctest-clients", "wctest-readers"
#: user -> supplementary groups (None: not in the socket's group).
USERS = {"wctest-allowed": [CLIENTS], "wctest-grouped": [CLIENTS, READERS], "wctest-denied": [CLIENTS],
         "wctest-outsider": None}


@pytest.fixture(scope="module")
def accounts():
    made_users, made_groups = [], []
    for g in (CLIENTS, READERS):
        try:
            grp.getgrnam(g)
        except KeyError:
            subprocess.run(["groupadd", "--system", g], check=True)
            made_groups.append(g)
    for user, groups in USERS.items():
        try:
            pwd.getpwnam(user)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", user],
                           check=True)
            made_users.append(user)
        subprocess.run(["usermod", "-G", ",".join(groups or []), user], check=True)
    try:
        yield {u: pwd.getpwnam(u) for u in USERS}
    finally:
        for u in made_users:
            subprocess.run(["userdel", u], check=False)
        for g in made_groups:
            subprocess.run(["groupdel", g], check=False)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def _as_user(pw: pwd.struct_passwd, target: str, socket_dir: str, fallback: bool = False) -> dict:
    """Runs ``attach(target)`` in a forked child with ``pw``'s uid, gid and groups; returns its outcome."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no return from here
        try:
            os.close(r)
            os.setgroups(os.getgrouplist(pw.pw_name, pw.pw_gid))
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            try:
                a = attach(target, socket_dir=socket_dir, fallback=fallback, timeout=30)
                out = {"source": a.source, "reason": a.fallback_reason, "digest": _digest(a.tensors)}
            except WeightcacheError as e:
                out = {"code": e.code, "details": e.details, "message": e.message}
        except BaseException as e:  # noqa: BLE001 - report anything to the parent
            out = {"crash": repr(e)}
        os.write(w, json.dumps(out, default=str).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return json.loads(b"".join(chunks))


def test_socket_group_and_allow_lists(daemon, accounts):
    """Outside the socket's group: the connect is refused (daemon_unavailable, nothing reaches the
    service). In it but not on a model's allow list: access_denied naming the uid, a "rejected" log
    entry with peer_uid, no lease. On the list by user or by group: byte-identical weights."""
    t0 = time.monotonic()
    shared = Path(tempfile.mkdtemp(prefix="wc-acl-"))
    try:
        os.chmod(shared, 0o755)
        open_ck = llama_checkpoint(shared / "open", seed=41)
        restricted_ck = llama_checkpoint(shared / "restricted", seed=42)
        for p in shared.rglob("*"):
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        svc = daemon({"open": open_ck, "restricted": {"path": restricted_ck, "allow_users": ["wctest-allowed"],
                                                      "allow_groups": [READERS]}})
        svc.wait_settled()
        for d in (Path(svc.socket_dir), Path(svc.socket_dir).parent):
            os.chmod(d, 0o711)
        os.chown(svc.socket_path, 0, grp.getgrnam(CLIENTS).gr_gid)
        os.chmod(svc.socket_path, 0o660)
        want = {"open": _digest(read_checkpoint(open_ck)), "restricted": _digest(read_checkpoint(restricted_ck))}
        u = accounts
        outcomes = 0

        for user in ("wctest-allowed", "wctest-grouped"):
            got = _as_user(u[user], str(restricted_ck), svc.socket_dir)
            assert got.get("source") == "daemon" and got["digest"] == want["restricted"], (user, got)
            outcomes += 1

        got = _as_user(u["wctest-denied"], "restricted", svc.socket_dir)
        assert got.get("code") == "access_denied", got
        assert got["details"]["uid"] == u["wctest-denied"].pw_uid and got["details"]["model"] == "restricted"
        got = _as_user(u["wctest-denied"], str(restricted_ck), svc.socket_dir)
        assert got.get("code") == "access_denied", got
        # Opting in to the disk fallback, a user who may read the files gets them from disk, with the reason.
        got = _as_user(u["wctest-denied"], str(restricted_ck), svc.socket_dir, fallback=True)
        assert got.get("source") == "disk" and got["reason"].startswith("access_denied"), got
        assert got["digest"] == want["restricted"]
        # A model without allow lists: the socket's group decides.
        got = _as_user(u["wctest-denied"], str(open_ck), svc.socket_dir)
        assert got.get("source") == "daemon" and got["digest"] == want["open"], got
        outcomes += 4

        got = _as_user(u["wctest-outsider"], "open", svc.socket_dir)
        assert got.get("code") == "daemon_unavailable", got
        assert got["details"]["socket"] == svc.socket_path
        # The message says who was refused and how to fix it, not just "no service".
        assert f"Permission denied: user wctest-outsider (uid {u['wctest-outsider'].pw_uid})" in got["message"]
        assert f"usermod -aG {CLIENTS} wctest-outsider" in got["message"], got
        outcomes += 1

        denied_uid = u["wctest-denied"].pw_uid
        log = svc.log()
        rejected = [ln for ln in log.splitlines() if "rejected attach" in ln]
        assert len(rejected) == 3, log[-3000:]  # name, path, path with fallback
        assert all(re.search(rf"\bmodel=restricted\b.*\bpeer_uid={denied_uid}\b", ln) for ln in rejected)
        assert all("event=rejected" in ln for ln in rejected)
        outsider_uid = u["wctest-outsider"].pw_uid
        assert f"peer_uid={outsider_uid}" not in log  # the kernel refused it: the service never saw it
        snap = svc.snapshot()
        assert snap["leases"] == 0
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    record_figures(
        "access.allow_lists", "Access control: socket group and per-model allow lists (SO_PEERCRED)",
        "allowed by user and by group: identical bytes; denied: access_denied naming uid and model, one "
        "'rejected' log entry each with peer_uid, no lease; fallback=True goes to disk with the reason; "
        "outside the socket group: connect refused (daemon_unavailable), never reaches the service",
        clients=outcomes, faults_injected=4, duration_s=round(time.monotonic() - t0, 2))
