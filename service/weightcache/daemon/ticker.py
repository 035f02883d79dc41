"""What the serving loop tells systemd on every pass: STATUS, EXTEND_TIMEOUT, READY, WATCHDOG; and gc.freeze.

Owns every ``sd_notify`` the service sends about its progress (not the fd
store's, :mod:`weightcache.daemon.fdstore`): ``STATUS=`` at most once per
:data:`STATUS_PERIOD_S` while it changes, ``EXTEND_TIMEOUT_USEC=`` every
third of :data:`EXTEND_TIMEOUT_S` until ``READY=1``, ``READY=1`` once every
slot has settled, ``WATCHDOG=1`` at the interval systemd asked for
(``$WATCHDOG_USEC``), ``RELOADING=1`` with ``MONOTONIC_USEC=`` before a
reload and ``READY=1`` after it (systemd.service(5), ``Type=notify-reload``;
systemd 252 honours them for ``Type=notify`` too), and ``STOPPING=1``. It also calls ``gc.freeze()``
after each batch of settled loads: everything alive then (torch, the config,
manifests) lives as long as the service, so later collections during an
attach scan only what that attach allocated.

Forbidden imports: socket, selectors, threading, torch, weightcache.protocol directly (``state``
builds the records),
weightcache.pipeline, weightcache.memory, weightcache.daemon.transport,
weightcache.daemon.handlers, weightcache.daemon.loads, weightcache.daemon.fdstore,
weightcache.daemon.loop.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Callable

from .. import notify
from ..journal import event
from ..wire import SlotState
from .state import ServiceState

log = logging.getLogger(__name__)

STATUS_PERIOD_S = 1.0
EXTEND_TIMEOUT_S = 30.0


class Ticker:
    """Sends the service's notifications; call :meth:`tick` on every loop pass.

    Args:
        state (`ServiceState`): what to report.
        send (`callable`, *optional*): ``(text) -> None``; :func:`weightcache.notify.notify` by default.
        watchdog_s (`float | None`, *optional*): ping interval, seconds (0: no
            watchdog); None (the default): from ``$WATCHDOG_USEC``.
    """

    def __init__(self, state: ServiceState, send: Callable[[str], object] = notify.notify,
                 watchdog_s: float | None = None) -> None:
        self.state = state
        self.send = send
        self.watchdog_s = notify.watchdog_interval_s() if watchdog_s is None else watchdog_s
        self.ready_sent = False
        self._frozen_at = -1
        self._last_status = ""
        self._last_status_t = 0.0
        self._last_extend_t = 0.0
        self._last_watchdog_t = 0.0

    def tick(self, now: float) -> None:
        """Sends what is due at ``now`` (``time.monotonic()`` seconds)."""
        st = self.state
        settled = st.settled
        status = st.status_line(now)
        extend_due = not self.ready_sent and now - self._last_extend_t >= EXTEND_TIMEOUT_S / 3
        if status != self._last_status and (now - self._last_status_t >= STATUS_PERIOD_S or settled):
            msg = f"STATUS={status}"
            if extend_due:
                msg += f"\nEXTEND_TIMEOUT_USEC={int(EXTEND_TIMEOUT_S * 1e6)}"
                self._last_extend_t = now
            self.send(msg)
            self._last_status, self._last_status_t = status, now
        elif extend_due:
            self.send(f"EXTEND_TIMEOUT_USEC={int(EXTEND_TIMEOUT_S * 1e6)}")
            self._last_extend_t = now
        if settled and not self.ready_sent:
            self.send(f"READY=1\nSTATUS={status}")
            self.ready_sent = True
            ready = [s for s in st.slots if s.state is SlotState.READY]
            failed = sum(s.state is SlotState.FAILED for s in st.slots)
            resident = sum(s.sealed.size_bytes for s in ready if s.sealed is not None)
            log.info("ready slabs=%d failed=%d size_bytes=%d", len(ready), failed, resident,
                     extra=event("ready", size_bytes=resident, slabs=len(ready), failed=failed))
        if settled and self._frozen_at != st.loads_done:
            # Keep what is alive now out of every later collection, so that a full collection in
            # the middle of an attach scans what that attach allocated, not the whole heap
            # (was a 40 ms reply on CPU).
            gc.freeze()
            self._frozen_at = st.loads_done
        if self.watchdog_s and now - self._last_watchdog_t >= self.watchdog_s:
            self.send("WATCHDOG=1")
            self._last_watchdog_t = now

    def reloading(self) -> None:
        """``RELOADING=1`` and ``MONOTONIC_USEC=`` (CLOCK_MONOTONIC, µs), once the service is ready."""
        if self.ready_sent:
            usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
            self.send(f"RELOADING=1\nMONOTONIC_USEC={usec}\nSTATUS=reloading the configuration")

    def reloaded(self, now: float) -> None:
        """``READY=1`` with the new status line after a reload, applied or refused (before the
        first ``READY=1`` only the status: :meth:`tick` sends READY once every slot settles)."""
        status = self.state.status_line(now)
        self.send(f"READY=1\nSTATUS={status}" if self.ready_sent else f"STATUS={status}")
        self._last_status, self._last_status_t = status, now

    def stopping(self) -> None:
        """``STOPPING=1``."""
        self.send("STOPPING=1\nSTATUS=stopping")
