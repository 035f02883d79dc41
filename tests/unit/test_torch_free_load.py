"""The torch-free fill: the same bytes, digests and manifest as the torch pipeline, and when it applies.

Real checkpoints (safetensors files written by the test), the real host
backend (sealed memfds); the slab's bytes are compared with what safetensors
reads from disk.
"""

from __future__ import annotations

import mmap
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fp8_fixtures as F  # noqa: E402
from checkpoints import llama_checkpoint, read_checkpoint  # noqa: E402

from weightcache import digest, pipeline  # noqa: E402
from weightcache.reader import _loader as loader  # noqa: E402
from weightcache.reader import _rows as row_reads  # noqa: E402
from weightcache.config import ModelConfig  # noqa: E402
from weightcache.spec import RankRequest  # noqa: E402
from weightcache.errors import CheckpointCorrupt  # noqa: E402
from weightcache.manifest import build_views  # noqa: E402
from weightcache.memory import get_backend  # noqa: E402

DEVICE = {"backend": "host", "gpu_uuid": "", "compute_capability": ""}


def _fill(ck: Path, dtype: str = "auto", tp: int = 1, rank: int = 0, **opts) -> tuple[pipeline.Filled, bytes]:
    """Fills a real host slab through :func:`pipeline.fill`; returns what it did and the slab's bytes."""
    p = pipeline.plan(RankRequest(ModelConfig(name="m", path=str(ck), dtype=dtype), tp, rank), DEVICE)
    w = get_backend("host").allocate(p.slab_size_bytes, "m")
    filled = pipeline.fill(p, w, options=loader.LoaderOptions(**opts))
    sealed = w.seal()
    buf = sealed.buffer
    try:
        return filled, bytes(buf[: p.slab_size_bytes])
    finally:
        buf.release()
        sealed.close()


def _execute(ck: Path, dtype: str = "auto", tp: int = 1, rank: int = 0, naming: str = "hf"):
    """The torch pipeline into a plain CPU tensor."""
    p = pipeline.plan(RankRequest(ModelConfig(name="m", path=str(ck), dtype=dtype, naming=naming), tp, rank), DEVICE)
    slab = torch.zeros(p.slab_size_bytes, dtype=torch.uint8)
    return pipeline.execute(p, slab), bytes(slab.numpy())


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1)])
def test_torch_free_fill_equals_the_torch_pipeline(tmp_path, tp, rank):
    ck = llama_checkpoint(tmp_path / "ck", seed=5, files=2)
    filled, got = _fill(ck, tp=tp, rank=rank, threads=3, staging_bytes=2 << 20)
    want_manifest, want = _execute(ck, tp=tp, rank=rank)
    # TP 2 shards o_proj/down_proj along dim 1: strided rows of the file, placed by the reader too.
    assert filled.torch_free is True
    assert got == want
    assert filled.manifest.tensors == want_manifest.tensors  # digests included
    assert all(r.digest.startswith("xxh3_128:") for r in filled.manifest.tensors)
    assert filled.bytes_read == sum(r.size_bytes for r in filled.manifest.tensors if r.alias_of is None)
    if tp == 1:
        views = build_views(torch.frombuffer(bytearray(got), dtype=torch.uint8), filled.manifest)
        ref = read_checkpoint(ck)
        assert sorted(views) == sorted(ref)
        assert all(torch.equal(views[n], ref[n]) for n in ref)


def test_a_cast_goes_through_torch_and_gives_the_same_bytes(tmp_path):
    ck = llama_checkpoint(tmp_path / "ck", seed=6, files=1)  # F32 stored
    filled, got = _fill(ck, dtype="bfloat16")
    want_manifest, want = _execute(ck, dtype="bfloat16")
    assert filled.torch_free is False
    assert got == want and filled.manifest.tensors == want_manifest.tensors


def test_o_direct_reads_through_staging(tmp_path):
    ck = llama_checkpoint(tmp_path / "ck", seed=7, files=2)
    try:
        fd = os.open(next(ck.glob("*.safetensors")), os.O_RDONLY | os.O_DIRECT)
        os.close(fd)
    except OSError:
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    filled, got = _fill(ck, o_direct=True, threads=2, staging_bytes=2 << 20)
    want_manifest, want = _execute(ck)
    assert filled.torch_free is True
    assert got == want and filled.manifest.tensors == want_manifest.tensors


def test_may_need_torch(tmp_path):
    plain = llama_checkpoint(tmp_path / "plain", seed=1, files=1)
    fp8 = F.write_fp8_per_tensor(tmp_path / "fp8")
    assert pipeline.may_need_torch(ModelConfig(name="a", path=str(plain))) is False
    assert pipeline.may_need_torch(ModelConfig(name="b", path=str(plain), dtype="bfloat16")) is True
    assert pipeline.may_need_torch(ModelConfig(name="c", path=str(fp8))) is False  # placed: weightcache.placement
    assert pipeline.may_need_torch(ModelConfig(name="d", path=str(tmp_path / "absent"))) is False


@pytest.mark.parametrize("n", [0, 7, 8, 4097])
def test_matches_dispatches_on_the_prefix(n):
    """One buffer, its three digests: each matches, each misses a flipped byte; host bytes refuse sum64."""
    data = bytearray(random.Random(n).randbytes(n))
    t = torch.frombuffer(data, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    recorded = [digest._sum64(t), digest._xxh3(t), digest.xxh3c_buffer(data)]
    assert [d.split(":")[0] for d in recorded] == ["sum64", "xxh3_128", "xxh3c"]
    assert all(digest.matches(t, d) for d in recorded)
    assert all(digest.matches_buffer(data, d) for d in recorded[1:])
    with pytest.raises(ValueError, match="checked on the GPU"):
        digest.matches_buffer(data, recorded[0])
    if n:
        data[n // 2] ^= 0x10
        assert not any(digest.matches(t, d) for d in recorded)


def test_xxh3_buffer_equals_the_tensor_digest():
    data = bytearray(os.urandom(100_003))
    assert digest.xxh3_buffer(memoryview(data)) == digest.digest(torch.frombuffer(data, dtype=torch.uint8))


@pytest.mark.parametrize("cpus,want", [(1, 4), (16, 16), (128, 32)])
def test_default_threads_follow_the_cpus_we_may_run_on(monkeypatch, cpus, want):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert loader.default_threads() == want
    assert loader.LoaderOptions().threads == want


class _FakeStager:
    """:class:`weightcache.memory.cuda_staging.CudaStager`'s contract over host memory: the copy is done at ``wait``
    (a late copy would show as wrong bytes if the reader reused a buffer too early)."""

    def __init__(self, slab: bytearray, buffer_bytes: int) -> None:
        self.slab, self.buffer_bytes = slab, buffer_bytes
        self.bufs = [mmap.mmap(-1, buffer_bytes), mmap.mmap(-1, buffer_bytes)]  # page-aligned, as pinned memory is
        self.pending: list = [None, None]

    def __enter__(self):
        return self

    def buffer(self, i: int) -> memoryview:
        assert self.pending[i] is None, "buffer refilled before its copy was waited for"
        return memoryview(self.bufs[i])

    def wait(self, i: int) -> None:
        if self.pending[i] is not None:
            self._land(i)
            self.pending[i] = None

    def copy(self, i: int, src_offset: int, length: int, slab_offset: int) -> None:
        assert src_offset + length <= self.buffer_bytes and slab_offset + length <= len(self.slab)
        self.pending[i] = (src_offset, length, slab_offset)

    def copy2d(self, i: int, src_offset: int, src_pitch: int, width: int, rows: int, slab_offset: int,
               dst_pitch: int) -> None:
        assert src_offset + (rows - 1) * src_pitch + width <= self.buffer_bytes
        assert slab_offset + (rows - 1) * dst_pitch + width <= len(self.slab)
        self.pending[i] = ("2d", src_offset, src_pitch, width, rows, slab_offset, dst_pitch)

    def _land(self, i: int) -> None:
        job = self.pending[i]
        if job[0] == "2d":
            _, src, sp, w, rows, dst, dp = job
            for r in range(rows):
                self.slab[dst + r * dp : dst + r * dp + w] = self.bufs[i][src + r * sp : src + r * sp + w]
        else:
            src, n, dst = job
            self.slab[dst : dst + n] = self.bufs[i][src : src + n]

    def __exit__(self, *exc) -> None:
        self.wait(0)
        self.wait(1)


class _FakeCudaSlab:
    """A writable slab offering what :class:`~weightcache.memory.cuda_slabs.CudaWritableSlab` offers a torch-free fill
    (``stager()``, ``zero``, ``write``, ``apply_lut``, ``digests``) over host memory; its digests are torch's
    ``sum64`` over the bytes (what the GPU kernel computes, compared on the GPU in tests/gpu)."""

    def __init__(self, size_bytes: int) -> None:
        self.bytes = bytearray(os.urandom(size_bytes))  # device memory is not zeroed: padding must be written

    def stager(self, buffer_bytes: int) -> _FakeStager:
        return _FakeStager(self.bytes, buffer_bytes)

    def zero(self, ranges) -> None:
        for off, n in ranges:
            self.bytes[off : off + n] = bytes(n)

    def write(self, offset: int, data: bytes) -> None:
        self.bytes[offset : offset + len(data)] = data

    def apply_lut(self, ranges, table: bytes) -> None:
        for off, n in ranges:
            self.bytes[off : off + n] = bytes(self.bytes[off : off + n]).translate(table)

    def digests(self, ranges) -> dict:
        return {name: digest._sum64(torch.frombuffer(self.bytes, dtype=torch.uint8)[off : off + n])
                for name, off, n in ranges}


@pytest.mark.parametrize("o_direct", [False, True])
@pytest.mark.parametrize("kind,naming,tp,rank", [("llama", "hf", 1, 0), ("llama", "vllm", 2, 1),
                                                 ("fp8_tensor", "vllm", 2, 0), ("fp8_channel", "vllm", 1, 0)])
def test_staged_fill_places_every_layout_and_verify_checks(tmp_path, o_direct, kind, naming, tp, rank):
    """The CUDA reader's logic (two buffers per thread, offsets, O_DIRECT alignment, strided rows as 2-D copies,
    zero fill, host-computed scales, in-place tables) against a stager that copies on host memory into a slab of
    random bytes, with 8 KiB staging pieces that split every large tensor: the bytes equal the torch pipeline's,
    the digests are ``sum64`` of each tensor, ``verify`` over the same bytes passes, and a flipped byte fails
    exactly its tensor."""
    if kind == "llama":
        ck = llama_checkpoint(tmp_path / "ck", seed=8, files=2, hidden=128, inter=256)
    elif kind == "fp8_tensor":
        ck = F.write_fp8_per_tensor(tmp_path / "ck")
    else:
        ck = F.write_fp8_per_channel(tmp_path / "ck")
    if o_direct:
        try:
            os.close(os.open(next(ck.glob("*.safetensors")), os.O_RDONLY | os.O_DIRECT))
        except OSError:
            pytest.skip(f"{tmp_path} does not support O_DIRECT")
    p = pipeline.plan(RankRequest(ModelConfig(name="m", path=str(ck), naming=naming), tp, rank), DEVICE)
    slab = _FakeCudaSlab(p.slab_size_bytes)
    opts = loader.LoaderOptions(threads=3, staging_bytes=6 * 16384, o_direct=o_direct)
    assert opts.chunk_bytes == 8192
    filled = pipeline.fill(p, slab, options=opts)
    assert filled.torch_free is True
    _, want = _execute(ck, tp=tp, rank=rank, naming=naming)
    if kind == "llama":
        assert max(r.size_bytes for r in filled.manifest.tensors) > 4 * 8192  # some tensors span several pieces
    for r in filled.manifest.tensors:
        part = bytes(slab.bytes[r.offset_bytes : r.offset_bytes + r.size_bytes])
        assert part == want[r.offset_bytes : r.offset_bytes + r.size_bytes], r.name
        assert r.digest == digest._sum64(torch.frombuffer(bytearray(part), dtype=torch.uint8) if part
                                         else torch.empty(0, dtype=torch.uint8)), r.name

    t = torch.frombuffer(slab.bytes, dtype=torch.uint8)
    assert pipeline.verify(filled.manifest, t) == []
    victim = max(filled.manifest.tensors, key=lambda r: r.size_bytes)
    slab.bytes[victim.offset_bytes + victim.size_bytes - 1] ^= 0x01
    assert pipeline.verify(filled.manifest, t) == [victim.name]


def _xxh3c_reference(data: bytes, chunk: int) -> str:
    """The ``xxh3c`` format written out from its definition, in one thread, over the whole buffer."""
    import xxhash

    parts = b"".join(xxhash.xxh3_128(data[i : i + chunk]).digest() for i in range(0, len(data), chunk))
    return "xxh3c:" + xxhash.xxh3_128(parts).hexdigest()


@pytest.mark.parametrize("n", [0, 1, 8191, 8192, 8193, 5 * 8192, 5 * 8192 + 17])
def test_xxh3c_from_shuffled_chunks_on_threads_equals_the_whole_buffer(monkeypatch, n):
    """Pieces covering whole chunks, added in shuffled order from 4 threads, give the one-thread reference."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(digest, "CHUNK_BYTES", 8192)
    rng = random.Random(n)
    data = rng.randbytes(n)
    want = _xxh3c_reference(data, 8192)
    assert digest.xxh3c_buffer(data) == want
    assert digest.matches(torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else
                          torch.empty(0, dtype=torch.uint8), want)
    cuts = sorted({0, n, *(rng.randrange(n + 1) // 8192 * 8192 for _ in range(4))})
    parts = list(zip(cuts, cuts[1:]))
    rng.shuffle(parts)
    c = digest.ChunkedXXH3(n)
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda ab: c.add(memoryview(data)[ab[0] : ab[1]], ab[0]), parts))
    assert c.hexdigest() == want
    if n:
        changed = bytearray(data)
        changed[rng.randrange(n)] ^= 0x80
        assert digest.xxh3c_buffer(changed) != want
        assert not digest.matches_buffer(changed, want)


def test_xxh3c_default_chunk_on_a_large_buffer():
    """The 1 MiB format itself: 2.5 chunks in two pieces, against the reference."""
    data = os.urandom(5 * (1 << 19))
    c = digest.ChunkedXXH3(len(data))
    c.add(data[1 << 20 :], 1 << 20)
    c.add(data[: 1 << 20], 0)
    assert c.hexdigest() == _xxh3c_reference(data, 1 << 20) == digest.xxh3c_buffer(data)


@pytest.mark.parametrize("offset,length", [(4096, 8192), (0, 4096), (8192, 16384)])
def test_xxh3c_refuses_pieces_off_the_chunk_grid(monkeypatch, offset, length):
    monkeypatch.setattr(digest, "CHUNK_BYTES", 8192)
    with pytest.raises(ValueError, match="whole 8192-byte chunks"):
        digest.ChunkedXXH3(20000).add(bytes(length), offset)


def test_xxh3c_names_a_chunk_never_hashed(monkeypatch):
    monkeypatch.setattr(digest, "CHUNK_BYTES", 8192)
    c = digest.ChunkedXXH3(3 * 8192)
    c.add(bytes(8192), 0)
    with pytest.raises(ValueError, match="2 of 3 chunks"):
        c.hexdigest()


def test_verify_checks_a_sealed_host_slab_on_its_mapping(tmp_path):
    import dataclasses

    ck = llama_checkpoint(tmp_path / "ck", seed=9, files=1)
    p = pipeline.plan(RankRequest(ModelConfig(name="m", path=str(ck)), 1, 0), DEVICE)
    w = get_backend("host").allocate(p.slab_size_bytes, "m")
    man = pipeline.fill(p, w).manifest
    sealed = w.seal()
    try:
        assert pipeline.verify(man, sealed) == []
        victim = man.tensors[3]
        wrong = dataclasses.replace(man, tensors=tuple(
            dataclasses.replace(r, digest=digest.xxh3_buffer(b"other")) if r.name == victim.name else r
            for r in man.tensors))
        assert pipeline.verify(wrong, sealed) == [victim.name]
        assert pipeline.verify(man, sealed.tensor) == []  # the torch way agrees
    finally:
        sealed.close()


@pytest.mark.parametrize("first,pitch,length,rows", [
    (0, 8, 4, 1000), (0, 8192, 1024, 4096), (4096, 22016, 2752, 300), (3, 7, 5, 64), (0, 5, 4, 50), (17, 9, 9, 3),
])
def test_compact_rows_packs_strided_rows_in_place(first, pitch, length, rows):
    """A row-parallel shard's rows, read as a span, packed to the buffer's start for one contiguous copy."""
    size = first + (rows - 1) * pitch + length
    raw = bytearray(os.urandom(size + 64))
    want = b"".join(bytes(raw[first + r * pitch : first + r * pitch + length]) for r in range(rows))
    buf = memoryview(raw)
    assert loader.compact_rows(buf, first, pitch, length, rows) == 0
    assert bytes(raw[: rows * length]) == want
    del buf


def test_kernels_expected_does_not_wait_for_nvrtc_while_a_compile_runs(monkeypatch):
    """The fill plans on the kernels when a compile for the device is running or done (its failure is met at
    the fill, which then takes the torch path); only otherwise does it load NVRTC to ask."""
    from types import SimpleNamespace

    from weightcache.memory import kernels

    asked = []
    monkeypatch.setattr(kernels, "available", lambda: asked.append(1) or False)
    dev = SimpleNamespace(index=97)
    monkeypatch.setitem(kernels._compiling, 97, object())
    assert kernels.expected(dev) is True and not asked
    kernels._compiling.pop(97)
    monkeypatch.setitem(kernels._modules, 97, object())
    assert kernels.expected(dev) is True and not asked
    kernels._modules.pop(97)
    assert kernels.expected(dev) is False and asked == [1]


def test_a_kernel_compile_thread_that_cannot_start_is_not_counted_as_running(monkeypatch):
    """No thread to be had (a thread limit): prepare() leaves no compile 'running' for ever (module() would join a
    thread never started, expected() would plan on kernels no one compiles)."""
    import threading
    from types import SimpleNamespace

    from weightcache.memory import kernels

    def refused(self):
        raise RuntimeError("can't start new thread")

    dev = SimpleNamespace(index=96)
    monkeypatch.setattr(kernels, "available", lambda: False)
    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", refused)
        kernels.prepare(dev)
    assert 96 not in kernels._compiling
    assert kernels.expected(dev) is False


@pytest.mark.parametrize("file_bytes", [0, 1000, 4095])
@pytest.mark.parametrize("backend", ["host", "staged"])
def test_a_row_parallel_shard_of_a_truncated_file_is_checkpoint_corrupt(tmp_path, file_bytes, backend):
    """A strided task (copied from the file's mapping) past the end of a short or empty file raises
    ``checkpoint_corrupt`` naming the file and the tensor, as a short ``pread`` does, instead of touching the
    mapping beyond the file (``SIGBUS``); the other threads' tasks stop and the files are closed."""
    from weightcache.errors import CheckpointCorrupt

    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(file_bytes))
    bad = loader.ReadTask(str(path), 64, 16, 0, "model.layers.0.mlp.down_proj.weight", rows=64, src_pitch=64,
                          dst_pitch=16)
    assert bad.file_span == 64 + 63 * 64 - 48 and loader.mapped(bad, False)
    slab = SimpleNamespace(buffer=memoryview(bytearray(4096))) if backend == "host" else _FakeCudaSlab(4096)
    opts = loader.LoaderOptions(threads=2, staging_bytes=4 * 16384)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(CheckpointCorrupt) as e:
        loader.read_direct([bad], slab, opts, with_digests=False)
    assert str(path) in str(e.value) and "'model.layers.0.mlp.down_proj.weight' ends at byte 4112" in str(e.value)
    assert e.value.code == "checkpoint_corrupt"
    assert set(os.listdir("/proc/self/fd")) <= before


def test_row_parallel_rows_copied_from_the_mapping_land_at_their_pitch(tmp_path):
    """A strided task copied from the file's mapping writes row ``i`` (``length`` bytes at ``file_offset + i *
    src_pitch``) at ``slab_offset + i * dst_pitch`` in a host slab and leaves the bytes between alone; through a
    stager (the CUDA reader) the same rows land packed."""
    data = os.urandom(1 << 16)
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    t = loader.ReadTask(str(path), 100, 24, 40, "w", rows=300, src_pitch=200, dst_pitch=32)
    want = [data[100 + i * 200 : 124 + i * 200] for i in range(300)]
    host = bytearray(b"\xee" * (40 + 300 * 32))
    loader.read_direct([t], SimpleNamespace(buffer=memoryview(host)), loader.LoaderOptions(threads=2),
                       with_digests=False)
    assert [bytes(host[40 + i * 32 : 64 + i * 32]) for i in range(300)] == want
    assert all(host[64 + i * 32 : 72 + i * 32] == b"\xee" * 8 for i in range(300)) and host[:40] == b"\xee" * 40
    packed = loader.ReadTask(str(path), 100, 24, 0, "w", rows=300, src_pitch=200, dst_pitch=24)
    slab = _FakeCudaSlab(300 * 24)
    r = loader.read_direct([packed], slab, loader.LoaderOptions(threads=2, staging_bytes=4 * 16384),
                           with_digests=False)
    assert bytes(slab.bytes) == b"".join(want) and r.bytes_read == 300 * 24


def test_in_page_cache_answers_for_a_written_file_and_a_piece_read_ahead_gives_the_same_rows(tmp_path, monkeypatch):
    """A file just written is in the page cache (no read-ahead asked) where the file system can say so without
    waiting (ext4, xfs; tmpfs and overlayfs cannot: ``EOPNOTSUPP``, and the piece is read ahead); where the probe
    says it is not (a checkpoint on disk after a reboot), the piece is read ahead (``MADV_WILLNEED``) and its rows
    are the same bytes."""
    import errno

    data = os.urandom(1 << 16)
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            os.preadv(fd, [bytearray(1)], 1000, os.RWF_NOWAIT)
        except OSError as e:  # the temporary directory is on tmpfs or overlayfs
            assert e.errno == errno.EOPNOTSUPP, e
            assert row_reads.in_page_cache(fd, 1000) is False
        else:
            assert row_reads.in_page_cache(fd, 1000) is True
        asked = []
        monkeypatch.setattr(row_reads, "in_page_cache", lambda fd, offset: asked.append(offset) or False)
        t = row_reads.ReadTask(str(path), 100, 24, 0, "w", rows=300, src_pitch=200, dst_pitch=24)
        out = bytearray(300 * 24)
        loader.copy_mapped_rows(fd, t, memoryview(out), 0, 24)
        assert asked == [100 + 299 * 200]
        assert bytes(out) == b"".join(data[100 + i * 200 : 124 + i * 200] for i in range(300))
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["spans", "staged span"])
def test_a_strided_read_of_a_short_file_names_where_its_last_row_ends(tmp_path, how):
    """A strided task read as spans (a file that will not map; ``O_DIRECT``'s staged span) from a file shorter than
    its rows: ``checkpoint_corrupt`` names the end of the task's last row in the file, not of its first."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(2000))
    t = loader.ReadTask(str(path), 64, 16, 0, "model.layers.0.self_attn.o_proj.weight", rows=64, src_pitch=64,
                        dst_pitch=16)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointCorrupt) as e:
            if how == "spans":
                row_reads.read_rows_by_spans(fd, t, memoryview(bytearray(64 * 16)), 0, 16)
            else:
                row_reads.pread_task(fd, memoryview(bytearray(t.file_span)), t.file_offset, t.file_span, t)
    finally:
        os.close(fd)
    assert f"{path} is truncated: tensor 'model.layers.0.self_attn.o_proj.weight' ends at byte 4112" in str(e.value)  # not 80
