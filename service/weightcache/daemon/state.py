"""The service's state: slots, their transition table, leases and peers. No I/O.

Owns:

- :class:`SlotEvent` and :data:`TRANSITIONS`, the
  literal table of every allowed move (as h11's ``_state.py`` and Dynamo GMS's
  ``fsm.py``). :meth:`Slot.move` is the only code that changes a slot's state;
  a move the table does not hold raises :class:`IllegalTransition` (a broken
  invariant of the service itself: the serving loop logs CRITICAL and exits).
  The states are :class:`~weightcache.wire.SlotState` (one definition for the
  service, the protocol's records, the CLI and the metrics).
- :class:`Slot` (one (model, layout, rank) on this GPU and its slab),
  :class:`Lease`, :class:`Peer` (one connection's identity, leases and parked
  attaches, without its socket) and :class:`ServiceState` (all of them, the
  lease counter and the count of every transition taken, for metrics).

Only the serving loop's thread touches these objects; the loader thread posts
results (:mod:`weightcache.daemon.loads`) instead of writing here.

Forbidden imports: socket, selectors, threading, torch, weightcache.memory,
weightcache.pipeline, weightcache.notify, weightcache.daemon.transport,
weightcache.daemon.handlers, weightcache.daemon.loads, weightcache.daemon.fdstore,
weightcache.daemon.ticker, weightcache.daemon.loop.
"""

from __future__ import annotations

import collections
import enum
import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .. import protocol
from ..config import Placement
from ..errors import ENGINE_LAYOUT_CODES, ConfigError, ModelNotFound, RemoteProtocolError, WeightcacheError
from ..hashes import blake2b_hex
from ..manifest import Manifest
from ..wire import UNSETTLED, AttachMode, SlotState
from .limits import MAX_MODEL_BYTES


class SlotEvent(enum.Enum):
    """What can happen to a slot."""

    START = "start"          # the loader took it
    LOADED = "loaded"        # the loader sealed its slab
    FAIL = "fail"            # the load failed (error, timeout, out of memory, crash)
    ADOPT = "adopt"          # a matching slab came back from systemd's fd store
    EVICT = "evict"          # ``evict`` freed the slab
    REQUEUE = "requeue"      # ``preload`` after a failure or an eviction
    RETIRE = "retire"        # a reload removed or changed it while leases hold its slab
    DROP = "drop"            # a reload removed or changed it (no lease), or its last lease ended while retired
    DEMOTE = "demote"        # the budget (or ``evict --to host``) moved the slab to the host tier
    SHELVE = "shelve"        # the budget (or ``evict --to disk``) dropped the slab: it waits on disk
    STASH = "stash"          # the load went to (or, refused room, stayed in) the host tier
    PUBLISH = "publish"      # an engine published the slab: the service sealed and owns it
    AWAIT_ENGINE = "await_engine"  # ``naming = "vllm"`` the service cannot lay out: its engine publishes it


@dataclass(frozen=True, slots=True)
class Transition:
    """One allowed move: ``source`` --``event``--> ``target``."""

    source: SlotState
    event: SlotEvent
    target: SlotState


S, E = SlotState, SlotEvent

#: Every allowed move; anything absent raises :class:`IllegalTransition`.
TRANSITIONS: tuple[Transition, ...] = (
    Transition(S.PENDING, E.START, S.LOADING),
    Transition(S.PENDING, E.ADOPT, S.READY),
    Transition(S.PENDING, E.PUBLISH, S.READY),     # a publication (daemon.publish): no load runs
    Transition(S.LOADING, E.LOADED, S.READY),
    Transition(S.LOADING, E.FAIL, S.FAILED),
    Transition(S.READY, E.EVICT, S.EVICTED),
    Transition(S.FAILED, E.REQUEUE, S.PENDING),
    Transition(S.EVICTED, E.REQUEUE, S.PENDING),
    # reload (weightcache.daemon.reload): a slot the new config no longer holds as it is
    Transition(S.PENDING, E.DROP, S.DROPPED),
    Transition(S.LOADING, E.DROP, S.DROPPED),
    Transition(S.READY, E.DROP, S.DROPPED),
    Transition(S.FAILED, E.DROP, S.DROPPED),
    Transition(S.EVICTED, E.DROP, S.DROPPED),
    Transition(S.READY, E.RETIRE, S.RETIRED),
    Transition(S.RETIRED, E.DROP, S.DROPPED),
    # tiers (weightcache.daemon.tiers): the memory budget, demand loads, ``evict --to``
    Transition(S.READY, E.DEMOTE, S.HOSTED),
    Transition(S.READY, E.SHELVE, S.ON_DISK),
    Transition(S.HOSTED, E.SHELVE, S.ON_DISK),
    Transition(S.PENDING, E.SHELVE, S.ON_DISK),    # preload = "disk" at start
    Transition(S.LOADING, E.SHELVE, S.ON_DISK),    # no room for it: it waits on disk
    Transition(S.PENDING, E.STASH, S.HOSTED),      # adopted into the host tier from the fd store
    Transition(S.LOADING, E.STASH, S.HOSTED),      # loaded into the host tier, or a promotion refused room
    Transition(S.HOSTED, E.REQUEUE, S.PENDING),    # an attach or ``preload`` promotes it
    Transition(S.ON_DISK, E.REQUEUE, S.PENDING),   # an attach or ``preload`` loads it
    Transition(S.HOSTED, E.EVICT, S.EVICTED),
    Transition(S.ON_DISK, E.EVICT, S.EVICTED),
    Transition(S.HOSTED, E.DROP, S.DROPPED),
    Transition(S.ON_DISK, E.DROP, S.DROPPED),
    # issue 35: a model the service cannot lay out waits for its engine's publication (daemon.publish)
    Transition(S.LOADING, E.AWAIT_ENGINE, S.WAITING_FOR_ENGINE),
    Transition(S.WAITING_FOR_ENGINE, E.REQUEUE, S.PENDING),   # ``preload``: the service tries again
    Transition(S.WAITING_FOR_ENGINE, E.DROP, S.DROPPED),
)

_TABLE: dict[tuple[SlotState, SlotEvent], SlotState] = {(t.source, t.event): t.target for t in TRANSITIONS}

#: Where a slot's resident bytes came from (``Slot.source``, ``status``'s ``source``, the load metrics' label):
#: the pipeline from the checkpoint, an image (weightcache.images), systemd's fd store, an engine's
#: publication; ``peer`` is kept for seeding from another node.
SOURCES = ("checkpoint", "image", "fd_store", "published", "peer")

#: States in which an attach loads or promotes the slab on demand.
ON_DEMAND = frozenset({S.HOSTED, S.ON_DISK})

del S, E




def waits_for_engine(slot: Slot, error: WeightcacheError) -> bool:
    """Whether ``slot``'s load failing with ``error`` makes it WAITING_FOR_ENGINE rather than FAILED: a configured
    (not published) slot with ``naming = "vllm"`` whose error is one of :data:`ENGINE_LAYOUT_CODES`."""
    return (slot.publication is None and slot.placement.model.naming == "vllm"
            and error.code in ENGINE_LAYOUT_CODES)


class IllegalTransition(Exception):
    """The transition table refused a move: the service's own bookkeeping is broken.

    Not a :class:`~weightcache.errors.WeightcacheError` (no client caused it):
    the serving loop logs CRITICAL and exits non-zero; systemd restarts the
    service and the fd store keeps the resident slabs.
    """

    def __init__(self, label: str, source: SlotState, event: SlotEvent) -> None:
        super().__init__(f"slot {label}: event {event.value!r} is not allowed in state {source.value!r} "
                         f"(allowed there: {[t.event.value for t in TRANSITIONS if t.source is source]})")
        self.label, self.source, self.event = label, source, event


@dataclass(eq=False)
class Lease:
    """One attach held by one connection: ends with ``release`` or the connection.

    ``pid``/``uid``/``gid`` come from ``SO_PEERCRED``; ``since`` is a Unix time
    in seconds; ``mode`` is ``zero_copy`` or ``copy``.
    """

    lease_id: int
    slot: "Slot"
    pid: int
    uid: int
    gid: int
    since: float
    mode: AttachMode

    def info(self) -> protocol.LeaseInfo:
        """The lease as the ``status`` reply carries it."""
        return protocol.LeaseInfo(self.lease_id, self.pid, self.uid, self.gid, self.since, self.mode)


@dataclass(frozen=True, slots=True)
class Publication:
    """What makes a slot a publication (DESIGN §6.4): an engine processed the weights and handed them over.

    Attributes:
        engine_key (`dict`): the engine's key fields (:func:`weightcache.identity.engine_key`).
        engine_key_blake2b (`str`): their hash (:func:`weightcache.identity.engine_key_blake2b`).
        publisher_uid (`int`): ``SO_PEERCRED`` uid of the publisher.
        shared (`bool`): made by a trusted publisher (root, the service user, the model's ``publishers``):
            every engine on the model's allow lists attaches it; False: only ``publisher_uid``'s engines do.
    """

    engine_key: dict
    engine_key_blake2b: str
    publisher_uid: int
    shared: bool

    def visible_to(self, uid: int) -> bool:
        """Whether an engine of ``uid`` may attach it (an operator sees it in ``status`` regardless)."""
        return self.shared or uid == self.publisher_uid

    def to_json(self) -> dict[str, Any]:
        """As the manifest file records it (``publication``), for the fd store's adoption."""
        return {"engine_key": self.engine_key, "engine_key_blake2b": self.engine_key_blake2b,
                "publisher_uid": self.publisher_uid, "shared": self.shared}

    @classmethod
    def from_json(cls, d: Any) -> "Publication":
        """Reverses :meth:`to_json`.

        Raises:
            ValueError: a field is missing or of the wrong type.
        """
        try:
            out = cls(dict(d["engine_key"]), str(d["engine_key_blake2b"]), int(d["publisher_uid"]), bool(d["shared"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"stored publication is damaged: {e!r}") from None
        return out


@dataclass(eq=False)
class Slot:
    """One (model, layout, rank) on this GPU and its slab.

    ``state`` changes only through :meth:`move` (see :data:`TRANSITIONS`).
    ``done_bytes``/``total_bytes`` are the load's progress in payload bytes;
    ``started_at`` is ``time.monotonic()`` seconds.
    """

    placement: Placement
    state: SlotState = SlotState.PENDING
    done_bytes: int = 0
    total_bytes: int = 0
    error: WeightcacheError | None = None
    manifest: Manifest | None = None
    #: The manifest file sent beside the slab on every attach and kept in the fd store
    #: (a ``memory.host.SealedFile``: ``fd``, ``size_bytes``) while READY.
    manifest_file: Any = None
    #: The backend's SealedSlab (fd, size_bytes, tensor) while READY.
    sealed: Any = None
    adopted: bool = False
    #: While ``adopted`` and READY: engines that attached before the restart may still map it, and this process
    #: cannot know (``tiers.unknown_leases``: the budget counts it as leased). False for a slab that had no lease
    #: when the previous process stopped cleanly (``fdstore.released_at_last_stop``).
    leases_unknown: bool = True
    #: The checkpoint path's resolution made where the config was read (Config.realpaths; "" when none):
    #: attach by path matches it, and the loader checks the checkpoint still resolves to it.
    realpath: str = ""
    #: Dtype name an attach asks for -> whether this slab serves it (the configured one and those giving
    #: the same bytes): every name from the loader's plan; before a plan, the answers the serving loop
    #: worked out once (each read the checkpoint's headers).
    dtype_served: dict[str, bool] = field(default_factory=dict)
    started_at: float = 0.0
    #: The checkpoint identity (the cache key's ``checkpoint``, :meth:`Checkpoint.identity`) the last load
    #: planned from, set when its plan is made (``Planned``): what a reload checks the files against while that
    #: load runs, before the slab has a manifest (the load reads the files it opened, even if replaced since).
    planned_checkpoint: dict | None = None
    #: Bytes of the slab its first plan worked out (``Planned``); a later load planning more is refused until a
    #: reload (the operator) takes the new size: a checkpoint's writer cannot grow it (issue 38, P6). 0: none yet.
    first_slab_bytes: int = 0
    #: A plan without a load was queued to size it (``tiers.unsized_restricted``, ``Loader.probe``): not again.
    size_probed: bool = False
    leases: dict[int, Lease] = field(default_factory=dict)
    #: The host tier's copy (a host SealedSlab: ``fd``, ``size_bytes``) while HOSTED, and while a promotion
    #: from it is PENDING or LOADING; ``manifest``/``manifest_file`` stay with it. While READY, a copy kept
    #: after a promotion on the ``cuda`` backend (the slab is immutable, so the next demotion copies nothing);
    #: the host tier drops such copies first.
    hosted: Any = None
    #: The GPU slab a demotion copies to the host tier off the serving loop (the slot stays READY and
    #: attachable meanwhile; the serving loop moves it to HOSTED once the copy is sealed, unless a lease came);
    #: None otherwise. The budget never picks such a slot again, and its copy counts in the host tier.
    demoting: Any = None
    #: Bytes of the budget granted to the load or promotion under way (LOADING); 0 otherwise.
    reserved_bytes: int = 0
    #: ``time.monotonic()`` s of the last attach, release or load: the budget's LRU order.
    last_used: float = 0.0
    #: Why the last demand load or promotion got no room (``insufficient_memory``); cleared by the next one.
    refusal: WeightcacheError | None = None
    #: The queued load was asked for (an attach, ``preload``): the budget may demote others to make room.
    demand: bool = False
    #: Who asked for it (the :class:`Peer` of the attach or ``preload`` that started it): the budget displaces
    #: only slabs that peer may attach (docs/design.md, "Memory budget: who may displace whom"). None: nobody.
    demand_by: Any = None
    #: Where the queued load goes: ``gpu``, or ``host`` (``preload = "host"`` at start).
    target: str = "gpu"
    #: Counts of (source, event, target) moves, shared with the ServiceState (for metrics).
    counts: collections.Counter = field(default_factory=collections.Counter, repr=False)
    #: Set when an engine published the slab (:mod:`weightcache.daemon.publish`); None for a slab the service
    #: lays out itself.
    publication: Publication | None = None
    #: Where the resident bytes came from (:data:`SOURCES`): set when the slab became ready; "" before.
    source: str = ""
    #: ``host:port`` of the peer service this slab was fetched from (issue 37, weightcache.seeding); "": read
    #: from the checkpoint (or adopted, or published).
    seeded_from: str = ""

    @property
    def store_id(self) -> str:
        """The slot's name in systemd's fd store (``slab-<id>``, ``manifest-<id>``): 16 hex digits."""
        p = self.placement
        raw = f"{p.model.name}\0{p.tp_size}\0{p.tp_rank}\0{p.gpu}"
        if self.publication is not None:
            pub = self.publication
            raw += f"\0{pub.engine_key_blake2b}\0{'shared' if pub.shared else pub.publisher_uid}"
        return blake2b_hex(raw.encode(), digest_size=8)

    @property
    def label(self) -> str:
        """``model/tpN/rankR``; a publication's adds ``+pub:<8 hex digits of its engine key>`` (and ``:uidN`` when
        only that uid's engines attach it)."""
        pub = self.publication
        if pub is None:
            return self.placement.label
        return f"{self.placement.label}+pub:{pub.engine_key_blake2b[:8]}{'' if pub.shared else f':uid{pub.publisher_uid}'}"

    def move(self, event: SlotEvent) -> SlotState:
        """Applies ``event`` through :data:`TRANSITIONS`; returns the new state.

        Raises:
            IllegalTransition: the table holds no move for (state, event).
        """
        target = _TABLE.get((self.state, event))
        if target is None:
            raise IllegalTransition(self.label, self.state, event)
        self.counts[(self.state, event, target)] += 1
        self.state = target
        return target

    def start(self, now: float) -> None:
        """PENDING -> LOADING: the loader took the slot at ``now`` (monotonic s).

        ``total_bytes`` keeps the previous load's size (a reload after evict or
        failure) until the new plan replaces it.
        """
        self.move(SlotEvent.START)
        self.error, self.done_bytes, self.started_at = None, 0, now

    def loaded(self, manifest: Manifest, sealed: Any, manifest_file: Any) -> None:
        """LOADING -> READY with the sealed slab, its manifest and its manifest file."""
        self.move(SlotEvent.LOADED)
        self.manifest, self.sealed, self.manifest_file = manifest, sealed, manifest_file
        self.done_bytes = self.total_bytes
        self.reserved_bytes = 0

    def publish(self, manifest: Manifest, sealed: Any, manifest_file: Any) -> None:
        """PENDING -> READY with a published slab the service sealed, its manifest and its manifest file."""
        self.move(SlotEvent.PUBLISH)
        self.manifest, self.sealed, self.manifest_file = manifest, sealed, manifest_file
        self.source = "published"
        self.reserved_bytes = 0
        self.total_bytes = self.done_bytes = sum(t.size_bytes for t in manifest.tensors if t.alias_of is None)

    def fail(self, error: WeightcacheError) -> None:
        """LOADING -> FAILED with the error clients will get."""
        self.move(SlotEvent.FAIL)
        self.error, self.reserved_bytes = error, 0

    def await_engine(self, error: WeightcacheError) -> None:
        """LOADING -> WAITING_FOR_ENGINE: the service cannot lay the model out (``error`` says why: an architecture
        without vLLM naming rules, a scheme it cannot pre-process); the first engine that starts it publishes it."""
        self.move(SlotEvent.AWAIT_ENGINE)
        self.error, self.reserved_bytes = error, 0

    def adopt(self, manifest: Manifest, sealed: Any, manifest_file: Any) -> None:
        """PENDING -> READY with a slab and its manifest file handed back by systemd's fd store."""
        self.move(SlotEvent.ADOPT)
        self.manifest, self.sealed, self.manifest_file, self.adopted = manifest, sealed, manifest_file, True
        self.source = "fd_store"
        self.total_bytes = self.done_bytes = sum(t.size_bytes for t in manifest.tensors if t.alias_of is None)

    def drop_host_copy(self) -> None:
        """Closes the host-tier copy a READY (or RETIRED) slot kept after its promotion, if any."""
        if self.sealed is not None and self.hosted is not None:
            self.hosted.close()
            self.hosted = None

    def evict(self) -> tuple[Any, Any]:
        """READY | HOSTED | ON_DISK -> EVICTED; returns (SealedSlab or host copy, manifest file) for the caller
        to close (leases stay until released)."""
        self.drop_host_copy()
        self.move(SlotEvent.EVICT)
        out = (self.sealed if self.sealed is not None else self.hosted, self.manifest_file)
        self.sealed, self.hosted, self.manifest, self.manifest_file, self.adopted = None, None, None, None, False
        return out

    def requeue(self) -> None:
        """FAILED | EVICTED | WAITING_FOR_ENGINE -> PENDING (``preload``)."""
        self.move(SlotEvent.REQUEUE)
        self.error = None

    def retire(self) -> None:
        """READY -> RETIRED: replaced or removed by a reload while leased; the slab stays until the last release."""
        self.move(SlotEvent.RETIRE)
        self.drop_host_copy()

    def drop(self) -> tuple[Any, Any]:
        """-> DROPPED (see :data:`TRANSITIONS`); returns (SealedSlab, manifest file), None when absent, to close."""
        promoting = self.state in (SlotState.PENDING, SlotState.LOADING) and self.hosted is not None
        self.drop_host_copy()
        self.move(SlotEvent.DROP)
        self.reserved_bytes = 0
        if promoting:  # the loader may read the host copy: its discarded result closes it (loads.discard)
            return None, None
        out = (self.sealed if self.sealed is not None else self.hosted, self.manifest_file)
        self.sealed, self.hosted, self.manifest, self.manifest_file, self.adopted = None, None, None, None, False
        return out

    @property
    def tier(self) -> str:
        """``gpu`` (slab on the GPU, or a load into it granted room), ``host`` (the host tier holds it) or
        ``disk`` (not resident)."""
        if self.state in (SlotState.READY, SlotState.RETIRED) or self.reserved_bytes:
            return "gpu"
        return "host" if self.hosted is not None else "disk"

    @property
    def gpu_bytes(self) -> int:
        """Bytes of the memory budget this slot takes: its slab while READY or RETIRED, its grant while LOADING."""
        if self.state in (SlotState.READY, SlotState.RETIRED) and self.sealed is not None:
            return self.sealed.size_bytes
        return self.reserved_bytes

    def demote(self, hosted: Any) -> Any:
        """READY -> HOSTED with ``hosted``, the host tier's copy; returns the GPU SealedSlab for the caller to
        close (the manifest and its file stay)."""
        self.move(SlotEvent.DEMOTE)
        out, self.sealed, self.hosted, self.adopted = self.sealed, None, hosted, False
        return out

    def shelve(self) -> tuple[Any, Any, Any]:
        """READY | HOSTED | PENDING | LOADING -> ON_DISK; returns (SealedSlab, host copy, manifest file), None
        when absent, for the caller to close."""
        self.move(SlotEvent.SHELVE)
        out = (self.sealed, self.hosted, self.manifest_file)
        self.sealed, self.hosted, self.manifest, self.manifest_file, self.adopted = None, None, None, None, False
        self.reserved_bytes = 0
        return out

    def stash(self, manifest: Any, hosted: Any, manifest_file: Any) -> None:
        """PENDING | LOADING -> HOSTED with a host-tier slab and its manifest (a load into the host tier, an
        adoption, a promotion that got no room)."""
        self.move(SlotEvent.STASH)
        self.manifest, self.hosted, self.manifest_file, self.reserved_bytes = manifest, hosted, manifest_file, 0
        if self.state is SlotState.HOSTED and not self.source:  # adopted into the host tier from the fd store
            self.source = "fd_store"
        self.total_bytes = self.done_bytes = sum(t.size_bytes for t in manifest.tensors if t.alias_of is None)

    def rate_bytes_per_s(self, now: float) -> float:
        """Load rate so far, bytes per second (0 unless LOADING)."""
        if self.state is not SlotState.LOADING or not self.started_at:
            return 0.0
        return self.done_bytes / max(1e-6, now - self.started_at)

    def info(self, now: float) -> protocol.SlabInfo:
        """The slot as ``status`` and ``list`` report it."""
        p, m = self.placement, self.manifest
        key = None
        if m is not None:
            k = m.key
            key = protocol.KeySummary(k.get("architecture"), k.get("quant_scheme"), k.get("pipeline_version"),
                                      len(k.get("checkpoint", {}).get("files", {})))
        return protocol.SlabInfo(
            model=p.model.name, path=p.model.path, tp_size=p.tp_size, tp_rank=p.tp_rank, state=self.state,
            done_bytes=self.done_bytes, total_bytes=self.total_bytes,
            rate_bytes_per_s=round(self.rate_bytes_per_s(now)),
            resident_bytes=self.sealed.size_bytes if self.sealed is not None else 0,
            tier=self.tier, host_bytes=self.hosted.size_bytes if self.hosted is not None else 0,
            pin=p.model.pin, priority=p.model.priority, demoting=self.demoting is not None,
            adopted=self.adopted, dtype=p.model.dtype, naming=p.model.naming, source=self.source,
            tensors=len(m.tensors) if m is not None else 0,
            error=(protocol.ErrorInfo(**(self.error or self.refusal).to_wire())
                   if (self.error or self.refusal) is not None else None),
            key=key, leases=tuple(lease.info() for lease in itertools.islice(self.leases.values(),
                                                                               protocol.MAX_LEASES_SHOWN)),
            lease_count=len(self.leases), lease_holders=lease_holders(self.leases.values()),
            publication=None if self.publication is None else {
                "engine": self.publication.engine_key.get("engine"),
                "engine_version": self.publication.engine_key.get("engine_version"),
                "engine_key_blake2b": self.publication.engine_key_blake2b, "shared": self.publication.shared,
                "publisher_uid": self.publication.publisher_uid},
            peer=self.seeded_from)


def lease_holders(leases: Any, hide: Callable[[int], bool] = lambda uid: False) -> tuple[protocol.LeaseHolder, ...]:
    """Leases counted per (uid, pid), the :data:`~weightcache.protocol.MAX_LEASE_HOLDERS_SHOWN` largest first.

    Holders for which ``hide(uid)`` is true are summed into one entry with
    :data:`~weightcache.protocol.HIDDEN_ID` as uid and pid. Linear in the leases.
    """
    counts: collections.Counter = collections.Counter()
    for x in leases:
        counts[(protocol.HIDDEN_ID, protocol.HIDDEN_ID) if hide(x.uid) else (x.uid, x.pid)] += 1
    return tuple(protocol.LeaseHolder(uid, pid, n)
                 for (uid, pid), n in counts.most_common(protocol.MAX_LEASE_HOLDERS_SHOWN))


@dataclass(eq=False)
class Peer:
    """One connection as the state sees it: who (``SO_PEERCRED``), its leases, its parked attaches.

    ``waiting`` holds ``(attach request, slot, deadline)`` with the deadline in
    ``time.monotonic()`` seconds. ``groups``: supplementary gids from
    ``SO_PEERGROUPS`` (what :mod:`weightcache.daemon.access` checks, with the uid).
    """

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    leases: dict[int, Lease] = field(default_factory=dict)
    waiting: list[tuple[protocol.Attach, Slot, float]] = field(default_factory=list)


class ServiceState:
    """Everything the service knows, without its sockets or threads.

    Args:
        gpu (`int`): the GPU index this instance serves.
        backend (`str`): ``host`` or ``cuda``.
        device (`dict`): the backend's ``device_info()`` (``gpu_uuid``, ``compute_capability``).
        placements (`list[Placement]`): what the config places on this GPU.
        config_source (`str`): the config file(s), for error messages.
        service_uid (`int`): the service's own uid (always allowed).
        realpaths (`Mapping[str, str]`, *optional*): configured checkpoint path -> its resolution, made
            where the configuration was read (:attr:`weightcache.config.Config.realpaths`); no I/O here.

    ``config_error`` is the :class:`~weightcache.errors.ConfigError` of the
    last configuration the service refused (at start, with slabs kept from the
    fd store, or at a reload), None once one is applied.
    """

    def __init__(self, gpu: int, backend: str, device: dict[str, Any], placements: list[Placement],
                 config_source: str = "the config", service_uid: int | None = None,
                 realpaths: Mapping[str, str] | None = None) -> None:
        self.gpu = gpu
        self.backend = backend
        self.device = device
        self.config_source = config_source
        self.service_uid = os.getuid() if service_uid is None else service_uid
        #: Counts of (source, event, target) moves of every slot: what a metrics layer exports.
        self.transition_counts: collections.Counter = collections.Counter()
        self.slots = [self.new_slot(p, (realpaths or {}).get(p.model.path, "")) for p in placements]
        self.peers: set[Peer] = set()
        self.loads_done = 0  # loads settled (ready or failed) since start
        self.config_error: ConfigError | None = None
        self._next_lease = 1
        #: uid -> leases its connections hold (``max_leases_per_uid``).
        self.leases_by_uid: collections.Counter = collections.Counter()

    def new_slot(self, placement: Placement, realpath: str, publication: Publication | None = None) -> Slot:
        """A PENDING slot for ``placement`` (not yet in :attr:`slots`); ``publication`` for a published slab.

        ``realpath`` is the checkpoint path's resolution made where the configuration was read
        (:attr:`weightcache.config.Config.realpaths`; ``""`` when none): this module does no I/O.
        """
        return Slot(placement, realpath=realpath, counts=self.transition_counts, publication=publication)

    def lease(self, peer: Peer, slot: Slot, mode: AttachMode, since: float) -> Lease:
        """Grants ``peer`` a new lease on READY ``slot``; ``since`` is Unix time in seconds."""
        lease = Lease(self._next_lease, slot, peer.pid, peer.uid, peer.gid, since, mode)
        self._next_lease += 1
        peer.leases[lease.lease_id] = lease
        slot.leases[lease.lease_id] = lease
        self.leases_by_uid[peer.uid] += 1
        return lease

    def end_lease(self, peer: Peer, lease: Lease) -> None:
        """Ends one lease of ``peer`` (release, or the connection closed)."""
        if peer.leases.pop(lease.lease_id, None) is not None:
            self.leases_by_uid[peer.uid] -= 1
            if self.leases_by_uid[peer.uid] <= 0:
                del self.leases_by_uid[peer.uid]
        lease.slot.leases.pop(lease.lease_id, None)

    @property
    def settled(self) -> bool:
        """True when no slot is PENDING or LOADING."""
        return all(s.state not in UNSETTLED for s in self.slots)

    def find_slots(self, model: str, tp_size: int | None = None, tp_rank: int | None = None,
                   dtype: str | None = None, naming: str | None = None,
                   dtype_matches: Callable[[Slot, str], bool] | None = None, retired: bool = False,
                   published: bool | None = False) -> list[Slot]:
        """Slots matching a model name or checkpoint path (and layout, when given).

        A path matches after ``os.path.normpath`` (linear in its length): the
        configured path, or the checkpoint's resolution when the slot was made
        (:attr:`Slot.realpath`; a reload makes a new slot for a retargeted
        symlink). The service never resolves a client's string (the client
        sends its own ``realpath``). RETIRED slots count only with ``retired``. ``published``: False (an
        ``attach``) leaves publications out, True takes only publications, None takes both (operators' requests).

        ``dtype_matches(slot, dtype)`` decides whether a slot serves an engine asking
        for ``dtype`` (the caller's, since it may read headers: see
        :func:`weightcache.identity.dtype_matches`); without it the configured
        dtype must equal ``dtype``.

        Raises:
            RemoteProtocolError (`protocol_violation`): ``model`` is longer than
                :data:`~weightcache.daemon.limits.MAX_MODEL_BYTES` (``PATH_MAX``).
            ModelNotFound (`model_not_found`): nothing matches; the message lists
                what this GPU holds and, where the model's name or path matches a
                slab whose layout, dtype or naming differs, each such slab with
                the values it has (``details["held_otherwise"]``: ``[{"slab": label,
                "dtype": ..., ...}]``, only the fields that differ).
        """
        if len(model) > MAX_MODEL_BYTES or len(model.encode("utf-8", "surrogatepass")) > MAX_MODEL_BYTES:
            raise RemoteProtocolError(f"model is {len(model.encode('utf-8', 'surrogatepass'))} bytes long; names "
                                      f"and checkpoint paths are at most {MAX_MODEL_BYTES} bytes (PATH_MAX)",
                                      field="model")
        if "\0" in model:  # no model name or path can contain one
            raise ModelNotFound(f"GPU {self.gpu} has no model {model[:200]!r}: names and paths contain no NUL byte",
                                model=model[:200], gpu=self.gpu)
        norm = os.path.normpath(model) if os.sep in model else None
        out, same = [], []
        for s in self.slots:
            m = s.placement.model
            if s.state is SlotState.RETIRED and not retired:
                continue
            if published is not None and (s.publication is not None) != published:
                continue
            if m.name != model and (norm is None or norm not in (s.realpath, os.path.normpath(m.path))):
                continue
            differs = []
            if tp_size is not None and s.placement.tp_size != tp_size:
                differs.append(("tp_size", s.placement.tp_size))
            if tp_rank is not None and s.placement.tp_rank != tp_rank:
                differs.append(("tp_rank", s.placement.tp_rank))
            if dtype is not None and not (dtype_matches(s, dtype) if dtype_matches else m.dtype == dtype):
                differs.append(("dtype", m.dtype))
            if naming is not None and m.naming != naming:
                differs.append(("naming", m.naming))
            if differs:
                same.append((s, differs))
            else:
                out.append(s)
        if not out:
            held = ", ".join(s.label for s in self.slots if s.state is not SlotState.RETIRED) or "nothing"
            rejected = "" if self.config_error is None else (
                f"; its configuration was rejected ({describe_config_error(self.config_error)}): fix it and run "
                f"`systemctl reload weightcache@{self.gpu}`")
            live = [(s, d) for s, d in same if s.state is not SlotState.RETIRED]
            near = [{"slab": s.label, **dict(d)} for s, d in live]
            hint = self._held_otherwise_hint(live, {"tp_size": tp_size, "tp_rank": tp_rank, "dtype": dtype,
                                                    "naming": naming})
            raise ModelNotFound(
                f"GPU {self.gpu} has no model {model!r} with tp_size={tp_size} tp_rank={tp_rank}"
                f"{'' if dtype is None else ' dtype=' + dtype}{'' if naming is None else ' naming=' + naming}; "
                f"it holds: {held}{rejected}{hint}", model=model, tp_size=tp_size, tp_rank=tp_rank, gpu=self.gpu,
                **({"held_otherwise": near} if near else {}))
        return out

    def _held_otherwise_hint(self, live: list, asked: dict[str, Any]) -> str:
        """The advice of :meth:`find_slots` when the checkpoint is held with other values.

        A slab that can be attached is offered (ask for its values); one whose load failed is not (asking
        for it would fail the same way, e.g. ``naming=vllm`` of an architecture without vLLM naming rules):
        the advice is to give the model's entry the values that were asked for, then reload.
        """
        def values(differs: list) -> str:
            return ", ".join(f"{k}={v}" for k, v in differs)

        usable = [(s, d) for s, d in live if s.state not in (SlotState.FAILED, SlotState.WAITING_FOR_ENGINE)]
        failed = [(s, d) for s, d in live if s.state is SlotState.FAILED]
        waiting = [(s, d) for s, d in live if s.state is SlotState.WAITING_FOR_ENGINE]
        hint = ""
        if usable:
            hint += ("; this checkpoint is held here with other values: "
                     + ", ".join(f"{s.label} ({values(d)})" for s, d in usable)
                     + ": ask for those, or add the layout, dtype or naming you asked for to the model's entry in "
                       "the configuration")
        if failed:
            wanted = sorted({k for _, d in failed for k, _ in d})
            hint += ("; this checkpoint's entry with other values failed to load: "
                     + ", ".join(f"{s.label} ({values(d)}; "
                                 f"{s.error.code if s.error is not None else 'failed'})" for s, d in failed)
                     + ": give the model's entry in the configuration the values asked for ("
                     + ", ".join(f"{k}={asked[k]}" for k in wanted)
                     + f") and run `systemctl reload weightcache@{self.gpu}`")
        if waiting:
            hint += ("; this checkpoint's entry with other values waits for its engine: "
                     + ", ".join(f"{s.label} ({values(d)})" for s, d in waiting)
                     + ": the service cannot lay it out itself; start the engine with --load-format weightcache (mode "
                       "zero_copy, the default), which publishes it (later starts attach that)")
        return hint

    def status_line(self, now: float) -> str:
        """One line for systemd's ``STATUS=`` and ``weightcache status``."""
        line = self._slots_line(now)
        retired = [s for s in self.slots if s.state is SlotState.RETIRED]
        if retired:
            # Removed from the config, changed in it, or its checkpoint files replaced on disk: replaced by a reload.
            line += f"; replaced or removed by a reload, kept while leased: {', '.join(s.label for s in retired)}"
        if self.config_error is not None:
            line += f"; configuration rejected, {describe_config_error(self.config_error)}"
        return line

    def _slots_line(self, now: float) -> str:
        configured = [s for s in self.slots if s.state is not SlotState.RETIRED]
        loading = [s for s in configured if s.state in UNSETTLED]
        ready = sum(s.state is SlotState.READY for s in configured)
        failed = [s for s in configured if s.state is SlotState.FAILED]
        if loading:
            cur = next((s for s in loading if s.state is SlotState.LOADING), loading[0])
            if not cur.total_bytes:  # planning: headers read, size not known yet
                return f"loading {cur.label}: planning; {ready}/{len(configured)} ready"
            pct = 100.0 * cur.done_bytes / cur.total_bytes
            return (f"loading {cur.label}: {pct:.0f}% ({cur.done_bytes / 1e6:.0f}/{cur.total_bytes / 1e6:.0f} MB, "
                    f"{cur.rate_bytes_per_s(now) / 1e9:.2f} GB/s); {ready}/{len(configured)} ready")
        line = f"ready: {ready}/{len(configured)} slabs resident"
        hosted = sum(s.state is SlotState.HOSTED for s in configured)
        on_disk = sum(s.state is SlotState.ON_DISK for s in configured)
        if hosted or on_disk:
            line += f"; in the host tier: {hosted}, on disk: {on_disk} (an attach brings them back)"
        waiting = [s for s in configured if s.state is SlotState.WAITING_FOR_ENGINE]
        if waiting:
            published = {(s.placement.model.name, s.placement.tp_size, s.placement.tp_rank) for s in configured
                         if s.publication is not None and s.state is SlotState.READY}
            line += "; waiting for its engine to publish: " + ", ".join(
                s.label + (" (published)" if (s.placement.model.name, s.placement.tp_size, s.placement.tp_rank)
                           in published else "") for s in waiting)
        if failed:
            line += f"; failed: {', '.join(s.label + ' (' + (s.error.code if s.error else '?') + ')' for s in failed)}"
        return line


def describe_config_error(e: ConfigError) -> str:
    """``FILE:LINE: KEY: what`` (the line when known) for STATUS=, ``status`` and the journal."""
    d, text = e.details, e.message
    file, line = d.get("file"), d.get("line")
    if file and line and text.startswith(f"{file}: "):
        text = f"{file}:{line}: {text[len(file) + 2:]}"
    return text
