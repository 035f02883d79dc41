"""What the serving loop hands to worker threads, and applying what they post: demotions, reloads, verifies.

Owns :class:`OffLoop`, the part of :class:`~weightcache.daemon.loop.Daemon`
that starts work which must not run on the serving loop (a demotion's copy,
reading the configuration files for a reload, hashing slabs for ``verify``)
on a daemon thread, holds the requester's later requests meanwhile, and
applies each result on the loop once the thread has written a byte to the
wake-up pipe; and the loader's requests for room (:meth:`OffLoop._admit`),
which wait for the demotions under way.

Forbidden imports: torch, weightcache.pipeline directly, weightcache.fdpass directly, weightcache.daemon.loop.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import protocol
from ..config import Config
from ..checkpoint import Checkpoint
from ..errors import ConfigError, WeightcacheError
from . import access, handlers, loads, reload, tiers
from .handlers import Outcome, StartVerify
from .state import IllegalTransition, Peer, SlotState
from .transport import Client

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
    """The off-loop work of :class:`~weightcache.daemon.loop.Daemon` (module docstring). A base class, not used
    alone: ``Daemon`` sets the state, tiers, transport, ticker, counters, context and the queues these methods
    use (``_reading``, ``_demoting``, ``_demoted``, ``_room_waits``, ``_answers``, ``_reloads``, ``_verified``,
    ``_wake_w``, ``_displaced``, ``elsewhere``) and provides ``_carry_out``, ``_effect``, ``_moved`` and ``_break``.
    """

    def _start_demotion(self, c: Client | None, eff: tiers.Demoting) -> None:
        """Runs the copy of a demotion on a worker thread (:meth:`Tiers.copy`); :meth:`_finish_demotions`
        applies it. The GPU slab counts as read meanwhile: an evict or reload that frees it waits for the copy."""
        self._reading[id(eff.sealed)] = self._reading.get(id(eff.sealed), 0) + 1
        self._demoting.append(eff)

        def work() -> None:
            self._demoted.put((eff, *self.tiers.copy(eff)))
            try:
                os.write(self._wake_w, b"d")
            except (BlockingIOError, InterruptedError):
                pass

        threading.Thread(target=work, name=f"weightcache-demote-{eff.slot.label}", daemon=True).start()

    def _finish_demotions(self) -> None:
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
                self._moved(None, moved)
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
                    loads.discard(req)
                else:
                    self._admit(req)

    def _done_reading(self, sealed: Any) -> None:
        """A verify or a demotion stopped reading ``sealed``: a FreeSlab that waited for the last reader runs."""
        self._reading[id(sealed)] -= 1
        if not self._reading[id(sealed)]:
            del self._reading[id(sealed)]
            later = self._close_later.pop(id(sealed), None)
            if later is not None:  # evicted while it was read
                for f in (later.sealed, later.manifest_file):
                    if f is not None:
                        self._close(f, later.store_id or "")

    def _close(self, f: Any, label: str) -> None:
        """Closes a slab, host copy or manifest file the service lets go of; on the host backend its memfd is
        watched first, and its bytes count against the budget until nothing maps it any more."""
        if self.elsewhere is not None and getattr(f, "fd", -1) >= 0:
            self.elsewhere.watch(f.fd, label, f.size_bytes)
            self.tiers.held_elsewhere_bytes = self.elsewhere.bytes
        f.close()

    def _freed_elsewhere(self) -> None:
        """The inotify fd is readable: watched memfds were freed (the last mapping went)."""
        freed = self.elsewhere.read()
        self.tiers.held_elsewhere_bytes = self.elsewhere.bytes
        for label, size in freed:
            log.debug("freed elsewhere slab=%s size_bytes=%d held_elsewhere_bytes=%d", label, size,
                      self.tiers.held_elsewhere_bytes)

    def _admit(self, req: loads.NeedRoom) -> None:
        """Answers the loader's request for room (:class:`~weightcache.daemon.loads.NeedRoom`): the budget's
        moves are carried out before the loader allocates, so the GPU never holds more than the budget. While
        demotions are under way the request waits for them (their GPU slabs are freed only when copied), then
        is asked again."""
        slot = req.slot
        if self.elsewhere is not None:
            self._freed_elsewhere()  # memfds freed since the last poll: their room is free now
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

    def _reload_from_signal(self) -> None:
        """SIGHUP: the same reload as a request from the service's own user (no reply to send)."""
        self._reload_asked = False
        self._start_reload(None, Peer(os.getpid(), os.getuid(), os.getgid()))

    def _start_reload(self, c: Client | None, peer: Peer) -> None:
        """Reads the configuration files on a worker thread (never on the serving loop: a file on a hung mount
        would freeze every client); the requester's later requests wait. :meth:`_finish_reloads` applies the
        result, or answers ``config_invalid`` (cause ``timeout``) past ``service.reload_timeout_s``."""
        self.ticker.reloading()
        if c is not None:
            self.transport.hold(c)
        job = _ReloadJob(c, peer, time.monotonic() + self.ctx.service_config.reload_timeout_s, time.perf_counter())
        self._reloads.append(job)
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

    def _finish_reloads(self, now: float) -> None:
        """Applies the reloads whose files were read, and refuses those past their deadline (the read is
        abandoned: its result is ignored)."""
        for job in [j for j in self._reloads if j.result is not None or now >= j.deadline]:
            self._reloads.remove(job)
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

    def _start_verify(self, c: Client, eff: StartVerify) -> None:
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

    def _finish_verifies(self) -> None:
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
