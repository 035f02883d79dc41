"""The guarded copy of row-parallel rows out of a file's mapping (issue 38, P7): a file cut during the copy is an
error for that piece, never ``SIGBUS`` (:func:`weightcache.reader._rows.guarded_copy_rows`)."""

from __future__ import annotations

import mmap
import os

import pytest

np = pytest.importorskip("numpy")

from weightcache import errors  # noqa: E402
from weightcache.reader import _loader as loader  # noqa: E402
from weightcache.reader import _rows as row_reads  # noqa: E402

pytestmark = pytest.mark.timeout(60)



def test_rows_are_copied_with_their_pitches(tmp_path):
    src = mmap.mmap(-1, 4 * 32)
    src[:] = bytes(range(128))
    dst = memoryview(bytearray(4 * 12))
    assert row_reads.guarded_copy_rows(dst, 2, 12, src, 4, 32, (4, 8)) == 4
    want = bytearray(48)
    for i in range(4):
        want[2 + 12 * i: 10 + 12 * i] = bytes(range(4 + 32 * i, 12 + 32 * i))
    assert bytes(dst) == bytes(want)


def test_more_rows_than_one_call_takes(tmp_path):
    rows = row_reads.IOV_MAX * 2 + 3
    src = mmap.mmap(-1, rows * 8)
    src[:] = np.arange(rows * 8, dtype=np.uint8).tobytes()
    dst = memoryview(bytearray(rows * 4))
    assert row_reads.guarded_copy_rows(dst, 0, 4, src, 0, 8, (rows, 4)) == rows
    assert bytes(dst) == np.arange(rows * 8, dtype=np.uint8).reshape(rows, 8)[:, :4].tobytes()


def test_rows_outside_either_buffer_are_refused():
    src = mmap.mmap(-1, 64)
    with pytest.raises(ValueError):
        row_reads.guarded_copy_rows(memoryview(bytearray(16)), 0, 8, src, 0, 8, (3, 8))
    with pytest.raises(ValueError):
        row_reads.guarded_copy_rows(memoryview(bytearray(64)), 0, 8, src, 40, 8, (4, 8))


def test_a_file_cut_after_it_was_mapped_is_checkpoint_corrupt_not_sigbus(tmp_path, monkeypatch):
    """The file is cut between the mapping and the copy (what ``cp`` over a file being read does): the copy
    stops at the first row past the end, and the piece is ``checkpoint_corrupt`` naming the file and tensor. Before
    the guarded copy this killed the test process with ``SIGBUS``."""
    rows, pitch = 4096, 64
    p = tmp_path / "m.safetensors"
    p.write_bytes(bytes(rows * pitch))
    t = loader.ReadTask(str(p), 0, 16, 0, "model.layers.0.mlp.down_proj.weight", rows=rows, src_pitch=pitch,
                        dst_pitch=16)
    fd = os.open(p, os.O_RDONLY)
    try:
        monkeypatch.setattr(row_reads, "in_page_cache", lambda f, o: os.truncate(p, 4096) or True)
        with pytest.raises(errors.CheckpointCorrupt) as e:
            row_reads.copy_mapped_rows(fd, t, memoryview(bytearray(rows * 16)), 0, 16)
        assert e.value.code == "checkpoint_corrupt"
        assert e.value.details["file"] == str(p) and e.value.details["tensor"] == t.tensor
    finally:
        os.close(fd)


def test_a_refused_guarded_copy_reads_spans(tmp_path, monkeypatch):
    """Where a seccomp filter refuses ``process_vm_readv`` (``None``), the rows are read with ``pread``."""
    rows, pitch = 8, 32
    p = tmp_path / "m.safetensors"
    data = np.arange(rows * pitch, dtype=np.uint8).tobytes()
    p.write_bytes(data)
    t = loader.ReadTask(str(p), 0, 8, 0, "w", rows=rows, src_pitch=pitch, dst_pitch=8)
    monkeypatch.setattr(row_reads, "guarded_copy_rows", lambda *a: None)
    spans = []
    real = row_reads.read_rows_by_spans
    monkeypatch.setattr(row_reads, "read_rows_by_spans", lambda *a: spans.append(1) or real(*a))
    out = memoryview(bytearray(rows * 8))
    fd = os.open(p, os.O_RDONLY)
    try:
        row_reads.copy_mapped_rows(fd, t, out, 0, 8)
    finally:
        os.close(fd)
    assert spans == [1]
    assert bytes(out) == np.frombuffer(data, np.uint8).reshape(rows, pitch)[:, :8].tobytes()
