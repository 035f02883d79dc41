"""The packed manifest (what ``attach_reply`` carries): round trips, runs, views, malformed payloads."""

from __future__ import annotations

import json
import struct
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
    torch_dtype,
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


def _record_views(slab: torch.Tensor, m: Manifest) -> dict[str, torch.Tensor]:
    """The reference: one slice + view + as_strided per record, straight from the docs' definition."""
    out: dict[str, torch.Tensor] = {}
    for r in m.tensors:
        if r.alias_of is None:
            raw = slab[r.offset_bytes: r.offset_bytes + r.size_bytes]
            out[r.name] = raw.view(torch_dtype(r.dtype)).as_strided(r.shape, r.stride)
    return {r.name: out[r.alias_of or r.name] for r in m.tensors}


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
    _same_views(_record_views(slab.tensor, man), build_views(slab.tensor, back))
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
        size += draw(st.sampled_from([0, 0, 8]))  # a record may hold more bytes than its view needs
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
    _same_views(_record_views(slab, m), build_views(slab, back))


def _packed_parts(tiny_llama):
    man, _, _ = load_rank(tiny_llama, 1, 0, "hf")
    return man.to_wire()


@pytest.mark.parametrize("breakage,message", [
    (lambda h, p: (h, p[:-7]), "outside the"),
    (lambda h, p: ({**h, "tensors": {**h["tensors"], "count": h["tensors"]["count"] + 1}}, p), "table rows"),
    (lambda h, p: ({**h, "tensors": {**h["tensors"], "format": "packed-9"}}, p), "format"),
    (lambda h, p: ({**h, "tensors": {**h["tensors"], "dtypes": []}}, p), "dtype index, ndim or alias index"),
    (lambda h, p: ({**h, "tensors": {**h["tensors"], "table": [h["tensors"]["table"][0],
                                                              h["tensors"]["table"][1] - 3]}}, p), "multiple of 8"),
])
def test_malformed_packed_manifest_is_a_clear_error(tiny_llama, breakage, message):
    header, payload = breakage(*_packed_parts(tiny_llama))
    with pytest.raises(ValueError, match=message) as ei:
        Manifest.from_wire(header, payload)
    assert ei.value.code == "manifest_invalid"


@pytest.mark.parametrize("keep", [0, 3])
def test_runs_are_a_hint(tiny_llama, keep):
    """Without runs, or with some left out, every tensor is still viewed as the table says."""
    man, views, slab = load_rank(tiny_llama, 2, 1, "vllm")
    header, payload = man.to_wire()
    header["tensors"]["runs"] = header["tensors"]["runs"][:keep]
    _same_views(views, build_views(slab.tensor, Manifest.from_wire(header, payload)))


def _edit_runs(edit):
    def apply(h, p):
        h = json.loads(json.dumps(h))
        edit(h["tensors"]["runs"], h)
        return h, p
    return apply


def _first_long_run(runs):
    return next(r for r in runs if r[2] > 2)


def _retable(edit):
    """Rewrites the table section through ``edit(rows)`` (rows: lists of 5 ints), runs dropped (the table alone)."""
    def apply(h, p):
        h = json.loads(json.dumps(h))
        h["tensors"]["runs"] = []
        start, length = h["tensors"]["table"]
        vals = list(struct.unpack(f"<{length // 8}q", p[start:start + length]))
        rows = [vals[i:i + 5] for i in range(0, len(vals), 5)]
        edit(rows)
        packed = struct.pack(f"<{length // 8}q", *[v for r in rows for v in r])
        return h, p[:start] + packed + p[start + length:]
    return apply


@pytest.mark.parametrize("breakage,message", [
    (_edit_runs(lambda runs, h: runs.append([-1, 0, 1, 0])), "does not lie within"),
    (_edit_runs(lambda runs, h: runs.append(list(runs[0]))), "another run covers"),
    (_edit_runs(lambda runs, h: _first_long_run(runs).__setitem__(3, 0)), "does not lie within"),
    (_edit_runs(lambda runs, h: _first_long_run(runs).__setitem__(3, _first_long_run(runs)[3] + 1)),
     "offset step"),
    (_edit_runs(lambda runs, h: _first_long_run(runs).__setitem__(1, 0)), "does not lie within"),
    (_edit_runs(lambda runs, h: runs.__setitem__(0, ["0", 0, 1, 0])), "is not 4 integers"),
    (_edit_runs(lambda runs, h: h["tensors"].__setitem__("count", "53")), "count"),
    (_edit_runs(lambda runs, h: h["tensors"].__setitem__("dtypes", ["XX"] + h["tensors"]["dtypes"][1:])),
     "safetensors dtype codes"),
    (_retable(lambda rows: rows[0].__setitem__(1, 0)), "need"),
    (_retable(lambda rows: rows[0].__setitem__(1, -1)), "need"),
    (_retable(lambda rows: rows[1].__setitem__(4, 1)), "does not repeat the row"),
])
def test_runs_and_rows_that_contradict_the_table_are_refused(tiny_llama, breakage, message):
    """A run must repeat its first member's dtype, shape, stride and size at its step; rows must fit their views."""
    header, payload = breakage(*_packed_parts(tiny_llama))
    with pytest.raises(ValueError, match=message) as ei:
        Manifest.from_wire(header, payload)
    assert ei.value.code == "manifest_invalid"


def _renamed(header, payload, names_bytes):
    """The packed manifest with its names section replaced (sections after it moved along)."""
    h = json.loads(json.dumps(header))
    start, length = h["tensors"]["names"]
    delta = len(names_bytes) - length
    h["tensors"]["names"] = [start, len(names_bytes)]
    for key in ("table", "dims", "digests", "layouts"):
        if h["tensors"][key][0] > start:
            h["tensors"][key][0] += delta
    return h, payload[:start] + names_bytes + payload[start + length:]


def test_names_must_be_unique_utf8_strings(tiny_llama):
    header, payload = _packed_parts(tiny_llama)
    start, length = header["tensors"]["names"]
    names = json.loads(bytes(payload[start:start + length]))
    for bad, message in ((json.dumps([names[1]] + names[1:]).encode(), "twice"),
                         (b'["\xff\xfe' + json.dumps(names)[2:].encode(), "not a UTF-8 JSON array"),
                         (json.dumps([1] + names[1:]).encode(), "array of strings")):
        with pytest.raises(ValueError, match=message) as ei:
            Manifest.from_wire(*_renamed(header, payload, bad))
        assert (ei.value.code, ei.value.details["section"]) == ("manifest_invalid", "names")


def test_any_tensor_name_round_trips():
    """safetensors allows any string as a name, NUL and newline included."""
    names = ["a\x00b", "line\nbreak", "\u00e9\u4e2d", ""]
    recs = tuple(TensorRecord(n, "U8", (1,), (1,), 256 * i, 1) for i, n in enumerate(names))
    m = Manifest("m", 1, 0, {}, 1024, recs)
    back = _wire(m)
    assert back.to_json() == m.to_json()
    assert list(build_views(torch.arange(1024, dtype=torch.int64).to(torch.uint8), back)) == names


def test_warm_up_views_runs_once_per_process():
    """``warm_up_views`` (called while the service answers a first attach) sets torch's view operations up once."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    code = ("import sys\nfrom weightcache import manifest\n"
            "print(manifest.warm_up_views(), manifest.warm_up_views(), 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True", "False", "True"]
