"""Peer seeding's memory and digest kinds without a GPU (issue 37, the cuda backend's part): the memory kind
chosen per side by what the slab is, which digest families each kind of memory checks, the host ``sum64``
against torch's, and the NIXL memory types the agent takes."""

from __future__ import annotations

import os

import pytest
from weightcache.digest import sum64_buffer, xxh3_buffer, xxh3c_buffer
from weightcache.manifest import TensorRecord
from weightcache.memory.host import HostWritableSlab
from weightcache.seeding._receiver import (
    CHECKABLE,
    check_digests,
    digest_kind_refusal,
    target_of,
)
from weightcache.seeding._source import _region


def _reference_sum64(data: bytes) -> str:
    """The digest's definition (weightcache.digest), in plain Python."""
    padded = data + bytes(-len(data) % 8)
    acc = 0
    for i in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * i:8 * i + 8], "little")
        acc = (acc + ((w ^ (i * 0x9E3779B97F4A7C15)) & (2**64 - 1)) * (2 * i + 1)) & (2**64 - 1)
    return f"sum64:{acc ^ len(data):016x}"


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4097])
def test_host_sum64_is_the_digests_definition(n):
    data = os.urandom(n)
    assert sum64_buffer(data) == _reference_sum64(data)


def test_host_sum64_equals_torchs_over_step_boundaries():
    torch = pytest.importorskip("torch")
    from weightcache.digest import _SUM64_STEP, _sum64

    data = bytearray(os.urandom(2 * _SUM64_STEP + 13))
    assert sum64_buffer(data) == _sum64(torch.frombuffer(data, dtype=torch.uint8))
    before = sum64_buffer(data)
    data[_SUM64_STEP + 5] ^= 1
    assert sum64_buffer(data) != before


def test_each_memory_kind_checks_its_families():
    assert CHECKABLE == {"DRAM": ("xxh3_128", "xxh3c", "sum64"), "VRAM": ("sum64",)}
    assert digest_kind_refusal("DRAM", ["xxh3_128:00", "xxh3c:00", "sum64:00"]) == ""
    assert digest_kind_refusal("VRAM", ["sum64:00"]) == ""
    why = digest_kind_refusal("VRAM", ["sum64:00", "xxh3_128:00"])
    assert why == ("the peer's digests are xxh3_128, which this node cannot check in GPU memory (the sum64 "
                   "kernel); it checks sum64 there")


def test_a_host_slab_is_read_as_dram_and_checked_in_every_host_family():
    w = HostWritableSlab(1 << 16, "kinds")
    try:
        w.buffer[:] = os.urandom(1 << 16)
        t = target_of(w)
        assert (t.mem, t.dev) == ("DRAM", 0) and t.address == t.keep.ctypes.data
        t.keep = None
        b = bytes(w.buffer)
        recs = [TensorRecord("a", "U8", (4096,), (1,), 0, 4096, xxh3_buffer(b[:4096])),
                TensorRecord("b", "U8", (4096,), (1,), 4096, 4096, xxh3c_buffer(b[4096:8192])),
                TensorRecord("c", "U8", (4100,), (1,), 8192, 4100, sum64_buffer(b[8192:12292]))]
        assert check_digests(w, "DRAM", recs, threads=2) == []
        for off in (10, 5000, 12291):
            w.buffer[off] ^= 0xFF
        assert check_digests(w, "DRAM", recs, threads=2) == ["a", "b", "c"]
        with pytest.raises(ValueError, match="cannot check in GPU memory"):
            check_digests(w, "VRAM", recs, threads=2)
    finally:
        w.abort()


def test_what_is_no_slab_memory_is_not_asked_of_peers_nor_offered():
    assert target_of(object()) is None
    assert _region(None) is None and _region(object()) is None
    w = HostWritableSlab(1 << 12, "kinds")
    sealed = w.seal()
    try:
        assert _region(sealed) == "DRAM"
    finally:
        sealed.close()
    assert _region(sealed) is None  # closed: its fd is gone


def test_the_agent_takes_dram_and_vram_only():
    pytest.importorskip("nixl_cu12", reason="NIXL (weightcache[seeding]) is not installed")
    from weightcache.seeding import Agent

    a = Agent(f"kinds-{os.getpid()}")
    with pytest.raises(ValueError, match="NIXL memory type 'HBM'"):
        a.register(0, 4096, "HBM")
    assert a.registrations == 0
