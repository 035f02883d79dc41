"""One function per request: takes the state and the request, returns replies and effects.

Owns the meaning of every request (``hello``, ``list``, ``status``,
``attach``, ``release``, ``verify``, ``evict``, ``preload``, ``reload``, ``attach_published``; ``publish``
is :mod:`weightcache.daemon.publish`'s), the
:data:`HANDLERS` dict that dispatches them by message type, and :func:`handle`,
which applies the service's rule for failures inside one request (STYLE.md,
"Errors"):

- a :class:`~weightcache.errors.WeightcacheError` becomes that client's error
  reply;
- any other exception answers that client with ``internal_error`` and logs
  CRITICAL with the traceback; the service goes on;
- :class:`~weightcache.daemon.state.IllegalTransition` (the service's own
  bookkeeping is broken) is not caught: the serving loop exits on it.

Handlers change the state directly (they run on the serving loop's thread)
and *return* what the I/O layer must do (h11's way): :class:`Reply` frames
for the requester and effects (:class:`StartLoad`, :class:`FreeSlab`,
:class:`Refuse`, :class:`CancelLoad`, :class:`Reconfigure`; defined with :class:`Context` in
:mod:`weightcache.daemon.effects`). They never touch a
socket, the fd store or the loader, so tests call them in-process
(tests/unit/test_daemon_handlers.py, tests/unit/test_daemon_reload.py).

Forbidden imports: socket, selectors, threading, weightcache.notify, weightcache.fdpass,
weightcache.daemon.transport, weightcache.daemon.loads, weightcache.daemon.fdstore,
weightcache.daemon.ticker, weightcache.daemon.loop.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from typing import Any, Callable

from .. import identity, pipeline, protocol
from ..spec import DTYPE_NAMES
from ..errors import (AccessDenied, ConfigError, InsufficientMemory, InternalError, LeaseBusy, ModelLoadFailed,
                      ModelNotFound, RemoteProtocolError, ResourceExhausted, WeightcacheError)
from ..journal import event
from ..wire import UNSETTLED, SlotState
from . import access, publish, reload, tiers
from .effects import (CancelLoad, Context, FreeSlab, Outcome, Reconfigure, Refuse, Reply, StartLoad, StartVerify,
                      VerifyItem, one_reply)
from .state import (ON_DEMAND, IllegalTransition, Peer, ServiceState, Slot, describe_config_error,
                    lease_holders)

log = logging.getLogger(__name__)

#: What ``hello_reply`` lists as the service's capabilities.
CAPABILITIES = ("attach", "release", "status", "list", "verify", "evict", "preload", "wait", "metrics", "reload",
                "publish")


def on_hello(ctx: Context, peer: Peer, msg: protocol.Hello) -> Outcome:
    """``hello``: the service's version, GPU and capabilities; another protocol version is refused."""
    st = ctx.state
    if msg.protocol_version != protocol.PROTOCOL_VERSION:
        return Outcome(effects=(Refuse(RemoteProtocolError(
            f"protocol version {msg.protocol_version} is not supported; this service speaks "
            f"{protocol.PROTOCOL_VERSION}: upgrade the client or the service", field="protocol_version")),))
    return one_reply(protocol.HelloReply(protocol.PROTOCOL_VERSION, st.gpu, st.device.get("gpu_uuid", ""),
                                    st.backend, list(CAPABILITIES) + (["publish_cuda_ipc"] if ctx.defer_publication
                                                                      is not None else [])))


#: What ``status`` shows of another uid's lease to a non-operator: the lease, not who holds it.
HIDDEN_ID = protocol.HIDDEN_ID


def _visible(ctx: Context, peer: Peer | None, now: float, every_slab: bool = False) -> tuple[protocol.SlabInfo, ...]:
    """What ``peer`` may see: every slot for an operator (or ``None``: the service itself); else the slots
    it may attach (every slot with ``every_slab``: the metrics endpoint's view), where the leases of other
    uids (of every uid with ``every_slab``) keep their id, time and mode but show :data:`HIDDEN_ID` as pid,
    uid and gid (lease counts stay right, holders stay private)."""
    if peer is None or access.is_operator(peer, ctx.policy):
        return tuple(s.info(now) for s in ctx.state.slots)
    shown = ctx.state.slots if every_slab else [s for s in ctx.state.slots if access.may_attach(peer, s, ctx.policy)]
    aliases = restricted_aliases(ctx, peer) if every_slab else {}

    def hidden(uid: int) -> bool:
        return every_slab or uid != peer.uid

    def hide(x: protocol.LeaseInfo) -> protocol.LeaseInfo:
        return dataclasses.replace(x, pid=HIDDEN_ID, uid=HIDDEN_ID, gid=HIDDEN_ID) if hidden(x.uid) else x

    def refused(s: Slot, i: protocol.SlabInfo) -> protocol.SlabInfo:
        if s.error is not None or s.refusal is None:
            return i
        return dataclasses.replace(i, error=protocol.ErrorInfo(**_refusal_for(ctx, peer, s.refusal).to_wire()))

    def named(i: protocol.SlabInfo) -> protocol.SlabInfo:
        alias = aliases.get(i.model)
        return i if alias is None else dataclasses.replace(i, model=alias, path="", error=None, key=None,
                                                            publication=None)

    return tuple(named(dataclasses.replace(refused(s, i), leases=tuple(hide(x) for x in i.leases),
                                           lease_holders=lease_holders(s.leases.values(), hidden)))
                 for s, i in ((s, s.info(now)) for s in shown))


def _refusal_for(ctx: Context, peer: Peer, e: Any) -> Any:
    """A slot's ``insufficient_memory`` as ``peer`` may see it (:func:`weightcache.daemon.tiers.refusal_for`)."""
    if access.is_operator(peer, ctx.policy):
        return e
    slots = {s.label: s for s in ctx.state.slots}
    return tiers.refusal_for(e, lambda label: label in slots and access.may_attach(peer, slots[label], ctx.policy),
                             peer.uid)


#: What the metrics endpoint's user sees instead of the name of a model it may not attach: ``restricted-N``.
RESTRICTED_ALIAS = "restricted-{}"


def restricted_aliases(ctx: Context, peer: Peer) -> dict[str, str]:
    """Model name -> ``restricted-N`` for each model ``peer`` may not attach (N: its position among those
    models in the configuration's order); empty for an operator. Names, paths and errors of those models are
    not shown to ``peer``; their figures are (docs/reliability.md, "Threat model")."""
    if access.is_operator(peer, ctx.policy):
        return {}
    out: dict[str, str] = {}
    for s in ctx.state.slots:
        name = s.placement.model.name
        if name not in out and not access.may_attach(peer, s, ctx.policy):
            out[name] = RESTRICTED_ALIAS.format(len(out))
    return out


def _counters_for(ctx: Context, peer: Peer, counters: protocol.ServiceCounters,
                  every_slab: bool) -> protocol.ServiceCounters:
    """``counters`` as ``peer`` may see them: the models it may not attach renamed (``every_slab``: the
    metrics endpoint) or left out (anyone else who is no operator), in every per-model table
    (:data:`PER_MODEL_COUNTERS`)."""
    aliases = restricted_aliases(ctx, peer)
    if not aliases:
        return counters

    def fix(entries: tuple) -> tuple:
        if every_slab:
            return tuple(dataclasses.replace(e, model=aliases[e.model]) if e.model in aliases else e for e in entries)
        return tuple(e for e in entries if e.model not in aliases)

    return dataclasses.replace(counters, **{f: fix(getattr(counters, f)) for f in PER_MODEL_COUNTERS})


#: The fields of :class:`~weightcache.protocol.ServiceCounters` whose entries name a model (a ``model`` field):
#: each is filtered by :func:`_counters_for`. Every tuple field of the record is one
#: (tests/unit/test_daemon_handlers.py checks it, so that a new per-model table cannot leak a restricted name).
PER_MODEL_COUNTERS = ("attaches", "attach_times", "loads", "slabs", "publishes", "seeds", "publications_dropped")


def on_list(ctx: Context, peer: Peer, msg: protocol.List) -> Outcome:
    """``list``: one :class:`~weightcache.protocol.SlabInfo` per slot ``peer`` may see (see :func:`status`)."""
    return one_reply(protocol.ListReply([i.to_json() for i in _visible(ctx, peer, ctx.monotonic())]))


def status(ctx: Context, peer: Peer | None = None, every_slab: bool = False) -> protocol.ServiceStatus:
    """The service's :class:`~weightcache.protocol.ServiceStatus` now, as ``peer`` may see it.

    Operators (and ``peer=None``) see every slab; anyone else sees the models it
    may attach, with the holders of other uids' leases hidden (:data:`HIDDEN_ID`);
    with ``every_slab`` a non-operator sees every slab, every holder hidden (``metrics``).
    """
    st, now = ctx.state, ctx.monotonic()
    free, total = ctx.mem_info()
    return protocol.ServiceStatus(
        gpu=st.gpu, pid=ctx.pid, backend=st.backend, device=protocol.DeviceInfo.from_json(st.device),
        free_bytes=int(free), total_bytes=int(total), slabs=_visible(ctx, peer, now, every_slab), clients=len(st.peers),
        status_line=st.status_line(now),
        config_error=protocol.ErrorInfo(**st.config_error.to_wire()) if st.config_error is not None else None,
        budget_bytes=ctx.tiers.budget_bytes, gpu_bytes=ctx.tiers.gpu_used(st),
        host_tier_bytes=ctx.tiers.host_tier_bytes, host_used_bytes=ctx.tiers.host_used(st),
        held_elsewhere_bytes=ctx.tiers.held_elsewhere_bytes)


def on_status(ctx: Context, peer: Peer, msg: protocol.Status) -> Outcome:
    """``status``: see :func:`status`."""
    return one_reply(protocol.StatusReply(status(ctx, peer).to_json()))


def _dtype_matches(slot: Slot, requested: str) -> bool:
    """Whether ``slot`` serves an engine asking for ``requested`` (see :func:`weightcache.identity.dtype_matches`).

    Answered from :attr:`Slot.dtype_served` alone: no file is opened, stat-ed or read on the serving loop.
    Once a load of the slot is planned (or its slab adopted) it holds every name. Before that a name is
    *provisionally* matched ("not planned yet"): the attach parks as for a load (or hears ``loading``), and
    :func:`answer_attach` checks the name again against the plan before granting a lease. A name that is
    no dtype at all never matches.
    """
    served = slot.dtype_served.get(requested)
    if served is not None:
        return served
    return requested == slot.placement.model.dtype or requested in DTYPE_NAMES


def _check_planned_dtype(ctx: Context, msg: protocol.Attach, slot: Slot) -> None:
    """Raises ModelNotFound (`model_not_found`) when the plan says ``slot`` does not serve ``msg.dtype``
    (an attach matched before the slot was planned: see :func:`_dtype_matches`)."""
    if msg.dtype is None or slot.dtype_served.get(msg.dtype, True):
        return
    p = slot.placement
    raise ModelNotFound(f"GPU {ctx.state.gpu}: model {p.model.name} ({p.label}) is planned as {p.model.dtype}, "
                        f"which does not give the bytes of dtype={msg.dtype}", model=msg.model, gpu=ctx.state.gpu,
                        dtype=msg.dtype)


def on_attach(ctx: Context, peer: Peer, msg: protocol.Attach) -> Outcome:
    """``attach``: a lease and the slab's fd, or ``loading``, or parks the request while the slot loads.

    ``msg.mode`` is an :class:`~weightcache.wire.AttachMode` (checked when the frame was decoded).

    Raises:
        ModelNotFound (`model_not_found`), AccessDenied (`access_denied`),
        ModelLoadFailed (`model_load_failed`): see :func:`answer_attach`.
    """
    st = ctx.state
    slot = st.find_slots(msg.model, msg.tp_size, msg.tp_rank, msg.dtype, msg.naming, _dtype_matches)[0]
    access.check_attach(peer, slot, ctx.policy)
    effects: tuple[Any, ...] = ()
    if tiers.demand(slot, ctx.monotonic()):  # in the host tier or on disk: promote or load it now
        effects = (StartLoad(slot),)
        slot.demand_by = peer  # its load displaces only what this peer may attach
    elif slot.state in UNSETTLED:
        if not slot.demand:
            slot.demand_by = peer  # a start-up load an engine now waits for: the room it may make is this peer's
        slot.demand = True  # an engine waits for it: its load may make room
    if slot.state in UNSETTLED and msg.wait_ms > 0:
        peer.waiting.append((msg, slot, ctx.monotonic() + msg.wait_ms / 1e3))
        return Outcome(effects=effects)
    out = answer_attach(ctx, peer, msg, slot)
    return Outcome(out.replies, out.effects + effects)


def _check_lease_caps(ctx: Context, peer: Peer) -> None:
    """Raises ResourceExhausted (`resource_exhausted`) when ``peer`` holds ``max_leases_per_connection`` leases,
    or its uid ``max_leases_per_uid`` (root and the service user are exempt from the latter)."""
    svc, st = ctx.service_config, ctx.state
    for limit, value, actual in (
            ("max_leases_per_connection", svc.max_leases_per_connection, len(peer.leases)),
            ("max_leases_per_uid", svc.max_leases_per_uid,
             0 if peer.uid in (0, st.service_uid) else st.leases_by_uid.get(peer.uid, 0))):
        if actual >= value:
            raise ResourceExhausted(
                f"attach refused: service.{limit} = {value} reached (this {'connection' if 'connection' in limit else 'uid'} "
                f"holds {actual} leases); release the leases you do not use (an engine holds one per rank), or ask "
                f"the operator to raise service.{limit}", limit=limit, value=value, actual=actual)


def answer_attach(ctx: Context, peer: Peer, msg: protocol.Attach, slot: Slot) -> Outcome:
    """The answer to an attach for ``slot`` as it is now.

    Raises:
        ModelLoadFailed (`model_load_failed`): the slot failed to load (``cause``
            is the load error's code) or was evicted (``cause=evicted``).
        InsufficientMemory (`insufficient_memory`): its load or promotion got no room in the memory budget.
        ResourceExhausted (`resource_exhausted`): the connection or its uid holds
            ``max_leases_per_connection`` / ``max_leases_per_uid`` leases.
    """
    p = slot.placement
    if slot.state is SlotState.READY:
        _check_planned_dtype(ctx, msg, slot)
        _check_lease_caps(ctx, peer)
        slot.last_used = ctx.monotonic()
        lease = ctx.state.lease(peer, slot, msg.mode, ctx.wall())
        tiers.note_receiver(slot.sealed, peer.pid)  # cuda: counted once freed until it exits
        mf = slot.manifest_file
        log.info("attached model=%s tp_size=%d rank=%d peer_pid=%d peer_uid=%d lease=%d mode=%s",
                 p.model.name, p.tp_size, p.tp_rank, peer.pid, peer.uid, lease.lease_id, msg.mode,
                 extra=event("attached", p.model.name, p.tp_rank, tp_size=p.tp_size, size_bytes=slot.sealed.size_bytes,
                               peer_pid=peer.pid, lease=lease.lease_id))
        return one_reply(protocol.AttachReply(lease.lease_id, p.model.path, ctx.state.backend, mf.size_bytes),
                    (slot.sealed.fd, mf.fd))
    if slot.state is SlotState.FAILED:
        e = slot.error
        raise ModelLoadFailed(f"model {p.model.name} ({p.label}) failed to load: {e.message}",
                              model=p.model.name,
                              cause=e.details.get("cause", e.code) if isinstance(e, ModelLoadFailed) else e.code,
                              cause_details=e.details)
    if slot.state is SlotState.WAITING_FOR_ENGINE:  # only its engine lays it out: attach_published gets it
        e = slot.error
        raise ModelLoadFailed(f"model {p.model.name} ({p.label}) waits for its engine: the service cannot lay it out "
                              f"with naming=vllm ({e.message if e is not None else 'no rules'}); an engine started "
                              f"with --load-format weightcache loads it with vLLM's own loader and publishes it",
                              model=p.model.name, cause=e.code if e is not None else "unsupported_architecture",
                              cause_details=e.details if e is not None else {}, waiting_for_engine=True)
    if slot.state is SlotState.DROPPED and slot.publication is not None and slot.error is not None:
        # a parked attach_published whose publication failed its promotion (or image load) and left the service
        raise ModelNotFound(
            f"GPU {ctx.state.gpu} dropped the publication of {p.model.name} tp_size={p.tp_size} tp_rank={p.tp_rank}: "
            f"{slot.error.message}; the engine loads it itself and publishes it again", model=p.model.name,
            tp_size=p.tp_size, tp_rank=p.tp_rank, gpu=ctx.state.gpu, publication="none",
            cause=str(slot.error.details.get("cause") or slot.error.code))
    if slot.state is SlotState.DROPPED:  # a parked attach whose model a reload removed
        raise ModelNotFound(f"model {p.model.name} ({p.label}) was removed from the configuration by a reload",
                            model=p.model.name, gpu=ctx.state.gpu)
    if slot.state is SlotState.EVICTED:
        raise ModelLoadFailed(f"model {p.model.name} ({p.label}) was evicted; run `weightcache preload "
                              f"{p.model.name}` to load it again", model=p.model.name, cause="evicted")
    if slot.state in ON_DEMAND and slot.refusal is not None:
        raise _refusal_for(ctx, peer, slot.refusal)
    return one_reply(protocol.Loading(p.model.name, slot.done_bytes, slot.total_bytes, slot.state.value))


def _answer_parked(ctx: Context, peer: Peer, msg: protocol.Attach, slot: Slot) -> Outcome:
    """:func:`answer_attach` for an attach parked earlier: the allow lists are checked again (a reload may have
    taken the peer off them while it waited)."""
    access.check_attach(peer, slot, ctx.policy)
    return answer_attach(ctx, peer, msg, slot)


def _replacement(ctx: Context, msg: protocol.Attach, slot: Slot) -> Slot:
    """The slot a parked attach waits for now: ``slot``, or when a reload dropped it and added another for the
    same model (its path retargeted, its checkpoint files replaced: a load under way discarded), that one."""
    if slot.state is not SlotState.DROPPED or slot.publication is not None:  # a publication has no replacement
        return slot
    try:
        new = ctx.state.find_slots(msg.model, msg.tp_size, msg.tp_rank, msg.dtype, msg.naming, _dtype_matches)[0]
    except WeightcacheError:  # removed from the configuration: the dropped slot's answer says so
        return slot
    if new.state in UNSETTLED:
        new.demand = True  # an engine waits for it, as on_attach marks it
    return new


def service_waiting(ctx: Context, peer: Peer) -> Outcome:
    """Answers the parked attaches of ``peer`` whose slot settled or whose deadline passed (one whose slot a reload
    replaced waits for the new one: :func:`_replacement`)."""
    now = ctx.monotonic()
    still, replies = [], []
    for msg, slot, deadline in peer.waiting:
        slot = _replacement(ctx, msg, slot)
        if slot.state in UNSETTLED and now < deadline:
            still.append((msg, slot, deadline))
            continue
        replies += _guarded(peer, msg, lambda m=msg, s=slot: _answer_parked(ctx, peer, m, s)).replies
    peer.waiting = still
    return Outcome(tuple(replies))


def on_release(ctx: Context, peer: Peer, msg: protocol.Release) -> Outcome:
    """``release``: ends one lease of this connection.

    Raises:
        RemoteProtocolError (`protocol_violation`): the lease is not this connection's.
    """
    lease = peer.leases.get(msg.lease_id)
    if lease is None:
        raise RemoteProtocolError(f"release: lease {msg.lease_id} is not held by this connection",
                                  lease_id=msg.lease_id)
    return Outcome((Reply(protocol.ReleaseReply(msg.lease_id)),), end_lease(ctx.state, peer, lease))


def end_lease(state: ServiceState, peer: Peer, lease: Any) -> tuple[FreeSlab, ...]:
    """Ends ``lease`` (release or connection closed) and logs it; returns the effects (the last lease
    of a RETIRED slot frees its slab)."""
    state.end_lease(peer, lease)
    lease.slot.last_used = time.monotonic()
    p = lease.slot.placement
    log.info("released model=%s tp_size=%d rank=%d peer_pid=%d lease=%d", p.model.name, p.tp_size, p.tp_rank, peer.pid,
             lease.lease_id, extra=event("released", p.model.name, p.tp_rank, tp_size=p.tp_size,
                                         duration_ms=(time.time() - lease.since) * 1e3,
                         lease=lease.lease_id))
    freed = reload.release_retired(state, lease.slot)
    return (FreeSlab(None, *freed),) if freed is not None else ()


def _operator_slots(ctx: Context, peer: Peer, request: str, model: str, **layout: Any) -> list[Slot]:
    """The slots of ``model`` that an operator ``peer`` may also attach.

    Raises:
        AccessDenied (`access_denied`): not an operator, or not on the model's allow lists.
        ModelNotFound (`model_not_found`): nothing matches.
    """
    access.check_operator(peer, ctx.policy, request, model)
    slots = ctx.state.find_slots(model, published=None, **layout)
    for s in slots:
        access.check_attach(peer, s, ctx.policy, request)
    return slots


def on_verify(ctx: Context, peer: Peer, msg: protocol.Verify) -> Outcome:
    """``verify``: recomputes the content digests of each matching READY slab (operators only).

    Hashing a slab takes seconds per GiB, so it is not done here: the handler
    takes a snapshot of the slots (:class:`VerifyItem`) and returns
    :class:`StartVerify`; the serving loop runs :func:`verify_reply` on a
    worker thread, holds the requester's later requests until the reply is
    sent, and keeps the slabs mapped until it is done.
    """
    items = []
    for s in _operator_slots(ctx, peer, "verify", msg.model, tp_size=msg.tp_size, tp_rank=msg.tp_rank):
        p, ready = s.placement, s.state is SlotState.READY
        items.append(VerifyItem(p.model.name, p.tp_size, p.tp_rank, s.state.value,
                                s.manifest if ready else None, s.sealed if ready else None))
    return Outcome(effects=(StartVerify(msg, tuple(items)),))


def verify_reply(peer: Peer, eff: StartVerify) -> Outcome:
    """The ``verify_reply`` for ``eff.items`` (runs on a worker thread; touches no state), under the failure rule."""
    def run() -> Outcome:
        results = []
        for it in eff.items:
            if it.sealed is None:
                results.append(protocol.VerifyResult(it.model, it.tp_size, it.tp_rank, it.state, []))
                continue
            t0 = time.monotonic()
            bad = pipeline.verify(it.manifest, it.sealed)
            n = len(it.manifest.tensors)
            log.log(logging.WARNING if bad else logging.INFO,
                    "verified model=%s tp_size=%d rank=%d tensors=%d mismatched=%d", it.model, it.tp_size,
                    it.tp_rank, n, len(bad),
                    extra=event("verify", it.model, it.tp_rank, tp_size=it.tp_size,
                                duration_ms=(time.monotonic() - t0) * 1e3,
                                tensors=n, mismatched=len(bad)))
            results.append(protocol.VerifyResult(it.model, it.tp_size, it.tp_rank, it.state, bad, n))
        return one_reply(protocol.VerifyReply([r.to_json() for r in results]))

    return _guarded(peer, eff.request, run)


def on_evict(ctx: Context, peer: Peer, msg: protocol.Evict) -> Outcome:
    """``evict``: frees every READY slab of a model (engines keep their mappings; operators only).

    Raises:
        AccessDenied (`access_denied`): see :func:`_operator_slots`.
        LeaseBusy (`lease_busy`): leases are held and ``force`` is not set.
    """
    if msg.to not in ("", "host", "disk"):
        raise RemoteProtocolError(f"evict: to must be host or disk (or empty), got {msg.to!r}", field="to")
    slots = _operator_slots(ctx, peer, "evict", msg.model, retired=True)
    leased = [s for s in slots if s.leases]
    if leased and msg.to:
        raise LeaseBusy(f"model {msg.model!r} has {sum(len(s.leases) for s in leased)} active leases; "
                        f"evict --to {msg.to} moves only unleased slabs (plain evict --force frees it anyway)",
                        model=msg.model)
    if leased and not msg.force:
        raise LeaseBusy(f"model {msg.model!r} has {sum(len(s.leases) for s in leased)} active leases; "
                        f"use --force to evict anyway (engines keep their mappings)", model=msg.model)
    _refuse_unknown_leases(slots, msg)
    if msg.to:
        return _evict_to(ctx, slots, msg.to)
    evicted, effects = [], []
    for s in slots:
        if s.state is SlotState.RETIRED:  # removed by a reload, already out of the fd store
            effects.append(FreeSlab(None, *reload.release_retired(ctx.state, s, force=True)))
            evicted.append(s.label)
            continue
        if s.state in ON_DEMAND:  # the host tier's copy, or nothing, goes; out until preload
            sealed, manifest_file = s.evict()
            if sealed is not None:
                effects.append(FreeSlab(s.store_id, sealed, manifest_file))
                evicted.append(s.label)
            if s.publication is not None:  # nothing loads a publication again: gone, the next engine publishes
                ctx.state.slots = [x for x in ctx.state.slots if x is not s]
            continue
        if s.state is not SlotState.READY:
            continue
        sealed, manifest_file = s.evict()
        effects.append(FreeSlab(s.store_id, sealed, manifest_file))
        evicted.append(s.label)
        if s.publication is not None:  # nothing loads a publication again: it is gone, the next engine publishes
            ctx.state.slots = [x for x in ctx.state.slots if x is not s]
        log.info("evicted model=%s tp_size=%d rank=%d forced=%s size_bytes=%d", s.placement.model.name,
                 s.placement.tp_size, s.placement.tp_rank, msg.force, sealed.size_bytes,
                 extra=event("evicted", s.placement.model.name, s.placement.tp_rank, size_bytes=sealed.size_bytes,
                             tp_size=s.placement.tp_size))
    return Outcome((Reply(protocol.EvictReply(evicted)),), tuple(effects))


def _refuse_unknown_leases(slots: list[Slot], msg: protocol.Evict) -> None:
    """Refuses an ``evict`` without ``force`` of slabs adopted from the fd store after a restart.

    Leases live in the process that granted them: after a restart, engines that attached before it
    still map the slab, and this process cannot know whether any does (issue 26). Their leases are
    unknown, not zero, so ``evict`` treats them as held.

    Raises:
        LeaseBusy (`lease_busy`, details ``leases="unknown"``): an adopted READY slab and no ``force``.
    """
    adopted = [s for s in slots if s.adopted and s.state is SlotState.READY]
    if adopted and not msg.force:
        raise LeaseBusy(f"model {msg.model!r} was taken back from systemd's fd store after the service restarted: "
                        f"engines that attached before the restart are unknown to this process and may still map "
                        f"it; use --force to evict anyway (engines keep their mappings; the memory is freed when "
                        f"the last one detaches)", model=msg.model, leases="unknown")


def _evict_to(ctx: Context, slots: list[Slot], to: str) -> Outcome:
    """``evict --to host|disk``: moves the unleased READY (and, to disk, HOSTED) slots of a model. A demotion
    that copies runs off the serving loop (:class:`~weightcache.daemon.tiers.Demoting`); the serving loop sends
    the reply once it is done.

    Raises:
        InsufficientMemory (`insufficient_memory`): ``--to host`` and the host tier has no room for them
            (``[service] host_tier_bytes``); nothing moved.
    """
    st, t = ctx.state, ctx.tiers
    moving = [s for s in slots if (s.state is SlotState.READY and (to == "disk" or s.demoting is None))
              or (to == "disk" and s.state is SlotState.HOSTED)]  # a slab already on its way to the host stays
    if to == "host":
        need = sum(s.gpu_bytes for s in moving)
        if t.host_used(st) + need > t.host_tier_bytes:
            raise InsufficientMemory(
                f"evict --to host: the host tier has {t.host_tier_bytes - t.host_used(st)} bytes free of "
                f"host_tier_bytes = {t.host_tier_bytes}, {need} needed for {', '.join(s.label for s in moving)}; "
                f"raise host_tier_bytes or evict --to disk", model=moving[0].placement.model.name if moving else "",
                need_bytes=need, budget_bytes=t.host_tier_bytes, free_bytes=t.host_tier_bytes - t.host_used(st),
                resident=[], leases=[])
        moves = [t.demote(st, s, "evict --to host") for s in moving]
    else:
        moves = [t.shelve(st, s, "evict --to disk") for s in moving]
    return Outcome((Reply(protocol.EvictReply([s.label for s in moving])),), tuple(moves))


def on_preload(ctx: Context, peer: Peer, msg: protocol.Preload) -> Outcome:
    """``preload``: queues every FAILED or EVICTED slot of a model for loading again, and loads or promotes
    every one in the host tier or on disk, making room in the budget as an attach does (operators only)."""
    started, effects = [], []
    for s in _operator_slots(ctx, peer, "preload", msg.model):
        if tiers.demand(s, ctx.monotonic()):
            s.demand_by = peer
            effects.append(StartLoad(s))
            started.append(s.label)
        elif s.state in (SlotState.FAILED, SlotState.EVICTED, SlotState.WAITING_FOR_ENGINE):
            s.requeue()
            effects.append(StartLoad(s))
            started.append(s.label)
    return Outcome((Reply(protocol.PreloadReply(started)),), tuple(effects))


#: How long an ``attach_published`` of a publication in the host tier waits for its promotion, ms (the request has
#: no ``wait_ms`` of its own; the client's timeout bounds it too).
PUBLISHED_PROMOTION_WAIT_MS = 60_000


def on_attach_published(ctx: Context, peer: Peer, msg: protocol.AttachPublished) -> Outcome:
    """``attach_published``: a lease on the publication of the model's rank made under the engine's key, answered
    as ``attach`` (:func:`answer_attach`); see :func:`weightcache.daemon.publish.find_publication`.

    Raises:
        PublicationInvalid (`publication_invalid`): the engine key lacks a field or has one of the wrong type.
        ModelNotFound (`model_not_found`), CacheKeyMismatch (`cache_key_mismatch`): see
            :func:`~weightcache.daemon.publish.find_publication`.
        AccessDenied (`access_denied`): the peer is not on the model's allow lists.
    """
    fields = identity.engine_key(msg.engine_key, msg.tp_size, msg.tp_rank)
    slot = publish.find_publication(ctx, peer, msg.model, msg.tp_size, msg.tp_rank, fields)
    access.check_attach(peer, slot, ctx.policy)
    attach = protocol.Attach(msg.model, msg.tp_size, msg.tp_rank, mode=msg.mode, wait_ms=PUBLISHED_PROMOTION_WAIT_MS)
    effects: tuple[Any, ...] = ()
    if tiers.demand(slot, ctx.monotonic()):  # in the host tier: promoted, the attach waits for it
        slot.demand_by = peer
        effects = (StartLoad(slot),)
    if slot.state in UNSETTLED:
        peer.waiting.append((attach, slot, ctx.monotonic() + attach.wait_ms / 1e3))
        return Outcome(effects=effects)
    return answer_attach(ctx, peer, attach, slot)


def on_metrics(ctx: Context, peer: Peer, msg: protocol.Metrics) -> Outcome:
    """``metrics``: the :func:`status` record and the service's counters (none: empty).

    Operators and the metrics endpoint's user (:func:`access.may_observe_all`) see
    every slab, the endpoint with every lease holder hidden and the models it may
    not attach named ``restricted-N`` (:func:`restricted_aliases`: no name, path or
    error); anyone else sees what :func:`status` shows it, and the counters of
    those models only.
    """
    every_slab = access.may_observe_all(peer, ctx.policy)
    counters = ctx.counters.record() if ctx.counters is not None else protocol.ServiceCounters("", 0.0)
    record = status(ctx, peer, every_slab=every_slab)
    return one_reply(protocol.MetricsReply(record.to_json(), _counters_for(ctx, peer, counters, every_slab).to_json()))


def on_reload(ctx: Context, peer: Peer, msg: protocol.Reload) -> Outcome:
    """``reload``: reads the configuration again and applies it (:mod:`weightcache.daemon.reload`).

    Raises:
        AccessDenied (`access_denied`): the peer is neither root nor the service's user.
        ConfigError (`config_invalid`): the files do not load; nothing changed, the
            service keeps serving and reports the error (``status``, ``STATUS=``).
    """
    st = ctx.state
    if peer.uid not in (0, st.service_uid):
        raise AccessDenied(f"uid {peer.uid} may not reload the service on GPU {st.gpu}: only root and the "
                           f"service's user (uid {st.service_uid}) may; run `sudo systemctl reload "
                           f"weightcache@{st.gpu}`", uid=peer.uid)
    try:
        config = ctx.load_config()
    except ConfigError as e:
        st.config_error = e
        log.warning("reload refused, still serving the previous configuration file=%s line=%s key=%s error=%s",
                    e.details.get("file"), e.details.get("line"), e.details.get("key"), describe_config_error(e),
                    extra=reload.config_rejected_event(e))
        raise
    p = reload.plan(st.slots, config.placements(st.gpu), ctx.service_config, config.service,
                    realpath=config.realpath_of, running_backend=st.backend, changed=ctx.changed_checkpoints)
    done = reload.apply(st, p, config)
    ctx.service_config = config.service
    ctx.tiers.budget_bytes = config.service.budget_bytes(int(ctx.mem_info()[1]))
    ctx.tiers.host_tier_bytes = config.service.host_tier_bytes
    moved = ctx.tiers.enforce(st, "reload: memory_budget_bytes or host_tier_bytes lowered")
    load = [s for s in done.load if tiers.start_placement(s)]
    log.info("reloaded files=%s added=%d dropped=%d retired=%d kept=%d restart_keys=%s", ",".join(config.files),
             len(done.added), len(done.dropped), len(done.retired), len(done.kept), ",".join(p.restart_keys) or "-",
             extra=event("reloaded", added=len(done.added), dropped=len(done.dropped), retired=len(done.retired),
                         kept=len(done.kept)))
    effects = ([CancelLoad(s) for s in done.cancel] + [FreeSlab(*f) for f in done.free] + moved
               + [StartLoad(s) for s in load] + [Reconfigure(config)])
    moves = [f"{m.slot.label} -> {m.tier}" if isinstance(m, tiers.Moved) else f"{m.slot.label} -> host (copying)"
             for m in moved]
    return Outcome((Reply(protocol.ReloadReply(list(done.added), list(done.dropped), list(done.retired),
                                               list(done.kept), list(p.restart_keys), list(config.files),
                                               moves)),),
                   tuple(effects))


#: Message type -> handler.
HANDLERS: dict[type, Callable[[Context, Peer, Any], Outcome]] = {
    protocol.Hello: on_hello,
    protocol.List: on_list,
    protocol.Status: on_status,
    protocol.Attach: on_attach,
    protocol.Release: on_release,
    protocol.Verify: on_verify,
    protocol.Evict: on_evict,
    protocol.Preload: on_preload,
    protocol.Metrics: on_metrics,
    protocol.Reload: on_reload,
    protocol.AttachPublished: on_attach_published,
}

#: Message type -> handler, for the requests that carry fds (``(ctx, peer, msg, fds)``; the fds stay the caller's).
FD_HANDLERS: dict[type, Callable[[Context, Peer, Any, tuple[int, ...]], Outcome]] = {
    protocol.Publish: publish.on_publish,
    protocol.PublishCudaIpc: publish.on_publish,
}


def _guarded(peer: Peer, msg: protocol.Message, fn: Callable[[], Outcome]) -> Outcome:
    """Runs ``fn`` under the rule for failures inside one request (module docstring)."""
    try:
        return fn()
    except WeightcacheError as e:
        return one_reply(protocol.Error.from_exc(e))
    except IllegalTransition:
        raise
    except Exception as e:  # noqa: BLE001 - one request must never take the service down
        log.critical("request failed peer_pid=%d type=%s error=%r\n%s", peer.pid, msg.tag(), e,
                     traceback.format_exc())
        return one_reply(protocol.Error.from_exc(InternalError(
            f"the service failed to handle {msg.tag()!r}: {e!r}"[:4096], request=msg.tag())))


def finish_publish(ctx: Context, peer: Peer, eff: publish.StartPublish, prepared: publish.Prepared | None,
                   error: BaseException | None) -> Outcome:
    """:func:`weightcache.daemon.publish.commit` of a publication whose worker is done, under the failure rule."""
    return _guarded(peer, eff.request, lambda: publish.commit(ctx, eff, prepared, error))


def handle(ctx: Context, peer: Peer, msg: protocol.Message, fds: tuple[int, ...] = ()) -> Outcome:
    """Dispatches one request of ``peer`` and applies the failure rule (module docstring).

    ``fds`` came with the request (only ``publish`` has any: the protocol matched them by count); they stay the
    caller's, to close once this returns.

    Raises:
        IllegalTransition: the service's own state is broken (the caller exits).
    """
    fd_handler = FD_HANDLERS.get(type(msg))
    if fd_handler is not None:
        return _guarded(peer, msg, lambda: fd_handler(ctx, peer, msg, fds))
    return _guarded(peer, msg, lambda: HANDLERS[type(msg)](ctx, peer, msg))
