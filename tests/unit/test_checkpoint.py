"""Checkpoint reader: single-file and sharded, identity, header validation."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from weightcache.checkpoint import Checkpoint
from weightcache.errors import CheckpointCorrupt, CheckpointNotFound


def _sharded(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    a = {"x.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    b = {"y.weight": torch.arange(4, dtype=torch.bfloat16).reshape(2, 2), "y.bias": torch.ones(2, dtype=torch.int64)}
    save_file(a, d / "model-00001-of-00002.safetensors")
    save_file(b, d / "model-00002-of-00002.safetensors")
    wm = {"x.weight": "model-00001-of-00002.safetensors", "y.weight": "model-00002-of-00002.safetensors",
          "y.bias": "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (d / "config.json").write_text('{"architectures": ["Tiny"]}')
    return d, {**a, **b}


def test_sharded_offsets_read_exact_bytes(tmp_path):
    d, ref = _sharded(tmp_path)
    ck = Checkpoint(d)
    assert set(ck.tensors) == set(ref)
    for name, t in ref.items():
        info = ck.tensors[name]
        buf = bytearray(info.size_bytes)
        ck.read_into(info, buf)
        assert bytes(buf) == t.contiguous().view(torch.uint8).numpy().tobytes()
        assert info.shape == tuple(t.shape)


def test_identity_changes_when_file_replaced_with_copied_mtime(tmp_path):
    d, _ = _sharded(tmp_path)
    f = d / "model-00001-of-00002.safetensors"
    before = Checkpoint(d).identity()
    st = os.stat(f)
    save_file({"x.weight": torch.full((2, 3), 7.0)}, tmp_path / "new.safetensors")
    os.replace(tmp_path / "new.safetensors", f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = Checkpoint(d).identity()
    fb, fa = before["files"][f.name], after["files"][f.name]
    assert fa["mtime_ns"] == fb["mtime_ns"]
    assert fa["inode"] != fb["inode"] or fa["ctime_ns"] != fb["ctime_ns"]
    assert fa["header_blake2b"] == fb["header_blake2b"]  # same layout, same header


def test_truncated_file_names_file_and_tensor(tmp_path):
    d, _ = _sharded(tmp_path)
    f = d / "model-00002-of-00002.safetensors"
    os.truncate(f, os.path.getsize(f) - 3)
    with pytest.raises(Exception) as e:
        Checkpoint(d)
    assert e.value.code == "checkpoint_corrupt"
    assert str(f) in e.value.message and e.value.details["tensor"] in ("y.weight", "y.bias")


def test_garbage_header(tmp_path):
    d = tmp_path / "g"
    d.mkdir()
    (d / "model.safetensors").write_bytes((20).to_bytes(8, "little") + b"{not json at all!!!}")
    with pytest.raises(Exception) as e:
        Checkpoint(d)
    assert e.value.code == "checkpoint_corrupt"


def test_a_runtime_that_cannot_import_numpy_is_not_a_corrupt_checkpoint(tmp_path, monkeypatch):
    """safetensors' ``safe_open(framework="numpy")`` imports numpy on first use; when that import fails (a
    broken runtime, or ``check-config --as-user`` in a child that may not read the interpreter's files) the
    ImportError propagates. It was caught with safetensors' own errors and every good checkpoint was
    ``checkpoint_corrupt``."""
    d, _ = _sharded(tmp_path)
    monkeypatch.setitem(__import__("sys").modules, "numpy", None)
    with pytest.raises(ImportError):
        Checkpoint(d)


@pytest.mark.parametrize("entries, found", [
    (["config.json", "pytorch_model.bin"], ["pytorch_model.bin"]),  # a checkpoint saved without safetensors
    (["blobs/", "refs/", "snapshots/"], ["snapshots"]),  # the hub cache's repository, not its snapshot
    ([], []),
])
def test_a_directory_without_safetensors_says_what_it_holds(tmp_path, entries, found):
    """``checkpoint_not_found`` for a directory with no ``*.safetensors`` names what is there instead
    (``details["found"]``): weights in another format, or a hub cache repository whose snapshot was meant."""
    d = tmp_path / "ck"
    d.mkdir()
    for e in entries:
        (d / e.rstrip("/")).mkdir() if e.endswith("/") else (d / e).write_bytes(b"x")
    with pytest.raises(CheckpointNotFound) as e:
        Checkpoint(d)
    assert e.value.code == "checkpoint_not_found"
    assert e.value.details["path"] == str(d) and e.value.details["found"] == found


def test_missing_directory_and_index_entry(tmp_path):
    with pytest.raises(Exception) as e:
        Checkpoint(tmp_path / "absent")
    assert e.value.code == "checkpoint_not_found"
    d, _ = _sharded(tmp_path)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"]["z.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(Exception) as e:
        Checkpoint(d)
    assert e.value.code == "checkpoint_not_found" and e.value.details["tensor"] == "z.weight"


def test_shard_file_missing_from_disk(tmp_path):
    d, _ = _sharded(tmp_path)
    os.unlink(d / "model-00002-of-00002.safetensors")
    with pytest.raises(Exception) as e:
        Checkpoint(d)
    assert e.value.code == "checkpoint_not_found" and "model-00002-of-00002" in e.value.message


def _rewrite_same_times(path, data: bytes) -> None:
    """New bytes, atime/mtime put back (what a careless copy tool does); only ctime can tell."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("change,expected", [
    (None, []),
    (lambda d: _rewrite_same_times(d / "model-00002-of-00002.safetensors",
                                   (d / "model-00002-of-00002.safetensors").read_bytes()),
     ["files.model-00002-of-00002.safetensors.ctime_ns"]),
    (lambda d: (d / "model.safetensors.index.json").write_text(
        (d / "model.safetensors.index.json").read_text()), ["index"]),
    (lambda d: (d / "config.json").write_text('{"architectures": ["Other"]}'), ["config_json_blake2b"]),
    (lambda d: (d / "hf_quant_config.json").write_text("{}"), ["quant_config_blake2b"]),
    (lambda d: os.unlink(d / "model-00001-of-00002.safetensors"), ["files.model-00001-of-00002.safetensors"]),
])
def test_identity_diff_by_stat_names_what_changed(tmp_path, change, expected):
    """The engine's stat()-only check agrees with a full identity recomputation about *whether* it changed."""
    d, _ = _sharded(tmp_path)
    ident = Checkpoint(d).identity()
    if change is not None:
        change(d)
    now = Checkpoint(d, validate=False)
    assert now.identity_diff(ident) == expected
    if change is not None and (d / "model-00001-of-00002.safetensors").exists():
        assert Checkpoint(d, validate=False).identity() != ident


def test_identity_diff_single_file_checkpoint_sees_a_new_file(tmp_path):
    d = tmp_path / "one"
    d.mkdir()
    save_file({"w": torch.ones(3)}, d / "model.safetensors")
    ident = Checkpoint(d).identity()
    assert ident["index"] is None and Checkpoint(d, validate=False).identity_diff(ident) == []
    save_file({"v": torch.ones(3)}, d / "extra.safetensors")
    assert Checkpoint(d, validate=False).identity_diff(ident) == ["files"]
    # An identity from a version without the index field never matches.
    del ident["index"]
    assert Checkpoint(d, validate=False).identity_diff(ident) == ["index"]


def test_unvalidated_checkpoint_reads_no_header_until_asked(tmp_path):
    """validate=False reads config.json only; a corrupt shard raises at first use, naming the file."""
    d, _ = _sharded(tmp_path)
    with open(d / "model-00002-of-00002.safetensors", "r+b") as f:
        f.truncate(4)
    ck = Checkpoint(d, validate=False)
    assert ck.config == {"architectures": ["Tiny"]}
    with pytest.raises(CheckpointCorrupt, match="model-00002-of-00002.safetensors"):
        ck.raw_headers


def _read_all(ck: Checkpoint) -> dict[str, bytes]:
    out = {}
    for name, info in ck.tensors.items():
        buf = bytearray(info.size_bytes)
        ck.read_into(info, memoryview(buf))
        out[name] = bytes(buf)
    return out


def test_hub_snapshot_links_into_blobs_are_allowed(tmp_path):
    """A Hugging Face hub cache: snapshots/<rev>/model.safetensors -> ../../blobs/<sha>; read as usual."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    t = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    save_file(t, repo / "blobs" / "sha256-0001")
    (snap / "model.safetensors").symlink_to("../../blobs/sha256-0001")
    ck = Checkpoint(snap)
    assert _read_all(ck) == {"w": t["w"].numpy().tobytes()}


@pytest.mark.parametrize("hub", [False, True])
def test_a_link_to_a_missing_file_says_so(tmp_path, hub):
    """``model.safetensors`` is a link (``ls`` lists it) to a file that is gone: ``checkpoint_not_found``
    names the link's target (``details["link_target"]``); it said the link itself 'does not exist'."""
    if hub:  # a hub snapshot whose blob is missing
        (tmp_path / "models--org--tiny" / "blobs").mkdir(parents=True)
        d = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
        d.mkdir(parents=True)
        target = "../../blobs/sha256-0001"
    else:
        d = tmp_path / "ck"
        d.mkdir()
        target = "model-renamed.safetensors"
    (d / "model.safetensors").symlink_to(target)
    with pytest.raises(CheckpointNotFound) as e:
        Checkpoint(d)
    assert e.value.code == "checkpoint_not_found"
    assert (e.value.details["file"], e.value.details["link_target"]) == ("model.safetensors", target)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "subdir", "symlink_out", "fifo", "directory"])
def test_files_outside_the_directory_or_not_regular_are_refused(tmp_path, how):
    """Index entries that are not plain names, a shard symlinked out of the directory, a FIFO or a directory
    as a shard: checkpoint_corrupt naming the entry, before any byte of it is read."""
    d, _ = _sharded(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    save_file({"x.weight": torch.zeros(2, 3)}, other / "secret.safetensors")
    index = d / "model.safetensors.index.json"
    wm = json.loads(index.read_text())["weight_map"]
    first = d / "model-00001-of-00002.safetensors"
    target = ""
    if how in ("dotdot", "absolute", "subdir"):
        target = {"dotdot": "../other/secret.safetensors", "absolute": str(other / "secret.safetensors"),
                  "subdir": "sub/model-00001-of-00002.safetensors"}[how]
        wm["x.weight"] = target
        index.write_text(json.dumps({"weight_map": wm}))
    else:
        first.unlink()
        if how == "symlink_out":
            first.symlink_to(other / "secret.safetensors")
        elif how == "fifo":
            os.mkfifo(first)
        else:
            first.mkdir()
    with pytest.raises(CheckpointCorrupt) as e:
        Checkpoint(d)
    assert e.value.code == "checkpoint_corrupt"
    named = e.value.details["file"]
    assert named.endswith(target) if how in ("dotdot", "absolute", "subdir") else \
        named.endswith("model-00001-of-00002.safetensors")


@pytest.mark.parametrize("path,cause", [("/" + "a" * 5000, "File name too long"), ("/srv/a\0b", "NUL character")])
def test_impossible_path_is_checkpoint_not_found(path, cause):
    """A path no directory can have is the typed error, not an OSError/ValueError traceback."""
    with pytest.raises(Exception) as e:
        Checkpoint(path)
    assert e.value.code == "checkpoint_not_found" and cause in e.value.message


# --- containment by file descriptor (issue 25, attack 3) -----------------------------------------------------


def test_a_file_swapped_after_its_header_was_read_is_refused(tmp_path):
    """The race variant of the directory swap: after the plan read a shard's header, the shard is replaced by
    another file (same name). Before: the read opened the name again and served the new file's bytes. Now the
    data fd is checked against the header-time fstat (st_dev, st_ino, size, mtime): checkpoint_corrupt."""
    d, _ = _sharded(tmp_path)
    ck = Checkpoint(d)
    info = ck.tensors["x.weight"]
    other = tmp_path / "other.safetensors"
    save_file({"x.weight": torch.full((2, 3), 7.0)}, other)
    os.replace(other, d / info.file)
    with pytest.raises(CheckpointCorrupt) as e:
        ck.read_into(info, memoryview(bytearray(info.size_bytes)))
    assert e.value.details["file"] == info.file and "st_ino" in e.value.details["changed"]


def test_a_directory_swapped_after_the_open_is_not_followed(tmp_path):
    """After the checkpoint directory was opened, it is renamed away and a symlink to another model takes its
    name: reads go on beneath the directory fd opened first (the model's own bytes), never to the other."""
    d, ref = _sharded(tmp_path)
    ck = Checkpoint(d)
    other = tmp_path / "other"
    other.mkdir()
    for f in d.glob("*.safetensors"):
        save_file({"x.weight": torch.full((2, 3), 9.0)}, other / f.name)
    os.rename(d, tmp_path / "moved")
    d.symlink_to(other)
    info = ck.tensors["x.weight"]
    buf = bytearray(info.size_bytes)
    ck.read_into(info, memoryview(buf))
    assert bytes(buf) == ref["x.weight"].numpy().tobytes()


def test_checkpoint_path_resolving_elsewhere_than_configured_is_refused(tmp_path):
    """The service passes the path's resolution when its configuration was read (root): a path that now
    resolves elsewhere (a retargeted link) is checkpoint_corrupt, not the other directory's bytes."""
    d, _ = _sharded(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    link = tmp_path / "link"
    link.symlink_to(d)
    root = os.path.realpath(link)
    Checkpoint(link, root=root).close()
    link.unlink()
    link.symlink_to(other)
    with pytest.raises(CheckpointCorrupt):
        Checkpoint(link, root=root)


def test_symlinks_of_untrusted_owners_are_not_followed(tmp_path):
    """trusted_link_owners: a symlink on the way to the checkpoint owned by another uid is refused, naming it
    and its owner; the same link owned by a trusted uid is followed."""
    d, _ = _sharded(tmp_path)
    link = tmp_path / "snap"
    link.symlink_to(d)
    os.lchown(link, 65534, 65534)
    with pytest.raises(CheckpointCorrupt) as e:
        Checkpoint(link, trusted_link_owners=frozenset({0}))
    assert e.value.details["owner_uid"] == 65534 and e.value.details["file"] == str(link)
    ck = Checkpoint(link, trusted_link_owners=frozenset({0, 65534}))
    assert ck.path == d.resolve()


def test_side_files_are_opened_beneath_the_directory(tmp_path):
    """config.json symlinked out of the checkpoint (to a root-only file) is checkpoint_corrupt, and a FIFO
    config.json is refused at once instead of blocking the read."""
    d, _ = _sharded(tmp_path)
    secret = tmp_path / "secret.json"
    secret.write_text('{"architectures": ["Secret"]}')
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(secret)
    with pytest.raises(CheckpointCorrupt):
        Checkpoint(d, validate=False)
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    with pytest.raises(CheckpointCorrupt):
        Checkpoint(d, validate=False)
