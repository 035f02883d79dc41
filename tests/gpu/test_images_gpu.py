"""Processed images on the cuda backend (issue 36; run on a GPU machine, ``-m gpu``).

A slab the service loaded to the GPU is written as an image (a host copy of the GPU slab on the writer's
thread, ``sum64`` digests in its manifest), the service is stopped (no fd store: the GPU memory is freed),
and a new service makes the slab from the image: ``source = image``, ``torch_free=yes``, and the bytes an
engine attaches on ``cuda:0`` equal the checkpoint's. Then a flipped byte in the image is refused
(``digest``, checked by the NVRTC kernel where the bytes are) and the slab is made from the checkpoint.

And a SIGTERM mid-write with ``image_stop_write_s = 0``: no image and no temporary file left; the restart takes
the GPU slab back from the fd store and writes its missing image.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "integration"))


def test_a_cuda_slab_comes_back_from_its_image_and_a_damaged_one_is_refused(tmp_path):
    from checkpoints import compare_bytes, llama_checkpoint, read_checkpoint
    from service_harness import poll_until, start_service
    from test_images import _flip_byte, _images

    from weightcache import attach

    ck = llama_checkpoint(tmp_path / "ck", seed=11, files=2)
    images = tmp_path / "images"
    cfg = {"service": {"backend": "cuda", "image_dir": str(images)},
           "models": {"m": {"path": str(ck), "image": True, "layouts": [{"tp": 1, "gpus": [0]}]}}}
    want = read_checkpoint(ck)

    def check(svc, source: str) -> None:
        slab = svc.wait_settled()["slabs"][0]
        assert (slab["state"], slab["source"]) == ("ready", source), svc.log()
        with attach("m", socket_dir=svc.socket_dir, device="cuda:0", fallback=False) as w:
            assert w.source == "daemon" and all(t.is_cuda for t in w.tensors.values())
            assert compare_bytes(dict(w.tensors), want) > 0

    first = start_service(tmp_path / "a", cfg, backend="cuda")
    try:
        check(first, "checkpoint")
        [img] = poll_until(lambda: _images(images) or None, "the image", 120, detail=first.log)
    finally:
        first.stop()
    second = start_service(tmp_path / "b", cfg, backend="cuda")
    try:
        check(second, "image")
        assert "torch_free=yes source=image" in second.log()
    finally:
        second.stop()
    _flip_byte(img)
    third = start_service(tmp_path / "c", cfg, backend="cuda")
    try:
        check(third, "checkpoint")
        assert "reason=digest" in third.log() and img.with_name(img.name + ".rejected").exists()
        assert os.path.exists(img) or poll_until(lambda: img.exists(), "the image written again", 120)
    finally:
        third.kill()


def test_a_cuda_slabs_write_abandoned_at_stop_is_redone_after_the_restart_from_the_fd_store(tmp_path):
    """``image_stop_write_s = 0``: a SIGTERM mid-write (the GPU slab's host copy being written under a slow cap)
    leaves no image and no temporary file; the restart takes the GPU slab back from the fd store and writes its
    image (a host copy again); a start without the fd store is then ``ready`` from it with the checkpoint's bytes."""
    import signal

    from checkpoints import compare_bytes, llama_checkpoint, read_checkpoint
    from service_harness import FdStoreStandIn, poll_until, start_service, to_toml
    from test_images_stop import SLOW, _config, _images, _mid_write, _settled, _temporary

    from weightcache import attach

    ck = llama_checkpoint(tmp_path / "ck", seed=13, files=2)
    images = tmp_path / "images"
    cfg, listen, log = tmp_path / "weightcache.toml", tmp_path / "0.sock", tmp_path / "serve.log"

    def config(**service) -> dict:
        c = _config(ck, images, **service)
        c["service"]["backend"] = "cuda"
        return c

    cfg.write_text(to_toml(config(image_write_bytes_per_s=SLOW, image_stop_write_s=0)))
    with FdStoreStandIn(tmp_path / "notify") as store:
        first = store.serve(cfg, listen, log, backend="cuda")
        store.collect(2, log=log.read_text)
        assert _settled(listen, log)["source"] == "checkpoint"
        _mid_write(images, ck, log.read_text)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0, log.read_text()
        assert _images(images) == [] and _temporary(images) == [], list(images.iterdir())
        cfg.write_text(to_toml(config()))
        store.drain()
        second = store.serve(cfg, listen, log, backend="cuda")
        assert _settled(listen, log)["source"] == "fd_store", log.read_text()
        poll_until(lambda: "image written model=m" in log.read_text(), "the image written after the restart", 120,
                   detail=log.read_text)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0, log.read_text()
    svc = start_service(tmp_path / "b", config(), backend="cuda")
    try:
        slab = svc.wait_settled()["slabs"][0]
        assert (slab["state"], slab["source"]) == ("ready", "image"), svc.log()
        with attach("m", socket_dir=svc.socket_dir, device="cuda:0", fallback=False) as w:
            assert compare_bytes(dict(w.tensors), read_checkpoint(ck)) > 0
    finally:
        svc.kill()
