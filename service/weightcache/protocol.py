"""The wire protocol, sans-I/O (in the manner of h11).

Frames on a Unix stream socket: a 4-byte big-endian length ``N`` followed by
``N`` bytes of one UTF-8 JSON object (no NaN, at most :data:`MAX_FRAME_BYTES`).
The object's ``type`` is the snake_case name of a message class below; its
optional ``fd_count`` says how many file descriptors travel as ``SCM_RIGHTS``
with the frame. On a stream socket the fds arrive with whichever read picks up
the frame's first byte, so fds are matched to frames by count, never by read
boundary. See ``docs/protocol.md``.

This module does no I/O: :meth:`Connection.receive` buffers what the caller
read, :meth:`Connection.next_message` returns a message or :data:`NEED_DATA`,
:meth:`Connection.send` returns the bytes (and fds) for the caller to write.
It never opens or closes an fd; the I/O code owns them.

Forbidden imports: socket, selectors, asyncio, torch, weightcache.memory.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .errors import LocalProtocolError, RemoteProtocolError, WeightcacheError

#: 3: the manifest travels as a sealed memfd beside the slab (2: inside the frame; 1: JSON lists).
PROTOCOL_VERSION = 3
MAX_FRAME_BYTES = 16 * 1024 * 1024
#: Integers on the wire are signed 64-bit, so that any client language can hold them.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
MAX_FDS_PER_FRAME = 8
_LEN = struct.Struct(">I")


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


#: Returned by :meth:`Connection.next_message` when no whole frame is buffered.
NEED_DATA = _NeedData()


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


_JSON_TYPES = {"int": int, "str": str, "bool": bool, "dict": dict, "list": list, "float": (int, float)}


@dataclass(frozen=True, slots=True)
class Message:
    """Base of every message. Subclasses are frozen, slotted dataclasses.

    ``fd_count`` is a class-level constant for messages that carry fds.
    """

    FD_COUNT: ClassVar[int] = 0
    TYPES: ClassVar[dict[str, type["Message"]]] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super(Message, cls).__init_subclass__(**kw)
        Message.TYPES[_snake(cls.__name__)] = cls

    @classmethod
    def tag(cls) -> str:
        """The wire ``type``: the class name in snake_case (``AttachReply`` -> ``attach_reply``)."""
        tag = _TAGS.get(cls)
        if tag is None:
            tag = _TAGS[cls] = _snake(cls.__name__)
        return tag

    def to_json(self) -> dict[str, Any]:
        """The message's JSON fields, with ``type`` (and ``fd_count``)."""
        d = {name: getattr(self, name) for name, _, _ in _specs(type(self))}
        d["type"] = self.tag()
        if self.FD_COUNT:
            d["fd_count"] = self.FD_COUNT
        return d

    def __post_init__(self) -> None:
        tag = type(self).tag()
        for spec in _specs(type(self)):
            _check_field(tag, spec, getattr(self, spec[0]), LocalProtocolError)


_SPECS: dict[type, tuple[tuple[str, str, bool], ...]] = {}
_TAGS: dict[type, str] = {}


def _specs(cls: type) -> tuple[tuple[str, str, bool], ...]:
    """``(field name, JSON base type, optional)`` of each field of message class ``cls``, computed once."""
    specs = _SPECS.get(cls)
    if specs is None:
        out = []
        for f in dataclasses.fields(cls):
            spec = str(f.type).replace(" ", "")
            out.append((f.name, spec.removesuffix("|None").split("[")[0], spec.endswith("|None")))
        specs = _SPECS[cls] = tuple(out)
    return specs


def _check_field(tag: str, spec: tuple[str, str, bool], value: Any, exc: type) -> None:
    name, base, optional = spec
    if value is None and optional:
        return
    want = _JSON_TYPES[base]
    if isinstance(value, bool) and base != "bool":
        raise exc(f"message {tag!r}: field {name!r} must be {base}, got a boolean", field=name)
    if not isinstance(value, want):
        raise exc(f"message {tag!r}: field {name!r} must be {base}, got {type(value).__name__}", field=name)
    if isinstance(value, int) and not isinstance(value, bool) and not INT_MIN <= value <= INT_MAX:
        raise exc(f"message {tag!r}: field {name!r} is outside the signed 64-bit range", field=name)


# --- requests (client -> service) -------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """First frame of a connection. ``client`` is a free-form identity string."""

    protocol_version: int
    client: str = ""


@dataclass(frozen=True, slots=True)
class List(Message):
    """Asks for the models placed on this GPU."""


@dataclass(frozen=True, slots=True)
class Status(Message):
    """Asks for the full status (states, progress, leases, memory)."""


@dataclass(frozen=True, slots=True)
class Attach(Message):
    """Asks for one slab.

    Attributes:
        model: a model name from the config, or a checkpoint path.
        tp_size, tp_rank: the layout and rank.
        wait_ms: how long the service may hold the request while the model loads
            (0: answer ``loading`` at once).
        dtype, naming: when attaching by path, select among configured models.
        mode: ``zero_copy`` or ``copy`` (recorded with the lease).
    """

    model: str
    tp_size: int = 1
    tp_rank: int = 0
    wait_ms: int = 0
    dtype: str | None = None
    naming: str | None = None
    mode: str = "zero_copy"


@dataclass(frozen=True, slots=True)
class Release(Message):
    """Ends one lease (closing the connection ends all of them)."""

    lease_id: int


@dataclass(frozen=True, slots=True)
class Verify(Message):
    """Recompute the content digests of a resident slab (all ranks if tp_size is None)."""

    model: str
    tp_size: int | None = None
    tp_rank: int | None = None


@dataclass(frozen=True, slots=True)
class Evict(Message):
    """Free a model's slabs and fd-store entries; refused while leased unless ``force``.

    ``to``: ``""`` (evicted: out until ``preload``), ``host`` (demoted to the host tier) or ``disk``
    (dropped; the next attach loads it again).
    """

    model: str
    force: bool = False
    to: str = ""


@dataclass(frozen=True, slots=True)
class Preload(Message):
    """Start (or restart after failure/eviction) the load of a model's slabs on this GPU."""

    model: str


@dataclass(frozen=True, slots=True)
class Reload(Message):
    """Re-read the configuration and apply it (``systemctl reload``, ``weightcache reload``; root or the service user)."""


# --- replies (service -> client) --------------------------------------------


@dataclass(frozen=True, slots=True)
class HelloReply(Message):
    """Answer to ``hello``: the service's protocol version, GPU index and UUID, backend (``host`` | ``cuda``) and capabilities."""

    protocol_version: int
    gpu: int
    gpu_uuid: str
    backend: str
    capabilities: list = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ListReply(Message):
    """Answer to ``list``: one :class:`SlabInfo` object per (model, layout, rank) on this GPU."""

    models: list

    def slabs(self) -> tuple[SlabInfo, ...]:
        """The typed records."""
        return tuple(SlabInfo.from_json(m) for m in self.models)


@dataclass(frozen=True, slots=True)
class StatusReply(Message):
    """Answer to ``status``: a :class:`ServiceStatus` object (GPU, backend, memory, every slab, leases)."""

    status: dict

    def typed(self) -> ServiceStatus:
        """The typed record."""
        return ServiceStatus.from_json(self.status)


@dataclass(frozen=True, slots=True)
class AttachReply(Message):
    """A lease on one slab; two fds travel with this frame: the slab, then its manifest file.

    The manifest file is a sealed memfd holding the slab's packed manifest
    (:func:`weightcache.manifest.pack_file`, docs/protocol.md), the same for
    every attach of the slab; it travels beside the frame so that a manifest
    of any tensor count fits (at most ``MAX_MANIFEST_BYTES`` of
    :mod:`weightcache.manifest`, checked when the slab is loaded).

    Attributes:
        lease_id: ends with :class:`Release` or the connection.
        checkpoint_path: the checkpoint directory the slab was loaded from.
        backend: ``host`` or ``cuda``.
        manifest_size_bytes: the manifest file's size in bytes.
    """

    FD_COUNT: ClassVar[int] = 2
    lease_id: int
    checkpoint_path: str
    backend: str
    manifest_size_bytes: int


@dataclass(frozen=True, slots=True)
class Loading(Message):
    """The model is still loading; progress in bytes."""

    model: str
    done_bytes: int
    total_bytes: int
    state: str = "loading"


@dataclass(frozen=True, slots=True)
class ReleaseReply(Message):
    """Answer to ``release``: the lease that ended."""

    lease_id: int


@dataclass(frozen=True, slots=True)
class VerifyReply(Message):
    """Answer to ``verify``: one :class:`VerifyResult` object per slab."""

    results: list

    def typed(self) -> tuple[VerifyResult, ...]:
        """The typed records."""
        return tuple(VerifyResult.from_json(r) for r in self.results)


@dataclass(frozen=True, slots=True)
class EvictReply(Message):
    """Answer to ``evict``: labels (``model/tpN/rankR``) of the slabs freed."""

    evicted: list


@dataclass(frozen=True, slots=True)
class PreloadReply(Message):
    """Answer to ``preload``: labels of the slabs whose load started."""

    started: list


@dataclass(frozen=True, slots=True)
class ReloadReply(Message):
    """Answer to ``reload`` once the new configuration is applied; labels (``model/tpN/rankR``) of the slabs.

    Attributes:
        added: new or changed placements, now loading.
        dropped: removed or changed placements whose slab was freed (or never loaded).
        retired: removed or changed placements kept while leases hold them (freed at the last release).
        kept: unchanged placements (slab and leases untouched; a failed one is loaded again).
        restart_keys: changed ``[service]`` keys that take effect at the next restart only.
        files: the configuration files read.
    """

    added: list
    dropped: list
    retired: list
    kept: list
    restart_keys: list = field(default_factory=list)
    files: list = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Error(Message):
    """A typed error: ``code`` (see docs/errors.md), ``message``, ``details``."""

    code: str
    message: str
    details: dict = field(default_factory=dict)

    @classmethod
    def from_exc(cls, e: WeightcacheError) -> "Error":
        return cls(**e.to_wire())


# --- typed records inside replies --------------------------------------------
#
# The ``status`` and ``list`` replies carry these as plain JSON objects (the
# wire is unchanged); the service builds them and clients read them through
# ``from_json``, so the schema lives here and nowhere else.


def _from_json(cls: type, d: dict[str, Any], **nested: Any) -> Any:
    """Builds record ``cls`` from the JSON object ``d``; keys ``cls`` does not know are ignored (newer services)."""
    if not isinstance(d, dict):
        raise RemoteProtocolError(f"{cls.__name__}: expected a JSON object, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in d.items() if k in names}, **nested)
    except TypeError as e:
        raise RemoteProtocolError(f"{cls.__name__}: {e}") from None


class _Record:
    """Base of the records inside replies: ``to_json`` is the fields as a JSON object, ``from_json`` the reverse."""

    __slots__ = ()

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Any:
        """Raises RemoteProtocolError (`protocol_violation`) when a field is missing."""
        return _from_json(cls, d)


class _SlabRecord(_Record):
    """Base of the records about one slab (fields ``model``, ``tp_size``, ``tp_rank``)."""

    __slots__ = ()

    @property
    def label(self) -> str:
        """``<model> tp=<tp_size> rank=<tp_rank>``, as the CLI prints it."""
        return f"{self.model} tp={self.tp_size} rank={self.tp_rank}"


#: pid, uid and gid of a :class:`LeaseInfo` whose holder the service hides from the caller (another uid's
#: lease, shown to a non-operator): the lease is counted, its holder stays private.
HIDDEN_ID = -1


@dataclass(frozen=True, slots=True)
class LeaseInfo(_Record):
    """One lease in a ``status`` reply.

    Attributes:
        lease_id (`int`): the lease's id on its service.
        pid, uid, gid (`int`): the holder, from ``SO_PEERCRED``; :data:`HIDDEN_ID`
            when the service hides it from this caller.
        since (`float`): when it was granted, Unix time in seconds.
        mode (`str`): ``zero_copy`` or ``copy``.
    """

    lease_id: int
    pid: int
    uid: int
    gid: int
    since: float
    mode: str


@dataclass(frozen=True, slots=True)
class KeySummary(_Record):
    """The part of a resident slab's cache key (DESIGN section 5) that ``status`` shows.

    Attributes:
        architecture (`str | None`): ``config.json`` ``architectures[0]``.
        quant_scheme (`str | None`): e.g. ``modelopt_fp8``; None when unquantized.
        pipeline_version (`int | None`): weightcache's processing version.
        files (`int`): number of checkpoint files in the key.
    """

    architecture: str | None
    quant_scheme: str | None
    pipeline_version: int | None
    files: int


@dataclass(frozen=True, slots=True)
class ErrorInfo(_Record):
    """Why a slab failed: the error's ``code`` (docs/errors.md), ``message`` and ``details``."""

    code: str
    message: str
    details: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SlabInfo(_SlabRecord):
    """One (model, layout, rank) in a ``status`` or ``list`` reply.

    Attributes:
        model (`str`), path (`str`): the configured name and checkpoint directory.
        tp_size, tp_rank (`int`): the layout and rank.
        state (`str`): ``pending``, ``loading``, ``ready``, ``failed``, ``evicted`` or
            ``retired`` (removed from the config by a reload, kept while leased).
        done_bytes, total_bytes (`int`): load progress, payload bytes.
        rate_bytes_per_s (`int`): load rate while loading, else 0.
        resident_bytes (`int`): size of the resident slab mapping (0 when none).
        adopted (`bool`): the slab came back from systemd's fd store.
        dtype (`str`), naming (`str`): the configured dtype and naming.
        tensors (`int`): tensor records in the resident slab's manifest.
        error (`ErrorInfo | None`): why the last load failed.
        key (`KeySummary | None`): summary of the resident slab's cache key.
        leases (`tuple[LeaseInfo]`): who holds it.
        tier (`str`): ``gpu`` (on the GPU, or a load into it under way), ``host`` (in the host tier, promoted
            by the next attach) or ``disk`` (not resident; the next attach loads it).
        host_bytes (`int`): bytes of its host-tier copy (0 when none).
        pin (`bool`), priority (`int`): the model's ``pin`` and ``priority`` (the budget's order).
    """

    model: str
    path: str
    tp_size: int
    tp_rank: int
    state: str
    done_bytes: int
    total_bytes: int
    rate_bytes_per_s: int
    resident_bytes: int
    adopted: bool
    dtype: str
    naming: str
    tensors: int
    error: ErrorInfo | None = None
    key: KeySummary | None = None
    leases: tuple[LeaseInfo, ...] = ()
    tier: str = "gpu"
    host_bytes: int = 0
    pin: bool = False
    priority: int = 0

    def to_json(self) -> dict[str, Any]:
        """The JSON object on the wire; ``error`` and ``key`` only when set."""
        d: dict[str, Any] = {f: getattr(self, f) for f in (
            "model", "path", "tp_size", "tp_rank", "state", "done_bytes", "total_bytes", "rate_bytes_per_s",
            "resident_bytes", "adopted", "dtype", "naming", "tensors", "tier", "host_bytes", "pin", "priority")}
        if self.error is not None:
            d["error"] = self.error.to_json()
        if self.key is not None:
            d["key"] = self.key.to_json()
        d["leases"] = [le.to_json() for le in self.leases]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SlabInfo":
        """Raises RemoteProtocolError (`protocol_violation`) when a field is missing."""
        err, key = d.get("error"), d.get("key")
        return _from_json(cls, {k: v for k, v in d.items() if k not in ("error", "key", "leases")},
                          error=ErrorInfo.from_json(err) if err is not None else None,
                          key=KeySummary.from_json(key) if key is not None else None,
                          leases=tuple(LeaseInfo.from_json(le) for le in d.get("leases", ())))


@dataclass(frozen=True, slots=True)
class DeviceInfo(_Record):
    """The device a service's slabs live on (the ``device`` fields of the cache key, DESIGN section 5).

    Attributes:
        backend (`str`): ``host`` or ``cuda``.
        gpu_uuid (`str`): ``GPU-...`` (empty on host).
        compute_capability (`str`): e.g. ``9.0`` (empty on host).
    """

    backend: str = ""
    gpu_uuid: str = ""
    compute_capability: str = ""


@dataclass(frozen=True, slots=True)
class ServiceStatus(_Record):
    """The ``status`` reply's record: one service (one GPU).

    Attributes:
        gpu (`int`): GPU index; pid (`int`): the service's pid.
        backend (`str`): ``host`` or ``cuda``.
        device (`DeviceInfo`): the slabs' device.
        free_bytes, total_bytes (`int`): memory of the backend (GPU, or host RAM), bytes.
        slabs (`tuple[SlabInfo]`): every configured (model, layout, rank).
        clients (`int`): open connections.
        status_line (`str`): the line systemd's ``STATUS=`` shows.
        config_error (`ErrorInfo | None`): the configuration the service refused
            (``config_invalid``, ``details``: ``file``, ``key``, ``line``) while it
            serves the one before (or the slabs kept in the fd store); None when
            the files on disk are the ones applied.
        budget_bytes (`int`): ``memory_budget_bytes`` in force (bytes).
        gpu_bytes (`int`): bytes of the budget taken (slabs on the GPU and loads granted room).
        host_tier_bytes, host_used_bytes (`int`): the host tier's size and the bytes it holds.
    """

    gpu: int
    pid: int
    backend: str
    device: DeviceInfo
    free_bytes: int
    total_bytes: int
    slabs: tuple[SlabInfo, ...]
    clients: int
    status_line: str
    config_error: ErrorInfo | None = None
    budget_bytes: int = 0
    gpu_bytes: int = 0
    host_tier_bytes: int = 0
    host_used_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        """The JSON object on the wire (memory as ``{"free_bytes", "total_bytes", "budget_bytes", "gpu_bytes",
        "host_tier_bytes", "host_used_bytes"}``; ``config_error`` when set)."""
        d = {"gpu": self.gpu, "pid": self.pid, "backend": self.backend, "device": self.device.to_json(),
             "memory": {"free_bytes": self.free_bytes, "total_bytes": self.total_bytes,
                        "budget_bytes": self.budget_bytes, "gpu_bytes": self.gpu_bytes,
                        "host_tier_bytes": self.host_tier_bytes, "host_used_bytes": self.host_used_bytes},
             "slabs": [s.to_json() for s in self.slabs], "clients": self.clients,
             "status_line": self.status_line}
        if self.config_error is not None:
            d["config_error"] = self.config_error.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ServiceStatus":
        """Raises RemoteProtocolError (`protocol_violation`) when a field is missing."""
        mem, err = d.get("memory") or {}, d.get("config_error")
        return _from_json(cls, {k: v for k, v in d.items() if k not in ("memory", "slabs", "device", "config_error")},
                          device=DeviceInfo.from_json(d.get("device") or {}), free_bytes=mem.get("free_bytes", 0),
                          total_bytes=mem.get("total_bytes", 0), budget_bytes=mem.get("budget_bytes", 0),
                          gpu_bytes=mem.get("gpu_bytes", 0), host_tier_bytes=mem.get("host_tier_bytes", 0),
                          host_used_bytes=mem.get("host_used_bytes", 0),
                          slabs=tuple(SlabInfo.from_json(s) for s in d.get("slabs", ())),
                          config_error=ErrorInfo.from_json(err) if err is not None else None)


@dataclass(frozen=True, slots=True)
class VerifyResult(_SlabRecord):
    """One slab in a ``verify`` reply.

    Attributes:
        model (`str`), tp_size, tp_rank (`int`): which slab.
        state (`str`): its state; only ``ready`` slabs are verified.
        mismatched (`list[str]`): tensors whose content digest differs from the one recorded at load.
        tensors (`int`): tensors checked (0 when not ready).
    """

    model: str
    tp_size: int
    tp_rank: int
    state: str
    mismatched: list
    tensors: int = 0

    def to_json(self) -> dict[str, Any]:
        d = {"model": self.model, "tp_size": self.tp_size, "tp_rank": self.tp_rank, "state": self.state}
        if self.state == "ready":
            d["tensors"] = self.tensors
        d["mismatched"] = list(self.mismatched)
        return d


# --- metrics (protocol version 3; docs/protocol.md "metrics") ---------------------------


@dataclass(frozen=True, slots=True)
class Metrics(Message):
    """Asks for the status and the service's counters (what ``weightcache metrics`` exports)."""


@dataclass(frozen=True, slots=True)
class MetricsReply(Message):
    """Answer to ``metrics``: a :class:`ServiceStatus` object and a :class:`ServiceCounters` object."""

    status: dict
    counters: dict

    def typed(self) -> tuple[ServiceStatus, ServiceCounters]:
        """The typed records."""
        return ServiceStatus.from_json(self.status), ServiceCounters.from_json(self.counters)


@dataclass(frozen=True, slots=True)
class AttachCount(_Record):
    """Attaches answered for one model with one outcome since the service started.

    Attributes:
        model (`str`): the configured model name; ``(other)`` for a name or path no model of this service has.
        outcome (`str`): ``daemon`` (a lease and the slab's fd), ``loading`` (a ``loading`` reply) or
            ``refused`` (an ``error`` reply).
        code (`str`): the error's code (docs/errors.md) when refused, else empty.
        count (`int`): how many.
    """

    model: str
    outcome: str
    code: str
    count: int


@dataclass(frozen=True, slots=True)
class AttachTimes(_Record):
    """Histogram of attach service times of one model: request read to reply queued, seconds.

    Attributes:
        model (`str`): as in :class:`AttachCount`.
        bounds_s (`list[float]`): bucket upper bounds, seconds, increasing (``+Inf`` is implied).
        counts (`list[int]`): observations per bucket, not cumulative; one more than ``bounds_s`` (the last
            is above every bound).
        sum_s (`float`): sum of all observations, seconds.
    """

    model: str
    bounds_s: list
    counts: list
    sum_s: float


@dataclass(frozen=True, slots=True)
class LoadCount(_Record):
    """Loads of one (model, layout, rank) that ended one way since the service started.

    Attributes:
        model (`str`), tp_size, tp_rank (`int`): which slab.
        outcome (`str`): ``loaded`` or ``failed``.
        code (`str`): the error's code when failed, else empty.
        count (`int`): how many.
    """

    model: str
    tp_size: int
    tp_rank: int
    outcome: str
    code: str
    count: int


@dataclass(frozen=True, slots=True)
class SlabCounters(_Record):
    """Counters of one (model, layout, rank) since the service started.

    Attributes:
        model (`str`), tp_size, tp_rank (`int`): which slab.
        last_load_s (`float`): duration of its last successful load, seconds (0: none since start).
        last_load_bytes (`int`): payload bytes that load wrote (0: none since start).
        verify_runs (`int`): ``verify`` requests that recomputed its digests.
        verify_failures (`int`): those that found a tensor whose digest differs.
    """

    model: str
    tp_size: int
    tp_rank: int
    last_load_s: float = 0.0
    last_load_bytes: int = 0
    verify_runs: int = 0
    verify_failures: int = 0


@dataclass(frozen=True, slots=True)
class ServiceCounters(_Record):
    """The ``metrics`` reply's counters: one service (one GPU) since it started.

    Attributes:
        version (`str`): weightcache's version.
        started_at (`float`): when the service started, Unix time in seconds.
        attaches (`tuple[AttachCount]`), attach_times (`tuple[AttachTimes]`),
        loads (`tuple[LoadCount]`), slabs (`tuple[SlabCounters]`): see there.
    """

    version: str
    started_at: float
    attaches: tuple[AttachCount, ...] = ()
    attach_times: tuple[AttachTimes, ...] = ()
    loads: tuple[LoadCount, ...] = ()
    slabs: tuple[SlabCounters, ...] = ()

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ServiceCounters":
        """Raises RemoteProtocolError (`protocol_violation`) when a field is missing."""
        nested = {"attaches": AttachCount, "attach_times": AttachTimes, "loads": LoadCount, "slabs": SlabCounters}
        if not isinstance(d, dict):
            raise RemoteProtocolError(f"ServiceCounters: expected a JSON object, got {type(d).__name__}")
        return _from_json(cls, {k: v for k, v in d.items() if k not in nested},
                          **{k: tuple(rec.from_json(x) for x in d.get(k, ())) for k, rec in nested.items()})


REQUESTS = (Hello, List, Status, Attach, Release, Verify, Evict, Preload, Reload)
REPLIES = (HelloReply, ListReply, StatusReply, AttachReply, Loading, ReleaseReply, VerifyReply, EvictReply,
           PreloadReply, ReloadReply, Error)
REQUESTS += (Metrics,)
REPLIES += (MetricsReply,)

# --- connection state machine -----------------------------------------------

CLIENT, SERVER = "client", "server"
START, READY, CLOSED = "start", "ready", "closed"

#: (our role, state, direction, message type) -> next state. Direction "in" is
#: a message received, "out" one sent. Anything absent is a protocol violation.
TRANSITIONS: dict[tuple[str, str, str, str], str] = {}
for _role, _dir in ((SERVER, "in"), (CLIENT, "out")):
    TRANSITIONS[(_role, START, _dir, "hello")] = READY  # hello first, exactly once
    for _req in REQUESTS[1:]:
        TRANSITIONS[(_role, READY, _dir, _req.tag())] = READY
for _role, _dir in ((SERVER, "out"), (CLIENT, "in")):
    TRANSITIONS[(_role, START, _dir, "error")] = START  # e.g. a rejected hello
    for _rep in REPLIES:
        TRANSITIONS[(_role, READY, _dir, _rep.tag())] = READY


def encode(msg: Message) -> bytes:
    """Serialises one message into a frame (length prefix + JSON).

    Raises:
        LocalProtocolError (`local_protocol_violation`): the frame exceeds
            :data:`MAX_FRAME_BYTES`.
    """
    body = json.dumps(msg.to_json(), allow_nan=False, separators=(",", ":"), ensure_ascii=False).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise LocalProtocolError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit",
                                 size_bytes=len(body))
    return _LEN.pack(len(body)) + body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode(body: bytes) -> tuple[Message, int]:
    """Parses one frame body into ``(message, fd_count)``.

    Raises:
        RemoteProtocolError (`protocol_violation`): invalid UTF-8/JSON (a NUL
            byte included), not an object, unknown ``type``, unknown or
            mistyped fields.
    """
    try:
        obj = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
        # Lone surrogates ("\ud800") parse but cannot be encoded again (e.g. echoed in an error).
        # Valid UTF-8 cannot hold a surrogate, so one can only come from a \uD800-\uDFFF
        # escape; re-encode (as costly as the parse) only when the body has one.
        if _SURROGATE_ESCAPE.search(body):
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except (UnicodeError, ValueError) as e:
        raise RemoteProtocolError(f"frame is not valid UTF-8 JSON: {e}") from None
    except RecursionError:
        raise RemoteProtocolError("frame is not valid UTF-8 JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise RemoteProtocolError(f"frame must be a JSON object, got {type(obj).__name__}")
    tag = obj.pop("type", None)
    fd_count = obj.pop("fd_count", 0)
    if not isinstance(fd_count, int) or isinstance(fd_count, bool) or not 0 <= fd_count <= MAX_FDS_PER_FRAME:
        raise RemoteProtocolError(f"fd_count must be an integer 0..{MAX_FDS_PER_FRAME}, got {fd_count!r}")
    cls = Message.TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {tag!r}", type=str(tag)[:64])
    specs = _specs(cls)
    names = {name for name, _, _ in specs}
    unknown = set(obj) - names
    if unknown:
        raise RemoteProtocolError(f"message {tag!r} has unknown field {sorted(unknown)[0]!r}", field=sorted(unknown)[0])
    if fd_count != cls.FD_COUNT:
        raise RemoteProtocolError(f"message {tag!r} must carry {cls.FD_COUNT} fds, frame declares {fd_count}")
    for spec in specs:
        if spec[0] in obj:
            _check_field(tag, spec, obj[spec[0]], RemoteProtocolError)
    try:
        return cls(**obj), fd_count
    except TypeError as e:
        raise RemoteProtocolError(f"message {tag!r} is missing a field: {e}") from None


class Connection:
    """One side of a connection: framing, fd matching and the state machine.

    Args:
        role (`str`): :data:`CLIENT` or :data:`SERVER`.
        max_frame_bytes (`int`, *optional*): largest frame accepted from the
            peer (the service reads requests with a far smaller cap than
            :data:`MAX_FRAME_BYTES`).

    Any protocol error moves the connection to :data:`CLOSED`; the caller then
    sends the error (if it can), closes every fd from :meth:`take_all_fds`,
    and closes the socket.

    Example:
        >>> srv = Connection(SERVER)
        >>> data, fds = Connection(CLIENT).send(Hello(PROTOCOL_VERSION))
        >>> srv.receive(data)
        >>> srv.next_message()
        (Hello(protocol_version=3, client=''), [])
    """

    def __init__(self, role: str, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.role = role
        self.max_frame_bytes = max_frame_bytes
        self.state = START
        self._buf = bytearray()
        self._fds: list[int] = []

    def receive(self, data: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
        """Buffers bytes and fds just read from the socket. ``b""`` means EOF."""
        if not data and not fds:
            self.state = CLOSED
            return
        self._buf += data
        self._fds.extend(fds)

    @property
    def buffered_bytes(self) -> int:
        """Bytes received but not yet returned as messages (an incomplete frame, or frames not yet taken)."""
        return len(self._buf)

    def take_all_fds(self) -> list[int]:
        """Hands back every fd received but not yet matched to a frame."""
        fds, self._fds = self._fds, []
        return fds

    def bytes_wanted(self, default: int) -> int:
        """How many more bytes complete the next frame (``default`` while its length is unknown).

        A hint for sizing the next read: one ``recv`` of exactly the rest of a
        large frame, instead of a huge buffer on every read.
        """
        if len(self._buf) < 4:
            return default
        (n,) = _LEN.unpack_from(self._buf)
        return max(1, min(4 + n - len(self._buf), self.max_frame_bytes))

    def _transition(self, direction: str, tag: str, exc: type) -> None:
        nxt = TRANSITIONS.get((self.role, self.state, direction, tag))
        if nxt is None:
            state = self.state
            self.state = CLOSED
            raise exc(f"message {tag!r} not allowed in state {state!r} ({self.role}, {direction})", type=tag)
        self.state = nxt

    def next_message(self) -> tuple[Message, list[int]] | _NeedData:
        """Returns ``(message, fds)`` for the next whole frame, or :data:`NEED_DATA`.

        Raises:
            RemoteProtocolError (`protocol_violation`): oversize frame, invalid
                frame, fewer fds than declared, or a message not allowed now.
        """
        if self.state == CLOSED and not self._buf:
            return NEED_DATA
        if len(self._buf) < 4:
            return NEED_DATA
        (n,) = _LEN.unpack_from(self._buf)
        if n > self.max_frame_bytes:
            self.state = CLOSED
            raise RemoteProtocolError(f"frame length {n} exceeds the {self.max_frame_bytes}-byte limit",
                                      size_bytes=n)
        if len(self._buf) < 4 + n:
            return NEED_DATA
        body = bytes(self._buf[4 : 4 + n])
        del self._buf[: 4 + n]
        try:
            msg, fd_count = decode(body)
        except RemoteProtocolError:
            self.state = CLOSED
            raise
        if fd_count > len(self._fds):
            self.state = CLOSED
            raise RemoteProtocolError(f"frame {msg.tag()!r} declares {fd_count} fds, {len(self._fds)} arrived")
        fds, self._fds = self._fds[:fd_count], self._fds[fd_count:]
        if self._fds and not self._buf:
            # fds arrived that no frame declared
            self.state = CLOSED
            self._fds = fds + self._fds
            raise RemoteProtocolError(f"{len(self._fds) - len(fds)} unexpected fds arrived with frame {msg.tag()!r}")
        try:
            self._transition("in", msg.tag(), RemoteProtocolError)
        except RemoteProtocolError:
            self._fds = fds + self._fds
            raise
        return msg, fds

    def send(self, msg: Message, fds: list[int] | tuple[int, ...] = ()) -> tuple[bytes, list[int]]:
        """Returns ``(frame bytes, fds)`` to write for ``msg``.

        Raises:
            LocalProtocolError (`local_protocol_violation`): wrong number of fds,
                or a message not allowed in the current state.
        """
        if len(fds) != msg.FD_COUNT:
            raise LocalProtocolError(f"message {msg.tag()!r} carries {msg.FD_COUNT} fds, {len(fds)} given")
        self._transition("out", msg.tag(), LocalProtocolError)
        return encode(msg), list(fds)
