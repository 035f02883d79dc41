"""Tensor records inside a slab, and the views built from them.

A *manifest* describes one slab: which tensor lives at which byte offset, with
which dtype, engine-facing shape and stride, and the layout metadata of any
processing (fused parts, FP8 transposed view, padding). Its packed form
(:meth:`Manifest.to_wire`: a JSON header and binary columns) travels on the
wire and into systemd's fd store, inside the manifest file
(:mod:`weightcache.manifest`).

Forbidden imports: socket, selectors, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Iterator

from ..errors import ManifestInvalid
from ..sizes import round_up

# safetensors dtype code -> (torch dtype attribute name, item size in bytes).
# Source: safetensors `Dtype` enum (safetensors/src/tensor.rs).
DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}

#: Every tensor starts at a multiple of this many bytes inside its slab.
ALIGNMENT_BYTES = 256


def itemsize(dtype: str) -> int:
    """Returns the size in bytes of one element of safetensors dtype ``dtype``."""
    return DTYPES[dtype][1]


def torch_dtype(dtype: str):
    """Returns the ``torch.dtype`` for safetensors dtype code ``dtype`` (e.g. ``BF16``)."""
    import torch

    return getattr(torch, DTYPES[dtype][0])


def align(n: int, alignment: int = ALIGNMENT_BYTES) -> int:
    """Rounds ``n`` bytes up to a multiple of ``alignment`` bytes."""
    return round_up(n, alignment)


def contiguous_stride(shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Row-major strides, in elements, of a tensor of ``shape``."""
    stride, acc = [], 1
    for d in reversed(list(shape)):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


@dataclass(frozen=True)
class TensorRecord:
    """One tensor in a slab.

    Attributes:
        name (`str`): engine-facing parameter name (HF name, or a vLLM fused
            name such as ``model.layers.0.self_attn.qkv_proj.weight``).
        dtype (`str`): safetensors dtype code of the stored bytes (``BF16``).
        shape (`tuple[int]`): engine-facing shape of the view.
        stride (`tuple[int]`): engine-facing strides of the view, in elements
            (``(1, K)`` for a column-major ``[K, N]`` FP8 weight).
        offset_bytes (`int`): start of the stored bytes in the slab, a multiple
            of :data:`ALIGNMENT_BYTES`.
        size_bytes (`int`): length of the stored bytes.
        digest (`str`): content digest of the stored bytes recorded at load
            (``xxh3_128:<hex>`` host, ``xxh3c:<hex>`` CUDA filled without torch,
            ``sum64:<hex>`` CUDA written by torch; see :mod:`weightcache.digest`).
        layout (`dict`): processing metadata (``fused_parts``, ``logical_shape``,
            ``stored_shape``, ``scale_granularity``, ``kernel``, ``tp_dim``...).
        alias_of (`str | None`): for a tied weight, the record whose bytes it shares.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset_bytes: int
    size_bytes: int
    digest: str = ""
    layout: dict[str, Any] = field(default_factory=dict)
    alias_of: str | None = None


@dataclass(frozen=True)
class Manifest:
    """Everything an engine needs to use one slab.

    Attributes:
        model (`str`): model name from the config.
        tp_size (`int`), tp_rank (`int`): the layout and rank of this slab.
        key (`dict`): the cache key (DESIGN §5), compared field by field.
        slab_size_bytes (`int`): size of the slab mapping, in bytes.
        tensors (`tuple[TensorRecord]`): records in slab order.
    """

    model: str
    tp_size: int
    tp_rank: int
    key: dict[str, Any]
    slab_size_bytes: int
    tensors: Sequence[TensorRecord]

    def to_json(self) -> dict[str, Any]:
        """The manifest as plain JSON-able data, one object per tensor record (for comparisons and debugging).

        What travels (on the wire and into the fd store) is the packed form,
        :meth:`to_wire`.
        """
        return {
            "model": self.model,
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "key": self.key,
            "slab_size_bytes": self.slab_size_bytes,
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "stride": list(t.stride),
                         "offset_bytes": t.offset_bytes, "size_bytes": t.size_bytes, "digest": t.digest,
                         "layout": _plain_copy(t.layout), "alias_of": t.alias_of} for t in self.tensors],
        }

    def to_wire(self) -> tuple[dict[str, Any], bytes]:
        """The manifest as a JSON header and a binary payload (the *packed* form of docs/protocol.md).

        The header holds the model, layout, key and slab size, and under
        ``tensors`` the tensor count, the dtype table, each payload section's
        ``[start, length]`` in bytes, and ``runs``. The payload holds the
        per-tensor data in sections a client decodes with a handful of calls
        whatever the tensor count: ``names`` (a UTF-8 JSON array), ``table``
        (little-endian int64 ``offset_bytes, size_bytes, dtype index, ndim,
        alias index or -1`` per tensor), ``dims`` (int64 shape then stride of
        each tensor), ``digests`` (ASCII, newline-separated) and ``layouts``
        (one UTF-8 JSON array, decoded only when asked for).

        ``runs`` partitions the non-alias tensors into ``[first, index_step,
        count, offset_step_bytes]``: ``count`` tensors of one dtype, shape and
        stride at indices ``first + k * index_step`` and offsets
        ``offset_bytes[first] + k * offset_step_bytes`` (the same projection
        of every layer), which a client can view with one strided view and one
        ``unbind`` instead of ``count`` views.
        """
        ts = list(self.tensors)
        index = {t.name: i for i, t in enumerate(ts)}
        dtypes = sorted({t.dtype for t in ts})
        dtype_index = {d: i for i, d in enumerate(dtypes)}
        table: list[int] = []
        dims: list[int] = []
        for t in ts:
            table += (t.offset_bytes, t.size_bytes, dtype_index[t.dtype], len(t.shape),
                      -1 if t.alias_of is None else index[t.alias_of])
            dims += (*t.shape, *t.stride)
        sections = [
            ("names", json.dumps([t.name for t in ts], ensure_ascii=False, separators=(",", ":")).encode()),
            ("table", struct.pack(f"<{len(table)}q", *table)),
            ("dims", struct.pack(f"<{len(dims)}q", *dims)),
            ("digests", "\n".join(t.digest for t in ts).encode("ascii")),
            ("layouts", json.dumps([_plain_copy(t.layout) for t in ts], allow_nan=False, separators=(",", ":"),
                                   ensure_ascii=False).encode()),
        ]
        header_t: dict[str, Any] = {"format": PACKED_FORMAT, "count": len(ts), "dtypes": dtypes}
        pos = 0
        for name, raw in sections:
            header_t[name] = [pos, len(raw)]
            pos += len(raw)
        header_t["runs"] = _runs(ts)
        header = {"model": self.model, "tp_size": self.tp_size, "tp_rank": self.tp_rank, "key": self.key,
                  "slab_size_bytes": self.slab_size_bytes, "tensors": header_t}
        return header, b"".join(raw for _, raw in sections)

    @classmethod
    def from_wire(cls, header: dict[str, Any], payload: bytes) -> "Manifest":
        """Rebuilds a manifest from :meth:`to_wire` output without decoding every record.

        ``tensors`` is a :class:`PackedTensors`: names, offsets, shapes and
        strides are decoded at once (a few C calls); records, digests and
        layouts only when first read. :func:`build_views` uses the packed
        columns directly.

        Raises:
            ManifestInvalid (`manifest_invalid`): a header field missing or of
                the wrong type, sections out of range or inconsistent with
                ``count``; ``details["section"]`` names the part.
        """
        if not isinstance(header, dict):
            raise ManifestInvalid(f"manifest header must be an object, got {type(header).__name__}", section="header")
        try:
            fields = dict(model=str(header["model"]), tp_size=int(header["tp_size"]), tp_rank=int(header["tp_rank"]),
                          key=dict(header["key"]), slab_size_bytes=int(header["slab_size_bytes"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestInvalid(f"manifest header field {e} is missing or of the wrong type", section="header") from None
        return cls(**fields, tensors=PackedTensors(header.get("tensors"), payload))


_new = object.__new__

#: ``tensors.format`` of the packed manifest (:meth:`Manifest.to_wire`).
PACKED_FORMAT = "packed-1"
def _runs(ts: list[TensorRecord]) -> list[list[int]]:
    """Partitions the non-alias records into runs (see :meth:`Manifest.to_wire`), in index order."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(ts):
        if t.alias_of is None:
            groups.setdefault((t.dtype, t.shape, t.stride, t.size_bytes), []).append(i)
    runs = []
    for (dtype, _, _, _), idx in groups.items():
        size = DTYPES[dtype][1]
        left = dict.fromkeys(idx)  # ordered set of indices not yet in a run
        while left:
            it = iter(left)
            first = next(it)
            off0 = ts[first].offset_bytes
            best = [first, 0, 1, 0]
            # Try the steps to the next few members (the same projection of the next layer is
            # one of them even when a layer holds several tensors of this shape); keep the longest.
            for _, j in zip(range(4), it):
                istep, ostep = j - first, ts[j].offset_bytes - off0
                if ostep <= 0 or ostep % size or off0 % size:
                    continue
                count = 2
                while first + count * istep in left and ts[first + count * istep].offset_bytes == off0 + count * ostep:
                    count += 1
                if count > best[2]:
                    best = [first, istep, count, ostep]
            for k in range(best[2]):
                del left[first + k * best[1]]
            runs.append(best)
    runs.sort()
    return runs


def _int64s(raw: memoryview, section: str) -> list[int]:
    """Little-endian int64 values of a payload section."""
    if len(raw) % 8:
        raise ManifestInvalid(f"manifest section {section!r} is {len(raw)} bytes, not a multiple of 8", section=section)
    if sys.byteorder == "little":
        return raw.cast("q").tolist()
    return list(struct.unpack(f"<{len(raw) // 8}q", raw))


class PackedTensors(Sequence):
    """The tensor records of a packed manifest, decoded lazily (a read-only sequence of :class:`TensorRecord`).

    Attributes (decoded at construction, a few C-level calls whatever the count):
        names (`list[str]`), table (`list[int]`: 5 ints per tensor), dims
        (`list[int]`), ndim_sum (`list[int]`: sum of the ndims before each
        tensor; its shape starts at ``dims[2 * ndim_sum[i]]``), dtypes (`list[str]`), runs (`list[list[int]]`).

    Raises:
        ManifestInvalid (`manifest_invalid`): a section out of the payload, or
            lengths that disagree with ``count``.
    """

    def __init__(self, header: dict[str, Any], payload: bytes) -> None:
        if not isinstance(header, dict):
            raise ManifestInvalid(f"manifest tensors must be an object, got {type(header).__name__}", section="header")
        if header.get("format") != PACKED_FORMAT:
            raise ManifestInvalid(f"manifest tensors format {header.get('format')!r} is not {PACKED_FORMAT!r}",
                                  section="header")
        n = header.get("count")
        if type(n) is not int or n < 0:
            raise ManifestInvalid(f"manifest tensors count {n!r} is not a non-negative integer", section="header")
        mv = memoryview(payload)

        def section(name: str) -> memoryview:
            where = header.get(name)
            if not (isinstance(where, list) and len(where) == 2 and all(type(x) is int for x in where)
                    and 0 <= where[0] and 0 <= where[1] and where[0] + where[1] <= len(payload)):
                raise ManifestInvalid(f"manifest section {name!r} {where!r} lies outside the {len(payload)}-byte payload",
                                      section=name)
            return mv[where[0]:where[0] + where[1]]

        self.count = n
        self.dtypes = header.get("dtypes")
        if not isinstance(self.dtypes, list) or not all(isinstance(d, str) and d in DTYPES for d in self.dtypes):
            raise ManifestInvalid(f"manifest dtypes {self.dtypes!r} are not all safetensors dtype codes",
                                  section="dtypes")
        try:
            self.names = json.loads(str(section("names"), "utf-8"))
        except (RecursionError, MemoryError) as e:  # nested 200,000 deep by whoever answers at the socket
            raise ManifestInvalid(f"manifest section 'names' cannot be parsed: {type(e).__name__}",
                                  section="names") from None
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError alike
            raise ManifestInvalid(f"manifest section 'names' is not a UTF-8 JSON array: {e}", section="names") from None
        if not isinstance(self.names, list) or not all(isinstance(x, str) for x in self.names):
            raise ManifestInvalid("manifest section 'names' is not a JSON array of strings", section="names")
        self.table = _int64s(section("table"), "table")
        self.dims = _int64s(section("dims"), "dims")
        if len(self.names) != n or len(self.table) != 5 * n:
            raise ManifestInvalid(f"manifest has {len(self.names)} names and {len(self.table) // 5} table rows "
                             f"for {n} tensors", section="table")
        if len(set(self.names)) != n:
            raise ManifestInvalid("manifest names a tensor twice", section="names")
        if n and (min(self.table[2::5]) < 0 or max(self.table[2::5]) >= len(self.dtypes)
                  or min(self.table[3::5]) < 0 or min(self.table[4::5]) < -1 or max(self.table[4::5]) >= n):
            raise ManifestInvalid("manifest table has a dtype index, ndim or alias index out of range", section="table")
        # Start of tensor i's shape in ``dims`` is 2 * ndim_sum[i] (shape then stride, ndim each).
        self.ndim_sum = list(accumulate(self.table[3::5], initial=0))
        if 2 * self.ndim_sum[-1] != len(self.dims):
            raise ManifestInvalid(f"manifest dims section holds {len(self.dims)} values, the table needs "
                             f"{2 * self.ndim_sum[-1]}", section="dims")
        self.runs = self._checked_runs(header.get("runs", []))
        self._digests = section("digests")
        if n and bytes(self._digests).count(b"\n") != n - 1:
            raise ManifestInvalid(f"manifest section 'digests' does not hold {n} newline-separated entries",
                                  section="digests")
        self._layouts = section("layouts")
        self._records: tuple[TensorRecord, ...] | None = None
        self._layout_list: list[dict] | None = None

    def _checked_runs(self, runs: Any) -> list[list[int]]:
        """``runs`` checked against the table, plus a run of one for each tensor no run covers.

        Every member of a run must have the dtype, ndim, size, shape and stride
        of its first member and sit at the run's offset step; a tensor is in
        at most one run and never an alias; each distinct view must lie within
        its record's ``size_bytes``; an alias must repeat its target's row. So
        views built from the runs are the views the table describes (the table
        alone is enough: a manifest without ``runs`` gets a run per tensor).
        One check per run and one list comparison per tensor.

        Raises:
            ValueError: the first inconsistency, naming the run or tensor.
        """
        if not isinstance(runs, list):
            raise ManifestInvalid(f"manifest runs {runs!r} is not a list", section="runs")
        n, tab, dims, pos, names = self.count, self.table, self.dims, self.ndim_sum, self.names
        offs, sizes, dts, nds, alias = tab[0::5], tab[1::5], tab[2::5], tab[3::5], tab[4::5]
        covered = bytearray(n)
        out = []
        for r in runs:
            if not (isinstance(r, list) and len(r) == 4 and all(type(x) is int for x in r)):
                raise ManifestInvalid(f"manifest run {r!r} is not 4 integers", section="runs")
            first, istep, count, ostep = r
            if count == 1:
                istep = ostep = 0
            if not (count >= 1 and 0 <= first and (count == 1 or (istep >= 1 and ostep >= 1))
                    and first + istep * (count - 1) < n):
                raise ManifestInvalid(f"manifest run {r} does not lie within the {n} tensors", section="runs")
            sl = slice(first, first + istep * (count - 1) + 1, istep or 1)
            if covered[sl].count(0) != count:
                raise ManifestInvalid(f"manifest run {r} covers a tensor another run covers", section="runs")
            covered[sl] = b"\x01" * count
            dt, nd, size, off = dts[first], nds[first], sizes[first], offs[first]
            if (dts[sl].count(dt) != count or nds[sl].count(nd) != count or sizes[sl].count(size) != count
                    or alias[sl].count(-1) != count
                    or (count > 1 and offs[sl] != list(range(off, off + count * ostep, ostep)))):
                raise ManifestInvalid(f"manifest run {r}: its tensors differ in dtype, rank, size or offset step, "
                                 f"or include a tied alias", section="runs")
            p = 2 * pos[first]
            ref = dims[p:p + 2 * nd]
            if count > 1:
                self._check_same_dims(r, sl, ref)
            self._check_extent(first, ref[:nd], ref[nd:], count > 1 and ostep)
            out.append([first, istep, count, ostep])
        i = covered.find(0)
        while i >= 0:  # aliases, and tensors no run covers (viewed one by one)
            a = alias[i]
            p = 2 * pos[i]
            if a < 0:
                self._check_extent(i, dims[p:p + nds[i]], dims[p + nds[i]:p + 2 * nds[i]], 0)
                out.append([i, 0, 1, 0])
            elif alias[a] >= 0 or tab[5 * i:5 * i + 4] != tab[5 * a:5 * a + 4] or \
                    dims[p:p + 2 * nds[i]] != dims[2 * pos[a]:2 * pos[a] + 2 * nds[a]]:
                raise ManifestInvalid(f"manifest tied tensor {names[i]!r} does not repeat the row of its target "
                                 f"{names[a]!r}", section="table")
            i = covered.find(0, i + 1)
        return out

    def _check_same_dims(self, run: list[int], sl: slice, ref: list[int]) -> None:
        """Every member of ``run`` (indices ``sl``) has the shape and stride ``ref`` of its first member."""
        if not ref:  # 0-d tensors: nothing to compare
            return
        dims, names = self.dims, self.names
        starts = self.ndim_sum[sl]
        d = starts[1] - starts[0]
        count = len(starts)
        if starts == list(range(starts[0], starts[0] + count * d, d)):
            # Members' dims sit at a fixed step (the usual layered model): compare column by column.
            base, step = 2 * starts[0], 2 * d
            if all(dims[base + j::step][:count].count(v) == count for j, v in enumerate(ref)):
                return
        for k, q in enumerate(starts):
            if dims[2 * q:2 * q + len(ref)] != ref:
                raise ManifestInvalid(f"manifest run {run}: tensor {names[sl.start + k * sl.step]!r} has another "
                                 f"shape or stride than {names[sl.start]!r}", section="runs")

    def _check_extent(self, i: int, shape: list[int], stride: list[int], step_bytes: int) -> None:
        """Tensor ``i``'s view (``shape``, ``stride`` in elements) lies within its record; a run's step is whole elements."""
        size = DTYPES[self.dtypes[self.table[5 * i + 2]]][1]
        off, nbytes = self.table[5 * i], self.table[5 * i + 1]
        if min(shape, default=0) < 0 or min(stride, default=0) < 0 or off < 0:
            raise ManifestInvalid(f"manifest tensor {self.names[i]!r} has a negative offset, dimension or stride",
                                  section="dims")
        extent = 0 if 0 in shape else 1 + sum((d - 1) * st for d, st in zip(shape, stride))
        if extent * size > nbytes or step_bytes % size or (step_bytes and off % size):
            raise ManifestInvalid(f"manifest tensor {self.names[i]!r}: shape {shape} and stride {stride} of "
                             f"{self.dtypes[self.table[5 * i + 2]]} need {extent * size} bytes (its record holds "
                             f"{nbytes}), or its run's step or offset is not a whole number of elements",
                             section="dims")

    def layouts(self) -> list[dict[str, Any]]:
        """Each tensor's layout dict, in slab order (the ``layouts`` section, decoded on first call).

        Raises:
            ValueError: the section is not a JSON list of ``count`` objects.
        """
        if self._layout_list is None:
            try:
                lays = json.loads(str(self._layouts, "utf-8")) if self.count else []
            except (RecursionError, MemoryError) as e:
                raise ManifestInvalid(f"manifest section 'layouts' cannot be parsed: {type(e).__name__}",
                                      section="layouts") from None
            except ValueError as e:
                raise ManifestInvalid(f"manifest section 'layouts' is not UTF-8 JSON: {e}", section="layouts") from None
            if not isinstance(lays, list) or len(lays) != self.count or not all(isinstance(x, dict) for x in lays):
                raise ManifestInvalid(f"manifest section 'layouts' must be a list of {self.count} objects",
                                      section="layouts")
            self._layout_list = lays
        return self._layout_list

    def _materialize(self) -> tuple[TensorRecord, ...]:
        if self._records is None:
            tab, dims, pos, names = self.table, self.dims, self.ndim_sum, self.names
            try:
                digests = str(self._digests, "ascii").split("\n") if self.count else []
            except UnicodeDecodeError:
                digests = []
            if len(digests) != self.count:
                raise ManifestInvalid(f"manifest section 'digests' holds {len(digests)} entries for {self.count} tensors",
                                      section="digests")
            lays = self.layouts()
            recs = []
            for i, name in enumerate(names):
                o, p = 5 * i, 2 * pos[i]
                nd = tab[o + 3]
                rec = _new(TensorRecord)
                rec.__dict__.update(name=name, dtype=self.dtypes[tab[o + 2]], shape=tuple(dims[p:p + nd]),
                                    stride=tuple(dims[p + nd:p + 2 * nd]), offset_bytes=tab[o],
                                    size_bytes=tab[o + 1], digest=digests[i], layout=lays[i],
                                    alias_of=None if tab[o + 4] < 0 else names[tab[o + 4]])
                recs.append(rec)
            self._records = tuple(recs)
        return self._records

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):  # type: ignore[override]
        return self._materialize()[i]

    def __iter__(self) -> Iterator[TensorRecord]:
        return iter(self._materialize())


class LayoutMap(Mapping):
    """``name -> layout dict`` of a manifest, built on first access (``Attachment.layouts``)."""

    def __init__(self, manifest: "Manifest") -> None:
        self._manifest = manifest
        self._map: dict[str, dict] | None = None

    def _get(self) -> dict[str, dict]:
        if self._map is None:
            ts = self._manifest.tensors
            if isinstance(ts, PackedTensors):
                self._map = dict(zip(ts.names, ts.layouts()))
            else:
                self._map = {r.name: r.layout for r in ts}
        return self._map

    def __getitem__(self, name: str) -> dict:
        return self._get()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def _plain_copy(v: Any) -> Any:
    """Deep copy of JSON-like data (dicts, lists, tuples, scalars), like ``dataclasses.asdict``."""
    if isinstance(v, dict):
        return {k: _plain_copy(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_plain_copy(x) for x in v)
    return v


def build_views(slab, manifest: Manifest) -> dict[str, Any]:
    """Builds the engine-facing tensors of ``manifest`` over ``slab``.

    Args:
        slab (`torch.Tensor`): the whole slab as a 1-D ``uint8`` tensor of
            ``manifest.slab_size_bytes`` bytes (host or CUDA, read-only or private).

    Returns:
        `dict[str, torch.Tensor]`: name -> view, with each record's dtype, shape
        and stride. Views share the slab's memory and stay valid as long as the
        slab's mapping does (for an attach: until the session is closed). Tied
        aliases map to the very same tensor object as their target. Keys are in manifest (slab) order.
        A manifest of records is packed first (:meth:`Manifest.to_wire`, about
        1 ms for 200 tensors), so one checked path builds every view.

    Raises:
        ValueError: the manifest is inconsistent (see :class:`PackedTensors`).
    """
    tensors = manifest.tensors
    if not isinstance(tensors, PackedTensors):  # a manifest of records (the disk fallback, the service)
        header, payload = manifest.to_wire()
        tensors = PackedTensors(header["tensors"], payload)
    return _packed_views(slab, tensors)


_views_warmed = False


def warm_up_views() -> bool:
    """Once per process: the torch operations :func:`build_views` calls, on a 16-byte CPU tensor.

    torch sets each operation's Python binding up on its first call in a
    process (its argument parser: tens of µs each; about 0.3 ms of the first
    attach's views of a 231-tensor manifest on the H200 host). The client calls
    this while the service answers a process's first attach, so that the views
    built after the reply find them set up. Needs torch.

    Returns:
        `bool`: whether this call did it (``False`` once done).
    """
    global _views_warmed
    if _views_warmed:
        return False
    _views_warmed = True
    import torch

    slab = torch.empty(16, dtype=torch.uint8)  # what _packed_views does, shapes aside
    flat = slab[: slab.numel()].view(torch.bfloat16)
    flat.as_strided([2, 2], [2, 1], flat.storage_offset()).unbind(0)
    return True


def _packed_views(slab, t: PackedTensors) -> dict[str, Any]:
    """:func:`build_views` over packed columns: one strided view + ``unbind`` per run, no records.

    One ``as_strided`` over a whole-slab view per dtype rather than slice + view
    per tensor: the per-tensor Python/dispatcher cost is what an attach pays.
    """
    n_bytes = slab.numel()
    tab, dims, pos = t.table, t.dims, t.ndim_sum
    views: list[Any] = [None] * t.count
    typed: dict[int, tuple[Any, int, int]] = {}
    for first, istep, count, ostep in t.runs:
        o, p = 5 * first, 2 * pos[first]
        off, dti, nd = tab[o], tab[o + 2], tab[o + 3]
        shape, stride = dims[p:p + nd], dims[p + nd:p + 2 * nd]
        tv = typed.get(dti)
        if tv is None:
            dt = torch_dtype(t.dtypes[dti])
            size = DTYPES[t.dtypes[dti]][1]
            flat = slab[: n_bytes - n_bytes % size].view(dt)
            tv = typed[dti] = (flat, size, flat.storage_offset())
        flat, size, base = tv
        if count == 1:
            if off % size:
                raw = slab[off: off + tab[o + 1]]
                views[first] = raw.view(torch_dtype(t.dtypes[dti])).as_strided(shape, stride)
            else:
                views[first] = flat.as_strided(shape, stride, base + off // size)
        else:
            views[first: first + istep * count: istep] = flat.as_strided(
                [count, *shape], [ostep // size, *stride], base + off // size).unbind(0)
    for i, a in enumerate(tab[4::5]):
        if a >= 0:
            views[i] = views[a]
    return dict(zip(t.names, views))  # PackedTensors' runs cover every tensor that is not an alias
