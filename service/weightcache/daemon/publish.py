"""Publication (DESIGN §6.4): an engine hands the service the weights it processed, and engines attach them by key.

Owns ``publish`` in three steps: :func:`on_publish` on the serving loop (who may, the engine key, an identical
publication, the memory budget, the memfd sealed against writes, a PENDING :class:`~weightcache.daemon.state.Slot`
with its :class:`~weightcache.daemon.state.Publication` reserving the bytes), :func:`prepare` on a worker thread
(the publisher's manifest checked against the memfd, the checkpoint identity computed from the files, a digest of
every tensor, the service's manifest file: seconds for a large slab, never on the loop) and :func:`commit` back
on the loop (READY, the reply, the fd store); and :func:`find_publication` (which slab an
``attach_published`` gets, or why none). :func:`weightcache.daemon.handlers.on_attach_published` answers it
as an ``attach``.

A publication is a slab like any other once made: ``status``, ``list``, ``verify``, ``evict``, the fd store
across restarts (:mod:`weightcache.daemon.fdstore`), the memory budget and its tiers (demoted to the host tier and
promoted back by the next ``attach_published``, in the budget's order: priority, then least recently used). One
difference: nothing loads it from disk, so a publication the budget drops (or ``evict`` frees) is gone; the next
engine start publishes it again, and a model only its engine lays out is back to ``waiting_for_engine``.

Identical publications (same model, rank, engine key and scope: shared, or private to one uid) end in one slab:
the serving loop handles one request at a time and the first's slot is in the state from its request on
(PENDING while the worker digests it), so the second finds it and is answered ``created: false``, its memfd
closed unused.

Forbidden imports: socket, selectors, threading, torch, weightcache.notify, weightcache.fdpass,
weightcache.daemon.transport, weightcache.daemon.loads, weightcache.daemon.fdstore, weightcache.daemon.ticker,
weightcache.daemon.loop, weightcache.daemon.handlers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from .. import digest, identity, protocol
from ..checkpoint import Checkpoint
from ..errors import CacheKeyMismatch, InsufficientMemory, ModelNotFound, PublicationInvalid, WeightcacheError
from ..journal import event
from ..manifest import ALIGNMENT_BYTES, Manifest, pack_file, read_file
from ..memory.host import SealedFile
from ..wire import SlotState
from . import access, tiers
from .effects import Context, Outcome, Reply, StoreSlab, one_reply
from .state import Peer, Publication, Slot

log = logging.getLogger(__name__)


def _configured(ctx: Context, model: str) -> Slot:
    """A slot the configuration places on this GPU for ``model`` (a name or checkpoint path): its model's table.

    Raises:
        ModelNotFound (`model_not_found`): the model is not configured on this GPU.
    """
    return ctx.state.find_slots(model, published=False)[0]


def _check_manifest(manifest: Manifest, size_bytes: int) -> None:
    """Raises PublicationInvalid (`publication_invalid`, ``reason = "manifest"``) unless every record of the
    publisher's ``manifest`` lies inside the ``size_bytes`` memfd at an aligned offset."""
    if not 0 < manifest.slab_size_bytes <= size_bytes:
        raise PublicationInvalid(f"publish: the manifest's slab_size_bytes {manifest.slab_size_bytes} does not fit "
                                 f"the {size_bytes}-byte memfd", reason="manifest")
    for t in manifest.tensors:
        if t.offset_bytes % ALIGNMENT_BYTES or t.offset_bytes + t.size_bytes > manifest.slab_size_bytes:
            raise PublicationInvalid(
                f"publish: tensor {t.name!r} at offset {t.offset_bytes} ({t.size_bytes} bytes) is not at a multiple "
                f"of {ALIGNMENT_BYTES} bytes inside the {manifest.slab_size_bytes}-byte slab", reason="manifest",
                tensor=t.name[:200])


def _check_room(ctx: Context, label: str, model: str, need_bytes: int) -> None:
    """Raises InsufficientMemory (`insufficient_memory`) when ``need_bytes`` more would take the slabs past the
    memory budget: a private publication (an untrusted publisher's) makes no room; refused, the engine keeps its
    own copy."""
    t, st = ctx.tiers, ctx.state
    used = t.gpu_used(st)
    if used + need_bytes <= t.budget_bytes:
        return
    raise InsufficientMemory(
        f"GPU {st.gpu}: no room to publish {label} ({need_bytes} bytes): the memory budget memory_budget_bytes = "
        f"{t.budget_bytes} has {t.budget_bytes - used} bytes free; the engine keeps its own copy (evict a slab, or "
        f"raise memory_budget_bytes)", model=model, need_bytes=need_bytes, budget_bytes=t.budget_bytes,
        free_bytes=t.budget_bytes - used, resident=[], leases=[])


#: States of a publication slot that hold it (or will): being digested (PENDING), on the GPU, in the host tier, or
#: promoted back from it (PENDING, LOADING with its host copy).
_HELD = frozenset({SlotState.PENDING, SlotState.LOADING, SlotState.READY, SlotState.HOSTED})


@dataclass(frozen=True, slots=True)
class StartPublish:
    """Effect: run :func:`prepare` on a worker thread (it reads the publisher's manifest file, the checkpoint's
    headers and every byte of the slab; on the cuda backend it first copies the publisher's bytes into the
    service's own slab), then :func:`commit` its result on the serving loop.

    Attributes:
        slot (`Slot`): the publication's slot, PENDING in the state (it reserves its bytes of the budget, and an
            identical publication meanwhile finds it).
        sealed: the backend's SealedSlab (host: the publisher's memfd, sealed, owned by the service now); None when
            ``adoption`` makes it.
        manifest_fd (`int`): a dup of the publisher's manifest file; :func:`prepare` closes it.
        request (`protocol.Publish | protocol.PublishCudaIpc`): the request.
        peer_pid (`int`): the publisher's pid, for the log.
        adoption: the cuda backend's :class:`~weightcache.memory.cuda_publish.Adoption` (the copy into the
            service's slab, with the digests), run by :func:`prepare`; None on the host backend.
    """

    slot: Slot
    sealed: Any
    manifest_fd: int
    request: Any
    peer_pid: int
    adoption: Any = None


@dataclass(frozen=True, slots=True)
class Prepared:
    """What :func:`prepare` made: the service's manifest and its manifest file, the seconds it took, and the sealed
    slab it holds."""

    manifest: Manifest
    manifest_file: Any
    seconds: float
    sealed: Any


def _ipc_source(msg: Any, fd: int) -> Any:
    """The :class:`~weightcache.memory.cuda_publish.IpcSource` a ``publish_cuda_ipc`` sent in its table memfd.

    Raises:
        PublicationInvalid (`publication_invalid`, ``reason = "ipc"``): the table is larger than
            :data:`~weightcache.memory.cuda_publish.MAX_IPC_TABLE_BYTES`, shorter than it says, or malformed.
    """
    from ..memory.cuda_publish import MAX_IPC_TABLE_BYTES, IpcSource

    n = msg.table_size_bytes
    if n > MAX_IPC_TABLE_BYTES:
        raise PublicationInvalid(f"publish: the CUDA IPC table of {n} bytes is larger than {MAX_IPC_TABLE_BYTES}",
                                 reason="ipc")
    data = os.pread(fd, n, 0)
    if len(data) != n:
        raise PublicationInvalid(f"publish: the CUDA IPC table holds {len(data)} bytes, the request says {n}",
                                 reason="ipc")
    return IpcSource.from_json(data)


def _adopt(ctx: Context, msg: Any, fds: tuple[int, ...], label: str) -> tuple[Any, Any]:
    """``(sealed, adoption)``: the host backend's sealed memfd (now), or the cuda backend's adoption (run by the
    worker). Raises as :func:`on_publish`."""
    st = ctx.state
    ipc = isinstance(msg, protocol.PublishCudaIpc)
    if len(fds) != 2:  # the protocol matched them by count: a bug if not
        raise PublicationInvalid(f"publish: {len(fds)} fds came with the request, 2 expected", reason="fds")
    if ctx.defer_publication is not None:
        if ipc:
            return None, ctx.defer_publication(_ipc_source(msg, fds[0]), msg.size_bytes, label)
        dup = os.dup(fds[0])
        try:
            return None, ctx.defer_publication(dup, msg.size_bytes, label)
        except BaseException:
            os.close(dup)
            raise
    if ctx.adopt_publication is None or ipc:
        raise PublicationInvalid(f"publish: the {st.backend} backend of GPU {st.gpu} takes no "
                                 f"{'CUDA IPC ' if ipc else ''}publication; the engine keeps its own copy",
                                 reason="backend", backend=st.backend)
    return ctx.adopt_publication(fds[0], msg.size_bytes), None


def on_publish(ctx: Context, peer: Peer, msg: Any, fds: tuple[int, ...]) -> Outcome:
    """``publish`` and ``publish_cuda_ipc``: the checks that need only the state, then the memfd sealed (host) or
    the copy set up (cuda) and the rest handed to a worker (fds: the slab's fd, or the CUDA IPC table, then the
    publisher's manifest file; they stay the caller's, the service keeps dups).

    Returns an outcome with no reply and :class:`StartPublish` (the reply comes from :func:`commit`), or the
    ``publish_reply`` of an identical publication already held or under way (``created: false``).

    Raises:
        ModelNotFound (`model_not_found`): the model is not configured on this GPU.
        AccessDenied (`access_denied`): see :func:`weightcache.daemon.access.check_publish`; nothing changed.
        PublicationInvalid (`publication_invalid`): the engine key or the memfd (see
            :func:`weightcache.memory.host.seal_publication`), a backend that takes no publication (or none by
            CUDA IPC), the CUDA size or IPC copies (:class:`weightcache.memory.cuda_publish.Adoption`), or a slab
            larger than the model's ``max_slab_bytes`` (``reason = "over_max_slab_bytes"``, ``limit``, ``value``,
            ``actual``).
        SlabStillMapped (`slab_still_mapped`): the publisher still maps the memfd writable.
        InsufficientMemory (`insufficient_memory`): the budget has no room for it (a shared publication: none can
            be made, :func:`_make_room`; a private one: no free room).
    """
    st = ctx.state
    fields = identity.engine_key(msg.engine_key, msg.tp_size, msg.tp_rank)
    base = _configured(ctx, msg.model)
    shared = access.check_publish(peer, base, ctx.policy)
    if ctx.adopt_publication is None and ctx.defer_publication is None:
        raise PublicationInvalid(f"publish: the {st.backend} backend of GPU {st.gpu} takes no publication yet; "
                                 f"the engine keeps its own copy", reason="backend", backend=st.backend)
    pub = Publication(fields, identity.engine_key_blake2b(fields), peer.uid, shared)
    placement = dataclasses.replace(base.placement, tp_size=msg.tp_size, tp_rank=msg.tp_rank)
    slot = st.new_slot(placement, base.realpath, pub)
    held = next((s for s in st.slots if s.publication is not None and s.store_id == slot.store_id
                 and s.state in _HELD), None)
    if held is not None:  # an identical publication came first (held, or under way): one slab
        log.info("publication already held model=%s tp_size=%d rank=%d slab=%s state=%s peer_pid=%d",
                 placement.model.name, msg.tp_size, msg.tp_rank, held.label, held.state.value, peer.pid)
        kept = held.sealed if held.sealed is not None else held.hosted
        size = kept.size_bytes if kept is not None else held.reserved_bytes
        return one_reply(protocol.PublishReply(held.label, False, size, pub.engine_key_blake2b))
    over = placement.model.slab_over_cap(msg.size_bytes, slot.label)
    if over is not None:  # the operator's bound on the model, whoever publishes it
        raise PublicationInvalid(f"publish: {over}; the engine keeps its own copy", reason="over_max_slab_bytes",
                                 limit=f"models.{placement.model.name}.max_slab_bytes",
                                 value=placement.model.max_slab_bytes, actual=msg.size_bytes)
    if not shared:  # a private publication takes free room only: it never moves what others attach
        _check_room(ctx, slot.label, placement.model.name, msg.size_bytes)
    sealed, adoption = _adopt(ctx, msg, fds, slot.label)
    drop = sealed.close if sealed is not None else adoption.close
    size = sealed.size_bytes if sealed is not None else adoption.size_bytes
    try:
        moves = _make_room(ctx, peer, slot, size) if shared else []
        manifest_fd = os.dup(fds[1])
    except BaseException:
        drop()
        raise
    slot.reserved_bytes = size  # counted in the budget while the worker copies and digests it
    st.slots.append(slot)
    return Outcome(effects=(*moves, StartPublish(slot, sealed, manifest_fd, msg, peer.pid, adoption)))


def _make_room(ctx: Context, peer: Peer, slot: Slot, need_bytes: int) -> list[Any]:
    """Room in the memory budget for a shared publication (a trusted publisher's), made as for a demand load of
    the publisher (:meth:`weightcache.daemon.tiers.Tiers.admit`: unleased, unpinned slabs it may attach, of at most
    the model's priority, leave lowest priority first, then least recently used); returns the moves for the serving
    loop to carry out before the worker digests the publication.

    Raises:
        InsufficientMemory (`insufficient_memory`): no room can be made; nothing moved (as ``status`` shows the
            state to the publisher when it is no operator).
    """
    policy = ctx.policy
    trusted = peer.uid in (0, policy.service_uid)
    requester = tiers.requester_of(ctx.state, slot, None if trusted else (lambda s: access.may_attach(peer, s, policy)),
                                   0)
    moves, refusal = ctx.tiers.admit(ctx.state, slot, need_bytes, True, requester)
    if refusal is None:
        return moves
    if access.is_operator(peer, policy):
        raise refusal
    slots = {s.label: s for s in ctx.state.slots}
    raise tiers.refusal_for(refusal, lambda label: label in slots and access.may_attach(peer, slots[label], policy),
                            peer.uid)


def prepare(eff: StartPublish, device: dict[str, Any], backend: str) -> Prepared:
    """The worker's part of a publication: the publisher's manifest checked against the slab, on the cuda backend
    the copy into the service's own slab (:meth:`weightcache.memory.cuda_publish.Adoption.run`, digests computed
    by the copy), the checkpoint identity computed from the files, a digest of every tensor, and the service's
    manifest file. Touches no state; closes ``eff.manifest_fd`` and, when it fails, the slab it made.

    Raises:
        ManifestInvalid (`manifest_invalid`): the publisher's manifest file does not decode.
        PublicationInvalid (`publication_invalid`): a tensor outside the slab or off a 256-byte offset; the CUDA
            source (:meth:`~weightcache.memory.cuda_publish.Adoption.run`).
        OutOfMemory (`out_of_memory`): no room on the GPU for the service's copy.
        CheckpointNotFound, CheckpointCorrupt: the configured checkpoint cannot be read.
        ManifestTooLarge (`manifest_too_large`): the service's manifest file would be too large.
    """
    t0 = time.monotonic()
    msg, slot = eff.request, eff.slot
    sealed = eff.sealed
    marks = [t0]
    try:
        try:
            mf = read_file(eff.manifest_fd, msg.manifest_size_bytes)
        finally:
            os.close(eff.manifest_fd)
        _check_manifest(mf.manifest, msg.size_bytes)
        placement = slot.placement
        ck = Checkpoint(placement.model.path, validate=False)
        key = identity.published_key(slot.publication.engine_key, ck, device)  # the files say which checkpoint
        records = list(mf.manifest.tensors)
        stored = [(t.name, t.offset_bytes, t.size_bytes) for t in records if t.alias_of is None]
        marks.append(time.monotonic())
        digests = None
        if eff.adoption is not None:
            sealed, digests = eff.adoption.run(stored)
        if digests is None:
            digests = digest.slab_digests(sealed, stored)
        marks.append(time.monotonic())
        tensors = [dataclasses.replace(t, digest=digests[t.alias_of or t.name]) for t in records]
        manifest = Manifest(placement.model.name, msg.tp_size, msg.tp_rank, key, mf.manifest.slab_size_bytes,
                            tensors)
        data = pack_file(manifest, backend=backend, size_bytes=sealed.size_bytes,
                         checkpoint_path=placement.model.path, placement=placement.to_json(),
                         publication=slot.publication.to_json())
        out = Prepared(manifest, SealedFile.create(data, f"weightcache:manifest:{slot.label}"),
                       time.monotonic() - t0, sealed)
        marks.append(time.monotonic())
        log.info("publication prepared slab=%s tensors=%d checks_ms=%.1f copy_digest_ms=%.1f manifest_ms=%.1f",
                 slot.label, len(records), *[(b - a) * 1e3 for a, b in zip(marks, marks[1:])])
        return out
    except BaseException:
        if eff.adoption is not None:
            eff.adoption.close()
            if sealed is not None:
                sealed.close()
        raise


def commit(ctx: Context, eff: StartPublish, prepared: Prepared | None, error: BaseException | None) -> Outcome:
    """The serving loop's end of a publication: READY with its manifest (reply ``created: true`` and
    :class:`StoreSlab`), or, when :func:`prepare` failed or a reload dropped the slot meanwhile, the slot gone
    and its slab closed (reply: the error)."""
    slot, st = eff.slot, ctx.state
    if prepared is None or slot.state is not SlotState.PENDING:
        if slot.state is SlotState.PENDING:
            slot.drop()
        st.slots = [s for s in st.slots if s is not slot]
        kept = prepared.sealed if prepared is not None else eff.sealed
        if kept is not None:
            kept.close()
        if prepared is not None:
            prepared.manifest_file.close()
        if not isinstance(error, WeightcacheError):
            error = ModelNotFound(f"publish: model {slot.placement.model.name} was removed from the configuration "
                                  f"by a reload while its publication was checked", model=slot.placement.model.name,
                                  gpu=st.gpu) if error is None else error
        raise error
    sealed = prepared.sealed
    slot.publish(prepared.manifest, sealed, prepared.manifest_file)
    slot.last_used = ctx.monotonic()
    pub, p = slot.publication, slot.placement
    n = len(prepared.manifest.tensors)
    log.info("published model=%s tp_size=%d rank=%d slab=%s size_bytes=%d tensors=%d engine=%s engine_key=%s "
             "shared=%s peer_pid=%d peer_uid=%d duration_ms=%.0f", p.model.name, p.tp_size, p.tp_rank, slot.label,
             sealed.size_bytes, n, pub.engine_key["engine"], pub.engine_key_blake2b, pub.shared, eff.peer_pid,
             pub.publisher_uid, prepared.seconds * 1e3,
             extra=event("published", p.model.name, p.tp_rank, tp_size=p.tp_size, size_bytes=sealed.size_bytes,
                         duration_ms=prepared.seconds * 1e3, tensors=n, engine_key=pub.engine_key_blake2b,
                         shared="yes" if pub.shared else "no", peer_pid=eff.peer_pid, peer_uid=pub.publisher_uid))
    return Outcome((Reply(protocol.PublishReply(slot.label, True, sealed.size_bytes, pub.engine_key_blake2b)),),
                   (StoreSlab(slot),))


def _attachable(s: Slot) -> bool:
    """A publication an ``attach_published`` gets: READY, in the host tier (the attach promotes it), or being
    promoted (the attach waits for it); not one still being digested."""
    return s.state in (SlotState.READY, SlotState.HOSTED) or (s.state in (SlotState.PENDING, SlotState.LOADING)
                                                              and s.hosted is not None)


def find_publication(ctx: Context, peer: Peer, model: str, tp_size: int, tp_rank: int,
                     fields: dict[str, Any]) -> Slot:
    """The publication of ``model`` at (``tp_size``, ``tp_rank``) made under engine key ``fields`` that ``peer`` may
    attach (a shared one first, else its own uid's): READY, or in the host tier or on its way back from it.

    Raises:
        ModelNotFound (`model_not_found`): the model is not configured here, or no publication of that rank is
            held for ``peer`` (``details["publication"] = "none"``: the engine loads and publishes it).
        CacheKeyMismatch (`cache_key_mismatch`): publications of that rank are held, under other engine keys;
            ``details["fields"]`` lists the fields in which the first differs.
    """
    base = _configured(ctx, model)
    name = base.placement.model.name
    held = [s for s in ctx.state.slots
            if s.publication is not None and s.placement.model.name == name and s.placement.tp_size == tp_size
            and s.placement.tp_rank == tp_rank and _attachable(s)
            and access.may_attach(peer, s, ctx.policy)]
    h = identity.engine_key_blake2b(fields)
    same = sorted((s for s in held if s.publication.engine_key_blake2b == h), key=lambda s: not s.publication.shared)
    if same:
        return same[0]
    if held:
        diff = identity.diff_keys(fields, held[0].publication.engine_key)
        raise CacheKeyMismatch(
            f"GPU {ctx.state.gpu} holds {name} tp_size={tp_size} tp_rank={tp_rank} as published under another "
            f"engine key: differing fields {', '.join(diff[:10])}; this engine loads it itself (and may publish "
            f"its own)", fields=diff, model=name)
    raise ModelNotFound(
        f"GPU {ctx.state.gpu} holds no publication of {name} tp_size={tp_size} tp_rank={tp_rank} for this engine "
        f"yet; the engine loads it itself and publishes it", model=name, tp_size=tp_size, tp_rank=tp_rank,
        gpu=ctx.state.gpu, publication="none")
