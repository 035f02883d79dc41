"""Tiers: the memory budget applied to the slots, and every move between ``gpu``, ``host`` and ``disk``.

Owns :class:`Tiers` (the budget in force, the host tier's size and the
backend's copy GPU -> host), :class:`Moved` (the effect of one move, carried
out by the serving loop: fd store and closing), :class:`Demoting` (a copy to
the host tier to run off the serving loop), and the journal events
``demoted``, ``promoted``, ``shelved`` (dropped to disk by the budget or
``evict --to disk``) with their ``reason``. Which slab moves is decided by
:func:`weightcache.daemon.budget.make_room`; this module turns the slots into
:class:`~weightcache.daemon.budget.Holding` records and moves the victims
through the transition table.

Every state change happens on the serving loop's thread; the copy of a
demotion does not. In the service (``Tiers(off_loop=True)``) a demotion that
must copy (the ``cuda`` backend: GPU -> a fresh sealed, page-locked host memfd,
its length divided by the device-to-host bandwidth) is a :class:`Demoting`
effect: the serving loop runs :meth:`Tiers.copy` on a worker thread and keeps
answering every client; the slot stays READY (attachable) and busy for the
budget, its GPU bytes still counted, its copy counted in the host tier. When
the copy is sealed the loop calls :meth:`Tiers.finish_demote`: READY ->
HOSTED, then the GPU slab is freed, so the room a load waits for
(:meth:`Tiers.admit` grants none while a demotion it started is under way)
exists only then and the GPU never holds more than the budget. A lease taken
meanwhile, or an evict or reload that moved the slot, abandons the demotion
(the copy is closed, the slot keeps its state). On the ``host`` backend the
tiers are the same memory: the "copy" returns the sealed memfd itself, and a
demotion moves it to the host tier's account. Without ``off_loop`` (in-process
tests) :meth:`Tiers.demote` copies at once.

Also owns :class:`HeldElsewhere`: the host-backend slabs the service freed
while something else still maps them. Before the service closes a memfd it
puts an inotify watch on its inode (``/proc/self/fd/N``); the kernel removes
the watch with ``IN_IGNORED`` when the inode is evicted, that is when no fd
and no mapping of it is left anywhere. Until then its bytes count against the
budget (``held_elsewhere_bytes``), so what engines keep mapped after their
lease cannot be allocated a second time (issue 38, P2: 30 slabs released and
still mapped took the node's shared memory 2.34 GB past a 280 MB budget). The
cuda backend has no such signal: an imported VMM handle keeps the allocation
after the engine closed the fd, and the driver tells the exporter nothing. There
:class:`HeldByReceivers` counts a freed slab until every process the service
sent its fd to has exited (a pidfd each).

Forbidden imports: socket, selectors, threading, torch, weightcache.memory, weightcache.pipeline,
weightcache.daemon.transport, weightcache.daemon.handlers, weightcache.daemon.loads,
weightcache.daemon.fdstore, weightcache.daemon.loop.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import select
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable

from .. import protocol
from ..errors import InsufficientMemory, WeightcacheError
from ..journal import event
from ..wire import SlotState
from . import budget
from .state import ON_DEMAND, ServiceState, Slot

log = logging.getLogger(__name__)

#: Rank of a host copy a READY slab kept after its promotion: below every configured ``priority``, so the
#: host tier drops such copies (the GPU holds the same bytes) before any demoted slab.
_KEPT_COPY_PRIORITY = -(10**9)


def unknown_leases(s: Slot) -> int:
    """1 for a READY slab adopted from the fd store after a restart whose leases are unknown, else 0: the
    budget counts it as a lease.

    Leases live in the process that granted them: engines that attached before the restart may still map the
    slab, and this process cannot know (``evict`` refuses it without ``--force`` for the same reason). Moving
    it out would free nothing they map (on CUDA the physical allocation stays while an engine maps it) while
    the budget counted the room as free. So it stays until it is known released: the previous process
    stopped cleanly with no lease on it (``Slot.leases_unknown`` False, from
    :func:`~weightcache.daemon.fdstore.released_at_last_stop`), ``weightcache evict --force`` (the operator
    knows), or a reload or change that replaces it. After a crash nothing is known; there is no grace period,
    since an engine may run for days.
    """
    return int(s.adopted and s.leases_unknown and s.state is SlotState.READY)


@dataclass(frozen=True, slots=True)
class Moved:
    """Effect: ``slot`` left a tier. The fd store follows its new ``tier`` (``host``: the slab's entry becomes
    the host tier's; ``disk``: every entry of ``store_id`` goes), then each of ``close`` (a GPU slab, a host
    copy or a manifest file; None entries skipped) is closed."""

    slot: Slot
    store_id: str
    tier: str
    close: tuple[Any, ...] = ()
    #: A publication that left the service (``tier == "disk"``): why, for the ``publications_dropped`` counter
    #: (``budget``, ``evict``); empty otherwise.
    dropped: str = ""


@dataclass(frozen=True, slots=True)
class Demoting:
    """Effect: copy ``sealed`` (the GPU slab of READY ``slot``) to the host tier off the serving loop
    (:meth:`Tiers.copy` on a worker thread), then :meth:`Tiers.finish_demote` on the loop. ``started`` is
    ``time.monotonic()`` s (the ``demoted`` event's ``duration_ms`` counts from it)."""

    slot: Slot
    sealed: Any
    reason: str
    started: float


def _same(a: Any, b: Any) -> bool:
    return a is not None and a is b


@dataclass
class Tiers:
    """The budget in force and how slabs move.

    Attributes:
        budget_bytes (`int`): ``[service] memory_budget_bytes`` (or its default for the device).
        host_tier_bytes (`int`): ``[service] host_tier_bytes`` (0: no host tier).
        to_host (`callable`, *optional*): ``(GPU SealedSlab, label) -> host-tier SealedSlab``: the backend's
            copy (``Backend.demote``); the ``host`` backend returns the same object. None: as the host backend.
        off_loop (`bool`): a demotion that calls ``to_host`` becomes a :class:`Demoting` effect (the serving
            loop runs the copy on a worker); False: :meth:`demote` copies at once.
    """

    budget_bytes: int
    host_tier_bytes: int = 0
    to_host: Callable[[Any, str], Any] | None = None
    off_loop: bool = False
    #: Bytes of slabs the service freed that clients still map (:mod:`weightcache.daemon.elsewhere`): taken
    #: from the budget until the last mapping goes (issue 38, P2).
    held_elsewhere_bytes: int = 0

    # --- what is where ------------------------------------------------------

    @staticmethod
    def gpu_used(state: ServiceState) -> int:
        """Bytes of the budget taken: slabs READY or RETIRED and loads granted room."""
        return sum(s.gpu_bytes for s in state.slots)

    @staticmethod
    def host_used(state: ServiceState) -> int:
        """Bytes the host tier holds (copies of HOSTED slots, of promotions under way, kept after one, and those
        demotions are making)."""
        return (sum(s.hosted.size_bytes for s in state.slots if s.hosted is not None)
                + sum(s.demoting.size_bytes for s in state.slots if s.demoting is not None))

    @staticmethod
    def _holding(s: Slot, size: int) -> budget.Holding:
        m = s.placement.model
        if s.hosted is not None and s.sealed is not None:  # a copy kept after a promotion: dropped first
            return budget.Holding(s.label, size, priority=_KEPT_COPY_PRIORITY, last_used=s.last_used)
        return budget.Holding(s.label, size, len(s.leases), _pinned(s), m.priority, s.last_used,
                              busy=s.state in (SlotState.PENDING, SlotState.LOADING))

    @staticmethod
    def _gpu_holding(s: Slot) -> budget.Holding:
        m = s.placement.model
        if s.state is SlotState.RETIRED:
            return budget.Holding(s.label, s.gpu_bytes, busy=True)
        return budget.Holding(s.label, s.gpu_bytes, len(s.leases) + unknown_leases(s), _pinned(s), m.priority,
                              s.last_used,
                              busy=s.state in (SlotState.PENDING, SlotState.LOADING) or s.demoting is not None,
                              host_copy=s.hosted is not None and s.sealed is not None)

    def holdings(self, state: ServiceState) -> tuple[list[budget.Holding], list[budget.Holding]]:
        """(GPU tier, host tier) as the policy weighs them; RETIRED slabs count but never move."""
        gpu = [self._gpu_holding(s) for s in state.slots if s.gpu_bytes]
        host = [self._holding(s, s.hosted.size_bytes) for s in state.slots if s.hosted is not None]
        host += [budget.Holding(s.label, s.demoting.size_bytes, busy=True) for s in state.slots
                 if s.demoting is not None]  # a copy under way: counted, never dropped
        return gpu, host

    # --- room ---------------------------------------------------------------

    def admit(self, state: ServiceState, slot: Slot, need_bytes: int, evict: bool,
              requester: budget.Requester = budget.ANYONE) -> tuple[list[Moved], InsufficientMemory | None]:
        """Grants ``slot`` (LOADING) ``need_bytes`` of the budget, moving other slabs out as the policy says.

        Args:
            evict (`bool`): the load was asked for (an attach, ``preload``): others may be demoted; False (a
                start-up load) takes only free room.
            requester (`budget.Requester`, *optional*): who asked (:func:`requester_of`): only slabs of at most
                its priority that it may attach are moved.

        Returns:
            `tuple`: (the moves made, for the serving loop to carry out; the refusal or None). On a refusal
            nothing moved and ``slot`` is unchanged. When a move is a :class:`Demoting` (a copy off the loop)
            no room is granted yet (``slot.reserved_bytes`` stays 0): ask again once the copies are done.
        """
        gpu, host = self.holdings(state)
        room = budget.make_room(need_bytes, self.budget_bytes - self.held_elsewhere_bytes, gpu, self.host_tier_bytes,
                                host, evict, requester)
        if not room.fits:
            return [], self.refusal(state, slot, need_bytes, room)
        moves = self.carry_out(state, room, f"room for {slot.label}")
        if not any(isinstance(m, Demoting) for m in moves):
            slot.reserved_bytes = need_bytes
        return moves, None

    def admit_host(self, state: ServiceState, slot: Slot, need_bytes: int) -> InsufficientMemory | None:
        """A load into the host tier (``preload = "host"``) of ``need_bytes``: None when it fits the tier's free
        room (nothing is moved for it), else the refusal naming ``host_tier_bytes``."""
        used = self.host_used(state)
        if used + need_bytes <= self.host_tier_bytes:
            return None
        return InsufficientMemory(
            f"GPU {state.gpu}: no room for {slot.label} ({need_bytes / 1e9:.2f} GB) in host_tier_bytes = "
            f"{self.host_tier_bytes} ({(self.host_tier_bytes - used) / 1e9:.2f} GB free); it waits on disk and the "
            f"first attach loads it", model=slot.placement.model.name, need_bytes=need_bytes,
            budget_bytes=self.host_tier_bytes, free_bytes=self.host_tier_bytes - used, resident=[], leases=[])

    def enforce(self, state: ServiceState, reason: str) -> list[Moved | Demoting]:
        """Brings the GPU back under the budget and the host tier under its size (a reload lowered them):
        unleased, unpinned slabs leave in the policy's order; leased and pinned ones stay (logged when
        they keep the GPU over)."""
        gpu, host = self.holdings(state)
        room = budget.make_room(0, self.budget_bytes, gpu, self.host_tier_bytes, host)
        moves = self.carry_out(state, room, reason)
        if room.short_bytes:
            log.warning("over memory budget budget_bytes=%d over_bytes=%d reason=%s: the rest is leased or pinned",
                        self.budget_bytes, room.short_bytes, reason)
        drop, over = budget.fit_host(self.host_tier_bytes, self.holdings(state)[1])
        by_label = {s.label: s for s in state.slots}
        moves += [self.shelve(state, by_label[lb], reason) for lb in drop if not self._drop_kept(by_label[lb])]
        if over:
            log.warning("over host tier host_tier_bytes=%d over_bytes=%d reason=%s: the rest is pinned",
                        self.host_tier_bytes, over, reason)
        return moves

    def carry_out(self, state: ServiceState, room: budget.Room, reason: str) -> list[Moved | Demoting]:
        """Moves the slots ``room`` names (host-tier drops first, then demotions, then drops)."""
        by_label = {s.label: s for s in state.slots}
        moves = [self.shelve(state, by_label[lb], reason) for lb in room.drop_host if not self._drop_kept(by_label[lb])]
        moves += [self.demote(state, by_label[lb], reason) for lb in room.demote]
        moves += [self.shelve(state, by_label[lb], reason) for lb in room.drop]
        return moves

    def refusal(self, state: ServiceState, slot: Slot, need_bytes: int, room: budget.Room) -> InsufficientMemory:
        """The ``insufficient_memory`` error for ``slot``: the budget, what is resident, who holds leases (all of
        it: an operator's view; :func:`refusal_for` cuts it to what another requester may see)."""
        resident = [s for s in state.slots if s.gpu_bytes and s is not slot]
        return _refusal_error(
            state.gpu, slot.label, slot.placement.model.name, need_bytes, self.budget_bytes, room.free_bytes,
            self.held_elsewhere_bytes,
            [{"slab": s.label, "size_bytes": s.gpu_bytes, "leases": len(s.leases), "pinned": s.placement.model.pin,
              "loading": s.state is SlotState.LOADING, "unknown_leases": bool(unknown_leases(s))} for s in resident],
            [{"slab": s.label, "lease_id": le.lease_id, "pid": le.pid, "uid": le.uid}
             for s in resident for le in s.leases.values()])

    # --- single moves ---------------------------------------------------------

    @staticmethod
    def _drop_kept(slot: Slot) -> bool:
        """Drops the host copy a READY slot kept after its promotion; False when ``slot`` holds none."""
        if slot.sealed is None or slot.hosted is None:
            return False
        size = slot.hosted.size_bytes
        slot.drop_host_copy()
        log.info("host tier copy dropped model=%s tp_size=%d rank=%d size_bytes=%d reason=room in the host tier",
                 slot.placement.model.name, slot.placement.tp_size, slot.placement.tp_rank, size)
        return True

    def demote(self, state: ServiceState, slot: Slot, reason: str) -> Moved | Demoting:
        """READY -> HOSTED: copies the slab to the host tier (none when it kept its copy from a promotion;
        the ``host`` backend moves it without a copy). With ``off_loop`` a copy is a :class:`Demoting` for
        the serving loop to run (the slot stays READY until :meth:`finish_demote`)."""
        sealed, t0 = slot.sealed, time.monotonic()
        kept = slot.hosted
        if kept is None and self.off_loop and self.to_host is not None:
            slot.demoting = sealed
            return Demoting(slot, sealed, reason, t0)
        if kept is not None:
            copy = kept
        else:
            try:
                copy = self.to_host(sealed, slot.label) if self.to_host is not None else sealed
            except WeightcacheError as e:  # no host RAM, no page-locking: the room is made all the same
                return self._copy_failed(state, slot, e, reason)
        return self._demoted(slot, copy, sealed, kept, t0, reason)

    def copy(self, eff: Demoting) -> tuple[Any, Exception | None]:
        """Runs the backend's copy of ``eff`` (on a worker thread: reads only ``eff``, writes no state).

        Returns:
            `tuple`: (the host-tier SealedSlab, None), or (None, the exception the copy raised).
        """
        try:
            return (self.to_host(eff.sealed, eff.slot.label) if self.to_host is not None else eff.sealed), None
        except Exception as e:  # noqa: BLE001 - handed to finish_demote on the loop, which logs it
            return None, e

    def finish_demote(self, state: ServiceState, eff: Demoting, copy: Any,
                      error: Exception | None) -> tuple[Moved | None, tuple[Any, ...]]:
        """The copy of ``eff`` ended (serving loop): READY -> HOSTED with ``copy``; a failed copy drops the slab
        to disk instead (the room is made all the same). A slot that got a lease, left READY or holds another
        slab meanwhile keeps its state: the demotion is abandoned.

        Returns:
            `tuple`: (the move for the serving loop to carry out, or None; host copies to close).
        """
        slot = eff.slot
        if slot.demoting is eff.sealed:
            slot.demoting = None
        p = slot.placement
        if slot.state is not SlotState.READY or slot.sealed is not eff.sealed or slot.leases:
            why = f"{len(slot.leases)} leases" if slot.state is SlotState.READY else f"now {slot.state.value}"
            log.info("demotion abandoned model=%s tp_size=%d rank=%d reason=%s",
                     p.model.name, p.tp_size, p.tp_rank, why)
            return None, (copy,) if copy is not None and not _same(copy, eff.sealed) else ()
        if error is not None:
            if isinstance(error, WeightcacheError):
                return self._copy_failed(state, slot, error, eff.reason), ()
            log.critical("demotion crashed model=%s tp_size=%d rank=%d error=%r: dropped to disk instead",
                         p.model.name, p.tp_size, p.tp_rank, error)
            return self.shelve(state, slot, f"{eff.reason}; the copy to the host tier crashed"), ()
        return self._demoted(slot, copy, eff.sealed, None, eff.started, eff.reason), ()

    def _copy_failed(self, state: ServiceState, slot: Slot, e: WeightcacheError, reason: str) -> Moved:
        log.warning("demotion failed model=%s tp_size=%d rank=%d code=%s error=%s: dropped to disk instead",
                    slot.placement.model.name, slot.placement.tp_size, slot.placement.tp_rank, e.code, e.message)
        return self.shelve(state, slot, f"{reason}; the copy to the host tier failed ({e.code})")

    @staticmethod
    def _demoted(slot: Slot, copy: Any, sealed: Any, kept: Any, t0: float, reason: str) -> Moved:
        slot.hosted = None
        slot.demote(copy)
        p = slot.placement
        dt = time.monotonic() - t0
        log.info("demoted model=%s tp_size=%d rank=%d size_bytes=%d duration_ms=%.0f copied=%s to=host reason=%s",
                 p.model.name, p.tp_size, p.tp_rank, copy.size_bytes, dt * 1e3,
                 "no" if copy is kept or _same(copy, sealed) else "yes", reason,
                 extra=event("demoted", p.model.name, p.tp_rank, tp_size=p.tp_size, size_bytes=copy.size_bytes,
                             duration_ms=dt * 1e3,
                             reason=reason, to="host"))
        return Moved(slot, slot.store_id, "host", () if _same(copy, sealed) else (sealed,))

    def shelve(self, state: ServiceState, slot: Slot, reason: str) -> Moved:
        """READY | HOSTED -> ON_DISK: frees the slab and its host copy; the next attach loads it from disk. A
        publication leaves the state instead (no image on disk to load it from): the next engine start publishes
        it again, and a model configured only through its engine is back to WAITING_FOR_ENGINE alone."""
        was = slot.tier
        sealed, hosted, manifest_file = slot.shelve()
        size = (sealed or hosted).size_bytes if (sealed or hosted) is not None else 0
        p = slot.placement
        log.info("shelved model=%s tp_size=%d rank=%d size_bytes=%d from=%s to=disk reason=%s", p.model.name,
                 p.tp_size, p.tp_rank, size, was, reason,
                 extra=event("shelved", p.model.name, p.tp_rank, tp_size=p.tp_size, size_bytes=size, reason=reason,
                             tier_from=was))
        close = (sealed,) + (() if _same(hosted, sealed) else (hosted,)) + (manifest_file,)
        dropped = ""
        if slot.publication is not None:  # no image on disk to load it from: it is gone, its engine publishes again
            dropped = "evict" if reason.startswith("evict") else "budget"
            publication_dropped(state, slot, reason, dropped, logging.INFO)
        return Moved(slot, slot.store_id, "disk", tuple(f for f in close if f is not None), dropped)

    @staticmethod
    def promoted(slot: Slot, duration_s: float) -> None:
        """Logs a finished promotion host -> GPU (the loader's :class:`~weightcache.daemon.loads.Loaded`)."""
        p = slot.placement
        size = slot.sealed.size_bytes if slot.sealed is not None else 0
        log.info("promoted model=%s tp_size=%d rank=%d size_bytes=%d duration_ms=%.0f gbps=%.2f", p.model.name,
                 p.tp_size, p.tp_rank, size, duration_s * 1e3, size / max(duration_s, 1e-9) / 1e9,
                 extra=event("promoted", p.model.name, p.tp_rank, tp_size=p.tp_size, size_bytes=size,
                             duration_ms=duration_s * 1e3,
                             reason="attach"))


def publication_dropped(state: ServiceState, slot: Slot, reason: str, kind: str, level: int) -> None:
    """Takes the publication ``slot`` out of ``state`` and logs it (the ``publication_dropped`` event, ``REASON``
    ``kind``): nothing can load it again but its engine, which publishes it again at its next start; a model
    configured only through its engine is back to WAITING_FOR_ENGINE alone.

    Args:
        reason (`str`): the log line's reason (the budget's, or the error's).
        kind (`str`): the event's and the ``publications_dropped`` counter's reason: ``budget``, ``evict``, or
            the cause of a failed promotion or image load (``digest_mismatch``...).
        level (`int`): the log level (``logging.INFO`` for the budget's drops, ``WARNING`` for a failure).
    """
    p = slot.placement
    state.slots = [x for x in state.slots if x is not slot]
    waits = any(x.state is SlotState.WAITING_FOR_ENGINE and x.placement.model.name == p.model.name
                for x in state.slots)
    log.log(level, "publication dropped model=%s tp_size=%d rank=%d slab=%s reason=%s: the next engine start "
            "publishes it again%s", p.model.name, p.tp_size, p.tp_rank, slot.label, reason,
            "; its model waits for its engine" if waits else "",
            extra=event("publication_dropped", p.model.name, p.tp_rank, tp_size=p.tp_size, reason=kind))


def _pinned(slot: Slot) -> bool:
    """Whether the budget must leave ``slot`` where it is: its model's ``pin``. A publication moves like any other
    slab (host tier, by priority and LRU); one the budget drops leaves the service (nothing can make it again without
    its engine: :meth:`Tiers.shelve`)."""
    return slot.placement.model.pin


def demand(slot: Slot, now: float) -> bool:
    """Queues an on-demand load or promotion of ``slot`` when it is HOSTED or ON_DISK; returns whether it did
    (the caller then starts the load). Clears the last refusal."""
    if slot.state not in ON_DEMAND:
        return False
    slot.refusal = None
    slot.demand = True
    slot.target = "gpu"
    slot.last_used = now
    slot.requeue()
    return True


def start_placement(slot: Slot) -> bool:
    """Applies the model's ``preload`` to a new PENDING ``slot`` (at start, or added by a reload); returns
    whether to queue its load: ``gpu`` (yes, into the budget's free room), ``host`` (yes, into the host
    tier) or ``disk`` (no: ON_DISK until the first attach)."""
    preload = slot.placement.model.preload
    if preload == "disk":
        slot.shelve()
        return False
    slot.target = "host" if preload == "host" else "gpu"
    return True


def start_order(slots: list[Slot]) -> list[Slot]:
    """``slots`` in the order start-up loads go: pinned first, then by ``priority`` (highest first), then as
    configured."""
    return sorted(slots, key=lambda s: (not s.placement.model.pin, -s.placement.model.priority))


def refuse(slot: Slot, error: InsufficientMemory | Exception, reason: str) -> None:
    """A load or promotion of ``slot`` (LOADING) got no room: it goes back to the host tier (a promotion) or to
    disk, keeping ``error`` for the attaches waiting on it (``insufficient_memory``). Nothing else moves."""
    slot.refusal = error if isinstance(error, InsufficientMemory) else None
    slot.demand, slot.demand_by = False, None
    if slot.hosted is not None:
        slot.stash(slot.manifest, slot.hosted, slot.manifest_file)
    else:
        slot.shelve()
    p = slot.placement
    log.info("no room model=%s tp_size=%d rank=%d tier=%s reason=%s", p.model.name, p.tp_size, p.tp_rank,
             slot.tier, reason)


def _refusal_error(gpu: int, label: str, model: str, need_bytes: int, budget_bytes: int, free_bytes: int,
                   held_elsewhere_bytes: int, resident: list[dict], leases: list[dict]) -> InsufficientMemory:
    """``insufficient_memory`` for slab ``label`` of ``model``, its message worked out from its ``details``
    (``resident``: ``slab``, ``size_bytes``, ``leases``, ``pinned``, ``loading``, ``unknown_leases``; ``leases``: ``slab``,
    ``lease_id``, ``pid``, ``uid``), so that :func:`refusal_for` can rebuild it from fewer."""
    def why(r: dict) -> str:
        if r.get("pinned"):
            return "pinned"
        if r.get("unknown_leases"):
            return f"{r['leases']} leases and unknown ones: adopted after a restart"
        return "loading" if r.get("loading") else f"{r['leases']} leases"

    what = ", ".join(f"{r['slab']} ({r['size_bytes'] / 1e9:.2f} GB, {why(r)})" for r in resident) or "nothing"
    who = ", ".join(f"lease {le['lease_id']} on {le['slab']} by pid {le['pid']} uid {le['uid']}"
                    for le in leases) or "none"
    hint = ("release a lease, unpin a model or raise memory_budget_bytes"
            + ("; a slab adopted after a restart may still be mapped by engines that attached before it: "
               "weightcache evict --force MODEL once none does" if any(r.get("unknown_leases") for r in resident)
               else "")
            if need_bytes <= budget_bytes else
            "the slab alone is larger than the whole budget: raise memory_budget_bytes (or give the model more GPUs)")
    elsewhere = (f"; {held_elsewhere_bytes / 1e9:.2f} GB of slabs it freed are still mapped by engines (counted until "
                 f"they unmap them)" if held_elsewhere_bytes else "")
    return InsufficientMemory(
        f"GPU {gpu}: no room for {label} ({need_bytes / 1e9:.2f} GB) in memory_budget_bytes = {budget_bytes} "
        f"({free_bytes / 1e9:.2f} GB free{elsewhere}); resident: {what}; leases: {who}; {hint}", model=model,
        need_bytes=need_bytes, budget_bytes=budget_bytes, free_bytes=free_bytes, resident=resident, leases=leases,
        gpu=gpu, slab=label, held_elsewhere_bytes=held_elsewhere_bytes)


def refusal_for(e: WeightcacheError, shown: Callable[[str], bool], uid: int) -> WeightcacheError:
    """``e`` (a :meth:`Tiers.refusal`) as a requester of ``uid`` who is no operator may see it, the way
    ``status`` shows it the state: slabs it may not attach (``shown(label)`` false) are one sum of bytes,
    unnamed, their leases left out; other uids' leases keep their id but show pid and uid as
    ``protocol.HIDDEN_ID``. Before, the refusal named restricted models and other uids' pids and lease ids that
    ``status`` hides from the same requester (issue 38, P5). Other errors are returned as they are."""
    d = e.details
    if not isinstance(e, InsufficientMemory) or "slab" not in d:
        return e
    resident = [r for r in d["resident"] if shown(r["slab"])]
    other = sum(r["size_bytes"] for r in d["resident"] if not shown(r["slab"]))
    if other:
        resident.append({"slab": "other models", "size_bytes": other, "leases": 0, "pinned": False,
                         "loading": False, "unknown_leases": False})
    leases = [le if le["uid"] == uid else dict(le, pid=protocol.HIDDEN_ID, uid=protocol.HIDDEN_ID)
              for le in d["leases"] if shown(le["slab"])]
    return _refusal_error(d["gpu"], d["slab"], d["model"], d["need_bytes"], d["budget_bytes"], d["free_bytes"],
                          d.get("held_elsewhere_bytes", 0), resident, leases)


#: Demand loads one uid may have displace other slabs within :data:`DISPLACING_WINDOW_S` (root and the service
#: user exempt); past it its loads take free room only (issue 38, P4: three attaches of another uid thrashed a
#: restricted model, 83 loads in 25 s).
DISPLACING_LOADS_PER_UID = 8
DISPLACING_WINDOW_S = 60.0


#: States of a slot whose room a load by someone who may not attach it must leave free (it waits off the GPU).
_RESERVING = frozenset({SlotState.ON_DISK, SlotState.HOSTED, SlotState.PENDING})


def unsized_restricted(slots: list[Slot]) -> list[Slot]:
    """The slots whose room :func:`requester_of` would hold back but cannot, their size unknown: a model with
    allow lists waiting off the GPU (ON_DISK or HOSTED; a PENDING one is planned by its own load) that no plan
    has sized yet (``preload = "disk"``, at start or added by a reload; a slab adopted from the fd store, then
    evicted). The serving loop has the loader plan them without loading (:meth:`Loader.probe`)."""
    return [s for s in slots if s.publication is None and not s.first_slab_bytes
            and s.state in (SlotState.ON_DISK, SlotState.HOSTED)
            and (s.placement.model.allow_users or s.placement.model.allow_groups)]


def requester_of(state: ServiceState, slot: Slot, may_attach: Callable[[Slot], bool] | None,
                 displaced_recently: int) -> budget.Requester:
    """The :class:`budget.Requester` of ``slot``'s load: its model's priority, the slabs the peer that asked
    may attach (``may_attach``; None: every slab, the service's own loads; none at all once the peer's uid
    made :data:`DISPLACING_LOADS_PER_UID` loads displace others within the window, ``displaced_recently``),
    and the room held back for the models it may not attach while they wait off the GPU (each its
    :attr:`Slot.first_slab_bytes`; a model never loaded is sized by a plan alone: :func:`unsized_restricted`)."""
    if may_attach is None:
        return budget.Requester(slot.placement.model.priority)
    mine = frozenset(s.label for s in state.slots if may_attach(s))
    # The room of the models it may not attach that wait off the GPU (their last planned size) is theirs.
    reserved = sum(s.first_slab_bytes for s in state.slots if s.label not in mine and s.state in _RESERVING)
    if displaced_recently >= DISPLACING_LOADS_PER_UID:
        return budget.Requester(slot.placement.model.priority, frozenset(), reserved)
    return budget.Requester(slot.placement.model.priority, mine, reserved)


#: inotify event bits (linux/inotify.h).
IN_CLOSE_NOWRITE = 0x10
IN_DELETE_SELF = 0x400
IN_IGNORED = 0x8000
_EVENT = struct.Struct("iIII")


class HeldElsewhere:
    """The host-backend slabs the service freed whose memfd something else still holds or maps.

    Attributes:
        fd (`int`): the inotify fd; readable when a watched memfd was freed (call :meth:`read`).
    """

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        #: watch descriptor -> (label, size_bytes)
        self._watches: dict[int, tuple[str, int]] = {}

    @property
    def bytes(self) -> int:
        """Bytes of the freed slabs still held or mapped elsewhere."""
        return sum(size for _, size in self._watches.values())

    def labels(self) -> list[str]:
        """The labels of those slabs (one per slab, in no particular order)."""
        return [label for label, _ in self._watches.values()]

    def watch(self, fd: int, label: str, size_bytes: int) -> None:
        """Starts watching the memfd ``fd`` (still open: the caller closes it right after) of slab ``label``.

        A memfd nobody else holds is freed by the caller's close and reported by the next :meth:`read`.
        A watch the kernel refuses (``fs.inotify.max_user_watches``) is logged and the slab not counted.
        """
        wd = self._libc.inotify_add_watch(self.fd, f"/proc/self/fd/{fd}".encode(), IN_CLOSE_NOWRITE | IN_DELETE_SELF)
        if wd < 0:
            err = ctypes.get_errno()
            log.warning("cannot watch a freed slab label=%s size_bytes=%d error=%s: its memory is not counted while "
                        "clients still map it", label, size_bytes, os.strerror(err))
            return
        self._watches[wd] = (label, size_bytes)

    def read(self) -> list[tuple[str, int]]:
        """Drains the inotify fd; returns ``(label, size_bytes)`` of each watched slab whose memory is now free."""
        freed = []
        while True:
            try:
                data = os.read(self.fd, 64 * 1024)
            except BlockingIOError:
                return freed
            off = 0
            while off + _EVENT.size <= len(data):
                wd, mask, _cookie, name_len = _EVENT.unpack_from(data, off)
                off += _EVENT.size + name_len
                if mask & IN_IGNORED and wd in self._watches:
                    freed.append(self._watches.pop(wd))

    def watch_freed(self, f: Any, label: str) -> None:
        """:meth:`watch` of the memfd of ``f`` (a slab, host copy or manifest file: ``fd``, ``size_bytes``)."""
        if getattr(f, "fd", -1) >= 0:
            self.watch(f.fd, label, f.size_bytes)

    def close(self) -> None:
        os.close(self.fd)


#: A slab's receivers are pruned of exited processes when they reach this many (:func:`note_receiver`).
RECEIVERS_PRUNE_AT = 256


def note_receiver(sealed: Any, pid: int) -> None:
    """Records that process ``pid`` received the fd of ``sealed`` (an attach reply), on a slab that keeps its
    ``receivers`` (the cuda backend's: :class:`HeldByReceivers`); nothing for one without. At
    :data:`RECEIVERS_PRUNE_AT` the pids of processes that exited are dropped (``kill(pid, 0)``: ``ESRCH``), so a
    slab attached by many short-lived engines keeps a short list, and a pid reused later is not waited for."""
    receivers = getattr(sealed, "receivers", None)
    if receivers is None:
        return
    receivers.add(pid)
    if len(receivers) >= RECEIVERS_PRUNE_AT:
        receivers.difference_update([p for p in receivers if not _runs(p)])


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another uid's: it runs
        return True
    return True


class HeldByReceivers:
    """The cuda-backend slabs the service freed that processes it sent their fd to may still map (issue 38, P2
    on CUDA).

    The driver tells the exporter nothing when the last imported handle of a VMM allocation goes (the
    allocation lives on: tests/gpu/test_trust_gpu.py records it), so a freed slab counts against the budget
    until every process that received its fd (``CudaSealedSlab.receivers``: the pids of its attach replies)
    has exited: a pidfd each (``pidfd_open``), polled through one epoll fd. Two limits, said in
    docs/operations.md: an engine that unmapped and runs on (``copy`` mode, or a release before it exits)
    keeps the slab counted until it exits; an fd passed on to another process is not followed.

    Attributes:
        fd (`int`): the epoll fd; readable when a watched process exited (call :meth:`read`).
    """

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self.fd = self._epoll.fileno()
        self._ids = itertools.count()
        #: entry id -> (label, size_bytes, the pidfds still open)
        self._entries: dict[int, tuple[str, int, set[int]]] = {}
        #: pidfd -> its entry id
        self._owner: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        """Bytes of the freed slabs some receiver of which still runs."""
        return sum(size for _, size, _ in self._entries.values())

    def labels(self) -> list[str]:
        """The labels of those slabs (one per slab, in no particular order)."""
        return [label for label, _, _ in self._entries.values()]

    def watch_freed(self, f: Any, label: str) -> None:
        """Counts ``f`` (a sealed slab the service lets go of: ``receivers``, ``size_bytes``) until every process
        of its ``receivers`` has exited; one that has already exited is not waited for. An object without
        receivers (a host copy, a manifest file, a slab nobody attached) is not counted."""
        pids = getattr(f, "receivers", None)
        if not pids:
            return
        left = set()
        for pid in sorted(pids):
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            except OSError as e:  # out of fds: that receiver is not waited for
                log.warning("cannot watch a receiver of a freed slab label=%s pid=%d error=%s: its memory is not "
                            "counted while that process may still map it", label, pid, e.strerror)
                continue
            self._epoll.register(pidfd, select.EPOLLIN)
            left.add(pidfd)
        if not left:
            return
        entry = next(self._ids)
        self._entries[entry] = (label, int(f.size_bytes), left)
        for pidfd in left:
            self._owner[pidfd] = entry

    def read(self) -> list[tuple[str, int]]:
        """Takes the receivers that exited; returns ``(label, size_bytes)`` of each slab none of whose receivers
        runs any more."""
        freed = []
        for pidfd, _ in self._epoll.poll(0):
            self._epoll.unregister(pidfd)
            os.close(pidfd)
            entry = self._owner.pop(pidfd)
            label, size, left = self._entries[entry]
            left.discard(pidfd)
            if not left:
                del self._entries[entry]
                freed.append((label, size))
        return freed

    def close(self) -> None:
        for pidfd in self._owner:
            os.close(pidfd)
        self._owner.clear()
        self._entries.clear()
        self._epoll.close()
