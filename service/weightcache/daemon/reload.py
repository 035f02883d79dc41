"""Applying a new configuration to a running service: which slots to keep, add, drop or retire.

Owns :func:`plan` (pure: the slots now and the placements of the new config in,
a :class:`ReloadPlan` out) and :func:`apply` (moves the slots through the
transition table and returns what the I/O layer must do, as a
:class:`Applied`). :func:`weightcache.daemon.handlers.on_reload` reads the
files, calls both and turns :class:`Applied` into effects;
``systemctl reload`` (the unit's ``ExecReload=``, ``weightcache reload``),
``weightcache reload`` and ``SIGHUP`` all end there.

A slot is identified by (model name, ``tp_size``, ``tp_rank``, GPU), the
same identity as its name in systemd's fd store. Per slot:

==========================================  ====================================================
old slot / new config                       outcome
==========================================  ====================================================
same identity, same :class:`LoadRequest`    **kept**: slab, leases, state untouched; its
fields, same checkpoint resolution, same    placement takes the new allow lists and source
checkpoint files                            file; a FAILED one is loaded again
identity gone, or fields or the             **dropped** when no lease holds it (a slab is
resolution of the path changed, or the      freed, a load under way is discarded), else
files replaced since the load
                                            **retired**: kept until the last lease is
                                            released, attachable by nobody new, out of the
                                            fd store
new identity, or the changed one            **added**: a new PENDING slot, loaded
==========================================  ====================================================

A slot already RETIRED stays so until its leases end. ``[service]`` keys that
the running process cannot change (:data:`RESTART_KEYS`: ``backend``, ``socket_dir``,
``image_dir``, the seeding keys) are reported as ``restart_keys``; the loader's keys apply to the next load.

Forbidden imports: socket, selectors, threading, torch, weightcache.memory,
weightcache.pipeline, weightcache.notify, weightcache.daemon.transport,
weightcache.daemon.handlers, weightcache.daemon.loads, weightcache.daemon.fdstore,
weightcache.daemon.ticker, weightcache.daemon.loop.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

from ..config import Config, Placement, ServiceConfig
from ..errors import ConfigError
from ..journal import event
from ..spec import LoadRequest
from ..wire import SlotState
from .state import ServiceState, Slot

log = logging.getLogger(__name__)

#: ``[service]`` keys a running service cannot change: they take effect at the next restart (the seeding keys:
#: the seeder, its listener and its secret are made once, at the start; docs/configuration.md "Peer seeding").
RESTART_KEYS = ("backend", "socket_dir", "image_dir", "peers", "peers_file", "seed_secret_file", "seed_listen",
                "seed_transport", "seed_devices", "seed_bandwidth_bytes_per_s", "seed_timeout_s",
                "seed_max_transfers", "seed_max_bytes", "seed_samples")
#: The fields of a model that decide its slab's bytes (the rest, allow lists and source, do not).
_SLAB_FIELDS = tuple(f.name for f in dataclasses.fields(LoadRequest))


def config_rejected_event(e: ConfigError) -> dict[str, str]:
    """Journal fields of a refused configuration: ``WEIGHTCACHE_ERROR_CODE``, ``WEIGHTCACHE_CONFIG_FILE``,
    ``WEIGHTCACHE_CONFIG_LINE``, ``WEIGHTCACHE_CONFIG_KEY``."""
    d = e.details
    return event("config_rejected", error_code=e.code, config_file=d.get("file", ""),
                 config_line=d.get("line") or "", config_key=d.get("key", ""))


def identity(p: Placement) -> tuple[str, int, int, int]:
    """(model name, ``tp_size``, ``tp_rank``, GPU): what a slot is across reloads (and in the fd store)."""
    return p.model.name, p.tp_size, p.tp_rank, p.gpu


def _slab_fields(p: Placement) -> tuple[Any, ...]:
    return tuple(getattr(p.model, f) for f in _SLAB_FIELDS)


@dataclass(frozen=True)
class ReloadPlan:
    """What a new configuration does to the slots (see the module's table).

    Attributes:
        keep (`tuple[tuple[Slot, Placement]]`): unchanged slots and their new placement.
        add (`tuple[Placement]`): placements to load, in config order.
        drop (`tuple[Slot]`): removed or changed slots no lease holds.
        retire (`tuple[Slot]`): removed or changed READY slots held by leases.
        restart_keys (`tuple[str]`): changed ``[service]`` keys of :data:`RESTART_KEYS`.
        published (`tuple[tuple[Slot, Placement]]`): publications kept (their model still configured on this GPU
            with the same checkpoint path and resolution) and their new placement (new allow lists, publishers).
    """

    keep: tuple[tuple[Slot, Placement], ...]
    add: tuple[Placement, ...]
    drop: tuple[Slot, ...]
    retire: tuple[Slot, ...]
    restart_keys: tuple[str, ...] = ()
    published: tuple[tuple[Slot, Placement], ...] = ()


def recorded_checkpoints(slots: list[Slot]) -> list[tuple[tuple[str, int, int, int], str, Any, dict]]:
    """What :func:`weightcache.daemon.offloop.changed_checkpoints` checks off the loop, per slot: (slot identity,
    checkpoint path, what the check is made against, the checkpoint identity it holds). No I/O.

    A slot with a manifest (READY or HOSTED, or a promotion of its host copy under way) is checked against its
    manifest's key; a LOADING one without, against the identity its load planned from
    (:attr:`Slot.planned_checkpoint`): a load reads the files it opened, so one replaced meanwhile would end
    ``ready`` with the old bytes, which every engine refuses.
    """
    out = []
    for s in slots:
        if s.publication is not None:  # keyed apart from the configured slot of its identity: left out for now
            continue
        if s.manifest is not None and s.state in (SlotState.READY, SlotState.HOSTED, SlotState.PENDING,
                                                  SlotState.LOADING):
            out.append((identity(s.placement), s.placement.model.path, s.manifest, s.manifest.key["checkpoint"]))
        elif s.state is SlotState.LOADING and s.planned_checkpoint is not None:
            out.append((identity(s.placement), s.placement.model.path, s.planned_checkpoint, s.planned_checkpoint))
    return out


def plan(slots: list[Slot], placements: list[Placement], old: ServiceConfig, new: ServiceConfig,
         realpath: Callable[[str], str] = lambda path: "", running_backend: str | None = None,
         changed: dict | None = None) -> ReloadPlan:
    """The :class:`ReloadPlan` taking ``slots`` to ``placements``; changes nothing.

    Args:
        slots (`list[Slot]`): the service's slots now (RETIRED ones are left alone).
        placements (`list[Placement]`): the new config's placements on this GPU.
        old, new (`ServiceConfig`): ``[service]`` before and after.
        realpath (`callable`): a checkpoint path's resolution made where the new files were read, a lookup
            (:meth:`weightcache.config.Config.realpath_of`); never ``os.path.realpath`` itself, since this
            runs on the serving loop. A slot is kept only while its recorded resolution equals this one.
        running_backend (`str`, *optional*): ``host`` or ``cuda``, the backend in use. When given, a changed
            ``backend`` is a restart key only if the new value names another one (``auto`` accepts either):
            after a start with rejected files the old value is that of the slabs the fd store kept, not
            what any file said, and a fixed file saying ``auto`` or the same backend changes nothing.
        changed (`dict`, *optional*): :func:`weightcache.daemon.offloop.changed_checkpoints`' answer, made
            where the files were read (on the reload's worker, never here): a
            slot whose checkpoint files were replaced since its load is changed, as if its path were.
    """
    current = {identity(s.placement): s for s in slots if s.state is not SlotState.RETIRED and s.publication is None}
    models = {p.model.name: p.model for p in placements}
    published, gone_published = [], []
    for s in slots:  # a publication stays while its model is configured here from the same checkpoint
        if s.publication is None or s.state is SlotState.RETIRED:
            continue
        m = models.get(s.placement.model.name)
        if m is not None and m.path == s.placement.model.path and s.realpath == realpath(m.path):
            published.append((s, dataclasses.replace(s.placement, model=m)))
        else:
            gone_published.append(s)
    keep, add, kept_ids = [], [], set()
    for p in placements:
        s = current.get(identity(p))
        if s is not None and _slab_fields(s.placement) == _slab_fields(p) and s.realpath == realpath(p.model.path):
            replaced = (changed or {}).get(identity(p))
            # Checked against another slab (evicted and loaded again meanwhile): not this one. A load under way
            # when the files were checked may have ended since: its slab holds what that load planned from.
            if replaced is None or (replaced[0] is not s.manifest and replaced[0] is not s.planned_checkpoint):
                keep.append((s, p))
                kept_ids.add(identity(p))
                continue
            log.info("checkpoint replaced on disk model=%s tp_size=%d rank=%d fields=%s: loading it again",
                     p.model.name, p.tp_size, p.tp_rank, ",".join(replaced[1][:8]))
        add.append(p)
    gone = [s for k, s in current.items() if k not in kept_ids] + gone_published
    retire = tuple(s for s in gone if s.state is SlotState.READY and s.leases)
    drop = tuple(s for s in gone if s not in retire)
    changed = tuple(k for k in RESTART_KEYS if getattr(old, k) != getattr(new, k)
                    and not (k == "backend" and running_backend is not None
                             and new.backend in ("auto", running_backend)))
    return ReloadPlan(tuple(keep), tuple(add), drop, retire, changed, tuple(published))


@dataclass(frozen=True)
class Applied:
    """What :func:`apply` leaves for the I/O layer, and the ``reload_reply`` figures.

    Attributes:
        load (`tuple[Slot]`): PENDING slots to queue on the loader.
        cancel (`tuple[Slot]`): DROPPED slots whose load is queued or under way.
        free (`tuple[tuple[str | None, Any, Any]]`): (fd-store id to remove, SealedSlab
            to close, manifest file to close), each None when there is none.
        added, dropped, retired, kept (`tuple[str]`): slot labels.
    """

    load: tuple[Slot, ...]
    cancel: tuple[Slot, ...]
    free: tuple[tuple[str | None, Any, Any], ...]
    added: tuple[str, ...]
    dropped: tuple[str, ...]
    retired: tuple[str, ...]
    kept: tuple[str, ...]


def apply(state: ServiceState, p: ReloadPlan, config: Config) -> Applied:
    """Carries out ``p`` on ``state`` (serving loop only) and records ``config`` as applied.

    The new slot list is the config's order, then the RETIRED slots.

    Raises:
        IllegalTransition: a slot is not in a state the plan allows (a bug).
    """
    load, cancel, free = [], [], []
    for s in p.drop:
        # a publication being digested has no load to cancel; one promoted from the host tier has
        if s.state in (SlotState.PENDING, SlotState.LOADING) and (s.publication is None or s.hosted is not None):
            cancel.append(s)
        sealed, manifest_file = s.drop()
        if sealed is not None or manifest_file is not None:
            free.append((s.store_id, sealed, manifest_file))
        log.info("dropped by reload model=%s tp_size=%d rank=%d", s.placement.model.name, s.placement.tp_size,
                 s.placement.tp_rank,
                 extra=event("evicted", s.placement.model.name, s.placement.tp_rank, tp_size=s.placement.tp_size))
    for s in p.retire:
        s.retire()
        free.append((s.store_id, None, None))  # out of the fd store now: the changed model's new slab takes its name
        log.info("retired by reload model=%s tp_size=%d rank=%d leases=%d: freed when the last is released",
                 s.placement.model.name, s.placement.tp_size, s.placement.tp_rank, len(s.leases))
    by_id = {identity(new): s for s, new in p.keep}
    for s, new in p.keep:
        s.placement = new
        if s.state in (SlotState.FAILED, SlotState.WAITING_FOR_ENGINE):
            s.requeue()
            load.append(s)
    for s, new in p.published:
        s.placement = new
    added = {identity(pl): state.new_slot(pl, config.realpath_of(pl.model.path)) for pl in p.add}
    load += added.values()
    order = [identity(pl) for pl in config.placements(state.gpu)]
    retired = [s for s in state.slots if s.state is SlotState.RETIRED]
    state.slots = [by_id.get(k) or added[k] for k in order] + [s for s, _ in p.published] + retired
    state.config_error = None
    state.config_source = config.files[0] if config.files else state.config_source
    return Applied(tuple(load), tuple(cancel), tuple(free), tuple(s.label for s in added.values()),
                   tuple(s.label for s in p.drop), tuple(s.label for s in p.retire),
                   tuple(s.label for s, _ in p.keep))


def release_retired(state: ServiceState, slot: Slot, force: bool = False) -> tuple[Any, Any] | None:
    """Drops a RETIRED ``slot`` whose last lease ended (or any RETIRED one with ``force``: ``evict --force``);
    returns (SealedSlab, manifest file) for the caller to close.

    Returns None (and changes nothing) while the slot is not RETIRED or still leased.
    """
    if slot.state is not SlotState.RETIRED or (slot.leases and not force):
        return None
    state.slots = [s for s in state.slots if s is not slot]
    log.info("freed retired slab model=%s tp_size=%d rank=%d", slot.placement.model.name, slot.placement.tp_size,
             slot.placement.tp_rank,
             extra=event("evicted", slot.placement.model.name, slot.placement.tp_rank, tp_size=slot.placement.tp_size))
    return slot.drop()
