"""The plan of a CUDA publication's copy into the service's slab (:func:`weightcache.memory.cuda_publish.plan_fill`),
carried out on host bytes: every byte of the slab written once (the pieces' bytes where they land, zeros
elsewhere), each tensor either copied-and-digested in one pass or digested after, never both nor neither."""

from __future__ import annotations

import os
import re

from hypothesis import given, settings
from hypothesis import strategies as st

import pytest

from weightcache.errors import PublicationInvalid
from weightcache.memory.cuda_publish import IpcSource, plan_fill

SRC = os.urandom(1 << 16)  # the publisher's memory: a pointer is an offset into it


@st.composite
def layouts(draw):
    """(pieces, ranges, size): pieces sorted and apart, ranges inside or across them (views, overlaps)."""
    pos, pieces = 0, []
    for _ in range(draw(st.integers(0, 6))):
        pos += draw(st.sampled_from([0, 8, 256, 3]))
        n = draw(st.integers(1, 2048))
        src = draw(st.integers(0, len(SRC) - n))
        pieces.append((pos, src, n))
        pos += n
    size = pos + draw(st.integers(0, 512))
    ranges = []
    for i in range(draw(st.integers(0, 10))):
        off = draw(st.integers(0, max(0, size - 1)))
        n = draw(st.integers(0, size - off))
        ranges.append((f"t{i}", off, n))
    return pieces, ranges, size


def _carry_out(plan, size):
    slab = bytearray(b"\xee" * size)  # a fresh allocation is not zeroed
    writes = [0] * size
    for off, n in plan.zero:
        slab[off:off + n] = bytes(n)
        for k in range(off, off + n):
            writes[k] += 1
    for off, src, n in [*plan.plain, *plan.fused.values()]:
        slab[off:off + n] = SRC[src:src + n]
        for k in range(off, off + n):
            writes[k] += 1
    return bytes(slab), writes


def _expected(pieces, size):
    slab = bytearray(size)
    for d0, src, n in pieces:
        slab[d0:d0 + n] = SRC[src:src + n]
    return bytes(slab)


@settings(max_examples=300, deadline=None)
@given(layouts(), st.booleans())
def test_every_byte_is_written_once_and_every_range_digested_once(layout, fused_ok):
    pieces, ranges, size = layout
    plan = plan_fill(pieces, ranges, size, fused_ok)
    slab, writes = _carry_out(plan, size)
    assert slab == _expected(pieces, size)
    assert writes == [1] * size
    assert sorted([*plan.fused, *(r[0] for r in plan.after)]) == sorted(r[0] for r in ranges)
    assert not set(plan.fused) & {r[0] for r in plan.after}
    by_name = {r[0]: r for r in ranges}
    for name, (off, src, n) in plan.fused.items():
        assert (off, n) == by_name[name][1:] and off % 8 == 0 and src % 8 == 0
        assert any(d0 <= off and off + n <= d0 + pn for d0, _, pn in pieces)  # inside one piece
    if not fused_ok:
        assert not plan.fused and plan.plain == [p for p in pieces]


def test_one_tensor_per_piece_is_all_fused_and_nothing_copied_twice():
    # the common publication: each tensor its own allocation, 256-byte aligned in the slab
    pieces = [(0, 0, 4096), (4096, 8192, 1000), (5120, 16384, 256)]
    ranges = [("a", 0, 4096), ("b", 4096, 1000), ("c", 5120, 256)]
    plan = plan_fill(pieces, ranges, 2 << 20)
    assert set(plan.fused) == {"a", "b", "c"} and plan.plain == [] and plan.after == []
    assert plan.zero == [(5096, 24), (5376, (2 << 20) - 5376)]  # the gap to the next 256-byte offset, the tail


def test_views_of_one_storage_overlapping_are_digested_after_the_copy():
    # a fused qkv weight and a view of its first rows: one piece, two overlapping ranges
    pieces = [(0, 1024, 8192)]
    ranges = [("qkv", 0, 8192), ("q", 0, 2048), ("unaligned", 4100, 16)]
    plan = plan_fill(pieces, ranges, 8192)
    assert list(plan.fused) == ["qkv"]
    assert [r[0] for r in plan.after] == ["q", "unaligned"] and plan.plain == [] and plan.zero == []


def test_the_ipc_table_round_trips():
    t = IpcSource((bytes(range(64)), b"\xff" * 64), ((0, 512, 0, 4096), (1, 0, 4096, 8)))
    assert IpcSource.from_json(t.to_json()) == t


@pytest.mark.parametrize("table,says", [
    (b"not json", "does not decode"),
    (b'{"segments": []}', "does not decode: 'copies'"),
    (b'{"segments": "ab", "copies": []}', "segments and copies must be lists"),
    (b'{"segments": ["' + b"ab" * 63 + b'"], "copies": []}', "segments[0] is not 128 lowercase hex digits"),
    (b'{"segments": ["' + b"AB" * 64 + b'"], "copies": []}', "segments[0] is not 128 lowercase hex digits"),
    (b'{"segments": ["' + b"zz" * 64 + b'"], "copies": []}', "non-hexadecimal"),
    (b'{"segments": [], "copies": [[0, 0, 0]]}', "copies[0] is not 4 non-negative integers"),
    (b'{"segments": [], "copies": [[0, -1, 0, 8]]}', "copies[0] is not 4 non-negative integers"),
    (b'{"segments": [], "copies": [[0, 0, 0, true]]}', "copies[0] is not 4 non-negative integers"),
    (b'{"segments": [], "copies": [[0, 0, 0, 8, 1]]}', "copies[0] is not 4 non-negative integers"),
])
def test_a_malformed_ipc_table_is_publication_invalid_naming_what(table, says):
    with pytest.raises(PublicationInvalid, match=re.escape(says)) as e:
        IpcSource.from_json(table)
    assert e.value.details == {"reason": "ipc"}


@pytest.mark.parametrize("copies,says", [
    (((1, 0, 0, 8),), "names no segment"),
    (((0, 0, 0, 8), (0, 8, 4, 8)), "overlaps another"),
    (((0, 0, (2 << 20) - 4, 8),), "outside the 2097152-byte slab"),
])
def test_ipc_copies_that_name_no_segment_overlap_or_leave_the_slab_are_refused(copies, says):
    from weightcache.memory.cuda_publish import _check_copies

    with pytest.raises(PublicationInvalid) as e:
        _check_copies(IpcSource((b"\0" * 64,), copies), 2 << 20)
    assert e.value.details["reason"] == "ipc" and "names no segment, lies outside the 2097152-byte slab or " \
        "overlaps another" in str(e.value), says
    _check_copies(IpcSource((b"\0" * 64,), ((0, 0, 0, 8), (0, 8, 8, 8))), 2 << 20)  # adjacent is fine


def test_ipc_copies_in_any_order_up_to_the_slabs_last_byte_are_accepted():
    # tensors of one caching-allocator block in the reverse order of their slab offsets, the last one ending at
    # the slab's last byte (a slab the size of its tensors, granularity-aligned)
    from weightcache.memory.cuda_publish import _check_copies

    size = 2 << 20
    _check_copies(IpcSource((b"\0" * 64,), ((0, 4096, 0, 4096), (0, 0, 4096, size - 4096))), size)
    _check_copies(IpcSource((b"\0" * 64, b"\1" * 64), ((1, 0, size - 8, 8), (0, 64, 0, 8))), size)
