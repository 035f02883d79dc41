"""The publisher's staging copy (``weightcache.client._publish``): :func:`pack`'s plan made by ``_fill`` into a
memfd (one ``torch._foreach_copy_`` of every storage range, the same ``_copy_into`` the CUDA staging allocation
takes) holds each tensor's values at its record's offset, with its record's dtype, shape and stride, and leaves
the publisher's own tensors as they were."""

from __future__ import annotations

import mmap
import os

import pytest

torch = pytest.importorskip("torch")

from weightcache.client import pack  # noqa: E402
from weightcache.client._publish import _fill  # noqa: E402

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64, "F16": torch.float16}


def test_the_staged_memfd_holds_every_tensor_at_its_record_and_the_sources_stay():
    g = torch.Generator().manual_seed(3)
    fused = torch.randn(24, 40, generator=g)
    other = torch.randn(7, 5, generator=g).to(torch.bfloat16)
    tensors = {"fused": fused, "fused_t": fused.t(), "half": fused[16:], "odd": fused.reshape(-1)[3:70],
               "col": fused[:, 5], "other": other, "tied": other, "pos": torch.arange(1, 9, dtype=torch.int64),
               "h": torch.linspace(-2, 2, 33).to(torch.float16)}
    want = {n: t.clone() for n, t in tensors.items()}
    records, slab_bytes, copies = pack(tensors)
    # fused with its aligned views (half: byte 2560), odd and col (unaligned: one each), other with its tie, pos, h
    assert len(copies) == 6
    fd = _fill(copies, slab_bytes)
    try:
        size = os.fstat(fd).st_size
        assert size >= slab_bytes
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            slab = bytes(mm)
    finally:
        os.close(fd)
    raw = torch.frombuffer(bytearray(slab), dtype=torch.uint8)
    for r in records:
        dtype = DTYPES[r.dtype]
        es = torch.tensor([], dtype=dtype).element_size()
        assert r.offset_bytes % 256 == 0 and r.offset_bytes + r.size_bytes <= slab_bytes, r.name
        got = raw[r.offset_bytes:].view(dtype).as_strided(r.shape, r.stride)
        assert r.size_bytes == (1 + sum((d - 1) * s for d, s in zip(r.shape, r.stride))) * es, r.name
        assert torch.equal(got, want[r.name]), f"bytes of {r.name} differ"
    for n, t in tensors.items():  # the copy read the publisher's tensors and wrote none of them
        assert torch.equal(t, want[n]), n
