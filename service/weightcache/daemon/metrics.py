"""What the service counts for its metrics: attaches, their service times, loads, verifies, publications. No I/O.

Owns :class:`Counters`, fed by the serving loop (:mod:`weightcache.daemon.loop`)
with what it already handles: each request and the replies its handler
returned (:meth:`Counters.answered`), each parked attach answered later
(:meth:`Counters.waited`) and each settled load (:meth:`Counters.load_settled`).
:meth:`Counters.record` is the ``metrics`` reply's
:class:`~weightcache.protocol.ServiceCounters`. Gauges (resident bytes,
states, leases, memory) are not counted here: they are the ``status`` record
itself, so ``weightcache metrics`` and ``weightcache status --json`` agree.
The exposition (Prometheus text, names, labels) is :mod:`weightcache.metrics`.

Label values come from the config, never from a client: an attach naming a
model or path this service does not hold counts as ``(other)``, so a client
cannot grow the label set.

Forbidden imports: socket, selectors, threading, torch, prometheus_client,
weightcache.daemon.transport, weightcache.daemon.loop.
"""

from __future__ import annotations

import bisect
import collections
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from .. import __version__, notify, protocol
from ..config import Placement
from ..wire import SlotState

#: Upper bounds of the attach service-time buckets, seconds (an attach is sub-millisecond
#: to milliseconds; one that waited for a load takes up to its ``wait_ms``).
ATTACH_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0, 300.0)
#: The model label of an attach that names no model of this service.
OTHER_MODEL = "(other)"


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(ATTACH_BUCKETS_S) + 1))
    sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(ATTACH_BUCKETS_S, seconds)] += 1
        self.sum_s += seconds


@dataclass
class _Slab:
    last_load_s: float = 0.0
    last_load_bytes: int = 0
    verify_runs: int = 0
    verify_failures: int = 0


class Counters:
    """The service's counters since it started (serving loop's thread only).

    Args:
        placements (`list[Placement]`): what the config places on this GPU (the label values).
        started_at (`float`): the service's start, Unix time in seconds.
    """

    def __init__(self, placements: list[Placement], started_at: float) -> None:
        self.started_at = started_at
        self._names: dict[str, str] = {}
        self._slabs: dict[tuple[str, int, int], _Slab] = {}
        self.track(placements)
        self._attaches: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._times: dict[str, _Histogram] = collections.defaultdict(_Histogram)
        self._loads: collections.Counter[tuple[str, int, int, str, str, str]] = collections.Counter()
        self._publishes: collections.Counter[tuple[str, int, int, str, str]] = collections.Counter()
        self._pub_drops: collections.Counter[tuple[str, int, int, str]] = collections.Counter()
        #: The image store's counters (``weightcache.images.ImageStats``), None without images.
        self.images: Any = None
        #: Peer seeding's counters (``weightcache.seeding.SeedStats``: ``seed_counts()``), when seeding is on.
        self.seeding: Any = None

    def track(self, placements: list[Placement]) -> None:
        """Adds label values for ``placements`` (at start; again when a reload places new models).

        Counts already taken stay, also those of models no longer placed.
        """
        for p in placements:
            for alias in (p.model.name, p.model.path, os.path.normpath(p.model.path)):
                self._names.setdefault(alias, p.model.name)
            self._slabs.setdefault((p.model.name, p.tp_size, p.tp_rank), _Slab())

    def model_label(self, requested: str) -> str:
        """The configured name for a name or checkpoint path a client sent, else :data:`OTHER_MODEL`."""
        return self._names.get(requested) or self._names.get(os.path.normpath(requested), OTHER_MODEL)

    def attach_answered(self, msg: protocol.Attach | protocol.AttachPublished, reply: protocol.Message,
                        seconds: float) -> None:
        """Counts one attach answered with ``reply`` after ``seconds`` (read to reply queued)."""
        model = self.model_label(msg.model)
        if isinstance(reply, protocol.AttachReply):
            key = (model, "daemon", "")
        elif isinstance(reply, protocol.Error):
            key = (model, "refused", reply.code)
        else:  # protocol.Loading
            key = (model, "loading", "")
        self._attaches[key] += 1
        self._times[model].observe(max(0.0, seconds))

    def answered(self, msg: protocol.Message, replies: Iterable[Any], seconds: float) -> None:
        """Counts what one request's handler returned (``replies``: handler Reply records, ``.msg`` each)."""
        first = next(iter(replies), None)
        if first is None:
            return  # a parked attach: counted by waited() when it is answered
        if isinstance(msg, (protocol.Attach, protocol.AttachPublished)):  # by engine key, an attach all the same
            self.attach_answered(msg, first.msg, seconds)
        elif isinstance(msg, protocol.Publish):  # publish_cuda_ipc too (a subclass)
            reply = first.msg
            outcome, code = (("refused", reply.code) if isinstance(reply, protocol.Error)
                             else ("published" if reply.created else "held", ""))
            self._publishes[(self.model_label(msg.model), msg.tp_size, msg.tp_rank, outcome, code)] += 1
        elif isinstance(first.msg, protocol.VerifyReply):
            self.verified(first.msg)

    def waited(self, before: list[tuple[protocol.Attach, Any, float]], after: list[tuple[protocol.Attach, Any, float]],
               replies: Iterable[Any], now: float) -> None:
        """Counts the parked attaches answered by one pass over a peer's waiting list.

        Args:
            before, after: the peer's ``waiting`` list before and after the pass
                (``(attach, slot, deadline)``, deadline in ``time.monotonic()`` s).
            replies: the pass's Reply records, one per answered attach, in order.
            now (`float`): ``time.monotonic()`` seconds; an attach was parked at
                ``deadline - wait_ms / 1000``.
        """
        still = {id(w) for w in after}
        answered = [w for w in before if id(w) not in still]
        for (msg, _slot, deadline), reply in zip(answered, replies):
            self.attach_answered(msg, reply.msg, now - (deadline - msg.wait_ms / 1e3))

    def verified(self, reply: protocol.VerifyReply) -> None:
        """Counts the slabs a ``verify`` reply checked and those with a mismatch."""
        for r in reply.typed():
            slab = self._slabs.get((r.model, r.tp_size, r.tp_rank))
            if slab is None or r.state is not SlotState.READY:
                continue
            slab.verify_runs += 1
            slab.verify_failures += bool(r.mismatched)

    def load_settled(self, placement: Placement, error_code: str | None, duration_s: float = 0.0,
                     size_bytes: int = 0, source: str = "checkpoint") -> None:
        """Counts one load of ``placement`` that ended: ``error_code`` None for a sealed slab; ``source`` where
        its bytes came from (``checkpoint``, ``image``)."""
        p = placement
        outcome = "loaded" if error_code is None else "failed"
        self._loads[(p.model.name, p.tp_size, p.tp_rank, outcome, error_code or "", source)] += 1
        if error_code is None:
            slab = self._slabs.setdefault((p.model.name, p.tp_size, p.tp_rank), _Slab())
            slab.last_load_s, slab.last_load_bytes = duration_s, size_bytes

    def publication_dropped(self, placement: Placement, reason: str) -> None:
        """Counts one publication of ``placement`` that left the service (``reason``: ``budget``, ``evict``, or the
        cause of its failed promotion or image load, e.g. ``digest_mismatch``)."""
        p = placement
        self._pub_drops[(p.model.name, p.tp_size, p.tp_rank, reason)] += 1

    def record(self) -> protocol.ServiceCounters:
        """The counters as the ``metrics`` reply carries them."""
        return protocol.ServiceCounters(
            version=__version__, started_at=self.started_at,
            attaches=tuple(protocol.AttachCount(m, o, c, n) for (m, o, c), n in sorted(self._attaches.items())),
            attach_times=tuple(protocol.AttachTimes(m, list(ATTACH_BUCKETS_S), list(h.counts), h.sum_s)
                               for m, h in sorted(self._times.items())),
            loads=tuple(protocol.LoadCount(*k[:5], n, k[5]) for k, n in sorted(self._loads.items())),
            images=self.images.snapshot() if self.images is not None else {},
            publishes=tuple(protocol.PublishCount(*k, n) for k, n in sorted(self._publishes.items())),
            publications_dropped=tuple(protocol.PublicationDropCount(*k, n) for k, n in sorted(self._pub_drops.items())),
            notify_dropped=dict(sorted(notify.dropped.items())),
            seeds=tuple(protocol.SeedCount(*row) for row in (self.seeding.seed_counts() if self.seeding else ())),
            slabs=tuple(protocol.SlabCounters(m, t, r, s.last_load_s, s.last_load_bytes, s.verify_runs,
                                              s.verify_failures) for (m, t, r), s in self._slabs.items()))
