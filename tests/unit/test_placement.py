"""Placements: the vLLM layout, TP shards and ModelOpt FP8 filled by the parallel reader without torch.

Every case compares the slab a torch-free fill writes (the real host backend,
a sealed memfd) with what the torch pipeline (:func:`pipeline.execute`, the
reference kept for that) writes for the same plan: bytes, records and
digests. Real checkpoints: tiny transformers Llama and Qwen2 (sharded
safetensors, GQA, q/k/v biases, tied embeddings, vocab padding) and the tiny
ModelOpt FP8 fixtures (per-tensor scales that differ between fused parts, so
parts are requantised; per-channel scales; N and K not multiples of 16).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fp8_fixtures as F  # noqa: E402
from tiny_models import tiny_llama, tiny_qwen2  # noqa: E402,F401  (fixtures)

from weightcache import pipeline, placement, quant  # noqa: E402
from weightcache.reader import _loader as loader  # noqa: E402
from weightcache.config import ModelConfig  # noqa: E402
from weightcache.spec import RankRequest  # noqa: E402
from weightcache.memory import get_backend  # noqa: E402
from weightcache.quant import fp8_codes, modelopt_fp8  # noqa: E402

DEVICE = {"backend": "host", "gpu_uuid": "", "compute_capability": ""}


def _both(ck: Path, naming: str, tp: int, rank: int, **opts):
    """(filled, slab bytes) of the torch-free fill and (manifest, slab bytes) of the torch pipeline."""
    p = pipeline.plan(RankRequest(ModelConfig(name="m", path=str(ck), naming=naming), tp, rank), DEVICE)
    w = get_backend("host").allocate(p.slab_size_bytes, "m")
    filled = pipeline.fill(p, w, options=loader.LoaderOptions(**opts))
    sealed = w.seal()
    buf = sealed.buffer
    try:
        got = bytes(buf[: p.slab_size_bytes])
    finally:
        buf.release()
        sealed.close()
    slab = torch.zeros(p.slab_size_bytes, dtype=torch.uint8)
    want_manifest = pipeline.execute(p, slab)
    return p, filled, got, want_manifest, bytes(slab.numpy())


def _assert_same(filled, got, want_manifest, want) -> None:
    assert filled.torch_free is True
    for r in want_manifest.tensors:
        a, b = got[r.offset_bytes : r.offset_bytes + r.size_bytes], want[r.offset_bytes : r.offset_bytes + r.size_bytes]
        assert a == b, r.name
    assert got == want
    assert filled.manifest.tensors == want_manifest.tensors  # layouts and xxh3_128 digests included


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("naming", ["vllm", "hf"])
@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_and_tp_layouts_are_filled_without_torch_with_the_pipelines_bytes(request, family, naming, tp):
    ck = request.getfixturevalue(family)
    for rank in range(tp):
        p, filled, got, want_manifest, want = _both(ck, naming, tp, rank, threads=3, staging_bytes=1 << 16)
        _assert_same(filled, got, want_manifest, want)
        if naming == "vllm":
            names = {r.name for r in filled.manifest.tensors}
            assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names


@pytest.mark.parametrize("from_mapping", [True, False])
def test_row_parallel_shards_copied_from_the_mapping_or_read_as_spans(tiny_llama, monkeypatch, from_mapping):
    """o_proj/down_proj at TP 4 are strided rows: copied from a mapping of the file (the default without
    O_DIRECT) or read as spans and packed (O_DIRECT's way, forced here), in pieces of a few rows (4 KiB staging
    buffers)."""
    if not from_mapping:
        monkeypatch.setattr(loader, "mapped", lambda t, o_direct: False)
    p = pipeline.plan(RankRequest(ModelConfig(name="m", path=str(tiny_llama), naming="vllm"), 4, 3), DEVICE)
    placed = placement.place_all(p.specs, p.records, p.checkpoint, quant.placer)
    strided = [t for t in placed.reads if t.rows > 1]
    assert {t.tensor.rsplit(".", 2)[-2] for t in strided} == {"o_proj", "down_proj"}
    assert all(t.src_pitch == 4 * t.length for t in strided)
    assert all(loader.mapped(t, False) is from_mapping for t in strided)
    _, filled, got, want_manifest, want = _both(tiny_llama, "vllm", 4, 3, threads=2, staging_bytes=4 * 4096 + 8192)
    _assert_same(filled, got, want_manifest, want)


@pytest.mark.parametrize("algo", [F.PER_TENSOR, F.PER_CHANNEL])
@pytest.mark.parametrize("naming,tp", [("hf", 1), ("vllm", 1), ("vllm", 2), ("hf", 2)])
def test_modelopt_fp8_layers_equal_the_current_processing(tmp_path, algo, naming, tp):
    ck = F.write_fp8_checkpoint(tmp_path / "ck", algo=algo)
    for rank in range(tp):
        p, filled, got, want_manifest, want = _both(ck, naming, tp, rank, threads=2, staging_bytes=1 << 15)
        _assert_same(filled, got, want_manifest, want)
        placed = placement.place_all(p.specs, p.records, p.checkpoint, quant.placer)
        values = placement.scalar_values(p.checkpoint, placed.scalars)
        tables = [fn(values) for _, fn in placed.luts]
        if algo == F.PER_TENSOR and naming == "vllm":
            # k_proj, v_proj and up_proj were scaled apart: some fused parts are requantised.
            assert sum(t is not None for t in tables) >= 2 * 2
        else:
            assert not any(t is not None for t in tables)


def test_o_direct_places_fused_and_strided_tensors(tmp_path):
    ck = F.write_fp8_per_tensor(tmp_path / "ck")
    try:
        os.close(os.open(next(ck.glob("*.safetensors")), os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    _, filled, got, want_manifest, want = _both(ck, "vllm", 2, 1, threads=2, staging_bytes=1 << 15, o_direct=True)
    _assert_same(filled, got, want_manifest, want)


def _torch_table(scale: float, new_scale: float) -> bytes:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = modelopt_fp8.requantize(codes, torch.tensor(scale, dtype=torch.float32),
                                  torch.tensor(new_scale, dtype=torch.float32))
    return bytes(out.view(torch.uint8).numpy())


@pytest.mark.parametrize("seed", range(6))
def test_requant_table_equals_torch_on_every_code(seed):
    """All 256 codes (NaN codes 0x7f/0xff aside, whose sign torch leaves to the hardware) for scale pairs from
    near-equal to 1000x apart, float32-exact values as a checkpoint stores them."""
    rng = random.Random(seed)
    for _ in range(50):
        s = float(torch.tensor(10 ** rng.uniform(-5, 1), dtype=torch.float32))
        m = float(torch.tensor(s * (1 + 10 ** rng.uniform(-7, 3)), dtype=torch.float32))
        for a, b in ((s, m), (m, s), (s, s)):
            got, want = fp8_codes.requant_table(a, b), _torch_table(a, b)
            diff = [c for c in range(256) if got[c] != want[c] and c not in (0x7F, 0xFF)]
            assert not diff, (a, b, diff[:5])
            assert got[0] == 0


def test_decode_encode_round_trip_every_code():
    import numpy as np

    codes = np.arange(256, dtype=np.uint8)
    v = fp8_codes.decode(codes)
    assert np.array_equal(v[~np.isnan(v)], torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
                          .float().numpy()[~np.isnan(v)])
    back = fp8_codes.encode(v)
    finite = (codes & 0x7F) != 0x7F
    assert np.array_equal(back[finite], codes[finite])


def test_a_cast_has_no_placement(tiny_llama):
    p = pipeline.plan(RankRequest(ModelConfig(name="m", path=str(tiny_llama), naming="vllm", dtype="bfloat16"), 2, 0),
                      DEVICE)
    assert placement.place_all(p.specs, p.records, p.checkpoint, quant.placer) is None


def test_placement_imports_no_torch(tiny_qwen2):
    """The planner, the table and the host fill import no torch (the daemon's first load runs before it)."""
    code = (
        "import sys\n"
        "from weightcache import pipeline\nfrom weightcache.reader import _loader as loader\n"
        "from weightcache.spec import LoadRequest, RankRequest\n"
        "from weightcache.memory import host\n"
        f"p = pipeline.plan(RankRequest(LoadRequest('m', {str(tiny_qwen2)!r}, naming='vllm'), 2, 1), "
        "{'backend': 'host', 'gpu_uuid': '', 'compute_capability': ''})\n"
        "w = host.HostBackend().allocate(p.slab_size_bytes, 'm')\n"
        "f = pipeline.fill(p, w, options=loader.LoaderOptions(threads=2))\n"
        "assert f.torch_free, f\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_without_nvrtc_a_cuda_slab_takes_the_torch_path(tmp_path, monkeypatch):
    """A CUDA slab (it offers ``prepare_kernels``) on a host without libnvrtc: the torch pipeline fills it, with
    the same bytes; a kernel that fails during the fill sends it there too."""
    from weightcache.memory import kernels

    ck = F.write_fp8_per_tensor(tmp_path / "ck")
    p = pipeline.plan(RankRequest(ModelConfig(name="m", path=str(ck), naming="vllm"), 2, 1), DEVICE)
    want = torch.zeros(p.slab_size_bytes, dtype=torch.uint8)
    pipeline.execute(p, want)

    class Slab:
        def __init__(self):
            self.tensor = torch.zeros(p.slab_size_bytes, dtype=torch.uint8)

        def stager(self, n):
            raise AssertionError("the torch path uses no stager")

        def prepare_kernels(self):
            """The torch path compiles no NVRTC kernels: nothing to prepare."""

        def kernels_expected(self):  # no compile started for this fake device: NVRTC's presence decides
            return kernels.available()

        def zero(self, ranges):
            raise kernels.KernelError("NVRTC refused the program")

    monkeypatch.setattr(kernels, "available", lambda: False)
    slab = Slab()
    assert pipeline.fill(p, slab).torch_free is False
    assert torch.equal(slab.tensor, want)
    monkeypatch.setattr(kernels, "available", lambda: True)
    slab = Slab()
    assert pipeline.fill(p, slab).torch_free is False
    assert torch.equal(slab.tensor, want)


def test_the_benchmarks_modelopt_generator_writes_what_the_loader_reads(tmp_path):
    """benchmarks/modelopt_fp8_checkpoint.py (the 8B-shaped bench checkpoint), at a tiny width: detected as
    ModelOpt FP8, every scale and the requantised parts placed as the torch pipeline processes them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import modelopt_fp8_checkpoint as M
    from bench_common import LlamaShape

    for algo, scheme in ((M.PER_TENSOR, "modelopt_fp8"), (M.PER_CHANNEL, "modelopt_fp8_per_channel")):
        ck = M.write_modelopt_fp8(tmp_path / algo, LlamaShape(128, 256, 4, 2, 32, 2, 256), algo)
        p, filled, got, want_manifest, want = _both(ck, "vllm", 2, 1, threads=2, staging_bytes=1 << 16)
        assert p.key["quant_scheme"] == scheme
        _assert_same(filled, got, want_manifest, want)
