"""sd_notify(3) and sd_listen_fds(3) for the service.

``notify`` sends the datagram itself: ``KEY=VALUE`` lines to ``$NOTIFY_SOCKET``
(a leading ``@`` meaning the abstract namespace), fds as ``SCM_RIGHTS``, with
``MSG_DONTWAIT``. A manager that does not read its socket (a hung or busy
systemd, a test's stand-in) fills the socket's queue
(``net.unix.max_dgram_qlen``, 10 datagrams); the next send would block, and
libsystemd's ``sd_pid_notify_with_fds`` (what systemd-python's
``daemon.notify`` calls) does block there, holding the GIL: every thread of
the service stopped, the serving loop with them. Here such a datagram is
dropped instead, counted (:data:`dropped`) and logged (``notify dropped``, at
most once per :data:`DROP_LOG_PERIOD_S`): a ``STATUS=`` or ``WATCHDOG=1`` the
next one replaces, or an ``FDSTORE=1`` entry that a restart then lacks (that
slab is loaded again), never a service that stops serving.

``listen_fds`` is written here, one path for every installation: it only
reads three environment variables, and systemd-python's
``listen_fds_with_names`` (235) fails with ``EINVAL`` on ``LISTEN_FDS=0``.

The PyPI ``sdnotify`` package is not used (and not a dependency): it cannot
pass fds, which the fd store (``FDSTORE=1`` + ``FDNAME=``) needs, and it
swallows send errors. Outside systemd (``$NOTIFY_SOCKET`` unset) every call is
a no-op returning ``False``.

Forbidden imports: torch, weightcache.daemon, weightcache.client, weightcache.protocol.
"""

from __future__ import annotations

import array
import collections
import logging
import os
import socket
import threading
import time

log = logging.getLogger(__name__)

LISTEN_FDS_START = 3

#: Datagrams dropped because the manager's socket was full, by their first ``KEY`` (``STATUS``, ``FDSTORE``...).
dropped: collections.Counter = collections.Counter()
#: A dropped datagram is logged at most once per this many seconds (the count says how many went since).
DROP_LOG_PERIOD_S = 10.0
_drop_lock = threading.Lock()
_drop_logged = [float("-inf"), 0]  # monotonic s of the last warning, total dropped then


def notify(state: str, fds: list[int] | None = None) -> bool:
    """Sends ``state`` (e.g. ``"READY=1\\nSTATUS=ready"``) to the service manager, never blocking.

    Args:
        state (`str`): newline-separated ``KEY=VALUE`` assignments.
        fds (`list[int]`, *optional*): fds to pass (with ``FDSTORE=1`` and
            ``FDNAME=``); the caller keeps them open and owns them.

    Returns:
        `bool`: whether a notify socket existed and the datagram was sent. A
        full socket drops it (counted in :data:`dropped`, logged ``notify
        dropped``); another send error is logged as a warning (``notify
        failed``); both give ``False``: the service goes on without the
        manager's acknowledgement.
    """
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    try:
        _send(path, state, fds or [])
    except BlockingIOError:
        _dropped(state)
        return False
    except OSError as e:
        log.warning("notify failed state=%r error=%s", state.split("\n")[0], e)
        return False
    return True


def _dropped(state: str) -> None:
    key = state.split("=", 1)[0]
    now = time.monotonic()
    with _drop_lock:
        dropped[key] += 1
        total = sum(dropped.values())
        if now - _drop_logged[0] < DROP_LOG_PERIOD_S:
            return
        since, _drop_logged[0], _drop_logged[1] = total - _drop_logged[1], now, total
    log.warning("notify dropped state=%r reason=the manager's socket is full (not read) dropped_since_last=%d "
                "dropped_total=%d", state.split("\n")[0], since, total)


def _send(path: str, state: str, fds: list[int]) -> None:
    """One datagram, ``MSG_DONTWAIT``: raises BlockingIOError when the socket's queue is full."""
    addr = "\0" + path[1:] if path.startswith("@") else path
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        # socket.send_fds() drops its address argument on Python 3.11: use sendmsg.
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        s.sendmsg([state.encode()], ancillary, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL, addr)


def listen_fds() -> dict[str, list[int]]:
    """The fds systemd passed (``$LISTEN_FDS``), grouped by ``$LISTEN_FDNAMES``.

    Returns:
        `dict[str, list[int]]`: name -> fds (unnamed fds under ``"unknown"``),
        each close-on-exec. Empty when ``$LISTEN_PID`` is not this process.
        The variables are unset afterwards so children do not inherit them.
    """
    try:
        if int(os.environ.get("LISTEN_PID", "0")) != os.getpid():
            return {}
        n = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return {}
    names = os.environ.get("LISTEN_FDNAMES", "").split(":") if n else []
    out: dict[str, list[int]] = {}
    for i in range(n):
        fd = LISTEN_FDS_START + i
        os.set_inheritable(fd, False)
        name = names[i] if i < len(names) and names[i] else "unknown"
        out.setdefault(name, []).append(fd)
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)
    return out


def watchdog_interval_s() -> float | None:
    """Half of ``$WATCHDOG_USEC`` in seconds (the ping period), or ``None``."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6
