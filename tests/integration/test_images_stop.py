"""Processed images (issue 36) and ``systemctl stop``: a SIGTERM while an image is being written.

What an operator expects (docs/operations.md, "Processed images"): the stop does not lose the image, and never
leaves one that loads partly written.

- With the default ``image_stop_write_s`` (10 s) a write under way goes on without the rate cap and ends
  (renamed into place) before the service exits: the next start, without the fd store, is ``ready`` from it,
  bytes equal to the checkpoint's.
- With ``image_stop_write_s = 0`` the write is abandoned: its temporary file is removed at once and no image
  is there. The next start that takes the slab back from the fd store (``systemctl restart``) writes the
  missing image; one more restart from the fd store finds it valid and writes nothing (and keeps no second fd
  of the slab's memfd for it).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from checkpoints import compare_bytes, llama_checkpoint, read_checkpoint
from service_harness import FdStoreStandIn, poll_until, start_service, to_toml
from weightcache import attach, protocol
from weightcache.errors import WeightcacheError
from weightcache.session import Session

#: Bytes per second: a tiny checkpoint's image takes tens of seconds, so a SIGTERM lands mid-write.
SLOW = 20_000


def _config(ck: Path, images: Path, **service) -> dict:
    return {"service": {"backend": "host", "image_dir": str(images), **service},
            "models": {"m": {"path": str(ck), "image": True, "layouts": [{"tp": 1, "gpus": [0]}]}}}


def _images(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.endswith(".safetensors") and not p.name.startswith("."))


def _temporary(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if ".tmp-" in p.name)


def _memfd_fds(pid: int) -> dict[str, int]:
    """How many fds process ``pid`` holds of each memfd (by name)."""
    held: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("/memfd:"):
            held[target] = held.get(target, 0) + 1
    return held


def _status(listen: Path) -> dict | None:
    try:
        s = Session(str(listen), timeout=10)
    except (WeightcacheError, OSError):
        return None
    try:
        return s.request(protocol.Status()).status
    except (WeightcacheError, OSError):
        return None
    finally:
        s.close()


def _settled(listen: Path, log: Path) -> dict:
    def ready() -> dict | None:
        st = _status(listen)
        return st["slabs"][0] if st and st["slabs"] and st["slabs"][0]["state"] == "ready" else None

    return poll_until(ready, "slab m ready", 60, detail=log.read_text)


def _mid_write(images: Path, ck: Path, log) -> Path:
    tmp = poll_until(lambda: next(iter(_temporary(images)), None), "a write under way", 30, detail=log)
    assert tmp.stat().st_size < sum(f.stat().st_size for f in ck.glob("*.safetensors"))  # partial
    return tmp


def _ready_from_the_image_with_the_checkpoints_bytes(workdir: Path, ck: Path, images: Path) -> None:
    svc = start_service(workdir, _config(ck, images))
    try:
        slab = svc.wait_settled()["slabs"][0]
        assert (slab["state"], slab["source"]) == ("ready", "image"), svc.log()
        with attach("m", socket_dir=svc.socket_dir, device="cpu", fallback=False) as w:
            assert w.source == "daemon"
            assert compare_bytes(dict(w.tensors), read_checkpoint(ck)) > 0
    finally:
        svc.kill()


def test_sigterm_mid_write_finishes_the_image_before_the_service_exits(tmp_path):
    ck = llama_checkpoint(tmp_path / "ck", seed=11, files=2)
    images = tmp_path / "images"
    svc = start_service(tmp_path / "a", _config(ck, images, image_write_bytes_per_s=SLOW))
    try:
        assert svc.wait_settled()["slabs"][0]["source"] == "checkpoint"
        _mid_write(images, ck, svc.log)
    finally:
        rc = svc.stop()  # SIGTERM: what systemctl stop sends
    assert rc == 0, svc.log()
    assert len(_images(images)) == 1 and _temporary(images) == [], svc.log()
    assert "image written model=m" in svc.log()
    _ready_from_the_image_with_the_checkpoints_bytes(tmp_path / "b", ck, images)


def test_an_abandoned_write_leaves_nothing_and_the_restart_from_the_fd_store_writes_the_image(tmp_path):
    ck = llama_checkpoint(tmp_path / "ck", seed=12, files=2)
    images = tmp_path / "images"
    cfg, listen, log = tmp_path / "weightcache.toml", tmp_path / "0.sock", tmp_path / "serve.log"
    cfg.write_text(to_toml(_config(ck, images, image_write_bytes_per_s=SLOW, image_stop_write_s=0)))
    with FdStoreStandIn(tmp_path / "notify") as store:
        first = store.serve(cfg, listen, log)
        store.collect(2, log=log.read_text)
        assert _settled(listen, log)["source"] == "checkpoint"
        _mid_write(images, ck, log.read_text)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0, log.read_text()
        assert "image write abandoned at stop model=m" in log.read_text()
        assert _images(images) == [] and _temporary(images) == [], list(images.iterdir())

        # systemctl restart: the slab comes back from the fd store; its image is missing, so it is written now.
        cfg.write_text(to_toml(_config(ck, images)))
        store.drain()
        second = store.serve(cfg, listen, log)
        slab = _settled(listen, log)
        assert (slab["source"], slab["adopted"]) == ("fd_store", True), log.read_text()
        [img] = poll_until(lambda: _images(images) or None, "the image written after the restart", 60,
                           detail=log.read_text)
        poll_until(lambda: "image written model=m" in log.read_text(), "the image written line", 30,
                   detail=log.read_text)
        written_at = img.stat().st_mtime_ns
        serving = _memfd_fds(second.pid)  # the write over (its dup closed before the line above is logged)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0, log.read_text()

        # Once more: the image is there and valid, so nothing is written again.
        store.drain()
        third = store.serve(cfg, listen, log)
        assert _settled(listen, log)["source"] == "fd_store"
        poll_until(lambda: "image present model=m" in log.read_text(), "the image found valid", 30,
                   detail=log.read_text)
        assert [p.name for p in _images(images)] == [img.name] and img.stat().st_mtime_ns == written_at
        # The writer's dup of the slab's memfd (made when the write was scheduled) is closed though it never read
        # it: kept, it would hold the slab's pages after an eviction until the service exits.
        poll_until(lambda: _memfd_fds(third.pid) == serving, "the writer's dup of the slab closed", 30,
                   detail=lambda: f"{_memfd_fds(third.pid)} != {serving}\n{log.read_text()}")
        third.send_signal(signal.SIGTERM)
        assert third.wait(timeout=30) == 0, log.read_text()
    _ready_from_the_image_with_the_checkpoints_bytes(tmp_path / "b", ck, images)


def test_sigterm_drops_the_writes_queued_behind_the_one_under_way(tmp_path):
    # two models made from their checkpoints, one image writer: the second model's write waits for the first's;
    # a stop finishes the write under way and drops the queued one (the next start from the fd store writes it)
    cks = {name: llama_checkpoint(tmp_path / name, seed=13 + i, files=2) for i, name in enumerate(("m", "n"))}
    images = tmp_path / "images"
    cfg = _config(cks["m"], images, image_write_bytes_per_s=SLOW)
    cfg["models"]["n"] = {**cfg["models"]["m"], "path": str(cks["n"])}
    svc = start_service(tmp_path / "a", cfg)
    try:
        assert [s["source"] for s in svc.wait_settled()["slabs"]] == ["checkpoint"] * 2
        _mid_write(images, cks["m"], svc.log)
    finally:
        rc = svc.stop()
    assert rc == 0, svc.log()
    assert len(_images(images)) == 1 and _temporary(images) == [], svc.log()
    assert svc.log().count("image written model=") == 1 and "image write dropped at stop model=" in svc.log()
