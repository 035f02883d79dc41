"""The typed records inside the ``status``, ``list``, ``verify`` and ``metrics`` replies.

The replies carry these as plain JSON objects (the wire is unchanged since
protocol 3); the service builds them, clients read them through
``from_json``, so the schema lives here and nowhere else. Records are frozen
and validate what they can when built: a slab's ``state`` is parsed into a
:class:`~weightcache.wire.SlotState`, a lease's ``mode`` into an
:class:`~weightcache.wire.AttachMode` (a string the enum does not hold raises
:class:`~weightcache.errors.LocalProtocolError` when built here,
:class:`~weightcache.errors.RemoteProtocolError` when decoded from a reply).
Keys a record does not know are ignored (a newer service may add fields).

Forbidden imports: socket, selectors, asyncio, torch, weightcache.memory, weightcache.client,
weightcache.daemon.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..errors import LocalProtocolError, RemoteProtocolError
from ..wire import AttachMode, SlotState


def _from_json(cls: type, d: dict[str, Any], **nested: Any) -> Any:
    """Builds record ``cls`` from the JSON object ``d``; keys ``cls`` does not know are ignored (newer services)."""
    if not isinstance(d, dict):
        raise RemoteProtocolError(f"{cls.__name__}: expected a JSON object, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in d.items() if k in names}, **nested)
    except TypeError as e:
        raise RemoteProtocolError(f"{cls.__name__}: {e}") from None
    except LocalProtocolError as e:  # a value the record refuses, sent by the peer
        raise RemoteProtocolError(e.message, **e.details) from None


def _parse(record: Any, name: str, enum: type) -> None:
    """Replaces field ``name`` of frozen ``record`` by its member of ``enum`` (a StrEnum).

    Raises:
        LocalProtocolError (`local_protocol_violation`): the value is not one of the enum's.
    """
    value = getattr(record, name)
    if isinstance(value, enum):
        return
    try:
        member = enum(value)
    except ValueError:
        raise LocalProtocolError(f"{type(record).__name__}: {name} {value!r} is not one of "
                                 f"{', '.join(m.value for m in enum)}", field=name) from None
    object.__setattr__(record, name, member)


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
        """``<model> tp=<tp_size> rank=<tp_rank>``, as the CLI prints it (a publication adds ``published:<8 hex
        digits of its engine key>``)."""
        pub = getattr(self, "publication", None)
        return (f"{self.model} tp={self.tp_size} rank={self.tp_rank}"
                + (f" published:{str(pub.get('engine_key_blake2b', ''))[:8]}" if pub else ""))


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
        mode (`AttachMode`): ``zero_copy`` or ``copy`` (a string is parsed into the member).
    """

    lease_id: int
    pid: int
    uid: int
    gid: int
    since: float
    mode: AttachMode

    def __post_init__(self) -> None:
        _parse(self, "mode", AttachMode)


#: Most leases a :class:`SlabInfo` lists one by one (the oldest); ``lease_count`` and ``lease_holders`` count all.
MAX_LEASES_SHOWN = 32
#: Most holders a :class:`SlabInfo` lists in ``lease_holders`` (the largest counts first).
MAX_LEASE_HOLDERS_SHOWN = 32


@dataclass(frozen=True, slots=True)
class LeaseHolder(_Record):
    """How many leases of one slab one process holds (``status`` summarises leases this way).

    Attributes:
        uid, pid (`int`): the holder, from ``SO_PEERCRED``; :data:`HIDDEN_ID` for the
            holders the service hides from this caller (their leases summed in one entry).
        count (`int`): its leases on this slab.
    """

    uid: int
    pid: int
    count: int


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
        state (`SlotState`): ``pending``, ``loading``, ``ready``, ``failed``, ``evicted`` or
            ``retired`` (replaced or removed by a reload, kept while leased); a string is
            parsed into the member.
        done_bytes, total_bytes (`int`): load progress, payload bytes.
        rate_bytes_per_s (`int`): load rate while loading, else 0.
        resident_bytes (`int`): size of the resident slab mapping (0 when none).
        adopted (`bool`): the slab came back from systemd's fd store.
        dtype (`str`), naming (`str`): the configured dtype and naming.
        tensors (`int`): tensor records in the resident slab's manifest.
        error (`ErrorInfo | None`): why the last load failed.
        key (`KeySummary | None`): summary of the resident slab's cache key.
        leases (`tuple[LeaseInfo]`): the first :data:`MAX_LEASES_SHOWN` leases (oldest first).
        lease_count (`int`): every lease held on it (default: ``len(leases)``).
        lease_holders (`tuple[LeaseHolder]`): leases per (uid, pid), the
            :data:`MAX_LEASE_HOLDERS_SHOWN` largest; the reply's size does not grow
            with the number of leases.
        tier (`str`): ``gpu`` (on the GPU, or a load into it under way), ``host`` (in the host tier, promoted
            by the next attach) or ``disk`` (not resident; the next attach loads it).
        host_bytes (`int`): bytes of its host-tier copy (0 when none).
        pin (`bool`), priority (`int`): the model's ``pin`` and ``priority`` (the budget's order).
        demoting (`bool`): a demotion to the host tier is copying it; it serves from the GPU (``ready``)
            until the copy is sealed, and an attach meanwhile keeps it there (the demotion is abandoned).
            Absent from older services' replies (False); older clients ignore it.
        publication (`dict | None`): set for a slab an engine published (docs/protocol.md, "Publication"):
            ``engine``, ``engine_version``, ``engine_key_blake2b``, ``shared`` (every allowed engine attaches it)
            and ``publisher_uid``; absent (None) for a slab the service loaded itself.
        source (`str`): where the resident bytes came from: ``checkpoint``, ``image`` (the image directory),
            ``fd_store``, ``published`` (``peer`` is reserved); "" before the slab was first ready. Absent from
            older services' replies ("").
        peer (`str`): ``host:port`` of the peer service the slab was fetched from (issue 37: its source is
            ``peer``); empty (absent on the wire) for a slab read from the checkpoint here.
    """

    model: str
    path: str
    tp_size: int
    tp_rank: int
    state: SlotState
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
    lease_count: int = -1
    lease_holders: tuple[LeaseHolder, ...] = ()
    tier: str = "gpu"
    host_bytes: int = 0
    pin: bool = False
    priority: int = 0
    demoting: bool = False
    publication: dict | None = None
    source: str = ""
    peer: str = ""

    def __post_init__(self) -> None:
        _parse(self, "state", SlotState)
        if self.lease_count < 0:  # not given: the leases listed are all there are
            object.__setattr__(self, "lease_count", len(self.leases))

    def to_json(self) -> dict[str, Any]:
        """The JSON object on the wire; ``error`` and ``key`` only when set."""
        d: dict[str, Any] = {f: getattr(self, f) for f in (
            "model", "path", "tp_size", "tp_rank", "done_bytes", "total_bytes", "rate_bytes_per_s",
            "resident_bytes", "adopted", "dtype", "naming", "tensors", "tier", "host_bytes", "pin", "priority",
            "demoting", "source")}
        d["state"] = self.state.value
        if self.error is not None:
            d["error"] = self.error.to_json()
        if self.key is not None:
            d["key"] = self.key.to_json()
        if self.publication is not None:
            d["publication"] = dict(self.publication)
        if self.peer:
            d["peer"] = self.peer
        d["leases"] = [le.to_json() for le in self.leases]
        d["lease_count"] = self.lease_count
        d["lease_holders"] = [h.to_json() for h in self.lease_holders]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SlabInfo":
        """Raises RemoteProtocolError (`protocol_violation`) when a field is missing."""
        err, key = d.get("error"), d.get("key")
        leases = tuple(LeaseInfo.from_json(le) for le in d.get("leases", ()))
        return _from_json(cls, {k: v for k, v in d.items()
                                if k not in ("error", "key", "leases", "lease_count", "lease_holders")},
                          error=ErrorInfo.from_json(err) if err is not None else None,
                          key=KeySummary.from_json(key) if key is not None else None, leases=leases,
                          lease_count=d.get("lease_count", -1),  # services before the summary listed every lease
                          lease_holders=tuple(LeaseHolder.from_json(h) for h in d.get("lease_holders", ())))


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
        held_elsewhere_bytes (`int`): bytes of slabs the service freed that engines still map, counted
            against the budget until they unmap them (host backend; issue 38, P2).
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
    held_elsewhere_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        """The JSON object on the wire (memory as ``{"free_bytes", "total_bytes", "budget_bytes", "gpu_bytes",
        "host_tier_bytes", "host_used_bytes"}``; ``config_error`` when set)."""
        d = {"gpu": self.gpu, "pid": self.pid, "backend": self.backend, "device": self.device.to_json(),
             "memory": {"free_bytes": self.free_bytes, "total_bytes": self.total_bytes,
                        "budget_bytes": self.budget_bytes, "gpu_bytes": self.gpu_bytes,
                        "host_tier_bytes": self.host_tier_bytes, "host_used_bytes": self.host_used_bytes,
                        "held_elsewhere_bytes": self.held_elsewhere_bytes},
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
                          held_elsewhere_bytes=mem.get("held_elsewhere_bytes", 0),
                          slabs=tuple(SlabInfo.from_json(s) for s in d.get("slabs", ())),
                          config_error=ErrorInfo.from_json(err) if err is not None else None)


@dataclass(frozen=True, slots=True)
class VerifyResult(_SlabRecord):
    """One slab in a ``verify`` reply.

    Attributes:
        model (`str`), tp_size, tp_rank (`int`): which slab.
        state (`SlotState`): its state; only ``ready`` slabs are verified (a string is parsed into the member).
        mismatched (`list[str]`): tensors whose content digest differs from the one recorded at load.
        tensors (`int`): tensors checked (0 when not ready).
    """

    model: str
    tp_size: int
    tp_rank: int
    state: SlotState
    mismatched: list
    tensors: int = 0

    def __post_init__(self) -> None:
        _parse(self, "state", SlotState)

    def to_json(self) -> dict[str, Any]:
        d = {"model": self.model, "tp_size": self.tp_size, "tp_rank": self.tp_rank, "state": self.state.value}
        if self.state is SlotState.READY:
            d["tensors"] = self.tensors
        d["mismatched"] = list(self.mismatched)
        return d



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
        source (`str`): ``checkpoint`` or ``image`` (where a loaded slab's bytes came from).
    """

    model: str
    tp_size: int
    tp_rank: int
    outcome: str
    code: str
    count: int
    #: Where a loaded slab's bytes came from (``checkpoint`` or ``image``); absent from older services' replies.
    source: str = "checkpoint"


@dataclass(frozen=True, slots=True)
class PublishCount(_Record):
    """Publications of one (model, layout, rank) answered one way since the service started.

    Attributes:
        model (`str`), tp_size, tp_rank (`int`): which rank (``model``: as in :class:`AttachCount`).
        outcome (`str`): ``published`` (a new slab), ``held`` (an identical publication was already held) or
            ``refused`` (an ``error`` reply).
        code (`str`): the error's code when refused, else empty.
        count (`int`): how many.
    """

    model: str
    tp_size: int
    tp_rank: int
    outcome: str
    code: str
    count: int


@dataclass(frozen=True, slots=True)
class PublicationDropCount(_Record):
    """Publications of one (model, layout, rank) that left the service for one reason since it started.

    Attributes:
        model (`str`), tp_size, tp_rank (`int`): which rank (``model``: as in :class:`AttachCount`).
        reason (`str`): ``budget`` (the memory budget dropped it), ``evict`` (``evict --to disk``), or the cause of
            the failed promotion from the host tier or load from its image (``digest_mismatch``, ...).
        count (`int`): how many.
    """

    model: str
    tp_size: int
    tp_rank: int
    reason: str
    count: int


@dataclass(frozen=True, slots=True)
class SeedCount(_Record):
    """Peer seeding (issue 37) of one model since the service started, one outcome.

    Attributes:
        role (`str`): ``received`` (this service asked peers) or ``served`` (peers asked it).
        model (`str`): the model (``(other)``: a peer asked for a model this service does not have).
        outcome (`str`): received: ``seeded`` or ``fallback`` (one per peer that did not seed); served:
            ``served``, ``refused`` (by this source), ``refused_by_peer`` (the receiver did not keep it).
        reason (`str`): why, when not ``seeded``/``served`` (docs/operations.md lists the reasons).
        count (`int`): how many; bytes (`int`): bytes moved; seconds (`float`): seconds of the READs
            (``received``/``seeded`` only).
    """

    role: str
    model: str
    outcome: str
    reason: str
    count: int
    bytes: int = 0
    seconds: float = 0.0


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
        loads (`tuple[LoadCount]`), slabs (`tuple[SlabCounters]`), publishes (`tuple[PublishCount]`),
        seeds (`tuple[SeedCount]`), publications_dropped (`tuple[PublicationDropCount]`): see there
            (``publishes``, ``seeds``, ``publications_dropped`` absent from older services' replies).
        notify_dropped (`dict[str, int]`): sd_notify datagrams dropped because the manager's socket was full, by
            their first key (``STATUS``, ``FDSTORE``...; :data:`weightcache.notify.dropped`); absent from older
            services' replies.
    """

    version: str
    started_at: float
    attaches: tuple[AttachCount, ...] = ()
    attach_times: tuple[AttachTimes, ...] = ()
    loads: tuple[LoadCount, ...] = ()
    slabs: tuple[SlabCounters, ...] = ()
    publishes: tuple[PublishCount, ...] = ()
    #: The image store's counters (:meth:`weightcache.images.ImageStats.snapshot`); absent from older services.
    images: dict = field(default_factory=dict)
    notify_dropped: dict = field(default_factory=dict)
    seeds: tuple[SeedCount, ...] = ()
    publications_dropped: tuple[PublicationDropCount, ...] = ()

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ServiceCounters":
        """Raises RemoteProtocolError (`protocol_violation`) when a field is missing."""
        nested = {"attaches": AttachCount, "attach_times": AttachTimes, "loads": LoadCount, "slabs": SlabCounters,
                  "publishes": PublishCount, "seeds": SeedCount, "publications_dropped": PublicationDropCount}
        if not isinstance(d, dict):
            raise RemoteProtocolError(f"ServiceCounters: expected a JSON object, got {type(d).__name__}")
        return _from_json(cls, {k: v for k, v in d.items() if k not in nested},
                          **{k: tuple(rec.from_json(x) for x in d.get(k, ())) for k, rec in nested.items()})
