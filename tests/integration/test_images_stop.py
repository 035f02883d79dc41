"""Processed images (issue 36) and ``systemctl stop``: a SIGTERM while an image is being written.

What an operator expects (docs/operations.md, "Processed images"): the stop does not lose the image, and never
leaves one that loads partly written.

- With the default ``image_stop_write_s`` (10 s) a write under way goes on without the rate cap and ends
  (renamed into place) before the service exits: the next start, without the fd store, is ``ready`` from it,
  bytes equal to the checkpoint's.
- With ``image_stop_write_s = 0`` the write is abandoned: its temporary file is removed at once and no image
  is there. The next start that takes the slab back from the fd store (``systemctl restart``) writes the
  missing image; one more restart from the fd store finds it valid and writes nothing.
"""

from __future__ import annotations

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
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0, log.read_text()

        # Once more: the image is there and valid, so nothing is written again.
        store.drain()
        third = store.serve(cfg, listen, log)
        assert _settled(listen, log)["source"] == "fd_store"
        poll_until(lambda: "image present model=m" in log.read_text(), "the image found valid", 30,
                   detail=log.read_text)
        assert [p.name for p in _images(images)] == [img.name] and img.stat().st_mtime_ns == written_at
        third.send_signal(signal.SIGTERM)
        assert third.wait(timeout=30) == 0, log.read_text()
    _ready_from_the_image_with_the_checkpoints_bytes(tmp_path / "b", ck, images)
