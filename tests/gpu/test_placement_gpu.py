"""Placements on the cuda backend: vLLM layouts, TP shards and ModelOpt FP8 filled torch-free on the GPU.

The torch pipeline (:func:`weightcache.pipeline.execute` on the slab's CUDA
tensor, processing on the GPU as it always has) is the reference: every
tensor of every layer, FP8 weights requantised to the fused scale included,
must be bit-identical, and the manifests equal digests included (both record
``sum64``: torch's element-wise version there, the NVRTC kernel here).
Also the kernels alone against torch, and ``verify`` of a sealed slab
through the kernel (no host copy).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def test_kernels_equal_torch():
    from weightcache import digest
    from weightcache.memory import kernels
    from weightcache.memory.cuda import CudaBackend

    dev = CudaBackend(0)._device(0)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8, generator=g).cuda()
    base = data.data_ptr()
    ranges = [(0, 0), (8, 1), (16, 7), (24, 8), (32, 9), (256, 4097), (4096, (1 << 20) + 3), (8, (5 << 20) - 8)]
    got = kernels.sum64(dev, [(base + o, n) for o, n in ranges])
    assert got == [digest.digest(data[o : o + n]) for o, n in ranges]
    # copy_sum64: one launch copies every range (16-byte and 8-byte aligned, several chunks, tails) and digests it
    dst = torch.zeros(12 << 20, dtype=torch.uint8, device="cuda")
    places = [(0, 0, 5 << 20), (5 << 20, 8, 4097), ((5 << 20) + 8192, 24, (4 << 20) + 13), (11 << 20, 16, 0)]
    sums = kernels.copy_sum64(dev, [(dst.data_ptr() + d, base + o, n) for d, o, n in places])
    assert sums == [digest.digest(data[o : o + n]) for _, o, n in places]
    for d, o, n in places:
        assert torch.equal(dst[d : d + n], data[o : o + n])
    assert int(dst[(5 << 20) + 4097 : (5 << 20) + 8192].sum()) == 0  # nothing written past a range
    table = bytes(range(255, -1, -1))
    for o, n in [(0, 1000003), (3, 77), (4096, 5)]:
        before = data[o : o + n].cpu()
        kernels.lut8(dev, [(base + o, n)], table)
        torch.cuda.synchronize()
        assert bytes(data[o : o + n].cpu().numpy()) == bytes(before.numpy()).translate(table)


def _cases(tmp_path: Path):
    import fp8_fixtures as F
    from checkpoints import llama_checkpoint

    return {
        "llama": llama_checkpoint(tmp_path / "ll", seed=3, files=2, hidden=256, inter=768),
        "fp8_tensor": F.write_fp8_per_tensor(tmp_path / "pt"),
        "fp8_channel": F.write_fp8_per_channel(tmp_path / "pc"),
    }


@pytest.mark.parametrize("o_direct", [False, True])
def test_cuda_placements_equal_the_torch_pipeline_on_the_gpu(tmp_path, o_direct):
    from weightcache import pipeline
    from weightcache.reader import _loader as loader
    from weightcache.config import ModelConfig
    from weightcache.spec import RankRequest
    from weightcache.memory.cuda import CudaBackend
    from weightcache.memory.cuda_mapping import _map_fd

    backend = CudaBackend(0)
    for kind, ck in _cases(tmp_path).items():
        if o_direct:
            try:
                os.close(os.open(next(ck.glob("*.safetensors")), os.O_RDONLY | os.O_DIRECT))
            except OSError:
                pytest.skip(f"{tmp_path} does not support O_DIRECT")
        for naming, tp in (("vllm", 1), ("vllm", 2), ("hf", 2)):
            for rank in range(tp):
                p = pipeline.plan(RankRequest(ModelConfig(name="m", path=str(ck), naming=naming), tp, rank),
                                  backend.device_info())
                opts = loader.LoaderOptions(threads=3, staging_bytes=1 << 20, o_direct=o_direct)
                w = backend.allocate(p.slab_size_bytes, "m")
                filled = pipeline.fill(p, w, options=opts)
                sealed = w.seal()
                ref = backend.allocate(p.slab_size_bytes, "ref")
                want = pipeline.execute(p, ref.tensor, options=opts)
                where = f"{kind} naming={naming} tp={tp} rank={rank}"
                assert filled.torch_free is True, where
                for r in want.tensors:
                    a = sealed.tensor[r.offset_bytes : r.offset_bytes + r.size_bytes]
                    b = ref.tensor[r.offset_bytes : r.offset_bytes + r.size_bytes]
                    assert torch.equal(a, b), f"{where}: {r.name}"
                assert filled.manifest.tensors == want.tensors, where
                ref.abort()
                assert pipeline.verify(filled.manifest, sealed) == [], where
                victim = max((r for r in filled.manifest.tensors if r.alias_of is None), key=lambda r: r.size_bytes)
                rw = _map_fd(backend._device(0), sealed.fd, sealed.size_bytes, read_only=False)
                flip = rw.tensor()[victim.offset_bytes : victim.offset_bytes + 1]
                flip.bitwise_xor_(torch.ones(1, dtype=torch.uint8, device=flip.device))
                torch.cuda.synchronize()
                del flip
                rw.release()
                assert pipeline.verify(filled.manifest, sealed) == [victim.name], where
                sealed.close()
