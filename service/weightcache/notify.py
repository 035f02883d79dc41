"""sd_notify(3) and sd_listen_fds(3) for the service.

``notify`` uses systemd-python (``systemd.daemon.notify(state, fds=...)``,
libsystemd itself) whenever it is installed: the packages depend on it
(``python3-systemd``; the ``systemd`` extra for pip). Without it, a
pure-Python fallback sends the same datagram: ``KEY=VALUE`` lines to
``$NOTIFY_SOCKET`` (a leading ``@`` meaning the abstract namespace), fds as
``SCM_RIGHTS``.

``listen_fds`` is written here, one path for every installation: it only
reads three environment variables, the fallback would need it anyway, and
systemd-python's ``listen_fds_with_names`` (235) fails with ``EINVAL`` on
``LISTEN_FDS=0``.

The PyPI ``sdnotify`` package is not used (and not a dependency): it cannot
pass fds, which the fd store (``FDSTORE=1`` + ``FDNAME=``) needs, and it
swallows send errors; using it for fd-less notifications only would be a
second code path for the same datagram. Outside systemd (``$NOTIFY_SOCKET``
unset) every call is a no-op returning ``False``.

Forbidden imports: torch, weightcache.daemon, weightcache.client, weightcache.protocol.
"""

from __future__ import annotations

import array
import logging
import os
import socket

log = logging.getLogger(__name__)

LISTEN_FDS_START = 3

try:  # pragma: no cover - depends on the environment
    from systemd import daemon as _sd_daemon
except ImportError:  # pragma: no cover
    _sd_daemon = None


def notify(state: str, fds: list[int] | None = None) -> bool:
    """Sends ``state`` (e.g. ``"READY=1\\nSTATUS=ready"``) to the service manager.

    Args:
        state (`str`): newline-separated ``KEY=VALUE`` assignments.
        fds (`list[int]`, *optional*): fds to pass (with ``FDSTORE=1`` and
            ``FDNAME=``); the caller keeps them open and owns them.

    Returns:
        `bool`: whether a notify socket existed and the datagram was sent. A
        send error is logged as a warning (``notify failed``) and gives
        ``False``: the service goes on without the manager's acknowledgement.
    """
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    try:
        if _sd_daemon is not None:
            sent = _sd_daemon.notify(state, fds=list(fds)) if fds else _sd_daemon.notify(state)
            return bool(sent)
        _send(path, state, fds or [])
    except OSError as e:
        log.warning("notify failed state=%r error=%s", state.split("\n")[0], e)
        return False
    return True


def _send(path: str, state: str, fds: list[int]) -> None:
    """The fallback datagram (systemd-python missing)."""
    addr = "\0" + path[1:] if path.startswith("@") else path
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        # socket.send_fds() drops its address argument on Python 3.11: use sendmsg.
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        s.sendmsg([state.encode()], ancillary, 0, addr)


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
