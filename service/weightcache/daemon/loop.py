"""The serving loop: wires state, transport, handlers, loader, fd store and ticker together.

Owns :class:`Daemon` (``Daemon(config, gpu, backend, listener, stored_fds).serve()``),
signal handling, the wake-up pipe, and carrying out what handlers and the
loader return: replies go to :mod:`~weightcache.daemon.transport`,
:class:`~weightcache.daemon.handlers.StartLoad` to the loader,
:class:`~weightcache.daemon.handlers.FreeSlab` to the fd store and the
backend, loader results into the state (:func:`weightcache.daemon.load_results.apply`),
:class:`~weightcache.daemon.tiers.Demoting` (and ``verify``'s hashing, a reload's
reads) to :class:`~weightcache.daemon.offloop.OffLoop`, which runs them on worker
threads and applies their results on this loop (a demotion by
:meth:`~weightcache.daemon.tiers.Tiers.finish_demote` once sealed; the loader's
request for room and an ``evict --to host`` reply wait for it, other clients do
not). Only this module's thread changes the state.

``SIGHUP`` and a ``reload`` request both run
:func:`~weightcache.daemon.handlers.on_reload`, between ``RELOADING=1``
(with ``MONOTONIC_USEC=``) and ``READY=1`` to systemd.

A broken invariant of the service's own state
(:class:`~weightcache.daemon.state.IllegalTransition`) logs CRITICAL and
:meth:`Daemon.serve` returns :data:`EXIT_INVARIANT` (non-zero: systemd
restarts the service; the fd store keeps the resident slabs).

Forbidden imports: torch, weightcache.pipeline directly, weightcache.fdpass directly (the rooms it
wires use them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import socket
import time
import traceback
from typing import Any

from .. import protocol
from ..config import Config, Placement
from ..errors import ConfigError, WeightcacheError
from ..journal import event
from ..reader import LoaderOptions
from ..seeding import Seeder
from ..memory import Backend
from ..spec import DTYPE_NAMES
from ..wire import SlotState
from . import access, handlers, imaging, load_results, lograte, publish, tiers
from .fdstore import FdStore, record_released, released_at_last_stop
from .effects import CancelLoad, Context, FreeSlab, Outcome, Reconfigure, Refuse, StartLoad, StartVerify, StoreSlab
from .limits import Limits
from .loads import Loader, LoadSettings
from .metrics import Counters
from .offloop import OffLoop
from .peers import seed_settings
from .state import IllegalTransition, Publication, ServiceState, Slot
from .ticker import Ticker
from .clients import Client
from .transport import Callbacks, Transport

log = logging.getLogger(__name__)

#: Exit status on a broken invariant (sysexits.h EX_SOFTWARE).
EXIT_INVARIANT = 70


class Daemon:
    """The service for one GPU: the serving loop, which holds its rooms (transport, loader, fd store, ticker, and
    :class:`~weightcache.daemon.offloop.OffLoop` for the work it hands to threads).

    Args:
        config (`Config`): the merged configuration.
        gpu (`int`): the GPU index this instance serves (``CUDA_DEVICE_ORDER=PCI_BUS_ID``).
        backend (`Backend`): the slab backend (``host`` or ``cuda``).
        listener (`socket.socket`): the listening Unix stream socket.
        stored_fds (`dict[str, list[int]]`, *optional*): fds handed back by
            systemd's fd store, by ``FDNAME``.
        load_config (`callable`, *optional*): ``() -> Config``, reads the files
            again for ``reload`` and ``SIGHUP`` (without it a reload is refused).
        config_error (`ConfigError`, *optional*): the configuration was
            refused at start; ``config`` then holds only the placements of the
            slabs found in the fd store (``weightcache serve``), and stored
            entries that match no slot stay in the store for the next start.
    """

    def __init__(self, config: Config, gpu: int, backend: Backend, listener: socket.socket,
                 stored_fds: dict[str, list[int]] | None = None, load_config: Any = None,
                 config_error: ConfigError | None = None) -> None:
        self.config = config
        self.gpu = gpu
        self.backend = backend
        device = backend.device_info()
        source = config.files[0] if config.files else "the config"
        self.state = ServiceState(gpu, backend.name, device, config.placements(gpu), source,
                                  realpaths=config.realpaths)
        self.state.config_error = config_error
        self.counters = Counters([s.placement for s in self.state.slots], time.time())
        self.tiers = tiers.Tiers(config.service.budget_bytes(int(backend.mem_info()[1])),
                                 config.service.host_tier_bytes, backend.demote, off_loop=True)
        self.ctx = Context(self.state, backend.mem_info, load_config=load_config or self._no_config,
                           service_config=config.service, counters=self.counters,
                           policy=access.Policy(self.state.service_uid, config.service.operator_groups, config.names),
                           tiers=self.tiers, adopt_publication=getattr(backend, "adopt_publication", None),
                           defer_publication=getattr(backend, "defer_publication", None))
        self.transport = Transport(listener, Callbacks(self._on_message, self._on_close,
                                                       lambda c: self.state.peers.add(c.peer), self._on_unsent),
                                   Limits.from_config(config.service),
                                   trusted_uids=frozenset({0, self.state.service_uid}))
        self.fdstore = FdStore(backend, device)
        self.ticker = Ticker(self.state)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        #: Slabs freed while something else may still map them: counted in the budget (issue 38, P2; cuda: until
        #: every process their fd was sent to has exited).
        self.elsewhere = tiers.HeldElsewhere() if backend.name == "host" else tiers.HeldByReceivers()
        #: Processed images (issue 36): None without an image directory, or when it is refused.
        #: GPU slabs an image write finished reading (posted by the writer's thread, released on this loop).
        self._image_reads_done: queue.SimpleQueue = queue.SimpleQueue()
        self.images = None
        self._use_images(imaging.from_config(config, backend))
        #: Peer seeding (issue 37): None when not configured, or NIXL or the secret is missing (logged once).
        self.seeder = Seeder.create(seed_settings(config.service), gpu, self._wake)
        if self.seeder is not None:
            self.counters.seeding = self.seeder.stats
        self.loader = Loader(self._load_settings(config), self._wake_w)
        self._stop = False
        self._reload_asked = False
        self._broken: IllegalTransition | None = None
        #: Demotions, reloads and verifies, run on threads; they post through the wake-up pipe.
        self.offloop = OffLoop(self.state, self.tiers, self.ctx, self.counters, self.transport, self.ticker,
                               self._wake_w, read_config=self.ctx.load_config, carry_out=self._carry_out,
                               effect=self._effect, broken=self._break, elsewhere=self.elsewhere)
        stored = self.fdstore.adopt(stored_fds or {}, self.state.slots, drop_unknown=config_error is None,
                                    publication_slot=self._publication_slot)
        released = released_at_last_stop()
        for slot, got in stored.items():
            if slot.publication is not None:
                self.state.slots.append(slot)
            slot.leases_unknown = slot.store_id not in released
            if got.tier == "host":
                slot.stash(got.manifest, got.sealed, got.manifest_file)
            else:
                slot.adopt(got.manifest, got.sealed, got.manifest_file)
            if got.dtypes_served is not None:  # as its manifest file records them: no header read to match a dtype
                slot.dtype_served = {r: r in got.dtypes_served for r in DTYPE_NAMES}
        if self.images is not None and config_error is None:  # publications the fd store did not keep: images
            for slot in self.images.publication_slots(self.state.slots, self._publication_slot, gpu):
                self.state.slots.append(slot)
        if config_error is not None:  # serve what was kept, load nothing until a reload applies a config
            self.state.slots = [s for s in self.state.slots if s.state is SlotState.READY]

    # --- what handlers and the loader return ----------------------------------

    def _no_config(self) -> Config:
        raise ConfigError("this service was started without a configuration file to read again",
                          file="", key="")

    def _publication_slot(self, placement: Placement, publication: Publication) -> Slot | None:
        """A new PENDING slot for a publication the fd store kept (its placement and publication as its manifest
        file records them), when its model is still configured on this GPU from the same checkpoint path; else
        None (the store's entries are dropped)."""
        base = next((s for s in self.state.slots if s.publication is None
                     and s.placement.model.name == placement.model.name), None)
        if base is None or base.placement.model.path != placement.model.path:
            return None
        p = dataclasses.replace(base.placement, tp_size=placement.tp_size, tp_rank=placement.tp_rank)
        return self.state.new_slot(p, base.realpath, publication)

    def _on_message(self, c: Client, msg: protocol.Message, fds: tuple[int, ...] = ()) -> None:
        t0 = time.perf_counter()
        reloading = type(msg) is protocol.Reload
        if reloading and c.peer.uid in (0, self.state.service_uid):
            self.offloop.start_reload(c, c.peer)  # the files are read on a worker; others get access_denied below
            return
        if reloading:
            self.ticker.reloading()
        try:
            out = handlers.handle(self.ctx, c.peer, msg, fds)
            self.counters.answered(msg, out.replies, time.perf_counter() - t0)
            demotions = tuple(e for e in out.effects if isinstance(e, tiers.Demoting))
            if demotions:  # answered when the copies are done; the client's later requests wait, others don't
                self.offloop.answer_after(c, out.replies, demotions)
                self._carry_out(c, Outcome((), out.effects))
            else:
                self._carry_out(c, out)
        except IllegalTransition as e:
            self._break(e)
        finally:
            if reloading:
                self.ticker.reloaded(time.monotonic())
        if log.isEnabledFor(logging.DEBUG):  # the service's own time per request (benchmarks/bench_concurrency.py)
            log.debug("request served type=%s peer_pid=%d duration_us=%.0f", msg.tag(), c.peer.pid,
                      (time.perf_counter() - t0) * 1e6)

    def _carry_out(self, c: Client | None, out: Outcome) -> None:
        for r in out.replies:
            if c is None:
                log.info("reload answered %s", r.msg.to_json())
            elif not self.transport.send(c, r.msg, r.fds):
                break
        for eff in out.effects:
            self._effect(c, eff)

    def _effect(self, c: Client | None, eff: Any) -> None:
        {StoreSlab: self._store_slab, StartLoad: self._start_load, FreeSlab: self._free_slab, Refuse: self._refuse, CancelLoad: self._cancel_load,
         Reconfigure: self._reconfigure, StartVerify: self.offloop.start_verify, tiers.Moved: self._moved,
         tiers.Demoting: self.offloop.start_demotion, publish.StartPublish: self.offloop.start_publish}[type(eff)](c, eff)

    def _moved(self, c: Client | None, eff: tiers.Moved) -> None:
        """A slab changed tier: the fd store follows it (host tier, or nothing), then what it left is closed."""
        if eff.tier == "host":
            self.fdstore.put_host(eff.slot, eff.slot.hosted, eff.slot.manifest_file)
        else:
            self.fdstore.remove(eff.store_id)
        if eff.dropped:  # a publication that left the service
            self.counters.publication_dropped(eff.slot.placement, eff.dropped)
        for f in eff.close:
            if f is not None:
                self._free_slab(c, FreeSlab(None, f, None))

    def _drop_failed_publication(self, slot: Slot, error: WeightcacheError) -> None:
        """A publication whose promotion from the host tier (or load from its image) failed (FAILED) leaves the
        service as one the budget drops does (:func:`tiers.publication_dropped`: the journal's
        ``publication_dropped``, the ``publications_dropped`` counter), its host copy out of the fd store and
        closed: nothing loads a publication again but its engine, which publishes it again. An attach parked on it
        is answered ``model_not_found`` with ``publication = "none"`` (:func:`handlers.answer_attach`)."""
        store_id = slot.store_id
        kept, manifest_file = slot.drop()
        reason = str(error.details.get("cause") or error.code)
        tiers.publication_dropped(self.state, slot, reason, reason, logging.WARNING)
        self.counters.publication_dropped(slot.placement, reason)
        self._free_slab(None, FreeSlab(store_id, kept, manifest_file))

    def _cancel_load(self, c: Client | None, eff: CancelLoad) -> None:
        self.loader.cancel(eff.slot)

    def _reconfigure(self, c: Client | None, eff: Reconfigure) -> None:
        for sid in sorted(self.fdstore.left):  # kept while the config did not load; a new slab may take the name
            log.info("fd store slab dropped id=%s reason=unclaimed-after-reload", sid)
            self.fdstore.remove(sid)
        self.fdstore.left.clear()
        self.config = eff.config
        # The caps and the operator groups follow the file; connections over a lowered cap meet it at their
        # next request.
        self.transport.limits = Limits.from_config(eff.config.service)
        self.ctx.policy = access.Policy(self.state.service_uid, eff.config.service.operator_groups,
                                        eff.config.names)  # resolved on the reload worker
        if self.images is None and any(m.image is not False for m in eff.config.models.values()):
            self._use_images(imaging.from_config(eff.config, self.backend))
        elif self.images is not None:
            self.images.configure(eff.config)
        self.loader.settings = self._load_settings(eff.config)  # the loader reads it at each load's start
        self.counters.track(eff.config.placements(self.gpu))  # label values of models the reload added
        self._probe_sizes()

    def _probe_sizes(self) -> None:
        """Has the loader size the restricted models no plan has sized yet (:func:`tiers.unsized_restricted`):
        their room is then held back from the loads of uids off their allow lists (issue 38, P3)."""
        for s in tiers.unsized_restricted(self.state.slots):
            if not s.size_probed:
                s.size_probed = True
                self.loader.probe(s)

    def _use_images(self, images: imaging.Imaging | None) -> None:
        """Takes ``images`` (None: none): its counters in the metrics, its GPU slab reads held by the OffLoop."""
        self.images = images
        if images is None:
            return
        self.counters.images = images.store.stats

        def released(sealed: Any) -> None:  # the writer's thread: hand it to this loop
            self._image_reads_done.put(sealed)
            self._wake()

        images.reader_hold = (lambda sealed: self.offloop.hold_for_read(sealed), released)

    def _load_settings(self, cfg: Config) -> LoadSettings:
        svc = cfg.service
        return LoadSettings(self.backend, self.state.device, svc.load_timeout_s,
                            LoaderOptions(threads=svc.read_threads, staging_bytes=svc.staging_bytes),
                            cfg.files[0] if cfg.files else "the config", ask_room=True,
                            max_tensors=svc.max_tensors_per_checkpoint,
                            images=self.images.store if getattr(self, "images", None) is not None else None,
                            seeder=getattr(self, "seeder", None))

    def _store_slab(self, c: Client | None, eff: StoreSlab) -> None:
        self.fdstore.put(eff.slot, eff.slot.sealed, eff.slot.manifest_file)
        if self.images is not None and eff.slot.publication is not None:  # a publication just committed
            self.images.written_after_publish(eff.slot)

    def _start_load(self, c: Client, eff: StartLoad) -> None:
        self.loader.submit(eff.slot)

    def _free_slab(self, c: Client | None, eff: FreeSlab) -> None:
        if eff.store_id is not None:
            self.fdstore.remove(eff.store_id)
            self._probe_sizes()  # an adopted slab evicted: never planned here
        if eff.sealed is not None and self.offloop.close_when_read(eff):  # a verify or a demotion still reads it
            return
        for f in (eff.sealed, eff.manifest_file):
            if f is not None:
                self.offloop.close(f, eff.store_id or "")

    def _refuse(self, c: Client, eff: Refuse) -> None:
        self.transport.violation(c, eff.error)

    def _on_unsent(self, c: Client, msg: protocol.Message) -> None:
        """An attach reply went out as an error without its fds: the lease it granted ends."""
        lease = c.peer.leases.get(getattr(msg, "lease_id", -1)) if type(msg) is protocol.AttachReply else None
        if lease is not None:
            for eff in handlers.end_lease(self.state, c.peer, lease):
                self._effect(None, eff)

    def _on_close(self, c: Client) -> None:
        for lease in list(c.peer.leases.values()):
            for eff in handlers.end_lease(self.state, c.peer, lease):
                self._effect(None, eff)
        c.peer.waiting.clear()
        self.state.peers.discard(c.peer)

    def _drain_loader(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        self.offloop.finish_demotions()
        while not self._image_reads_done.empty():
            self.offloop.done_reading(self._image_reads_done.get_nowait())
        if self.seeder is not None:  # the seeding source's lookups (fds duplicated here, read off the loop)
            self.seeder.answer(self.state.slots)
        for result in self.loader.results():
            if result.slot.state is SlotState.DROPPED:  # a reload removed it while it loaded
                load_results.discard(result)
                continue
            if isinstance(result, load_results.NeedRoom):
                self.offloop.admit(result)
                continue
            if isinstance(result, (load_results.Refused, load_results.Skipped)):  # admit moved the slot back, or none ran
                continue
            if isinstance(result, load_results.Loaded):  # stored before it is reported ready
                put = self.fdstore.put_host if result.tier == "host" else self.fdstore.put
                put(result.slot, result.sealed, result.manifest_file)
            load_results.apply(self.state, result)
            if isinstance(result, load_results.Loaded):
                self.counters.load_settled(result.slot.placement, None, result.duration_s, result.slot.total_bytes,
                                           result.source)
                if self.images is not None:
                    self.images.written_after_load(result.slot, result.source, result.promoted_from is not None)
            elif isinstance(result, load_results.Failed):
                self.counters.load_settled(result.slot.placement, result.error.code)
                if result.slot.publication is not None:  # a failed promotion or image: gone; its engine publishes
                    self._drop_failed_publication(result.slot, result.error)
        self.offloop.finish_verifies()
        self.offloop.finish_publishes()
        if self.offloop.reloads:
            self.offloop.finish_reloads(time.monotonic())

    def _service_waiting(self) -> None:
        for c in list(self.transport.clients.values()):
            if c.peer.waiting:
                before = list(c.peer.waiting)
                out = handlers.service_waiting(self.ctx, c.peer)
                self.counters.waited(before, c.peer.waiting, out.replies, time.monotonic())
                self._carry_out(c, out)

    def _break(self, e: IllegalTransition) -> None:
        log.critical("invariant broken, exiting error=%s\n%s", e, traceback.format_exc())
        self._broken = e
        self.request_stop()

    # --- main loop -------------------------------------------------------------

    def request_reload(self, *_: Any) -> None:
        """Reloads the configuration at the next pass (SIGHUP)."""
        self._reload_asked = True
        self._wake()

    def request_stop(self, *_: Any) -> None:
        """Ends :meth:`serve` after the current pass (SIGTERM, SIGINT)."""
        self._stop = True
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except OSError:
            pass

    def serve(self) -> int:
        """Runs until SIGTERM/SIGINT. Returns the process exit status (:data:`EXIT_INVARIANT` on a broken invariant)."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_reload)
        self.transport.start()
        self.transport.add_reader(self._wake_r, self._drain_loader)
        if self.elsewhere is not None:
            self.transport.add_reader(self.elsewhere.fd, self.offloop.freed_elsewhere)
        self.loader.start()
        if self.seeder is not None:
            self.seeder.start()
        # Slabs taken back from the fd store count against the budget first (it may have been lowered).
        for m in self.tiers.enforce(self.state, "start: the slabs kept in the fd store exceed the budget"):
            self._effect(None, m)
        for s in tiers.start_order(self.state.slots):
            # A PENDING publication here is one its image brings back (daemon.imaging): to the GPU, as published.
            if s.state is SlotState.PENDING and (s.publication is not None or tiers.start_placement(s)):
                self.loader.submit(s)
        self._probe_sizes()
        if self.images is not None:  # slabs the fd store kept: their image, where the last stop lost its write
            for s in self.state.slots:
                if s.state in (SlotState.READY, SlotState.HOSTED):  # written_after_adopt keeps fd-store ones
                    self.images.written_after_adopt(s)
        log.info("serving gpu=%d backend=%s slabs=%d", self.gpu, self.backend.name, len(self.state.slots),
                 extra=event("serving", slabs=len(self.state.slots), backend=self.backend.name))
        while not self._stop:
            try:
                if self._reload_asked:
                    self._reload_asked = False
                    self.offloop.reload_from_signal()
                now = time.monotonic()
                self.ticker.tick(now)
                self.transport.expire(now)
                if self.offloop.reloads:
                    self.offloop.finish_reloads(now)
                lograte.flush(now)
                waiting = any(c.peer.waiting for c in self.transport.clients.values())
                self.transport.poll(0.2 if waiting else 0.5)
                self._service_waiting()
            except IllegalTransition as e:
                self._break(e)
        self.ticker.stopping()
        log.info("stopping gpu=%d", self.gpu)
        record_released(self.state.slots)
        if self.seeder is not None:
            self.seeder.stop()
        self.loader.stop()
        self.transport.close_all("service stopping")
        if self.images is not None:  # the image write under way: finished without the cap, or abandoned
            self.images.finish_writes()
        return EXIT_INVARIANT if self._broken is not None else 0

    @property
    def clients(self) -> dict[int, Client]:
        """Open connections by socket fd."""
        return self.transport.clients
