"""Processed images (issue 36) on the host backend: live services, real checkpoints, real image files.

- A slab loaded by the service, the service stopped (no fd store: the weights are gone), started again:
  ``ready`` from the image, ``torch_free=yes`` with torch unimportable, bytes equal to the checkpoint's,
  and no byte of the checkpoint's tensor data read (every ``pread``/``preadv``/``read``/``mmap`` of a
  checkpoint file is written down by the service's ``sitecustomize``; only header bytes may appear).
- Rejections: a flipped byte (``digest``), a checkpoint file replaced (``identity``), an image of another
  compute capability or pipeline version (``key``): each refused with its reason, the slab made from the
  checkpoint, the image moved aside as ``.rejected``, a new one written.
- ``kill -9`` during a write slowed by the rate cap: the next start loads no partial image, removes the
  temporary file and writes the image again.
- The byte limit with room for one image of two: the older, unused one is removed.
- ``image`` off (the default for slabs the service makes): no image is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import pytest
from checkpoints import (
    compare_bytes,
    llama_checkpoint,
    read_checkpoint,
    write_checkpoint,
)
from service_harness import (
    _TORCH_BLOCKER,
    SERVICE_DIR,
    poll_until,
    start_service,
    torch_import_attempts,
)
from weightcache import attach, protocol

#: Written by the service's sitecustomize: every read of a file under $WC_TEST_WATCH_DIR, as JSON lines.
_READ_WATCH = '''
import json, mmap, os

_WATCH = os.environ["WC_TEST_WATCH_DIR"]
_LOG = os.environ["WC_TEST_READ_LOG"]


def _note(fd, offset, length, how):
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return
    if path.startswith(_WATCH + "/"):
        with open(_LOG, "a") as f:
            f.write(json.dumps({"path": path, "offset": offset, "length": length, "how": how}) + "\\n")


def _wrap(name, offset_of):
    real = getattr(os, name)

    def wrapped(fd, *args, **kw):
        out = real(fd, *args, **kw)
        n = out if isinstance(out, int) else len(out)
        _note(fd, offset_of(fd, args), n, name)
        return out

    setattr(os, name, wrapped)


_wrap("pread", lambda fd, a: a[1])
_wrap("preadv", lambda fd, a: a[1])
_real_read = os.read


def _read(fd, n):
    try:
        at = os.lseek(fd, 0, os.SEEK_CUR)
    except OSError:
        at = -1
    out = _real_read(fd, n)
    _note(fd, at, len(out), "read")
    return out


os.read = _read
_real_mmap = mmap.mmap


class _Mmap(_real_mmap):
    def __new__(cls, fileno, length, *args, **kw):
        if fileno >= 0:
            _note(fileno, kw.get("offset", 0), length, "mmap")
        return _real_mmap.__new__(cls, fileno, length, *args, **kw)


mmap.mmap = _Mmap
'''


def _watched_env(tmp: Path, watch: Path) -> tuple[dict[str, str], Path, Path]:
    """``env=`` for a service with torch unimportable and every read of a file under ``watch`` written down."""
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_TORCH_BLOCKER + _READ_WATCH)
    torch_log, read_log = tmp / "torch-imports.jsonl", tmp / "reads.jsonl"
    return ({"PYTHONPATH": os.pathsep.join([str(site), str(SERVICE_DIR)]), "WC_TEST_TORCH_LOG": str(torch_log),
             "WC_TEST_WATCH_DIR": str(watch.resolve()), "WC_TEST_READ_LOG": str(read_log)}, torch_log, read_log)


def _data_start(f: Path) -> int:
    """File offset of a safetensors file's first tensor byte."""
    with open(f, "rb") as fh:
        return 8 + struct.unpack("<Q", fh.read(8))[0]


def _tensor_reads(read_log: Path, ck: Path) -> list[dict]:
    """The reads of ``ck``'s safetensors files that reached past their headers."""
    starts = {str(f.resolve()): _data_start(f) for f in ck.glob("*.safetensors")}
    reads = [json.loads(line) for line in read_log.read_text().splitlines()] if read_log.exists() else []
    return [r for r in reads if r["path"] in starts and r["offset"] + r["length"] > starts[r["path"]]]


def _images(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.endswith(".safetensors") and not p.name.startswith("."))


def _wait_image(d: Path, count: int = 1, svc=None) -> list[Path]:
    def enough() -> list[Path] | None:
        got = _images(d)
        return got if len(got) >= count else None

    return poll_until(enough, f"{count} image(s) in {d}", 60, detail=svc.log if svc else None)


def _config(models: dict, image_dir: Path, **service) -> dict:
    tables = {}
    for name, m in models.items():
        tables[name] = {"layouts": [{"tp": 1, "gpus": [0]}], "image": True, **{k: str(v) if k == "path" else v
                                                                                 for k, v in m.items()}}
    return {"service": {"backend": "host", "image_dir": str(image_dir), **service}, "models": tables}


def _attached_bytes(svc, model: str, ck: Path) -> int:
    with attach(model, socket_dir=svc.socket_dir, device="cpu", fallback=False) as w:
        assert w.source == "daemon"
        return compare_bytes(dict(w.tensors), read_checkpoint(ck))


def _image_counters(svc) -> dict:
    reply = svc.request(protocol.Metrics())
    return reply.typed()[1].images


def test_a_stopped_service_starts_ready_from_the_image_without_torch_or_the_checkpoints_tensor_data(tmp_path):
    ck = llama_checkpoint(tmp_path / "ck", seed=1, files=2)
    images = tmp_path / "images"
    cfg = _config({"m": {"path": ck}}, images)
    (tmp_path / "w1").mkdir()
    env1, _, read_log1 = _watched_env(tmp_path / "w1", ck)
    first = start_service(tmp_path / "a", cfg, env=env1)
    try:
        assert first.wait_settled()["slabs"][0]["source"] == "checkpoint"
        [img] = _wait_image(images, svc=first)
        assert _image_counters(first)["written"] == 1
        # The watch sees a load's tensor reads: its silence below is a finding, not a blind spot.
        assert sum(r["length"] for r in _tensor_reads(read_log1, ck)) >= 300_000
    finally:
        first.stop()  # SIGTERM, no fd store: the slab is gone with the process
    assert oct(img.stat().st_mode & 0o777) == "0o600" and oct(images.stat().st_mode & 0o777) == "0o700"
    assert img.stat().st_uid == os.getuid()
    import subprocess
    import sys

    from safetensors import safe_open
    from service_harness import service_env

    listed = subprocess.run([sys.executable, "-m", "weightcache", "images", "--dir", str(images), "--json"],
                            capture_output=True, text=True, timeout=60, env=service_env(), check=True).stdout
    (entry,) = [json.loads(line) for line in listed.splitlines()]
    assert (entry["model"], entry["tp_size"], entry["tp_rank"], entry["size_bytes"]) == ("m", 1, 0, img.stat().st_size)
    assert entry["key"]["architecture"] == "LlamaForCausalLM" and entry["key"]["backend"] == "host"
    assert not entry["rejected"]
    # Another tool reads it: one U8 tensor, the manifest and key beside.
    with safe_open(str(img), "np") as f:
        meta = f.metadata()
        assert list(f.keys()) == ["weightcache.slab"] and meta["format"] == "weightcache-image-1"
        assert json.loads(meta["key"])["checkpoint"]["files"] and meta["digest"].startswith("blake2b:")

    env, torch_log, read_log = _watched_env(tmp_path, ck)
    second = start_service(tmp_path / "b", cfg, env=env)
    try:
        slab = second.wait_settled()["slabs"][0]
        assert (slab["state"], slab["source"], slab["adopted"]) == ("ready", "image", False), second.log()
        assert "torch_free=yes source=image" in second.log()
        attempts = torch_import_attempts(torch_log)
        assert attempts == [], attempts[0]["stack"] if attempts else ""
        assert read_log.exists(), "the read watch saw no checkpoint read at all (not even the headers)"
        assert _tensor_reads(read_log, ck) == []
        counters = _image_counters(second)
        assert counters["read"] == 1 and counters["read_bytes"] > 0 and counters["written"] == 0
        loads = second.request(protocol.Metrics()).typed()[1].loads
        assert [(lc.outcome, lc.source) for lc in loads] == [("loaded", "image")]
        assert _attached_bytes(second, "m", ck) > 0
    finally:
        second.kill()


def _flip_byte(img: Path) -> None:
    from weightcache.images import read_header

    fd = os.open(img, os.O_RDWR)
    try:
        h = read_header(fd, os.fstat(fd).st_size)
        rec = next(r for r in h.manifest.tensors if r.alias_of is None and r.size_bytes > 8)
        at = h.data_offset + rec.offset_bytes + rec.size_bytes // 2
        b = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([b[0] ^ 0x40]), at)
    finally:
        os.close(fd)


def _rekey(img: Path, change) -> None:
    """Rewrites ``img`` with ``change(key)`` applied to its key (bytes and manifest as they were)."""
    from weightcache.images import build_header, read_header

    fd = os.open(img, os.O_RDONLY)
    try:
        h = read_header(fd, os.fstat(fd).st_size)
        data = os.pread(fd, h.data_bytes, h.data_offset)
    finally:
        os.close(fd)
    key = json.loads(json.dumps(h.key))
    change(key)
    tmp = img.with_name(".rekey")
    tmp.write_bytes(build_header(h.manifest, key, h.placement, h.backend, h.written_at) + data)
    os.chmod(tmp, 0o600)
    os.rename(tmp, img)



def _rewrite(img: Path, change_records, keep_digest: bool = False) -> None:
    """Rewrites ``img`` with ``change_records(records)`` as its manifest's records (bytes and key as they were);
    ``keep_digest``: the manifest's recorded digest left as it was (a manifest altered after it was written)."""
    from weightcache.images import build_header, read_header

    fd = os.open(img, os.O_RDONLY)
    try:
        h = read_header(fd, os.fstat(fd).st_size)
        data = os.pread(fd, h.data_bytes, h.data_offset)
    finally:
        os.close(fd)
    m = dataclasses.replace(h.manifest, tensors=tuple(change_records(list(h.manifest.tensors))))
    head = build_header(m, h.key, h.placement, h.backend, h.written_at)
    if keep_digest:
        old = json.loads(head[8:8 + int.from_bytes(head[:8], "little")])["__metadata__"]["digest"]
        assert len(old) == len(h.digest) and old != h.digest
        head = head.replace(old.encode(), h.digest.encode())
    tmp = img.with_name(".rewrite")
    tmp.write_bytes(head + data)
    os.chmod(tmp, 0o600)
    os.rename(tmp, img)


def _swap_records(img: Path) -> None:
    """Two stored tensors of one shape swap names (offsets and digests kept: every digest still matches the bytes
    at its offset, so only the layout check sees that each name would read the other tensor's bytes)."""
    def swap(records):
        stored = [r for r in records if r.alias_of is None and r.size_bytes]
        a, b = next((a, b) for i, a in enumerate(stored) for b in stored[i + 1:]
                    if (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)) and a.name != b.name)
        named = {a.name: b.name, b.name: a.name}
        return [dataclasses.replace(r, name=named.get(r.name, r.name)) for r in records]
    _rewrite(img, swap)


def _alter_manifest(img: Path) -> None:
    """One record's layout entry changed, the manifest's recorded digest left as it was: every other check passes
    (names, offsets, tensor digests), only the manifest digest tells."""
    def alter(records):
        r = next(r for r in records if r.alias_of is None and r.size_bytes)
        return [dataclasses.replace(x, layout={**dict(x.layout), "altered": 1}) if x is r else x for x in records]
    _rewrite(img, alter, keep_digest=True)

def _replace_checkpoint_file(ck: Path) -> None:
    """Writes one shard again with the same tensors: same bytes, a new file (inode, mtime): another identity."""
    from safetensors.torch import load_file, save_file

    f = min(ck.glob("*.safetensors"))
    tensors = {k: v.clone() for k, v in load_file(str(f)).items()}
    tmp = f.with_name("replacement.tmp")
    save_file(tensors, str(tmp))
    os.rename(tmp, f)


def _set_cc(key: dict) -> None:
    key["device"]["compute_capability"] = "9.0"


def _bump_pipeline(key: dict) -> None:
    key["pipeline_version"] = int(key["pipeline_version"]) + 1


@pytest.mark.parametrize("damage, reason", [
    ("flipped_byte", "digest"),
    ("manifest_altered", "digest"),
    ("records_swapped", "layout"),
    ("checkpoint_replaced", "identity"),
    ("compute_capability", "key"),
    ("pipeline_version", "key"),
])
def test_a_bad_image_is_refused_with_its_reason_moved_aside_and_the_slab_made_from_the_checkpoint(
        tmp_path, damage, reason):
    ck = llama_checkpoint(tmp_path / "ck", seed=2, files=2)
    images = tmp_path / "images"
    cfg = _config({"m": {"path": ck}}, images)
    first = start_service(tmp_path / "a", cfg)
    try:
        first.wait_settled()
        [img] = _wait_image(images, svc=first)
    finally:
        first.stop()
    {"flipped_byte": _flip_byte, "checkpoint_replaced": lambda p: _replace_checkpoint_file(ck),
     "compute_capability": lambda p: _rekey(p, _set_cc), "pipeline_version": lambda p: _rekey(p, _bump_pipeline),
     "manifest_altered": _alter_manifest, "records_swapped": _swap_records,
     }[damage](img)
    bad = img.read_bytes()
    second = start_service(tmp_path / "b", cfg)
    try:
        slab = second.wait_settled()["slabs"][0]
        assert (slab["state"], slab["source"]) == ("ready", "checkpoint"), second.log()
        assert f"image rejected model=m tp_size=1 rank=0 reason={reason} " in second.log()
        aside = img.with_name(img.name + ".rejected")
        assert aside.read_bytes() == bad
        assert _image_counters(second)["rejected"] == {reason: 1}
        assert _attached_bytes(second, "m", ck) > 0
        poll_until(lambda: img.exists(), "the image to be written again", 60, detail=second.log)
    finally:
        second.kill()
    third = start_service(tmp_path / "c", cfg)  # the rewritten image is valid
    try:
        assert third.wait_settled()["slabs"][0]["source"] == "image", third.log()
    finally:
        third.kill()


def test_kill_9_during_an_image_write_leaves_no_image_and_the_write_is_redone(tmp_path):
    ck = llama_checkpoint(tmp_path / "ck", seed=3, files=2)
    images = tmp_path / "images"
    slow = start_service(tmp_path / "a", _config({"m": {"path": ck}}, images, image_write_bytes_per_s=20_000))
    try:
        slow.wait_settled()
        tmp = poll_until(lambda: next((p for p in images.iterdir() if ".tmp-" in p.name), None),
                         "a write under way", 30, detail=slow.log)
        assert tmp.stat().st_size < sum(f.stat().st_size for f in ck.glob("*.safetensors"))  # partial
    finally:
        slow.kill()  # SIGKILL mid-write
    assert _images(images) == [] and tmp.exists()
    again = start_service(tmp_path / "b", _config({"m": {"path": ck}}, images))
    try:
        slab = again.wait_settled()["slabs"][0]
        assert (slab["state"], slab["source"]) == ("ready", "checkpoint"), again.log()
        assert not tmp.exists(), "the unfinished write was not removed"
        _wait_image(images, svc=again)
        assert _attached_bytes(again, "m", ck) > 0
    finally:
        again.kill()
    third = start_service(tmp_path / "c", _config({"m": {"path": ck}}, images))
    try:
        assert third.wait_settled()["slabs"][0]["source"] == "image", third.log()
    finally:
        third.kill()


def test_the_byte_limit_removes_the_older_unused_image(tmp_path):
    cks = {n: llama_checkpoint(tmp_path / f"ck-{n}", seed=s, files=1) for n, s in (("a", 4), ("b", 5))}
    images = tmp_path / "images"
    first = start_service(tmp_path / "a", _config({"a": {"path": cks["a"]}}, images))
    try:
        first.wait_settled()
        [img_a] = _wait_image(images, svc=first)
    finally:
        first.stop()
    size = img_a.stat().st_size
    # Room for one image and a half; a is configured but not loaded (preload = "disk": unused).
    cfg = _config({"a": {"path": cks["a"], "preload": "disk"}, "b": {"path": cks["b"]}}, images,
                  image_max_bytes=size * 3 // 2)
    second = start_service(tmp_path / "b", cfg)
    try:
        second.wait_settled()
        poll_until(lambda: [p.name.split(".")[0] for p in _images(images)] == ["b"], "b's image alone", 60,
                   detail=lambda: f"{os.listdir(images)}\n{second.log()}")
        assert "image removed for room model=a " in second.log()
        assert _image_counters(second)["removed"] == 1
    finally:
        second.kill()


def test_an_image_larger_than_the_byte_limit_is_not_written(tmp_path):
    """``image_max_bytes`` below one image's size: nothing is written (no file, not even a partial one), the
    write counted as failed with its reason, and the slab served from the checkpoint all the same."""
    ck = llama_checkpoint(tmp_path / "ck", seed=9, files=1)
    images = tmp_path / "images"
    limit = sum(f.stat().st_size for f in ck.glob("*.safetensors")) // 2
    svc = start_service(tmp_path / "a", _config({"m": {"path": ck}}, images, image_max_bytes=limit))
    try:
        slab = svc.wait_settled()["slabs"][0]
        assert (slab["state"], slab["source"]) == ("ready", "checkpoint"), svc.log()
        c = poll_until(lambda: (lambda c: c if c["write_failures"] + c["written"] else None)(_image_counters(svc)),
                       "the write to be given up", 60, detail=svc.log)
        assert (c["write_failures"], c["written"]) == (1, 0), c
        assert f"reason=no-room limit_bytes={limit}" in svc.log()
        assert os.listdir(images) == [] and _image_counters(svc)["written"] == 0
        assert _attached_bytes(svc, "m", ck) > 0
    finally:
        svc.kill()


def test_by_default_the_service_writes_no_image_of_what_it_makes(tmp_path):
    """``image`` unset: a slab the service makes from the checkpoint is not written (docs/configuration.md);
    the directory is there for publications."""
    ck = tmp_path / "ck"
    import torch

    write_checkpoint(ck, {"w": torch.arange(64, dtype=torch.float32)})
    images = tmp_path / "images"
    svc = start_service(tmp_path / "a", {"service": {"backend": "host", "image_dir": str(images)},
                                         "models": {"m": {"path": str(ck), "layouts": [{"tp": 1, "gpus": [0]}]}}})
    try:
        assert svc.wait_settled()["slabs"][0]["source"] == "checkpoint"
        assert oct(images.stat().st_mode & 0o777) == "0o700" and os.listdir(images) == []
        assert _image_counters(svc)["written"] == 0
    finally:
        svc.kill()


def test_without_image_dir_or_a_cache_directory_a_service_run_by_hand_keeps_no_images(tmp_path):
    ck = tmp_path / "ck"
    import torch

    write_checkpoint(ck, {"w": torch.arange(64, dtype=torch.float32)})
    svc = start_service(tmp_path / "a", {"service": {"backend": "host"},
                                         "models": {"m": {"path": str(ck), "image": True,
                                                          "layouts": [{"tp": 1, "gpus": [0]}]}}})
    try:
        assert svc.wait_settled()["slabs"][0]["source"] == "checkpoint"
        assert "images off: a model has image = true but [service] image_dir is unset" in svc.log()
        assert svc.request(protocol.Metrics()).typed()[1].images == {}
    finally:
        svc.kill()


def _on_disk_with_its_image(tmp_path, seed: int):
    """A service whose one model ``m`` (a 2-file Llama) had its image written, then was evicted to disk:
    ``(svc, ck, images, img)``; the caller kills the service."""
    ck = llama_checkpoint(tmp_path / "ck", seed=seed, files=2)
    images = tmp_path / "images"
    svc = start_service(tmp_path / "a", _config({"m": {"path": ck}}, images))
    try:
        svc.wait_settled()
        [img] = _wait_image(images, svc=svc)
        svc.request(protocol.Evict("m", to="disk"))
    except BaseException:
        svc.kill()
        raise
    return svc, ck, images, img


def test_evict_to_disk_keeps_the_image_and_the_next_attach_reads_it(tmp_path):
    svc, ck, images, img = _on_disk_with_its_image(tmp_path, 6)
    try:
        assert svc.slab("m")["state"] == "on_disk" and img.exists()
        assert _attached_bytes(svc, "m", ck) > 0  # the attach loads it on demand: from the image
        slab = svc.slab("m")
        assert (slab["state"], slab["source"]) == ("ready", "image"), svc.log()
        assert _image_counters(svc)["read"] == 1
    finally:
        svc.kill()


def test_a_slab_made_again_from_the_checkpoint_gets_its_image_written_again(tmp_path):
    # the image removed (an operator clearing the directory) while the slab is on disk: the next attach makes it
    # from the checkpoint, and the same service writes its image again (the first write is no longer pending)
    svc, ck, images, img = _on_disk_with_its_image(tmp_path, 8)
    try:
        img.unlink()
        assert _attached_bytes(svc, "m", ck) > 0
        assert svc.slab("m")["source"] == "checkpoint", svc.log()
        assert [p.name for p in _wait_image(images, svc=svc)] == [img.name]
    finally:
        svc.kill()


def test_a_publication_comes_back_from_its_image_after_a_stop(tmp_path):
    """The expensive slabs: an engine's publication is written (``image`` unset: published slabs get images),
    the service stopped without the fd store, started again: the publication is ``ready`` from its image
    before any engine asks, and ``attach_published`` gives the published bytes, names, views and attrs."""
    torch = pytest.importorskip("torch")
    from test_publish import _ckpt, _key, _processed, _same
    from weightcache.client import attach_published, publish

    ck = _ckpt(tmp_path / "ck")
    images = tmp_path / "images"
    cfg = {"service": {"backend": "host", "image_dir": str(images)},
           "models": {"m": {"path": str(ck), "layouts": [{"tp": 1, "gpus": [0]}]}}}
    first = start_service(tmp_path / "a", cfg)
    tensors = _processed(ck)
    try:
        first.wait_settled()
        got = publish(str(ck), _key(), tensors, attrs={"qk_proj.weight": {"output_dim": 0}},
                      socket_dir=first.socket_dir)
        assert got.created
        img = poll_until(lambda: next((p for p in _images(images) if ".pub-" in p.name), None),
                         "the publication's image", 60, detail=first.log)
        assert [p.name for p in _images(images)] == [img.name]  # the service's own slab: image unset, none
    finally:
        first.stop()
    second = start_service(tmp_path / "b", cfg)
    try:
        slabs = second.wait_settled()["slabs"]
        (pub,) = [s for s in slabs if s.get("publication")]
        assert (pub["state"], pub["source"]) == ("ready", "image"), second.log()
        assert pub["publication"]["engine_key_blake2b"] == got.engine_key_blake2b
        with attach_published(str(ck), _key(), socket_dir=second.socket_dir) as w:
            assert w.source == "daemon"
            _same(w.tensors, tensors)
            assert w.tensors["lm_head.weight"] is w.tensors["embed.weight"]
            assert w.layouts["qk_proj.weight"]["attrs"] == {"output_dim": 0}
        assert _image_counters(second)["read"] == 1
        assert torch is not None
    finally:
        second.kill()


def test_a_publication_whose_checkpoint_changed_is_not_brought_back(tmp_path):
    from test_publish import _ckpt, _key, _processed
    from weightcache.client import publish

    ck = _ckpt(tmp_path / "ck")
    images = tmp_path / "images"
    cfg = {"service": {"backend": "host", "image_dir": str(images)},
           "models": {"m": {"path": str(ck), "layouts": [{"tp": 1, "gpus": [0]}]}}}
    first = start_service(tmp_path / "a", cfg)
    try:
        first.wait_settled()
        publish(str(ck), _key(), _processed(ck), socket_dir=first.socket_dir)
        img = poll_until(lambda: next((p for p in _images(images) if ".pub-" in p.name), None),
                         "the publication's image", 60, detail=first.log)
    finally:
        first.stop()
    _replace_checkpoint_file(ck)
    second = start_service(tmp_path / "b", cfg)
    try:
        poll_until(lambda: "reason=identity" in second.log(), "the image refused", 60, detail=second.log)
        slabs = second.wait_settled()["slabs"]
        assert [s for s in slabs if s.get("publication")] == [], slabs  # no slot: the next engine publishes
        assert img.with_name(img.name + ".rejected").exists()
    finally:
        second.kill()


def test_check_config_warns_of_an_image_over_the_limit_at_the_size_the_service_writes(tmp_path, capsys):
    """check-config's image size is the file the service writes (header included), so a limit between the
    slab's bytes and the file's is warned of (the service would never write that image), and the file's
    own size is not."""
    from service_harness import to_toml
    from weightcache.cli import main

    ck = llama_checkpoint(tmp_path / "ck", seed=6, files=1)
    images = tmp_path / "images"
    svc = start_service(tmp_path / "a", _config({"m": {"path": ck}}, images))
    try:
        svc.wait_settled()
        [img] = _wait_image(images, svc=svc)
        slab = svc.status()["slabs"][0]["total_bytes"]
    finally:
        svc.stop()
    size = img.stat().st_size
    assert size > slab
    cfg = tmp_path / "check.toml"
    for limit, warned in ((size - 1, True), (size, False)):
        cfg.write_text(to_toml(_config({"m": {"path": ck}}, images, image_max_bytes=limit)))
        capsys.readouterr()
        assert main(["check-config", "--config", str(cfg)]) == 0
        err = capsys.readouterr().err
        assert (f"model m tp=1 rank=0: its image ({size / 1024:.1f} KiB, {size} bytes with its header) is larger "
                f"than [service] image_max_bytes" in err) is warned, err
