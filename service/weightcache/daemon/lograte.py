"""Warnings about one peer, rate-limited: a client cannot flood the journal.

Owns :func:`warn_peer`: the serving loop's WARNING lines about a client
(rejected requests, refused frames, failed sends) go through it, keyed by the
peer's ``(pid, uid)``. Each peer gets :data:`BURST` lines per
:data:`INTERVAL_S` seconds; the rest are counted, and the first warning after
the interval (or :func:`flush`, called by the serving loop's ticks) writes one
summary line, ``suppressed warnings peer_pid=.. peer_uid=.. count=..``. So one
connection costs the journal at most ``BURST + 1`` lines per interval
(journald's own rate limit, 10,000 lines per 30 s by default, would otherwise
hide every other line of the service).

The table holds one entry per peer that warned within the last interval, and
:func:`flush` drops the rest: it is bounded by the connections open.

Forbidden imports: socket, selectors, threading, torch, weightcache.memory,
weightcache.pipeline, weightcache.daemon.transport, weightcache.daemon.handlers.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

#: Lines per peer per interval before the rest are counted.
BURST = 5
#: Seconds of one interval.
INTERVAL_S = 10.0

#: (pid, uid) -> [interval start (monotonic s), lines written, lines suppressed]
_seen: dict[tuple[int, int], list] = {}
_clock: Callable[[], float] = time.monotonic
_summary_log = logging.getLogger(__name__)


def warn_peer(log: logging.Logger, pid: int, uid: int, msg: str, *args: Any, **kw: Any) -> bool:
    """``log.warning(msg, *args, **kw)`` unless peer ``(pid, uid)`` used its :data:`BURST` this interval.

    Returns:
        `bool`: whether the line was written.
    """
    now = _clock()
    key = (pid, uid)
    entry = _seen.get(key)
    if entry is not None and now - entry[0] >= INTERVAL_S:
        _summarise(key, entry)
        entry = None
    if entry is None:
        entry = _seen[key] = [now, 0, 0]
    if entry[1] >= BURST:
        entry[2] += 1
        return False
    entry[1] += 1
    log.warning(msg, *args, **kw)
    return True


def _summarise(key: tuple[int, int], entry: list) -> None:
    if entry[2]:
        _summary_log.warning("suppressed warnings peer_pid=%d peer_uid=%d count=%d interval_s=%.0f", key[0], key[1],
                             entry[2], INTERVAL_S)


def flush(now: float | None = None) -> None:
    """Writes the summary line of every interval that ended and forgets those peers."""
    now = _clock() if now is None else now
    for key in [k for k, e in _seen.items() if now - e[0] >= INTERVAL_S]:
        _summarise(key, _seen.pop(key))
