"""Reloading the configuration of a running service (issue 15): a real ``weightcache serve`` subprocess.

Each test changes the TOML file under a live service and asks it to apply it
(the ``reload`` request, ``weightcache reload``, ``SIGHUP``), then checks what
the service holds by its ``status`` replies, the bytes engines attach, the
leases, and the memfds open in the service (``/proc/PID/fd``: one per slab).
The last test starts the service with an invalid file and the slabs of a
previous process in its fd store, as systemd hands them back after a restart.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from service_harness import FdStoreStandIn, make_config, poll_until, proc_fds, service_env, to_toml  # noqa: E402
from checkpoints import big_checkpoint, compare_bytes, read_checkpoint, write_checkpoint  # noqa: E402
from weightcache import attach, protocol  # noqa: E402
from weightcache.errors import ConfigError, DaemonUnavailable, ModelNotFound, WeightcacheError  # noqa: E402

pytestmark = pytest.mark.timeout(180)

TYPO = "[service]\nbackend = \"host\"\nbakend = 1\n"  # line 3: an unknown key


def _ckpt(dest: Path, seed: int) -> Path:
    """A 2-tensor float32 checkpoint whose bytes differ per seed."""
    g = torch.Generator().manual_seed(seed)
    return write_checkpoint(dest, {"a.weight": torch.randn(4, 8, generator=g), "b.bias": torch.randn(8, generator=g)})


def _slabs(svc) -> dict[str, dict]:
    return {f"{s['model']}/tp{s['tp_size']}/rank{s['tp_rank']}": s for s in svc.status()["slabs"]}


def _attach(svc, model: str):
    return attach(model, socket_dir=svc.socket_dir, fallback=False, timeout=60)


def test_reload_adds_drops_keeps_and_retires_a_leased_model(daemon, tmp_path):
    cks = {n: _ckpt(tmp_path / n, seed) for n, seed in (("a", 1), ("b", 2), ("c", 3), ("d", 4))}
    svc = daemon({"a": cks["a"], "b": cks["b"], "d": cks["d"]})
    svc.wait_settled()
    held_a, held_b = _attach(svc, "a"), _attach(svc, "b")
    try:
        a_lease = _slabs(svc)["a/tp1/rank0"]["leases"][0]["lease_id"]
        per_slab, rem = divmod(proc_fds(svc.pid)["memfd"], 3)  # the host backend's fds of each slab
        assert per_slab >= 1 and rem == 0
        svc.write_config(make_config({"a": cks["a"], "c": cks["c"]}))  # b (leased) and d removed, c added

        r = svc.request(protocol.Reload())
        assert (r.added, r.dropped, r.retired, r.kept) == (["c/tp1/rank0"], ["d/tp1/rank0"], ["b/tp1/rank0"],
                                                           ["a/tp1/rank0"])
        assert r.files == [str(svc.config_path)] and r.restart_keys == []
        svc.wait_settled()
        slabs = _slabs(svc)
        assert {k: s["state"] for k, s in slabs.items()} == {"a/tp1/rank0": "ready", "c/tp1/rank0": "ready",
                                                             "b/tp1/rank0": "retired"}
        assert [le["lease_id"] for le in slabs["a/tp1/rank0"]["leases"]] == [a_lease]  # untouched
        assert slabs["b/tp1/rank0"]["resident_bytes"] > 0 and len(slabs["b/tp1/rank0"]["leases"]) == 1
        assert "kept while leased: b/tp1/rank0" in svc.status()["status_line"]
        # The engines attached before keep their bytes; a new one gets the new model, nobody new gets b.
        compare_bytes(held_a.tensors, read_checkpoint(cks["a"]))
        compare_bytes(held_b.tensors, read_checkpoint(cks["b"]))
        with _attach(svc, "c") as w:
            compare_bytes(w.tensors, read_checkpoint(cks["c"]))
        with pytest.raises(ModelNotFound):
            _attach(svc, "b")
        assert proc_fds(svc.pid)["memfd"] == 3 * per_slab  # a, c, and b while leased (d freed)
    finally:
        held_b.close()
    poll_until(lambda: "b/tp1/rank0" not in _slabs(svc), "the retired slab to go at its last release")
    assert proc_fds(svc.pid)["memfd"] == 2 * per_slab
    compare_bytes(held_a.tensors, read_checkpoint(cks["a"]))
    held_a.close()


def test_an_invalid_config_is_refused_and_the_old_one_keeps_serving(daemon, tmp_path, capsys):
    ck = _ckpt(tmp_path / "m", 5)
    svc = daemon({"m": ck})
    svc.wait_settled()
    good = to_toml(make_config({"m": ck}))
    svc.config_path.write_text(TYPO + good.split("\n", 2)[2])  # the [service] table with a typo on line 3

    with pytest.raises(ConfigError) as ei:
        svc.request(protocol.Reload())
    assert ei.value.code == "config_invalid"
    assert {k: ei.value.details.get(k) for k in ("file", "key", "line")} == {
        "file": str(svc.config_path), "key": "service.bakend", "line": 3}
    st = svc.status()
    assert st["config_error"]["details"]["line"] == 3 and st["config_error"]["code"] == "config_invalid"
    assert f"configuration rejected, {svc.config_path}:3: service.bakend: unknown key" in st["status_line"]
    assert [s["state"] for s in st["slabs"]] == ["ready"]
    with _attach(svc, str(ck)) as w:
        compare_bytes(w.tensors, read_checkpoint(ck))

    # The CLI: exit 2 and the file, key and line on stderr; `status` exits 1 and says what to do.
    cli = [sys.executable, "-m", "weightcache"]
    r = subprocess.run(cli + ["reload", "--socket-dir", svc.socket_dir], capture_output=True, text=True,
                       env=service_env(), timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{svc.config_path}: service.bakend: unknown key" in r.stderr and "(line 3)" in r.stderr, r.stderr
    r = subprocess.run(cli + ["status", "--socket-dir", svc.socket_dir], capture_output=True, text=True,
                       env=service_env(), timeout=60)
    assert r.returncode == 1 and "configuration rejected:" in r.stdout and "systemctl reload weightcache@0" in r.stdout

    svc.config_path.write_text(good)
    r = subprocess.run(cli + ["reload", "--socket-dir", svc.socket_dir], capture_output=True, text=True,
                       env=service_env(), timeout=60)
    assert r.returncode == 0 and "0 slabs added (loading), 0 dropped, 0 kept while leased, 1 unchanged" in r.stdout
    st = svc.status()
    assert "config_error" not in st and st["status_line"] == "ready: 1/1 slabs resident"


def test_sighup_reloads_and_the_service_lives_on(daemon, tmp_path):
    ck, new = _ckpt(tmp_path / "m", 6), _ckpt(tmp_path / "n", 7)
    svc = daemon({"m": ck})
    svc.wait_settled()
    svc.write_config(make_config({"m": ck, "n": new}))
    svc.proc.send_signal(signal.SIGHUP)
    poll_until(lambda: _slabs(svc).get("n/tp1/rank0", {}).get("state") == "ready", "n to load after SIGHUP")
    assert svc.alive() and _slabs(svc)["m/tp1/rank0"]["state"] == "ready"
    with _attach(svc, "n") as w:
        compare_bytes(w.tensors, read_checkpoint(new))


def test_a_retargeted_symlink_is_matched_by_its_new_resolution_after_reload(daemon, tmp_path):
    old, new = _ckpt(tmp_path / "v1", 8), _ckpt(tmp_path / "v2", 9)
    link = tmp_path / "current"
    link.symlink_to(old)
    svc = daemon({"m": link})
    svc.wait_settled()
    with _attach(svc, str(link)) as w:
        compare_bytes(w.tensors, read_checkpoint(old))
    tmp = tmp_path / "current.new"
    tmp.symlink_to(new)
    os.replace(tmp, link)

    r = svc.request(protocol.Reload())
    assert (r.added, r.dropped, r.kept) == (["m/tp1/rank0"], ["m/tp1/rank0"], [])  # the slab of v1 is freed
    svc.wait_settled()
    for path in (link, new):  # by the configured link and by what it resolves to now
        with _attach(svc, str(path)) as w:
            compare_bytes(w.tensors, read_checkpoint(new))
    with pytest.raises(ModelNotFound):
        _attach(svc, str(old))


def test_a_checkpoint_replaced_on_disk_is_loaded_again_by_a_reload(daemon, tmp_path):
    """A checkpoint whose file was renamed over (as ``hf download`` and ``rsync`` update one) under a running
    service: engines refuse the old slab (``cache_key_mismatch``: inode, mtime, ctime) and load from disk.
    A reload used to keep it ("1 unchanged", still ``ready``) until an evict + preload or a restart; now it
    replaces it, as it does a retargeted path: freed at once, or retired while an engine holds it."""
    ck, other = _ckpt(tmp_path / "m", 10), _ckpt(tmp_path / "o", 11)
    svc = daemon({"m": ck, "o": other})
    svc.wait_settled()

    def replace_with(seed: int) -> dict:
        """Renames a new model.safetensors over the checkpoint's; returns its tensors."""
        new = _ckpt(tmp_path / f"new{seed}", seed)
        tensors = read_checkpoint(new)
        os.replace(new / "model.safetensors", ck / "model.safetensors")
        return tensors

    v2 = replace_with(12)
    w = attach(str(ck), socket_dir=svc.socket_dir, fallback=True, timeout=60)
    assert w.source == "disk" and w.fallback_reason.startswith("cache_key_mismatch"), w.fallback_reason
    w.close()
    r = svc.request(protocol.Reload())
    assert (r.added, r.dropped, r.retired, r.kept) == (["m/tp1/rank0"], ["m/tp1/rank0"], [], ["o/tp1/rank0"])
    svc.wait_settled()
    with _attach(svc, str(ck)) as w:  # the service's slab again, with the new bytes
        compare_bytes(w.tensors, v2)

    # Replaced while an engine holds the slab: it keeps its bytes; the new version loads beside it.
    held = _attach(svc, str(ck))
    try:
        v3 = replace_with(13)
        r = svc.request(protocol.Reload())
        assert (r.added, r.dropped, r.retired) == (["m/tp1/rank0"], [], ["m/tp1/rank0"])
        svc.wait_settled()
        compare_bytes(held.tensors, v2)
        with _attach(svc, str(ck)) as w:
            compare_bytes(w.tensors, v3)
    finally:
        held.close()
    # Nothing changed since: a reload keeps everything.
    r = svc.request(protocol.Reload())
    assert (r.added, r.dropped, r.retired) == ([], [], [])


def test_a_touched_checkpoint_is_loaded_again_and_a_broken_replacement_fails_by_file_name(daemon, tmp_path):
    """What docs/operations.md says of a checkpoint 'replaced' by stat(): a ``touch`` (same bytes, new mtime)
    is refused by engines, so a reload loads it again, and the same bytes are served. A replacement with a bad
    header: the engine that holds the old slab keeps its bytes, the model fails with ``checkpoint_corrupt``
    naming the file (status and engines)."""
    ck = _ckpt(tmp_path / "m", 20)
    v1 = read_checkpoint(ck)
    svc = daemon({"m": ck})
    svc.wait_settled()
    os.utime(ck / "model.safetensors")
    w = attach(str(ck), socket_dir=svc.socket_dir, fallback=True, timeout=60)
    assert w.fallback_reason.startswith("cache_key_mismatch") and "mtime_ns" in w.fallback_reason
    w.close()
    r = svc.request(protocol.Reload())
    assert (r.added, r.dropped) == (["m/tp1/rank0"], ["m/tp1/rank0"])
    svc.wait_settled()
    held = _attach(svc, str(ck))
    try:
        compare_bytes(held.tensors, v1)
        (tmp_path / "bad").write_bytes(b"\xff" * 100)  # its header length points past the end
        os.replace(tmp_path / "bad", ck / "model.safetensors")
        r = svc.request(protocol.Reload())
        assert (r.added, r.retired) == (["m/tp1/rank0"], ["m/tp1/rank0"])
        svc.wait_settled()
        st = svc.status()
        assert sorted(s["state"] for s in st["slabs"]) == ["failed", "retired"]
        assert "failed: m/tp1/rank0 (checkpoint_corrupt)" in st["status_line"]
        with pytest.raises(WeightcacheError) as ei:
            _attach(svc, str(ck))
        assert ei.value.code == "checkpoint_corrupt" and str(ck / "model.safetensors") in ei.value.message
        compare_bytes(held.tensors, v1)
    finally:
        held.close()


def test_a_checkpoint_replaced_while_it_loads_is_loaded_again_by_a_reload(daemon, tmp_path):
    """The file renamed over while the service reads it (one reader thread, 512 MiB): the load reads the old
    file it opened and ends ``ready`` with a key every engine refuses (``cache_key_mismatch``). A reload made meanwhile used to answer
    "1 unchanged"; it now checks the files against what the load planned from, discards the load and loads the
    new file. (Should the load end before the reload, the reload replaces the ready slab: same outcome.)"""
    ck = big_checkpoint(512 * 1024 * 1024, tensors=32)
    new = big_checkpoint(512 * 1024 * 1024, tensors=32)  # the same bytes in another file (inode, mtime, ctime)
    try:
        svc = daemon(make_config({"m": ck}, read_threads=1))

        def reading() -> dict | None:
            s = _slabs(svc).get("m/tp1/rank0")
            return s if s is not None and (s["state"] != "loading" or s["done_bytes"] > 0) else None

        poll_until(reading, "the load to read its first bytes", 60, 0.002)
        waiting = concurrent.futures.ThreadPoolExecutor(1).submit(_attach, svc, str(ck))  # parks while it loads
        poll_until(lambda: waiting.running() or None, "the engine's attach to start", 60, 0.002)
        os.replace(new / "model.safetensors", ck / "model.safetensors")
        r = svc.request(protocol.Reload())
        assert (r.added, r.dropped, r.kept) == (["m/tp1/rank0"], ["m/tp1/rank0"], []), r
        # The engine that waited for the discarded load gets the new one's slab (it heard model_not_found,
        # "removed from the configuration", for a model still in it).
        with waiting.result(timeout=120) as w:
            assert w.source == "daemon"
            compare_bytes(w.tensors, read_checkpoint(ck))
        svc.wait_settled()
        with _attach(svc, str(ck)) as w:
            assert w.source == "daemon"
            compare_bytes(w.tensors, read_checkpoint(ck))
    finally:
        shutil.rmtree(ck, ignore_errors=True)
        shutil.rmtree(new, ignore_errors=True)


def test_an_invalid_config_at_start_serves_the_slabs_from_the_fd_store_until_a_reload(tmp_path):
    """systemd hands the fd store back to a restarted service whose file has a typo: it serves them."""
    ck = _ckpt(tmp_path / "m", 10)
    cfg, listen, log = tmp_path / "weightcache.toml", tmp_path / "0.sock", tmp_path / "serve.log"
    good = to_toml(make_config({"m": ck}))
    cfg.write_text(good)

    def status() -> dict:
        from weightcache.session import Session

        s = Session(str(listen), timeout=10)
        try:
            return s.request(protocol.Status()).status
        finally:
            s.close()

    with FdStoreStandIn(tmp_path / "notify.sock") as store:
        first = store.serve(cfg, listen, log)  # nothing stored yet
        store.collect(2, log=log.read_text)  # the slab and its manifest file
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0, log.read_text()

        cfg.write_text(TYPO + good.split("\n", 2)[2])
        second = store.serve(cfg, listen, log)

        def answering() -> dict | None:
            # The socket file exists from bind() (or the first service) before listen(): refused until then.
            assert second.poll() is None, log.read_text()
            try:
                return status() if listen.exists() else None
            except DaemonUnavailable:
                return None

        st = poll_until(answering, "the service with the invalid config to answer", 90)
        assert second.poll() is None, log.read_text()
        assert [(s["model"], s["state"], s["adopted"]) for s in st["slabs"]] == [("m", "ready", True)]
        assert st["config_error"]["details"]["key"] == "service.bakend" and st["config_error"]["details"]["line"] == 3
        with attach(str(ck), socket_dir=str(tmp_path), fallback=False, timeout=60) as w:
            compare_bytes(w.tensors, read_checkpoint(ck))
        assert "loaded model=" not in log.read_text().split("serving gpu=0")[-1]  # nothing read from disk

        cfg.write_text(good)
        second.send_signal(signal.SIGHUP)
        poll_until(lambda: "config_error" not in status(), "the fixed config to apply")
        st = status()
        assert [(s["model"], s["state"], s["adopted"]) for s in st["slabs"]] == [("m", "ready", True)]  # kept
        assert st["status_line"] == "ready: 1/1 slabs resident"


def test_an_invalid_config_at_start_with_nothing_to_keep_exits_78(tmp_path):
    """Run by hand (no fd store, no socket from systemd): nothing to keep, so it exits at once."""
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(TYPO)
    r = subprocess.run([sys.executable, "-m", "weightcache", "serve", "--gpu", "0", "--config", str(cfg),
                        "--listen", str(tmp_path / "0.sock")], capture_output=True, text=True, env=service_env(),
                       timeout=60)
    assert r.returncode == 78, r.stderr
    assert "service.bakend" in r.stderr and json.dumps(str(cfg))[1:-1] in r.stderr
