"""The packed manifest (what ``attach_reply`` carries): round trips, runs, views, malformed payloads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import load_rank, tiny_llama, tiny_qwen2  # noqa: E402,F401  (fixtures)

from weightcache.manifest import (  # noqa: E402
    DTYPES,
    LayoutMap,
    Manifest,
    PackedTensors,
    TensorRecord,
    align,
    build_views,
    contiguous_stride,
    itemsize,
)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _same_views(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        x, y = a[name], b[name]
        assert (x.dtype, x.shape, x.stride(), x.storage_offset(), x.data_ptr()) == \
            (y.dtype, y.shape, y.stride(), y.storage_offset(), y.data_ptr()), name
    ids_a = [id(t) for t in a.values()]
    ids_b = [id(t) for t in b.values()]
    # Tied aliases are the same object as their target on both paths.
    assert [ids_a.index(i) for i in ids_a] == [ids_b.index(i) for i in ids_b]


def _wire(m: Manifest) -> Manifest:
    header, payload = m.to_wire()
    return Manifest.from_wire(header, payload)


@pytest.mark.parametrize("family,tp,naming", [("tiny_llama", 2, "vllm"), ("tiny_qwen2", 4, "hf"),
                                              ("tiny_qwen2", 1, "vllm")])
def test_packed_round_trip_of_real_manifests(family, tp, naming, request):
    """Records, digests, layouts and views equal the manifest they were packed from (tied aliases included)."""
    path = request.getfixturevalue(family)
    man, views, slab = load_rank(path, tp, tp - 1, naming)
    back = _wire(man)
    assert isinstance(back.tensors, PackedTensors)
    assert back.to_json() == man.to_json()
    assert all(r.digest.startswith("xxh3_128:") for r in back.tensors if r.alias_of is None)
    _same_views(views, build_views(slab.tensor, back))
    assert dict(LayoutMap(back)) == {r.name: r.layout for r in man.tensors}


def test_runs_view_each_projection_of_every_layer_at_once(tiny_llama):
    """The runs group one projection of every layer: as many runs as distinct shapes, not tensors."""
    man, _, _ = load_rank(tiny_llama, 1, 0, "vllm")
    header, _ = man.to_wire()
    runs = header["tensors"]["runs"]
    layers = 2
    covered = sorted(first + k * step for first, step, count, _ in runs for k in range(count))
    assert covered == [i for i, r in enumerate(man.tensors) if r.alias_of is None]
    for first, istep, count, ostep in runs:
        members = [man.tensors[first + k * istep] for k in range(count)]
        assert {(m.dtype, m.shape, m.stride) for m in members} == {(members[0].dtype, members[0].shape,
                                                                   members[0].stride)}
        assert [m.offset_bytes for m in members] == [members[0].offset_bytes + k * ostep for k in range(count)]
    per_layer = [r for r in man.tensors if ".layers.0." in r.name]
    assert sum(1 for r in runs if r[2] >= layers) >= len(per_layer) - 1  # the two norms may share a run
    assert len(runs) < len(man.tensors) / 1.5


_dtype = st.sampled_from(sorted(DTYPES))
_shape = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def _manifests(draw):
    n = draw(st.integers(0, 12))
    recs, off = [], 0
    protos = draw(st.lists(st.tuples(_dtype, _shape), min_size=1, max_size=3))
    for i in range(n):
        if recs and draw(st.booleans()) and draw(st.booleans()):
            target = draw(st.sampled_from([r for r in recs if r.alias_of is None]))
            recs.append(TensorRecord(f"alias.{i}\u00e9", target.dtype, target.shape, target.stride,
                                     target.offset_bytes, target.size_bytes, target.digest, {}, target.name))
            continue
        dtype, shape = draw(st.sampled_from(protos))
        stride = contiguous_stride(shape)
        if len(shape) == 2 and draw(st.booleans()):  # column-major, as the FP8 [K, N] view
            stride = (1, shape[0])
        size = itemsize(dtype) * max(1, int(torch.tensor(shape).prod().item()) if shape else 1)
        recs.append(TensorRecord(f"model.layers.{i}.w", dtype, shape, stride, off, size,
                                 draw(st.sampled_from(["", f"xxh3_128:{i:032x}"])),
                                 draw(st.sampled_from([{}, {"tp_dim": 0, "parts": [i, None, "x"]}])), None))
        off = align(off + size + draw(st.sampled_from([0, 0, 512])))
    return Manifest("m", 1, 0, {"k": [1, "v"]}, max(off, 256), tuple(recs))


@settings(max_examples=150, deadline=None)
@given(_manifests())
def test_packed_views_equal_record_views(m):
    """Any manifest: the packed round trip keeps every record, and its views equal the per-record views."""
    back = _wire(m)
    assert back.to_json() == m.to_json()
    slab = torch.zeros(m.slab_size_bytes, dtype=torch.uint8)
    _same_views(build_views(slab, m), build_views(slab, back))


def _packed_parts(tiny_llama):
    man, _, _ = load_rank(tiny_llama, 1, 0, "hf")
    return man.to_wire()


@pytest.mark.parametrize("breakage,message", [
    (lambda h, p: (h, p[:-7]), "outside the"),
    (lambda h, p: ({**h, "tensors": {**h["tensors"], "count": h["tensors"]["count"] + 1}}, p), "table rows"),
    (lambda h, p: ({**h, "tensors": {**h["tensors"], "format": "packed-9"}}, p), "format"),
    (lambda h, p: ({**h, "tensors": {**h["tensors"], "dtypes": []}}, p), "dtype or alias index"),
    (lambda h, p: ({**h, "tensors": {**h["tensors"], "table": [h["tensors"]["table"][0],
                                                              h["tensors"]["table"][1] - 3]}}, p), "multiple of 8"),
])
def test_malformed_packed_manifest_is_a_clear_error(tiny_llama, breakage, message):
    header, payload = breakage(*_packed_parts(tiny_llama))
    with pytest.raises(ValueError, match=message):
        Manifest.from_wire(header, payload)


def test_runs_that_miss_a_tensor_are_refused(tiny_llama):
    header, payload = _packed_parts(tiny_llama)
    header["tensors"]["runs"] = header["tensors"]["runs"][1:]
    man = Manifest.from_wire(header, payload)
    with pytest.raises(ValueError, match="do not cover tensor"):
        build_views(torch.zeros(man.slab_size_bytes, dtype=torch.uint8), man)


def test_nul_in_a_tensor_name_is_refused_when_packing():
    m = Manifest("m", 1, 0, {}, 256, (TensorRecord("a\x00b", "U8", (1,), (1,), 0, 1),))
    with pytest.raises(ValueError, match="NUL"):
        m.to_wire()
