"""The image store on its own (weightcache.images): format round trip, access refusals, checks, room."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from weightcache.images import (
    DATA_ALIGN,
    ImageFormatError,
    ImageStore,
    build_header,
    image_name,
    read_header,
)
from weightcache.manifest import Manifest, TensorRecord


def _placement(name: str = "m", priority: int = 0, path: str = "/srv/m") -> SimpleNamespace:
    model = SimpleNamespace(name=name, path=path, dtype="auto", naming="hf", kernel="cutlass", revision="",
                            priority=priority)
    return SimpleNamespace(model=model, tp_size=1, tp_rank=0, to_json=lambda: {"model": {"name": name}})


KEY = {"checkpoint": {"files": {"a.safetensors": [1, 2]}}, "dtype": "auto", "pipeline_version": 1,
       "device": {"backend": "host", "gpu_uuid": "", "compute_capability": ""}}


def _manifest(name: str = "m", size: int = 4096) -> Manifest:
    return Manifest(name, 1, 0, KEY, size, (TensorRecord("w", "U8", (size,), (1,), 0, size, "xxh3_128:00"),))


def _write(store: ImageStore, placement, key=KEY, data: bytes = b"\1" * 4096, mode: int = 0o600) -> Path:
    path = Path(store.path_for(placement))
    path.write_bytes(build_header(_manifest(placement.model.name, len(data)), key, placement.to_json(), "host", 1.0)
                     + data)
    os.chmod(path, mode)
    return path


def test_the_header_round_trips_and_aligns_the_data(tmp_path):
    store = ImageStore(str(tmp_path / "img"), 0, "host")
    assert store.prepare()
    path = _write(store, _placement())
    fd = os.open(path, os.O_RDONLY)
    try:
        h = read_header(fd, path.stat().st_size)
    finally:
        os.close(fd)
    assert h.data_offset % DATA_ALIGN == 0 and h.data_bytes == 4096 and h.key == KEY
    assert [r.name for r in h.manifest.tensors] == ["w"]


def test_a_truncated_image_is_a_format_error(tmp_path):
    store = ImageStore(str(tmp_path / "img"), 0, "host")
    store.prepare()
    path = _write(store, _placement())
    os.truncate(path, path.stat().st_size - 1)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ImageFormatError, match="a write that did not finish"):
            read_header(fd, path.stat().st_size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["symlink", "group_readable", "other_owner", "fifo"])
def test_an_image_that_breaks_the_access_rules_is_refused_and_moved_aside(tmp_path, how):
    store = ImageStore(str(tmp_path / "img"), 0, "host")
    store.prepare()
    p = _placement()
    if how == "other_owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the image to another uid")
        os.chown(_write(store, p), 65534, 65534)  # 0600, but another user's: it could have written the bytes
    elif how == "fifo":
        os.mkfifo(store.path_for(p), 0o600)
    elif how == "symlink":
        elsewhere = tmp_path / "elsewhere.safetensors"
        real = _write(store, p)
        os.rename(real, elsewhere)
        os.symlink(elsewhere, store.path_for(p))
    else:
        _write(store, p, mode=0o640)
    records = list(_manifest().tensors)
    assert store.find(p, KEY, records, 4096) is None
    assert os.path.lexists(store.path_for(p) + ".rejected") and not os.path.lexists(store.path_for(p))
    assert store.stats.snapshot()["rejected"] == {"access": 1}


def test_the_gpu_uuid_is_not_compared_but_the_compute_capability_is(tmp_path):
    store = ImageStore(str(tmp_path / "img"), 0, "host")
    store.prepare()
    p = _placement()
    records = list(_manifest().tensors)
    other_card = json.loads(json.dumps(KEY))
    other_card["device"]["gpu_uuid"] = "GPU-elsewhere"
    _write(store, p, key=other_card)
    assert store.find(p, KEY, records, 4096) is not None
    other_cc = json.loads(json.dumps(KEY))
    other_cc["device"]["compute_capability"] = "9.0"
    _write(store, p, key=other_cc)
    assert store.find(p, KEY, records, 4096) is None
    assert store.stats.snapshot()["rejected"] == {"key": 1}


def test_room_goes_to_unconfigured_then_lowest_priority_then_least_recently_used(tmp_path):
    store = ImageStore(str(tmp_path / "img"), 0, "host")
    store.prepare()
    names = {"gone": None, "low": -5, "old": 0, "new": 0}
    paths = {}
    for i, n in enumerate(names):
        paths[n] = _write(store, _placement(n, path=f"/srv/{n}"))
        os.utime(paths[n], (1000.0 + {"gone": 4, "low": 3, "old": 1, "new": 2}[n], 1000.0))
    size = paths["old"].stat().st_size
    store.limit_bytes = size * 4
    removed = []
    for _ in range(3):
        assert store.make_room(size, "", lambda m: 0 if m.startswith("x") else names[m])
        gone = [n for n, p in paths.items() if not p.exists() and n not in removed]
        removed += gone
        _write(store, _placement(f"x{len(removed)}", path=f"/srv/x{len(removed)}"))
    assert removed == ["gone", "low", "old"]
    assert store.stats.snapshot()["removed"] == 3


def test_room_goes_first_to_rejected_files_however_recent(tmp_path):
    """A ``.rejected`` file (kept for the operator to look at) leaves before any image a configured model uses,
    even one used longer ago."""
    store = ImageStore(str(tmp_path / "img"), 0, "host")
    store.prepare()
    keep = _write(store, _placement("keep", path="/srv/keep"))
    bad = _write(store, _placement("bad", path="/srv/bad"))
    os.rename(bad, str(bad) + ".rejected")
    bad = Path(str(bad) + ".rejected")
    os.utime(keep, (1000.0, 1000.0))
    os.utime(bad, (2000.0, 2000.0))
    size = keep.stat().st_size
    store.limit_bytes = size * 2
    assert store.make_room(size, "", lambda m: 0)
    assert keep.exists() and not bad.exists()
    assert store.stats.snapshot()["removed"] == 1


def test_a_directory_of_another_user_or_a_symlink_turns_images_off(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    store = ImageStore(str(link), 0, "host")
    assert not store.prepare() and "is a symlink" in store.disabled
    assert store.find(_placement(), KEY, [], 4096) is None


def test_image_names_differ_by_checkpoint_and_backend_not_by_gpu():
    a, b = _placement(path="/srv/a"), _placement(path="/srv/b")
    assert image_name(a, "host") != image_name(b, "host") != image_name(b, "cuda")
    assert image_name(a, "host").startswith("m.tp1.rank0.") and image_name(a, "host").endswith(".safetensors")


def test_publication_image_names_differ_by_engine_key_and_by_the_private_publishers_uid():
    """A private publication's image is its publisher's alone: never the file of the shared one of the same key,
    nor of another uid's private one (a restart brings each back to whom it was)."""
    p = _placement()

    def pub(key: str = "ab" * 16, shared: bool = True, uid: int = 0) -> SimpleNamespace:
        return SimpleNamespace(engine_key_blake2b=key, shared=shared, publisher_uid=uid)

    names = [image_name(p, "host"), image_name(p, "host", pub()), image_name(p, "host", pub("cd" * 16)),
             image_name(p, "host", pub(shared=False, uid=1000)), image_name(p, "host", pub(shared=False, uid=1001))]
    assert len(set(names)) == len(names), names
    assert names[3].endswith(f".pub-{'ab' * 8}-uid1000.safetensors") and names[1].endswith(f".pub-{'ab' * 8}.safetensors")


def test_a_gpu_slab_is_held_for_the_writers_read_until_the_image_is_written(tmp_path):
    """On the cuda backend the writer copies the GPU slab to a host memfd (``backend.demote``) on its thread;
    the slab is held (an eviction waits, the OffLoop's read count) from the scheduling until the write ended.
    The backend here stands in for CUDA with a memfd: what is checked is the hold, the release and the file."""
    import threading

    from weightcache.config import Config, ModelConfig, Placement
    from weightcache.daemon.imaging import Imaging
    from weightcache.daemon.state import Slot
    from weightcache.images import ImageWriter, read_header

    data = bytes(range(256)) * 16
    fd = os.memfd_create("gpu-stand-in")
    os.write(fd, data)

    class Hosted:
        def __init__(self) -> None:
            self.fd, self.closed = os.dup(fd), False

        def close(self) -> None:
            os.close(self.fd)
            self.closed = True

    class Gpu:  # what the writer sees of a CudaSealedSlab: it offers digests, no host fd
        size_bytes = len(data)

        def digests(self, ranges):
            raise AssertionError("not called by the writer")

    copies = []

    class Backend:
        name = "cuda"

        def demote(self, sealed, label):
            copies.append(Hosted())
            return copies[-1]

    model = ModelConfig(name="m", path="/srv/m", image=True)
    placement = Placement(model, 1, 0, 0)
    slot = Slot(placement)
    slot.manifest, slot.sealed = _manifest("m", len(data)), Gpu()
    store = ImageStore(str(tmp_path / "img"), 0, "cuda")
    assert store.prepare()
    imaging = Imaging(store, ImageWriter(store, 0), Backend(), Config(models={"m": model}))
    held, released, done = [], [], threading.Event()
    imaging.reader_hold = (held.append, lambda s: (released.append(s), done.set()))
    assert imaging.written_after_load(slot, "checkpoint", promoted=False)
    assert held == [slot.sealed]
    assert done.wait(30) and released == [slot.sealed]
    assert copies and copies[0].closed
    path = store.path_for(placement)
    rfd = os.open(path, os.O_RDONLY)
    try:
        h = read_header(rfd, os.fstat(rfd).st_size)
        assert os.pread(rfd, h.data_bytes, h.data_offset) == data and h.backend == "cuda"
    finally:
        os.close(rfd)
        os.close(fd)


def test_listing_the_images_does_not_move_their_last_use(tmp_path):
    """``last use`` is the file's atime (set when an image is read into a slab): reading headers for
    ``weightcache images`` must not move it, as a relatime mount does for an atime older than a day."""
    store = ImageStore(str(tmp_path / "img"), 0, "host")
    store.prepare()
    path = _write(store, _placement())
    st = path.stat()
    old = st.st_mtime - 3 * 86400
    os.utime(path, (old, st.st_mtime - 4 * 86400))
    (e,) = store.entries(headers=True)
    assert e.model == "m" and e.last_used == old
    assert path.stat().st_atime == old
    assert [x.last_used for x in store.entries(headers=True)] == [old]


def test_a_publication_image_with_a_record_outside_its_data_is_refused_as_layout(tmp_path):
    """A publication's records are the engine's (no plan to compare with): each must still lie inside the image's
    data, or the slab would hand out bytes past its end."""
    store = ImageStore(str(tmp_path / "img"), 0, "host")
    store.prepare()
    p = _placement()
    pub = SimpleNamespace(engine_key_blake2b="ab" * 16, shared=True, publisher_uid=0)
    record = {"engine_key": {"engine": "vllm"}, "engine_key_blake2b": "ab" * 16, "shared": True}
    path = Path(store.path_for(p, pub))

    def write(records):
        m = Manifest("m", 1, 0, KEY, 4096, records)
        path.write_bytes(build_header(m, KEY, p.to_json(), "host", 1.0, record) + b"\1" * 4096)
        os.chmod(path, 0o600)

    write((TensorRecord("w", "U8", (4096,), (1,), 0, 4096, "xxh3_128:00"),))
    assert store.find(p, KEY, None, None, publication=pub) is not None
    write((TensorRecord("w", "U8", (4096,), (1,), 0, 4096, "xxh3_128:00"),
           TensorRecord("past_end", "U8", (4096,), (1,), 4096, 4096, "xxh3_128:00")))
    assert store.find(p, KEY, None, None, publication=pub) is None
    assert os.path.exists(str(path) + ".rejected") and not path.exists()
    assert store.stats.snapshot()["rejected"] == {"layout": 1}


def test_a_publication_image_of_another_user_is_not_offered_back(tmp_path):
    """What a start offers back as publications is the service's own files only: another uid's file, even 0600
    with a valid header, could hold any bytes under any engine key."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give the image to another uid")
    store = ImageStore(str(tmp_path / "img"), 0, "host")
    store.prepare()
    p = _placement()
    pub = SimpleNamespace(engine_key_blake2b="ab" * 16, shared=True, publisher_uid=0)
    path = Path(store.path_for(p, pub))
    record = {"engine_key": {"engine": "vllm"}, "engine_key_blake2b": "ab" * 16, "shared": True}
    path.write_bytes(build_header(_manifest(), KEY, p.to_json(), "host", 1.0, record) + b"\1" * 4096)
    os.chmod(path, 0o600)
    assert [(f, h.publication) for f, h in store.publications()] == [(str(path), record)]
    os.chown(path, 65534, 65534)
    assert store.publications() == []
