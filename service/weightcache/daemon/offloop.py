"""What the serving loop hands to worker threads, and applying what they post: demotions, reloads, verifies,
publications.

Owns :class:`OffLoop`, the object the serving loop (:class:`~weightcache.daemon.loop.Daemon`)
holds to start work which must not run on the loop (a demotion's copy,
reading the configuration files for a reload, hashing slabs for ``verify``, checking and digesting a
publication)
on a daemon thread, hold the requester's later requests meanwhile, and
apply each result on the loop once the thread has written a byte to the
wake-up pipe it is given; and the loader's requests for room (:meth:`OffLoop.admit`),
which wait for the demotions under way. It owns the queues of that work
(what threads post, the slabs they read, the replies and requests for room
that wait for them).

Forbidden imports: torch, weightcache.pipeline directly, weightcache.fdpass directly, weightcache.daemon.loop.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import protocol
from ..config import Config
from ..checkpoint import Checkpoint
from ..errors import ConfigError, WeightcacheError
from ..wire import SlotState
from . import access, handlers, load_results, publish, reload, tiers
from .clients import Client
from .effects import Context, FreeSlab, Outcome, StartVerify
from .metrics import Counters
from .state import IllegalTransition, Peer, ServiceState
from .ticker import Ticker
from .tiers import Demoting, Tiers
from .transport import Transport

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _ReloadJob:
    """One reload whose files a worker reads: who asked (None: SIGHUP), until when (monotonic s), the result."""

    client: Client | None
    peer: Peer
    deadline: float
    started: float
    result: Any = None
    #: Slot identity -> (manifest or planned identity, fields) of the slots whose checkpoint files were replaced
    #: (changed_checkpoints).
    changed: dict = field(default_factory=dict)


def changed_checkpoints(recorded: list[tuple[tuple[str, int, int, int], str, Any, dict]]) -> dict:
    """Slot identity -> (what it was checked against, changed fields) for each of ``recorded``
    (:func:`weightcache.daemon.reload.recorded_checkpoints`: identity, path, manifest or planned identity, the
    checkpoint identity) whose checkpoint files are no longer those its slab was (or is being) filled from: the
    engines' own check (:meth:`Checkpoint.identity_diff`, ``stat()`` and the small JSON files), so a reload
    replaces a slab every engine would refuse (``cache_key_mismatch``).

    Reads the file system: run it on the reload's worker thread, never on the serving loop. A checkpoint
    that cannot be opened now is not reported (its slab stays; a load of it would fail).
    """
    out = {}
    for ident, path, against, ck_identity in recorded:
        try:
            ck = Checkpoint(path, validate=False)
        except (WeightcacheError, OSError, ValueError, RecursionError, MemoryError) as e:
            log.warning("reload skips checkpoint path=%s model=%s: cannot open it (%s); its slabs stay as they are",
                        path, ident[0], getattr(e, "code", None) or repr(e)[:200])
            continue
        try:
            fields = ck.identity_diff(ck_identity)
        except (WeightcacheError, OSError, KeyError, TypeError, ValueError, RecursionError, MemoryError) as e:
            log.warning("reload skips checkpoint path=%s model=%s: cannot compare it (%s); its slabs stay as they are",
                        path, ident[0], getattr(e, "code", None) or repr(e)[:200])
            continue
        finally:
            ck.close()
        if fields:
            out[ident] = (against, tuple(fields))
    return out


class OffLoop:
    """The off-loop work of the serving loop (module docstring). Its methods run on the loop's thread; only the
    work they start runs on threads, which post to this object's queues and write a byte to ``wake_w``.

    Args:
        state (`ServiceState`), tiers (`Tiers`), ctx (`Context`), counters (`Counters`), transport (`Transport`),
            ticker (`Ticker`): the loop's.
        wake_w (`int`): the write end of the loop's wake-up pipe.
        read_config (`callable`): ``() -> Config``, reads the configuration files (on a worker thread).
        carry_out (`callable`): ``(client or None, Outcome) -> None``, the loop's: sends replies, carries out effects.
        effect (`callable`): ``(client or None, effect) -> None``, the loop's: carries out one effect.
        broken (`callable`): ``(IllegalTransition) -> None``, the loop's: logs CRITICAL and stops it.
        elsewhere (`tiers.HeldElsewhere | tiers.HeldByReceivers | None`): the slabs the service let go of that
            something may still map, counted in the budget until freed (issue 38, P2): host backend, the memfds
            still held or mapped (inotify); cuda, the slabs some process that received their fd still runs.
    """

    def __init__(self, state: ServiceState, tiers: Tiers, ctx: Context, counters: Counters,
                 transport: Transport, ticker: Ticker, wake_w: int, read_config: Callable[[], Config],
                 carry_out: Callable[[Any, Outcome], None], effect: Callable[[Any, Any], None],
                 broken: Callable[[IllegalTransition], None], elsewhere: tiers.HeldElsewhere | None = None) -> None:
        self.state = state
        self.tiers = tiers
        self.ctx = ctx
        self.counters = counters
        self.transport = transport
        self.ticker = ticker
        self._wake_w = wake_w
        #: The real reader of the files (``ctx.load_config`` is swapped while a reload's result is applied).
        self._read_config = read_config
        self._carry_out = carry_out
        self._effect = effect
        self._break = broken
        self.elsewhere = elsewhere
        #: uid -> monotonic s of its demand loads that displaced others (tiers.DISPLACING_WINDOW_S).
        self._displaced: dict[int, list[float]] = {}
        #: Reloads whose files a worker reads (see start_reload).
        self.reloads: list[_ReloadJob] = []
        #: Verifies done on their threads: (client, request, outcome, seconds, the slabs they read).
        self._verified: queue.SimpleQueue = queue.SimpleQueue()
        #: id(sealed slab) -> verifies and demotions reading it; the FreeSlab of one evicted meanwhile waits for
        #: the last.
        self._reading: dict[int, int] = {}
        self._close_later: dict[int, FreeSlab] = {}
        #: Demotions whose copy runs on a worker (tiers.Demoting), and what they post: (effect, copy, error).
        self._demoting: list[Demoting] = []
        self._demoted: queue.SimpleQueue = queue.SimpleQueue()
        #: The loader's requests for room that wait for the demotions under way.
        self._room_waits: list[load_results.NeedRoom] = []
        #: Publications whose worker is done: (client, StartPublish, Prepared or None, error or None).
        self._published: queue.SimpleQueue = queue.SimpleQueue()
        #: (client, replies, demotions): a request (``evict --to host``) answered once its demotions are done.
        self._answers: list[tuple[Client, tuple, tuple]] = []

    def answer_after(self, c: Client, replies: tuple, demotions: tuple[Demoting, ...]) -> None:
        """Holds ``c``'s ``replies`` (and its later requests) until ``demotions`` are done; other clients are
        served meanwhile."""
        self.transport.hold(c)
        self._answers.append((c, replies, demotions))

    def close_when_read(self, eff: FreeSlab) -> bool:
        """Whether a verify or a demotion still reads the slab ``eff`` frees: then its files are closed when the
        last reader is done (True), else now by the caller (False)."""
        if not self._reading.get(id(eff.sealed)):
            return False
        self._close_later[id(eff.sealed)] = eff
        return True

    def start_demotion(self, c: Client | None, eff: tiers.Demoting) -> None:
        """Runs the copy of a demotion on a worker thread (:meth:`~weightcache.daemon.tiers.Tiers.copy`);
        :meth:`finish_demotions` applies it. The GPU slab counts as read meanwhile: an evict or reload that frees
        it waits for the copy."""
        self._reading[id(eff.sealed)] = self._reading.get(id(eff.sealed), 0) + 1
        self._demoting.append(eff)

        def work() -> None:
            self._demoted.put((eff, *self.tiers.copy(eff)))
            try:
                os.write(self._wake_w, b"d")
            except (BlockingIOError, InterruptedError):
                pass

        threading.Thread(target=work, name=f"weightcache-demote-{eff.slot.label}", daemon=True).start()

    def finish_demotions(self) -> None:
        """Applies the demotions whose copy is done (the GPU slab is freed only now), then answers the requests
        that waited for them: replies held back, and the loader's requests for room (asked again)."""
        finished = False
        while True:
            try:
                eff, copy, error = self._demoted.get_nowait()
            except queue.Empty:
                break
            finished = True
            self._demoting.remove(eff)
            moved, close = self.tiers.finish_demote(self.state, eff, copy, error)
            self._done_reading(eff.sealed)
            if moved is not None:
                self._effect(None, moved)
            for f in close:
                f.close()
        if not finished:
            return
        for entry in [a for a in self._answers if not any(d in self._demoting for d in a[2])]:
            self._answers.remove(entry)
            c, replies, _ = entry
            self._carry_out(c, Outcome(replies, ()))
            self.transport.release(c)
        if not self._demoting:
            waits, self._room_waits = self._room_waits, []
            for req in waits:
                if req.slot.state is not SlotState.LOADING:  # dropped by a reload, or its load gave up waiting
                    load_results.discard(req)
                else:
                    self.admit(req)

    def hold_for_read(self, sealed: Any) -> None:
        """Another thread will read ``sealed`` (an image write of a GPU slab): a FreeSlab of it waits for
        :meth:`done_reading` (serving loop only)."""
        self._reading[id(sealed)] = self._reading.get(id(sealed), 0) + 1

    def done_reading(self, sealed: Any) -> None:
        """The reader :meth:`hold_for_read` announced is done with ``sealed`` (serving loop only)."""
        self._done_reading(sealed)

    def _done_reading(self, sealed: Any) -> None:
        """A verify or a demotion stopped reading ``sealed``: a FreeSlab that waited for the last reader runs."""
        self._reading[id(sealed)] -= 1
        if not self._reading[id(sealed)]:
            del self._reading[id(sealed)]
            later = self._close_later.pop(id(sealed), None)
            if later is not None:  # evicted while it was read
                for f in (later.sealed, later.manifest_file):
                    if f is not None:
                        self.close(f, later.store_id or "")

    def close(self, f: Any, label: str) -> None:
        """Closes a slab, host copy or manifest file the service lets go of; it is watched first (``elsewhere``),
        and its bytes count against the budget until nothing maps it any more (host: the memfd's inode is
        freed; cuda: every process its fd was sent to has exited)."""
        if self.elsewhere is not None:
            self.elsewhere.watch_freed(f, label)
            self.tiers.held_elsewhere_bytes = self.elsewhere.bytes
        f.close()

    def freed_elsewhere(self) -> None:
        """The watch's fd is readable: watched slabs were freed (host: the last mapping went; cuda: the last
        receiver exited)."""
        freed = self.elsewhere.read()
        self.tiers.held_elsewhere_bytes = self.elsewhere.bytes
        for label, size in freed:
            log.debug("freed elsewhere slab=%s size_bytes=%d held_elsewhere_bytes=%d", label, size,
                      self.tiers.held_elsewhere_bytes)

    def admit(self, req: load_results.NeedRoom) -> None:
        """Answers the loader's request for room (:class:`~weightcache.daemon.load_results.NeedRoom`): the budget's
        moves are carried out before the loader allocates, so the GPU never holds more than the budget. While
        demotions are under way the request waits for them (their GPU slabs are freed only when copied), then
        is asked again."""
        slot = req.slot
        if self.elsewhere is not None:
            self.freed_elsewhere()  # memfds freed since the last poll: their room is free now
        if self._demoting:
            self._room_waits.append(req)
            return
        if req.tier == "host":
            refusal = self.tiers.admit_host(self.state, slot, req.size_bytes)
        else:
            moves, refusal = self.tiers.admit(self.state, slot, req.size_bytes, slot.demand, self._requester(slot))
            if moves and slot.demand_by is not None and slot.demand_by.uid not in (0, self.ctx.policy.service_uid):
                self._displaced.setdefault(slot.demand_by.uid, []).append(time.monotonic())
            for m in moves:
                self._effect(None, m)
            if self._demoting:
                self._room_waits.append(req)
                return
        if refusal is not None:
            tiers.refuse(slot, refusal, "no room in the host tier" if req.tier == "host" else
                         "no room in the memory budget" + ("" if slot.demand else " at start: waits for an attach"))
        req.answer(refusal)

    def _requester(self, slot: Any) -> Any:
        """Whose load asks for room (:func:`tiers.requester_of`): the peer that asked, its uid's recent loads
        that displaced others counted (root and the service user: any slab)."""
        peer, policy = slot.demand_by, self.ctx.policy
        if peer is None or peer.uid in (0, policy.service_uid):
            return tiers.requester_of(self.state, slot, None, 0)
        now = time.monotonic()
        recent = self._displaced[peer.uid] = [t for t in self._displaced.get(peer.uid, [])
                                              if now - t < tiers.DISPLACING_WINDOW_S]
        return tiers.requester_of(self.state, slot, lambda s: access.may_attach(peer, s, policy),
                                  len(recent))

    def reload_from_signal(self) -> None:
        """SIGHUP: the same reload as a request from the service's own user (no reply to send)."""
        self.start_reload(None, Peer(os.getpid(), os.getuid(), os.getgid()))

    def start_reload(self, c: Client | None, peer: Peer) -> None:
        """Reads the configuration files on a worker thread (never on the serving loop: a file on a hung mount
        would freeze every client); the requester's later requests wait. :meth:`finish_reloads` applies the
        result, or answers ``config_invalid`` (cause ``timeout``) past ``service.reload_timeout_s``."""
        self.ticker.reloading()
        if c is not None:
            self.transport.hold(c)
        job = _ReloadJob(c, peer, time.monotonic() + self.ctx.service_config.reload_timeout_s, time.perf_counter())
        self.reloads.append(job)
        recorded = reload.recorded_checkpoints(self.state.slots)

        def work() -> None:
            try:
                config = self._read_config()
                job.changed = changed_checkpoints(recorded)
                job.result = config
            except ConfigError as e:
                job.result = e
            except Exception as e:  # noqa: BLE001 - any failure to read is this reload's error
                job.result = ConfigError(f"the configuration could not be read: {e!r}", file="", key="",
                                         cause="unreadable")
            try:
                os.write(self._wake_w, b"r")
            except (BlockingIOError, InterruptedError):
                pass

        threading.Thread(target=work, name="weightcache-reload", daemon=True).start()

    def finish_reloads(self, now: float) -> None:
        """Applies the reloads whose files were read, and refuses those past their deadline (the read is
        abandoned: its result is ignored)."""
        for job in [j for j in self.reloads if j.result is not None or now >= j.deadline]:
            self.reloads.remove(job)
            got = job.result
            if got is None:
                got = ConfigError(f"reading the configuration took longer than service.reload_timeout_s = "
                                  f"{self.ctx.service_config.reload_timeout_s:g} s (a file on a hung mount?); "
                                  f"the service keeps the configuration it has", file="", key="", cause="timeout")

            def loaded(got: Any = got) -> Config:
                if isinstance(got, ConfigError):
                    raise got
                return got

            read, self.ctx.load_config = self.ctx.load_config, loaded
            self.ctx.changed_checkpoints = job.changed
            try:
                out = handlers.handle(self.ctx, job.peer, protocol.Reload())
                self.counters.answered(protocol.Reload(), out.replies, time.perf_counter() - job.started)
                self._carry_out(job.client, out)
            except IllegalTransition as e:
                self._break(e)
            finally:
                self.ctx.load_config = read
                self.ctx.changed_checkpoints = {}
                self.ticker.reloaded(time.monotonic())
                if job.client is not None:
                    self.transport.release(job.client)

    def start_verify(self, c: Client, eff: StartVerify) -> None:
        """Runs the hashing on a thread; the client's later requests wait (replies stay in order)."""
        slabs = [it.sealed for it in eff.items if it.sealed is not None]
        for sealed in slabs:
            self._reading[id(sealed)] = self._reading.get(id(sealed), 0) + 1
        self.transport.hold(c)

        def work() -> None:
            t0 = time.perf_counter()
            out = handlers.verify_reply(c.peer, eff)
            self._verified.put((c, eff.request, out, time.perf_counter() - t0, slabs))
            try:
                os.write(self._wake_w, b"v")
            except (BlockingIOError, InterruptedError):
                pass

        threading.Thread(target=work, name="weightcache-verify", daemon=True).start()

    def start_publish(self, c: Client, eff: publish.StartPublish) -> None:
        """Runs :func:`weightcache.daemon.publish.prepare` (manifest, checkpoint identity, digests) on a thread;
        the client's later requests wait (replies stay in order)."""
        self.transport.hold(c)
        device, backend = dict(self.state.device), self.state.backend

        def work() -> None:
            try:
                self._published.put((c, eff, publish.prepare(eff, device, backend), None))
            except BaseException as e:  # noqa: BLE001 - answered to the publisher by publish.commit
                self._published.put((c, eff, None, e))
            try:
                os.write(self._wake_w, b"p")
            except (BlockingIOError, InterruptedError):
                pass

        threading.Thread(target=work, name="weightcache-publish", daemon=True).start()

    def finish_publishes(self) -> None:
        while True:
            try:
                c, eff, prepared, error = self._published.get_nowait()
            except queue.Empty:
                return
            out = handlers.finish_publish(self.ctx, c.peer, eff, prepared, error)
            self.counters.answered(eff.request, out.replies, prepared.seconds if prepared is not None else 0.0)
            self._carry_out(c, out)
            self.transport.release(c)

    def finish_verifies(self) -> None:
        while True:
            try:
                c, request, out, seconds, slabs = self._verified.get_nowait()
            except queue.Empty:
                return
            for sealed in slabs:
                self._done_reading(sealed)
            self.counters.answered(request, out.replies, seconds)
            self._carry_out(c, out)
            self.transport.release(c)
