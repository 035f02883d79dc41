"""What the loader thread posts, and applying it on the serving loop.

Owns the result records (:class:`Started`, :class:`Planned`, :class:`Progress`,
:class:`Loaded`, :class:`Failed`, :class:`NeedRoom`, :class:`Refused`,
:class:`Skipped`), each of which knows how it moves its slot through the
transition table (``apply``, serving loop only), :func:`apply` and
:func:`discard` (a result for a slot a reload removed) and
:func:`close_abandoned` (a result of a load the loader gave up on).

Forbidden imports: socket, selectors, torch, weightcache.protocol directly, weightcache.fdpass,
weightcache.daemon.transport, weightcache.daemon.handlers, weightcache.daemon.ticker,
weightcache.daemon.fdstore, weightcache.daemon.loop, weightcache.daemon.loads.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelLoadFailed, WeightcacheError
from ..journal import event
from ..manifest import Manifest
from ..memory.host import SealedFile
from .state import ServiceState, Slot, waits_for_engine

log = logging.getLogger("weightcache.daemon.loads")  # the loader's logger, as before the split


@dataclass(frozen=True, slots=True)
class Started:
    """The loader took ``slot`` at ``at`` (``time.monotonic()`` s)."""

    slot: Slot
    at: float

    def apply(self, state: ServiceState) -> None:
        self.slot.start(self.at)


@dataclass(frozen=True, slots=True)
class Planned:
    """The plan is made: ``total_bytes`` of payload will be written; ``dtype_served`` says which dtype
    names the slab serves (see :attr:`weightcache.daemon.state.Slot.dtype_served`); ``checkpoint`` is the
    checkpoint identity the plan read (:attr:`weightcache.daemon.state.Slot.planned_checkpoint`)."""

    slot: Slot
    total_bytes: int
    dtype_served: dict[str, bool] | None = None
    checkpoint: dict | None = None
    #: The plan's slab size: the slot's :attr:`~weightcache.daemon.state.Slot.first_slab_bytes` at its first plan.
    slab_bytes: int = 0

    def apply(self, state: ServiceState) -> None:
        self.slot.total_bytes = self.total_bytes
        if self.slab_bytes and not self.slot.first_slab_bytes:
            self.slot.first_slab_bytes = self.slab_bytes
        if self.checkpoint is not None:
            self.slot.planned_checkpoint = self.checkpoint
        if self.dtype_served is not None:
            self.slot.dtype_served = dict(self.dtype_served)


@dataclass(frozen=True, slots=True)
class Progress:
    """``done_bytes`` of the payload are written."""

    slot: Slot
    done_bytes: int

    def apply(self, state: ServiceState) -> None:
        self.slot.done_bytes = self.done_bytes


@dataclass(frozen=True, slots=True)
class Loaded:
    """The slab is sealed: its manifest, the backend's SealedSlab, its manifest file and the load time.

    ``stages_s`` holds the seconds of each stage: ``plan``, ``allocate``,
    ``read`` (on CUDA's torch-free path, digests included), ``digest`` (there:
    the share of ``read`` the digests took),
    ``seal`` (with the manifest file); ``torch_free`` whether the slab was
    filled without torch.
    """

    slot: Slot
    manifest: Manifest
    sealed: Any
    manifest_file: SealedFile
    duration_s: float
    stages_s: dict[str, float] = field(default_factory=dict)
    torch_free: bool = False
    #: ``gpu``, or ``host``: the slab was loaded into the host tier (``preload = "host"``).
    tier: str = "gpu"
    #: The host-tier copy a promotion read (None: a load from disk); the serving loop closes it unless it is
    #: ``sealed`` itself (the host backend promotes without a copy).
    promoted_from: Any = None
    #: Where the bytes came from: ``checkpoint`` (the pipeline) or ``image`` (weightcache.images); a promotion
    #: keeps the slot's earlier source.
    source: str = "checkpoint"
    #: ``host:port`` of the peer service the slab was fetched from (issue 37); "": read from the checkpoint.
    seeded_from: str = ""

    def apply(self, state: ServiceState) -> None:
        slot, p, dt = self.slot, self.slot.placement, self.duration_s
        state.loads_done += 1
        slot.last_used = time.monotonic()
        if self.promoted_from is None:  # a promotion keeps where the host copy came from
            slot.source = self.source
            slot.seeded_from = self.seeded_from
        if self.tier == "host":
            slot.stash(self.manifest, self.sealed, self.manifest_file)
        else:
            slot.loaded(self.manifest, self.sealed, self.manifest_file)
        if self.promoted_from is not None:
            if self.promoted_from is self.sealed:  # the host backend: one memfd, nothing to keep
                slot.hosted = None
            size, st = self.sealed.size_bytes, self.stages_s
            copy_s = st.get("copy", dt)
            log.info("promoted model=%s tp_size=%d rank=%d size_bytes=%d duration_ms=%.0f room_ms=%.0f copy_ms=%.0f "
                     "copy_gbps=%.2f digest_ms=%.0f copied=%s", p.model.name, p.tp_size, p.tp_rank, size, dt * 1e3,
                     st.get("room", 0) * 1e3, copy_s * 1e3, size / max(copy_s, 1e-9) / 1e9, st.get("digest", 0) * 1e3,
                     "no" if self.promoted_from is self.sealed else "yes",
                     extra=event("promoted", p.model.name, p.tp_rank, size_bytes=size, duration_ms=dt * 1e3,
                                 tp_size=p.tp_size))
            return
        st = self.stages_s
        read_s = st.get("read", dt)
        log.info("loaded model=%s tp_size=%d rank=%d tensors=%d size_bytes=%d duration_ms=%.0f read_ms=%.0f "
                 "read_gbps=%.2f plan_ms=%.0f allocate_ms=%.0f digest_ms=%.0f seal_ms=%.0f torch_free=%s source=%s",
                 p.model.name, p.tp_size, p.tp_rank, len(self.manifest.tensors), slot.total_bytes, dt * 1e3,
                 read_s * 1e3, slot.total_bytes / max(read_s, 1e-9) / 1e9, st.get("plan", 0) * 1e3,
                 st.get("allocate", 0) * 1e3, st.get("digest", 0) * 1e3, st.get("seal", 0) * 1e3,
                 "yes" if self.torch_free else "no", f"peer:{self.seeded_from}" if self.seeded_from else self.source,
                 extra=event("loaded", p.model.name, p.tp_rank, tp_size=p.tp_size, size_bytes=slot.total_bytes,
                             duration_ms=dt * 1e3,
                             tensors=len(self.manifest.tensors), read_ms=read_s * 1e3, source=self.source))


@dataclass(frozen=True, slots=True)
class Failed:
    """The load failed with ``error``; ``logged`` when the loader already logged it (CRITICAL)."""

    slot: Slot
    error: WeightcacheError
    logged: bool = False

    def apply(self, state: ServiceState) -> None:
        e, p = self.error, self.slot.placement
        state.loads_done += 1
        if waits_for_engine(self.slot, e):  # not a failure: the engine lays it out and publishes it
            self.slot.await_engine(e)
            log.warning("waiting for its engine model=%s tp_size=%d rank=%d code=%s reason=%s: the service cannot "
                        "lay out this model with naming = \"vllm\"; the first engine started on it with "
                        "--load-format weightcache publishes it, and later starts attach that zero-copy",
                        p.model.name, p.tp_size, p.tp_rank, e.code, e.message,
                        extra=event("waiting_for_engine", p.model.name, p.tp_rank, error_code=e.code,
                                    tp_size=p.tp_size))
            return
        self.slot.fail(e)
        if not self.logged:
            log.error("load failed model=%s tp_size=%d rank=%d code=%s error=%s", p.model.name, p.tp_size,
                      p.tp_rank, e.code, e.message,
                      extra=event("load_failed", p.model.name, p.tp_rank, error_code=e.code, tp_size=p.tp_size))


class NeedRoom:
    """The loader asks for ``size_bytes`` of the ``tier`` (``gpu``: the memory budget; ``host``: the host tier)
    for ``slot`` (LOADING) before it allocates, and waits for the serving loop's :meth:`answer`
    (:meth:`weightcache.daemon.tiers.Tiers.admit`). Applying it changes nothing: the serving loop answers it.
    """

    __slots__ = ("slot", "size_bytes", "tier", "refusal", "_done")

    def __init__(self, slot: Slot, size_bytes: int, tier: str) -> None:
        self.slot, self.size_bytes, self.tier = slot, size_bytes, tier
        self.refusal: WeightcacheError | None = None
        self._done = threading.Event()

    def answer(self, refusal: WeightcacheError | None) -> None:
        """Grants the room (``None``) or refuses it with ``refusal`` (``insufficient_memory``); wakes the loader."""
        self.refusal = refusal
        self._done.set()

    def wait(self, timeout_s: float) -> bool:
        """Waits for :meth:`answer` at most ``timeout_s`` seconds; False when none came."""
        return self._done.wait(max(0.0, timeout_s))

    def apply(self, state: ServiceState) -> None:
        pass


@dataclass(frozen=True, slots=True)
class Refused:
    """The load stopped because its room was refused (the serving loop already moved ``slot`` back)."""

    slot: Slot
    error: WeightcacheError

    def apply(self, state: ServiceState) -> None:
        pass


@dataclass(frozen=True, slots=True)
class Skipped:
    """A queued load a reload cancelled was skipped (posted only when ``slot`` holds a host copy to free)."""

    slot: Slot

    def apply(self, state: ServiceState) -> None:
        pass


def close_abandoned(result: Loaded | Failed) -> None:
    """Frees what an abandoned load produced (its partial slab was aborted already by :meth:`Loader._fail`)."""
    if isinstance(result, Loaded):
        try:
            result.sealed.close()
            result.manifest_file.close()
        except Exception as e:  # noqa: BLE001 - best effort after a timeout
            log.warning("close of an abandoned slab failed model=%s error=%r", result.slot.placement.model.name, e)


def discard(result: Started | Planned | Progress | Loaded | Failed | NeedRoom | Refused) -> None:
    """Drops a result for a slot a reload removed (DROPPED): a sealed slab, the host copy a promotion read
    and the manifest file are closed; a request for room is refused; nothing else happens."""
    if isinstance(result, NeedRoom):
        result.answer(ModelLoadFailed(f"model {result.slot.placement.model.name}: a reload removed it",
                                      model=result.slot.placement.model.name, cause="cancelled"))
        return
    slot = result.slot
    if isinstance(result, (Loaded, Failed, Refused, Skipped)) and slot.hosted is not None:  # a promotion's copy
        slot.hosted.close()
        slot.manifest_file.close()
        slot.hosted = slot.manifest_file = None
    if isinstance(result, Loaded):
        result.sealed.close()
        result.manifest_file.close()
        log.info("load discarded model=%s tp_size=%d rank=%d reason=removed-by-reload",
                 result.slot.placement.model.name, result.slot.placement.tp_size, result.slot.placement.tp_rank)


def apply(state: ServiceState, result: Started | Planned | Progress | Loaded | Failed) -> None:
    """Applies one loader result to the state (serving loop only).

    Raises:
        IllegalTransition: the result does not fit the slot's state (a bug).
    """
    result.apply(state)

