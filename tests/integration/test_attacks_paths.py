"""Issue 25, attacks 3 and 4: a directory swap serving another model's bytes, and files opened on the serving loop.

3. The owner of a Hugging Face-style cache replaces a configured snapshot
   directory with a symlink to a restricted model's directory before a reload:
   the service resolved it and served the restricted bytes under her model.
4. An attach with a ``dtype`` for a slot not yet planned made the serving loop
   read that checkpoint's ``config.json`` (a FIFO froze the service); a
   ``reload`` read its drop-ins on the loop (a FIFO blocked it, a link to
   ``/dev/zero`` grew RSS without bound).

Each test asserts the outcome the threat model (docs/reliability.md) promises,
a well-behaved client of another uid attaching within 1 s meanwhile, and fds
and RSS back at their baseline afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from attackers import (NOBODY, back_to_baseline, baseline_figures, fork_as, hung_read_env, ok_attach,  # noqa: E402
                       open_socket_to_all, reap, release_read, result, wait_read_hung)
from service_harness import make_config, poll_until, record_figures, service_env  # noqa: E402
from checkpoints import compare_bytes, llama_checkpoint, read_checkpoint  # noqa: E402
from weightcache import attach, protocol  # noqa: E402
from weightcache.session import Session  # noqa: E402
from weightcache.errors import WeightcacheError  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def ok_ck(tmp_path):
    ck = llama_checkpoint(tmp_path / "ok", seed=7)
    return ck, read_checkpoint(ck)


def _chown_tree(root: Path, uid: int) -> None:
    for p in [root, *root.rglob("*")]:
        os.lchown(p, uid, uid)


def _swap_to_link(snapshot: str, target: str) -> dict:
    """As the cache's owner: moves ``snapshot`` away and puts a symlink to ``target`` in its place."""
    os.rename(snapshot, snapshot + ".old")
    os.symlink(target, snapshot)
    return {"swapped": True}


def _attach_as_her(path: str, socket_dir: str) -> dict:
    try:
        with attach("hers", socket_dir=socket_dir, fallback=False, timeout=10) as w:
            return {"attach": "ok", "tensors": len(w.tensors)}
    except WeightcacheError as e:
        return {"attach": e.code, "cause": e.details.get("cause_details", {}).get("file")}


def test_a_snapshot_swapped_for_a_symlink_does_not_serve_another_models_bytes(daemon, ok_ck):
    """Attack 3. ``hers`` is a hub snapshot in a cache nobody owns; ``secret`` allows root only. nobody replaces
    ``snapshots/rev1`` with a symlink to secret's directory, then the operator reloads (and, second round,
    restarts). Before: the reload resolved the link and ``hers`` served a slab byte-identical to ``secret``.
    Now a symlink on the way to a checkpoint is followed only when root or the service user owns it: ``hers``
    fails with checkpoint_corrupt naming the link, ``secret`` serves its own bytes to root only."""
    ok, expected = ok_ck
    base = Path(tempfile.mkdtemp(prefix="wc-hub-", dir="/tmp"))
    os.chmod(base, 0o755)
    repo = base / "hub" / "models--her--tiny"
    snap = llama_checkpoint(repo / "snapshots" / "rev1", seed=21)
    (repo / "blobs").mkdir()
    _chown_tree(base / "hub", NOBODY)
    secret = llama_checkpoint(base / "secret", seed=22)
    os.chmod(base / "secret", 0o700)  # root-only: nobody can read it, the service can
    svc = daemon(make_config({"ok": ok, "hers": snap, "secret": {"path": base / "secret", "allow_users": ["root"]}}))
    st = {s["model"]: s for s in svc.wait_settled()["slabs"]}
    assert st["hers"]["state"] == "ready"
    open_socket_to_all(svc)
    before = svc.snapshot()
    pid, r = fork_as(NOBODY, NOBODY, [], _swap_to_link, str(snap), str(base / "secret"))
    try:
        assert result(r) == {"swapped": True}
    finally:
        reap(pid, r)
    compared = ok_attach(svc, expected)
    svc.request(protocol.Reload())
    for round_ in ("reload", "restart"):
        if round_ == "restart":
            svc.restart()
            open_socket_to_all(svc)
        svc.wait_settled()
        hers = next(s for s in svc.status()["slabs"] if s["model"] == "hers" and s["state"] != "retired")
        assert hers["state"] == "failed", (round_, hers)
        assert hers["error"]["code"] == "checkpoint_corrupt", (round_, hers["error"])
        assert hers["error"]["details"]["owner_uid"] == NOBODY and hers["error"]["details"]["file"] == str(snap)
        pid, r = fork_as(NOBODY, NOBODY, [], _attach_as_her, svc.socket_path, svc.socket_dir)
        try:
            got = result(r)
        finally:
            reap(pid, r)
        assert got["attach"] == "model_load_failed", (round_, got)
        with attach("secret", socket_dir=svc.socket_dir, fallback=False, timeout=5) as w:
            compared += compare_bytes(w.tensors, read_checkpoint(secret))
        compared += ok_attach(svc, expected)
        if round_ == "reload":  # hers's slab was freed by the reload: one slab's memfds fewer than before
            after = back_to_baseline(svc, before, extra_memfds=-(before["fds"]["memfd"] // 3))
    shutil.rmtree(base)
    record_figures("attack.snapshot_swap", "a hub snapshot replaced by a symlink to a root-only model, then reload "
                   "and restart", "the link (owned by the cache's owner) is not followed: checkpoint_corrupt naming "
                   "it and its owner, attach model_load_failed; the restricted model serves its own bytes; a "
                   "well-behaved attach within 1 s; fds and RSS back after the reload (less hers's freed slab)",
                   clients=6, faults_injected=1, bytes_compared=compared, **baseline_figures(before, after))


def _attach_with_dtype(path: str, model: str, n: int) -> dict:
    """As the attacker: ``n`` attaches of ``model`` with ``dtype=bfloat16``, each on its own connection."""
    codes = []
    for _ in range(n):
        try:
            s = Session(path, timeout=5)
            s.request(protocol.Attach(model, dtype="bfloat16"))
            codes.append("ok")
        except WeightcacheError as e:
            codes.append(e.code)
        finally:
            s.close()
    return {"codes": codes}


def test_an_attach_before_the_plan_opens_no_file_on_the_serving_loop(daemon, tmp_path, ok_ck):
    """Attack 4. ``later`` (allow list: root only) waits behind a load whose read hangs, so it is not planned;
    its config.json is a FIFO. nobody sends 8 attaches of ``later`` with ``dtype=bfloat16``. Before: the serving
    loop opened that config.json to match the dtype and froze (8 of 8 attaches timed out, every other client
    too). Now the dtype of an unplanned slot is matched without any file ("not planned yet"): nobody gets
    access_denied at once, a well-behaved attach works, and once the hung read returns ``later``'s own load
    refuses the FIFO (checkpoint_corrupt) instead of blocking on it."""
    ok, expected = ok_ck
    slow = llama_checkpoint(tmp_path / "slow", seed=31)
    later = llama_checkpoint(tmp_path / "later", seed=32)
    (later / "config.json").unlink()
    os.mkfifo(later / "config.json")
    for p in (tmp_path, later):
        os.chmod(p, 0o755)
    svc = daemon(make_config({"ok": ok, "slow": slow, "later": {"path": later, "allow_users": ["root"]}},
                             load_timeout_s=120), env=hung_read_env(tmp_path, slow))
    open_socket_to_all(svc)
    hung = wait_read_hung(svc.pid, slow)
    before = svc.snapshot()
    try:
        pid, r = fork_as(NOBODY, NOBODY, [], _attach_with_dtype, svc.socket_path, "later", 8)
        try:
            got = result(r)
        finally:
            reap(pid, r)
        assert got["codes"] == ["access_denied"] * 8, got
        compared = ok_attach(svc, expected)
        s = Session(svc.socket_path, timeout=5)  # root, on the allow list: "not planned yet" is loading
        reply = s.request(protocol.Attach("later", dtype="bfloat16"))
        assert isinstance(reply, protocol.Loading) and reply.state == "pending"
        s.close()
    finally:
        release_read(slow)
    st = {s["model"]: s for s in svc.wait_settled()["slabs"]}
    assert st["slow"]["state"] == "ready"
    assert st["later"]["error"]["code"] == "checkpoint_corrupt", st["later"]
    compared += ok_attach(svc, expected)
    # slow's slab is resident now (one slab's memfds more); the fds its hung read held are closed
    after = back_to_baseline(svc, before, extra_memfds=before["fds"]["memfd"], extra_files=-hung)
    record_figures("attack.unplanned_dtype", "8 attaches with a dtype for a slot not yet planned, its config.json "
                   "a FIFO", "no file opened on the serving loop: access_denied at once for the attacker, "
                   "loading (not planned yet) for root; the load itself refuses the FIFO (checkpoint_corrupt); a "
                   "well-behaved attach within 1 s; fds and RSS back", clients=11, faults_injected=8,
                   bytes_compared=compared, **baseline_figures(before, after))


def test_reload_refuses_non_regular_and_huge_drop_ins(daemon, ok_ck):
    """Attack 4, reload. A drop-in that is a FIFO, then one linked to /dev/zero, then one of 5 MiB. Before: the
    FIFO blocked the serving loop inside the reload, /dev/zero grew RSS to GiBs. Now each reload is answered
    config_invalid naming the file (cause not_regular, too_large) at once; the service keeps serving the
    configuration it has, a well-behaved attach works, fds and RSS are back after."""
    ok, expected = ok_ck
    svc = daemon(make_config({"ok": ok}))
    svc.wait_settled()
    before = svc.snapshot()
    conf_d = svc.config_path.parent / "conf.d"
    conf_d.mkdir()
    causes = {}
    compared = 0
    for name, make in (("fifo.toml", lambda p: os.mkfifo(p)), ("zero.toml", lambda p: p.symlink_to("/dev/zero")),
                       ("huge.toml", lambda p: p.write_bytes(b"# " + b"x" * (5 << 20) + b"\n"))):
        make(conf_d / name)
        with pytest.raises(WeightcacheError) as e:
            svc.request(protocol.Reload(), timeout=10)
        assert (e.value.code, e.value.details["file"]) == ("config_invalid", str(conf_d / name))
        causes[name] = e.value.details["cause"]
        compared += ok_attach(svc, expected)
        (conf_d / name).unlink()
    assert causes == {"fifo.toml": "not_regular", "zero.toml": "not_regular", "huge.toml": "too_large"}
    svc.request(protocol.Reload())  # clean again: the configuration applies
    after = back_to_baseline(svc, before)
    record_figures("attack.reload_drop_ins", "reload with a FIFO drop-in, one linked to /dev/zero, one of 5 MiB",
                   "config_invalid naming the file at once (not_regular, too_large); the service serves on; a "
                   "well-behaved attach within 1 s; fds and RSS back", clients=5, faults_injected=3,
                   bytes_compared=compared, **baseline_figures(before, after))


def test_a_deeply_nested_config_exits_78(tmp_path):
    """A 200,000-deep nested array in the config: config_invalid and exit 78 (EX_CONFIG: systemd does not
    restart it), not a RecursionError and exit 1 (a restart loop)."""
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text("a = " + "[" * 200_000 + "]" * 200_000 + "\n")
    proc = subprocess.run([sys.executable, "-m", "weightcache", "serve", "--gpu", "0", "--config", str(cfg),
                           "--listen", str(tmp_path / "0.sock"), "--backend", "host"], env=service_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert "code=config_invalid" in proc.stderr and "nested" in proc.stderr


def test_a_reload_whose_file_read_hangs_freezes_no_client(daemon, tmp_path, ok_ck):
    """Attack 4, reload on a hung mount: reading a drop-in never returns. Before: the serving loop read it, so
    every client froze. Now the files are read on a worker: a well-behaved attach works meanwhile, the reload
    is answered config_invalid (cause timeout) after reload_timeout_s (2 s here) with the configuration kept,
    and once the mount answers a reload applies."""
    from attackers import hung_config_env

    ok, expected = ok_ck
    gate = tmp_path / "config.gate"
    svc = daemon(make_config({"ok": ok}, reload_timeout_s=2), env=hung_config_env(tmp_path, "hung.toml", gate))
    svc.wait_settled()
    before = svc.snapshot()
    conf_d = svc.config_path.parent / "conf.d"
    conf_d.mkdir()
    (conf_d / "hung.toml").write_text("")
    os.mkfifo(gate)  # from now on, reading hung.toml hangs
    result_box: dict = {}

    def reload_() -> None:
        try:
            svc.request(protocol.Reload(), timeout=30)
            result_box["code"] = "ok"
        except WeightcacheError as e:
            result_box["code"], result_box["cause"] = e.code, e.details.get("cause")

    t = threading.Thread(target=reload_)
    t.start()
    compared = ok_attach(svc, expected)  # while the reload's read hangs
    t.join(30)
    assert result_box == {"code": "config_invalid", "cause": "timeout"}, result_box
    compared += ok_attach(svc, expected)
    release_read(gate.parent / gate.stem)  # the abandoned read returns (the gate is <name>.gate)
    os.unlink(gate)
    svc.request(protocol.Reload())  # the mount answers again: the reload applies

    def closed_by_the_abandoned_read() -> bool:
        """The abandoned worker, released, closes the gate and the drop-in on its own time: under CPU
        starvation (the newcomer check, issue 39) after the next reload has been answered."""
        held = []
        for name in os.listdir(f"/proc/{svc.pid}/fd"):
            try:
                held.append(os.readlink(f"/proc/{svc.pid}/fd/{name}"))
            except FileNotFoundError:
                continue
        return not any(t.startswith((str(gate), str(conf_d / "hung.toml"))) for t in held)

    poll_until(closed_by_the_abandoned_read, "the released read to close the gate and the drop-in", 60, 0.05)
    after = back_to_baseline(svc, before)
    record_figures("attack.reload_hung_read", "reload while reading a drop-in never returns (hung mount)",
                   "files read on a worker: a well-behaved attach within 1 s meanwhile; the reload answered "
                   "config_invalid cause=timeout after reload_timeout_s=2; the next reload applies; fds and RSS "
                   "back", clients=5, faults_injected=1, bytes_compared=compared, **baseline_figures(before, after))
