"""The chunk table of the GPU's ``wc_chunks_sum64`` (weightcache.memory.kernels), checked on the CPU: a numpy
emulation of the kernel over the table must copy every byte of every range once and give each range the
``sum64`` that :func:`weightcache.digest.sum64_buffer` computes for its bytes (the GPU run of the kernel itself
is tests/gpu/test_publish_gpu.py and the cuda backend's digests)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from weightcache.digest import sum64_buffer
from weightcache.memory import kernels

K = np.uint64(0x9E3779B97F4A7C15)


def emulate(table: np.ndarray, mem: bytearray, nitems: int) -> list[int]:
    """What the kernel does with ``table`` over ``mem`` (pointers are offsets into it): copies, per-slot sums."""
    slots = [0] * nitems
    for dst, src, word0, nbytes, slot in table.tolist():
        chunk = bytes(mem[src:src + nbytes])
        if dst:
            mem[dst:dst + nbytes] = chunk
        if nbytes % 8:
            chunk += bytes(8 - nbytes % 8)
        w = np.frombuffer(chunk, dtype="<u8")
        i = np.arange(word0, word0 + len(w), dtype=np.uint64)
        slots[slot] = (slots[slot] + int(((w ^ (i * K)) * (i * np.uint64(2) + np.uint64(1))).sum(dtype=np.uint64))) \
            & 0xFFFFFFFFFFFFFFFF
    return slots


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 3 * 4096 + 13), min_size=1, max_size=6), copy=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_chunk_table_copies_and_digests_every_range(sizes, copy, seed):
    src_base, dst_base = 64, 64 + sum(-(-n // 16) * 16 for n in sizes) + 64
    mem = bytearray(np.random.default_rng(seed).integers(0, 256, 2 * dst_base + 64, dtype=np.uint8).tobytes())
    items, pos = [], 0
    for n in sizes:
        items.append((dst_base + pos if copy else 0, src_base + pos, n))
        pos += -(-n // 16) * 16
    want = [sum64_buffer(bytes(mem[s:s + n])) for _, s, n in items]
    table, rows = kernels._chunk_table(items, 4096)  # small chunks: several per range, and tails
    assert rows == sum(-(-n // 4096) for n in sizes) == len(table)
    assert all(0 < r[3] <= 4096 for r in table.tolist())  # no empty chunk, none over the size
    slots = emulate(table, mem, len(items))
    got = [f"sum64:{(v ^ n) & 0xFFFFFFFFFFFFFFFF:016x}" for v, (_, _, n) in zip(slots, items)]
    assert got == want
    if copy:
        for d, s, n in items:
            assert mem[d:d + n] == mem[s:s + n]


def test_copy_sum64_refuses_a_null_destination_and_misalignment():
    import pytest

    with pytest.raises(ValueError, match="destination pointer is 0"):
        kernels.copy_sum64(None, [(0, 4096, 8)])
    with pytest.raises(ValueError, match="not 8-byte aligned"):
        kernels.sum64(None, [(4100, 8)])


def test_copy_sum64_refuses_a_misaligned_destination_naming_it():
    import pytest

    # the kernel stores 8-byte words at dst: a destination off an 8-byte boundary is refused before any launch,
    # and the error names that pointer (the source is aligned)
    with pytest.raises(ValueError, match="device pointer 0x1004 is not 8-byte aligned"):
        kernels.copy_sum64(None, [(4100, 8192, 64)])
    with pytest.raises(ValueError, match="device pointer 0x2002 is not 8-byte aligned"):
        kernels.copy_sum64(None, [(4096, 8192, 64), (4096 + 64, 8194, 64)])
