"""The serving loop: wires state, transport, handlers, loader, fd store and ticker together.

Owns :class:`Daemon` (``Daemon(config, gpu, backend, listener, stored_fds).serve()``),
signal handling, the wake-up pipe, and carrying out what handlers and the
loader return: replies go to :mod:`~weightcache.daemon.transport`,
:class:`~weightcache.daemon.handlers.StartLoad` to the loader,
:class:`~weightcache.daemon.handlers.FreeSlab` to the fd store and the
backend, loader results into the state (:func:`weightcache.daemon.loads.apply`).
Only this module's thread changes the state.

A broken invariant of the service's own state
(:class:`~weightcache.daemon.state.IllegalTransition`) logs CRITICAL and
:meth:`Daemon.serve` returns :data:`EXIT_INVARIANT` (non-zero: systemd
restarts the service; the fd store keeps the resident slabs).

Forbidden imports: torch, weightcache.pipeline, weightcache.fdpass.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import traceback
from typing import Any

from .. import protocol
from ..config import Config
from ..journal import event
from ..loader import LoaderOptions
from ..memory import Backend
from . import handlers, loads
from .fdstore import FdStore
from .handlers import Context, FreeSlab, Outcome, Refuse, StartLoad
from .loads import Loader, LoadSettings
from .metrics import Counters
from .state import IllegalTransition, ServiceState, SlotState
from .ticker import Ticker
from .transport import Client, Transport

log = logging.getLogger(__name__)

#: Exit status on a broken invariant (sysexits.h EX_SOFTWARE).
EXIT_INVARIANT = 70


class Daemon:
    """The service for one GPU.

    Args:
        config (`Config`): the merged configuration.
        gpu (`int`): the GPU index this instance serves (``CUDA_DEVICE_ORDER=PCI_BUS_ID``).
        backend (`Backend`): the slab backend (``host`` or ``cuda``).
        listener (`socket.socket`): the listening Unix stream socket.
        stored_fds (`dict[str, list[int]]`, *optional*): fds handed back by
            systemd's fd store, by ``FDNAME``.
    """

    def __init__(self, config: Config, gpu: int, backend: Backend, listener: socket.socket,
                 stored_fds: dict[str, list[int]] | None = None) -> None:
        self.config = config
        self.gpu = gpu
        self.backend = backend
        device = backend.device_info()
        source = config.files[0] if config.files else "the config"
        self.state = ServiceState(gpu, backend.name, device, config.placements(gpu), source)
        self.counters = Counters([s.placement for s in self.state.slots], time.time())
        self.ctx = Context(self.state, backend.mem_info, counters=self.counters)
        self.transport = Transport(listener, self._on_message, self._on_close,
                                   lambda c: self.state.peers.add(c.peer))
        self.fdstore = FdStore(backend, device)
        self.ticker = Ticker(self.state)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.loader = Loader(LoadSettings(backend, device, config.service.load_timeout_s,
                                          LoaderOptions(threads=config.service.read_threads,
                                                        staging_bytes=config.service.staging_bytes), source),
                             self._wake_w)
        self._stop = False
        self._broken: IllegalTransition | None = None
        now = time.monotonic()
        for slot, got in self.fdstore.adopt(stored_fds or {}, self.state.slots).items():
            slot.adopt(got.manifest, got.sealed, got.manifest_file, now)

    # --- what handlers and the loader return ----------------------------------

    def _on_message(self, c: Client, msg: protocol.Message) -> None:
        t0 = time.perf_counter()
        try:
            out = handlers.handle(self.ctx, c.peer, msg)
            self.counters.answered(msg, out.replies, time.perf_counter() - t0)
            self._carry_out(c, out)
        except IllegalTransition as e:
            self._break(e)
        if log.isEnabledFor(logging.DEBUG):  # the service's own time per request (benchmarks/bench_concurrency.py)
            log.debug("request served type=%s peer_pid=%d duration_us=%.0f", msg.tag(), c.peer.pid,
                      (time.perf_counter() - t0) * 1e6)

    def _carry_out(self, c: Client, out: Outcome) -> None:
        for r in out.replies:
            if not self.transport.send(c, r.msg, r.fds):
                break
        for eff in out.effects:
            self._effect(c, eff)

    def _effect(self, c: Client, eff: Any) -> None:
        {StartLoad: self._start_load, FreeSlab: self._free_slab, Refuse: self._refuse}[type(eff)](c, eff)

    def _start_load(self, c: Client, eff: StartLoad) -> None:
        self.loader.submit(eff.slot)

    def _free_slab(self, c: Client, eff: FreeSlab) -> None:
        self.fdstore.remove(eff.store_id)
        eff.sealed.close()
        eff.manifest_file.close()

    def _refuse(self, c: Client, eff: Refuse) -> None:
        self.transport.violation(c, eff.error)

    def _on_close(self, c: Client) -> None:
        for lease in list(c.peer.leases.values()):
            handlers.end_lease(self.state, c.peer, lease)
        c.peer.waiting.clear()
        self.state.peers.discard(c.peer)

    def _drain_loader(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        for result in self.loader.results():
            if isinstance(result, loads.Loaded):  # stored before it is reported ready
                self.fdstore.put(result.slot, result.sealed, result.manifest_file)
            loads.apply(self.state, result)
            if isinstance(result, loads.Loaded):
                self.counters.load_settled(result.slot.placement, None, result.duration_s, result.slot.total_bytes)
            elif isinstance(result, loads.Failed):
                self.counters.load_settled(result.slot.placement, result.error.code)

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

    def request_stop(self, *_: Any) -> None:
        """Ends :meth:`serve` after the current pass (SIGTERM, SIGINT)."""
        self._stop = True
        try:
            os.write(self._wake_w, b"s")
        except OSError:
            pass

    def serve(self) -> int:
        """Runs until SIGTERM/SIGINT. Returns the process exit status (:data:`EXIT_INVARIANT` on a broken invariant)."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        self.transport.start()
        self.transport.add_reader(self._wake_r, self._drain_loader)
        self.loader.start()
        for s in self.state.slots:
            if s.state is SlotState.PENDING:
                self.loader.submit(s)
        log.info("serving gpu=%d backend=%s slabs=%d", self.gpu, self.backend.name, len(self.state.slots),
                 extra=event("serving", slabs=len(self.state.slots), backend=self.backend.name))
        while not self._stop:
            try:
                self.ticker.tick(time.monotonic())
                waiting = any(c.peer.waiting for c in self.transport.clients.values())
                self.transport.poll(0.2 if waiting else 0.5)
                self._service_waiting()
            except IllegalTransition as e:
                self._break(e)
        self.ticker.stopping()
        log.info("stopping gpu=%d", self.gpu)
        self.loader.stop()
        self.transport.close_all("service stopping")
        return EXIT_INVARIANT if self._broken is not None else 0

    @property
    def clients(self) -> dict[int, Client]:
        """Open connections by socket fd."""
        return self.transport.clients
