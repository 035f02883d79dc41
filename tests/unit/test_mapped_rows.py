"""Row-parallel shards copied from a mapping of the checkpoint file (:func:`weightcache.reader._rows.copy_mapped_rows`):
what an operator or an attacker can do to the file around and during the load.

Real safetensors files written by the test, the real host backend and the fake CUDA stager of
``test_torch_free_load``; bytes are compared with the torch pipeline (:func:`pipeline.execute`), errors by
``code`` and the file and tensor they name, leaks by ``/proc/self/fd`` and ``/proc/self/maps``.
"""

from __future__ import annotations

import copy
import errno
import json
import mmap
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoints import llama_checkpoint  # noqa: E402

from weightcache import pipeline, protocol  # noqa: E402
from weightcache.reader import _loader as loader  # noqa: E402
from weightcache.reader import _rows as row_reads  # noqa: E402
from weightcache.config import ModelConfig  # noqa: E402
from weightcache.errors import CheckpointCorrupt  # noqa: E402
from weightcache.memory import get_backend  # noqa: E402
from weightcache.spec import RankRequest  # noqa: E402

DEVICE = {"backend": "host", "gpu_uuid": "", "compute_capability": ""}


def _plan(ck: Path, tp: int, rank: int):
    return pipeline.plan(RankRequest(ModelConfig(name="m", path=str(ck), naming="vllm"), tp, rank), DEVICE)


def _fill_error(p, **opts) -> CheckpointCorrupt:
    """Fills a real host slab for the plan ``p``; returns the ``checkpoint_corrupt`` it raised."""
    w = get_backend("host").allocate(p.slab_size_bytes, "m")
    try:
        with pytest.raises(CheckpointCorrupt) as e:
            pipeline.fill(p, w, options=loader.LoaderOptions(**opts))
    finally:
        w.abort()
    return e.value


def _cut_when_opened(monkeypatch, size: int) -> None:
    """The reader's files are cut to ``size`` bytes just after it opens them (past the header-time ``fstat``
    check of :meth:`Checkpoint.open_member`): a file truncated during the load."""
    real = loader.open_file

    def open_then_cut(path, flags=os.O_RDONLY | os.O_CLOEXEC):
        fd = real(path, flags)
        os.truncate(path, size)
        return fd

    monkeypatch.setattr(loader, "open_file", open_then_cut)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_file_cut_during_the_load_fails_it_with_a_status_record_that_serialises(tmp_path, monkeypatch, tp):
    """A checkpoint cut while it is read (by ``cp`` over it, say) fails the reader with ``checkpoint_corrupt``
    naming the file and tensor: as a row-parallel shard copied from the mapping (TP 2) or read with ``pread``
    (TP 1). The error becomes the slab's record in ``status`` and ``list`` (:class:`protocol.ErrorInfo`): it
    must serialise (a checkpoint member's path, a ``str`` subclass bound to its checkpoint, made every later
    ``status`` fail with ``internal``), and ``details.file`` is a plain path."""
    ck = llama_checkpoint(tmp_path / "ck", seed=3, files=1, hidden=64, inter=4096)
    p = _plan(ck, tp, 0)
    f = next(ck.glob("*.safetensors"))
    _cut_when_opened(monkeypatch, 4096)
    e = _fill_error(p, threads=2, staging_bytes=1 << 20)
    assert e.code == "checkpoint_corrupt" and str(f) in e.message and repr(e.details["tensor"]) in e.message
    assert type(e.details["file"]) is str and e.details["file"] == str(f)
    record = protocol.ErrorInfo(**e.to_wire()).to_json()
    assert json.loads(json.dumps(record))["details"]["file"] == str(f)
    member = p.checkpoint.file_path(f.name)  # what the reader opens; any error may name it
    assert type(copy.deepcopy({"file": member})["file"]) is str and copy.deepcopy(member) == member == str(f)


class _NoFileMappings:
    """The ``mmap`` module where the checkpoint's file system refuses shared mappings of its files (FUSE with
    ``direct_io`` and no ``direct_io_allow_mmap``, virtiofs with ``cache=never``: ``ENODEV``); anonymous and
    memfd mappings (staging, the host slab) work."""

    def __init__(self, err: int = errno.ENODEV) -> None:
        self.err, self.refused = err, 0

    def __getattr__(self, name: str):
        return getattr(mmap, name)

    def mmap(self, fileno: int, *args, **kwargs):
        if fileno != -1 and not os.readlink(f"/proc/self/fd/{fileno}").startswith("/memfd:"):
            self.refused += 1
            raise OSError(self.err, os.strerror(self.err))
        return mmap.mmap(fileno, *args, **kwargs)


@pytest.mark.parametrize("err", [errno.ENODEV, errno.ENOMEM])
@pytest.mark.parametrize("tp,rank,staging", [(2, 1, 1 << 20), (4, 3, 1), (8, 5, 4 * 16384)])
def test_a_file_that_cannot_be_mapped_is_read_as_spans_with_the_same_bytes(tmp_path, monkeypatch, err, tp, rank,
                                                                            staging):
    """Where the file system refuses to map the checkpoint (``ENODEV``), or the process is out of mappings
    (``ENOMEM``: ``vm.max_map_count``), row-parallel shards are read as spans of the file, as before the mapped
    copy, instead of failing the load with ``internal``: the host slab and the CUDA stager get the torch
    pipeline's bytes, down to one-row pieces (the 4 KiB minimum staging buffer)."""
    from test_torch_free_load import _FakeCudaSlab

    ck = llama_checkpoint(tmp_path / "ck", seed=tp, files=2, hidden=64, heads=8, kv_heads=2, inter=8 * 130)
    p = _plan(ck, tp, rank)
    slab = torch.zeros(p.slab_size_bytes, dtype=torch.uint8)
    pipeline.execute(p, slab)
    want = bytes(slab.numpy())
    fake = _NoFileMappings(err)
    monkeypatch.setattr(row_reads, "mmap", fake)
    opts = dict(threads=2, staging_bytes=staging)
    w = get_backend("host").allocate(p.slab_size_bytes, "m")
    pipeline.fill(p, w, options=loader.LoaderOptions(**opts))
    sealed = w.seal()
    buf = sealed.buffer
    try:
        assert bytes(buf[: p.slab_size_bytes]) == want
    finally:
        buf.release()
        sealed.close()
    cuda = _FakeCudaSlab(p.slab_size_bytes)
    pipeline.fill(p, cuda, options=loader.LoaderOptions(**opts))
    assert bytes(cuda.bytes) == want
    assert fake.refused > 0


def test_a_file_cut_between_the_size_check_and_the_mapping_is_checkpoint_corrupt(tmp_path, monkeypatch):
    """A file cut after the piece's ``fstat`` but before its ``mmap`` (Python's ``mmap`` checks the size again
    and raises ``ValueError``) fails the load with ``checkpoint_corrupt`` naming the file and tensor, not
    ``internal``."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(1000))
    real = os.fstat

    def stale(fd):  # what fstat said just before the cut
        st = list(real(fd))
        st[6] = 1 << 20
        return os.stat_result(st)

    monkeypatch.setattr(os, "fstat", stale)
    t = loader.ReadTask(str(path), 64, 16, 0, "model.layers.0.mlp.down_proj.weight", rows=64, src_pitch=64,
                        dst_pitch=16)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with pytest.raises(CheckpointCorrupt) as e:
            loader.copy_mapped_rows(fd, t, memoryview(bytearray(1024)), 0, 16)
    finally:
        os.close(fd)
    assert e.value.code == "checkpoint_corrupt" and str(path) in str(e.value)
    assert "'model.layers.0.mlp.down_proj.weight'" in str(e.value)


CUT_UNDER_VMREAD = """
import mmap, os, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
import bench_tp_reads as b
from weightcache.reader import ReadTask
path = sys.argv[1]
real = mmap.mmap

def map_then_cut(*args, **kwargs):
    m = real(*args, **kwargs)
    os.truncate(path, 1 << 16)
    return m

mmap.mmap = map_then_cut
t = ReadTask(path, 100, 1024, 0, "w", rows=300, src_pitch=4096, dst_pitch=1024)
out = np.zeros(300 * 1024, np.uint8)
try:
    b.vm_read_rows(t, os.open(path, os.O_RDONLY), out)
    print("no error")
except OSError as e:
    data = open(path, "rb").read()
    good = (len(data) - 100) // 4096
    assert all(bytes(out[i * 1024 : (i + 1) * 1024]) == data[100 + i * 4096 : 1124 + i * 4096] for i in range(good))
    print("short:", e)
"""


def test_rows_copied_by_the_kernel_from_a_file_cut_under_the_mapping_are_a_short_count_not_sigbus(tmp_path):
    """The way proposed to remove the mapped copy's ``SIGBUS`` (``bench_tp_reads.py``'s ``vmread``: the rows of
    the mapping copied by ``process_vm_readv`` on this process): a file cut after its span was mapped gives a
    short count (``OSError``, the rows before the cut copied), and the process lives. Run in a child: a
    ``SIGBUS`` would kill it, not pytest."""
    import subprocess

    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(300 * 4096 + 100))
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    r = subprocess.run([sys.executable, "-c", CUT_UNDER_VMREAD, str(path), str(bench)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "short: " in r.stdout and "process_vm_readv copied" in r.stdout, r.stdout


def _memfds(label: str) -> tuple[int, int]:
    """(fds, mappings) of this process on memfds named ``weightcache:<label>``."""
    name = f"/memfd:weightcache:{label}"
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith(name)
        except FileNotFoundError:
            pass
    with open("/proc/self/maps") as f:
        return fds, sum(name in line for line in f)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_failed_read_leaves_nothing_of_the_host_slab_while_its_error_is_kept(tmp_path, monkeypatch, tp):
    """The service keeps a failed load's error (``status`` shows it) and aborts its slab. The error's traceback
    held the reader's frames, whose views of the slab's mapping (the row a ``pread`` was filling) kept the
    mapping, Python's duplicate of the memfd fd and so the whole slab's memory until the model was loaded again:
    after the abort, no fd or mapping of the slab is left while the error lives."""
    ck = llama_checkpoint(tmp_path / "ck", seed=4, files=1, hidden=64, inter=4096)
    p = _plan(ck, tp, 0)
    _cut_when_opened(monkeypatch, 1 << 16)
    label = f"leak-tp{tp}"
    w = get_backend("host").allocate(p.slab_size_bytes, label)
    with pytest.raises(CheckpointCorrupt) as e:
        pipeline.fill(p, w, options=loader.LoaderOptions(threads=2, staging_bytes=1 << 20))
    kept = e.value
    assert _memfds(label) != (0, 0)
    w.abort()
    assert _memfds(label) == (0, 0)
    assert kept.code == "checkpoint_corrupt"


def test_rows_longer_than_a_staging_piece_fill_a_host_slab_and_name_the_setting_for_a_cuda_one(tmp_path):
    """``service.staging_bytes`` at its 2 MiB minimum over 256 threads leaves 4 KiB pieces, shorter than a TP-2
    ``down_proj`` row here (4104 bytes): the host slab needs no staging for rows copied from the mapping and is
    filled with the torch pipeline's bytes; a CUDA slab (rows packed into a staging buffer) fails the model with
    ``config_invalid`` naming ``service.staging_bytes``, not ``internal`` (a ``ValueError``)."""
    from test_torch_free_load import _FakeCudaSlab

    from weightcache.errors import ConfigError

    ck = llama_checkpoint(tmp_path / "ck", seed=6, files=1, hidden=64, inter=2 * 1026)
    p = _plan(ck, 2, 1)
    opts = loader.LoaderOptions(threads=256, staging_bytes=2 << 20)
    assert opts.chunk_bytes == 4096
    slab = torch.zeros(p.slab_size_bytes, dtype=torch.uint8)
    pipeline.execute(p, slab)
    w = get_backend("host").allocate(p.slab_size_bytes, "m")
    pipeline.fill(p, w, options=opts)
    sealed = w.seal()
    buf = sealed.buffer
    try:
        assert bytes(buf[: p.slab_size_bytes]) == bytes(slab.numpy())
    finally:
        buf.release()
        sealed.close()
    with pytest.raises(ConfigError) as e:
        pipeline.fill(p, _FakeCudaSlab(p.slab_size_bytes), options=opts)
    assert e.value.code == "config_invalid" and e.value.details["key"] == "service.staging_bytes"
    assert "'model.layers.0.mlp.down_proj.weight'" in str(e.value) and "4104" in str(e.value)
