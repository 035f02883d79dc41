"""Starting one instance: the configuration (or what the fd store kept), the backend, the listener, the serving loop.

``weightcache serve`` (:mod:`weightcache.cli`) parses its arguments into a
:class:`ServeOptions` and calls :func:`serve`; everything that starts the
service lives here, next to the :class:`~weightcache.daemon.loop.Daemon` it
starts:

- the configuration: the files, or, when they do not load, the placements
  recorded beside the slabs in systemd's fd store (:func:`config_kept`);
- the slab backend (:func:`backend_for`: ``--backend``, else the config's;
  ``auto`` asks the CUDA driver), whose driver start-up (``cuInit``, the
  primary context) :func:`start_cuda` begins on a thread as soon as the
  configuration is read, beside this thread's import of the daemon;
- the listening socket: the one systemd passed (``LISTEN_FDS``, name
  ``listen``), else one bound at ``--listen`` or ``<socket dir>/<gpu>.sock``
  (:func:`listener`), refusing a path another live instance serves on and
  replacing a stale one (:func:`remove_stale`);
- the exit status of a start that cannot go on (:data:`EXIT_CONFIG`, 78, stops
  the unit's restart loop through ``RestartPreventExitStatus=78``).

Forbidden imports: torch, weightcache.cli, weightcache.client.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import socket
import stat
from dataclasses import dataclass
from typing import Any

from .. import notify
from ..config import Config, ServiceConfig, account_names, config_path, load_config
from ..config import resolve_paths
from ..errors import ConfigError, WeightcacheError
from ..journal import event

log = logging.getLogger("weightcache")

#: A start that failed in a way a restart may fix (e.g. the CUDA driver not ready yet).
EXIT_FAILED = 1
#: sysexits.h EX_CONFIG: the unit's RestartPreventExitStatus=78 stops restart loops on a bad config.
EXIT_CONFIG = 78


@dataclass(frozen=True)
class ServeOptions:
    """What ``weightcache serve`` was asked (weightcache(1)).

    Attributes:
        gpu (`int`): the GPU index this instance serves (the unit's ``%i``).
        config (`str | None`): the main config file; None: ``$WEIGHTCACHE_CONFIG`` or
            ``/etc/weightcache/weightcache.toml``.
        listen (`str | None`): the socket path to bind when systemd passed none; None:
            ``<socket dir>/<gpu>.sock``.
        backend (`str | None`): ``auto``, ``cuda`` or ``host``; None: the config's ``[service] backend``.
        verbose (`bool`): debug logging.
    """

    gpu: int
    config: str | None = None
    listen: str | None = None
    backend: str | None = None
    verbose: bool = False


def backend_for(cfg: Config, explicit: str | None, gpu: int, kept: bool = False, start: Any = None):
    """The slab backend for ``serve``: ``explicit`` (``--backend``), else the config's; ``auto`` asks the driver.

    ``kept``: ``cfg`` is :func:`config_kept`'s (the files were rejected), whose backend is that of the
    slabs in the fd store; the journal line says so instead of naming the configuration. ``start``: the
    driver's start-up begun by :func:`start_cuda` (its probe answers, its device is the backend's); None:
    the driver is asked here.

    Raises:
        ConfigError (`config_invalid`): ``cuda`` without a usable driver (see
            :func:`weightcache.memory.select_backend`).
        CudaDriverError: the driver loads but GPU ``gpu`` cannot be used (no such device, no context).
    """
    from ..memory import get_backend, select_backend

    name, reason = select_backend(explicit or cfg.service.backend, *([start.probe] if start is not None else []))
    if kept and not explicit and cfg.service.backend != "auto":
        reason = (f"backend = {name}: the backend of the slabs kept in systemd's fd store (the configuration "
                  f"files were rejected)")
    log.info("backend selected backend=%s gpu=%d reason=%s", name, gpu, reason,
             extra=event("backend", backend=name, reason=reason))
    return get_backend(name, gpu, device=start.device() if start is not None and name == "cuda" else None)


def start_cuda(cfg: Config, explicit: str | None, gpu: int) -> Any:
    """Begins the CUDA driver's start-up on a background thread when the backend may be ``cuda``
    (:class:`~weightcache.memory.cuda_start.CudaStart`); None for ``host`` (the driver is not asked).

    ``explicit`` (``--backend``), else the config's backend, as :func:`backend_for` reads them. None as well
    when no thread can start (a thread limit): :func:`backend_for` then asks the driver itself.
    """
    if (explicit or cfg.service.backend) not in ("auto", "cuda"):
        return None
    from ..memory.cuda_start import CudaStart

    try:
        return CudaStart(gpu).begin()
    except RuntimeError as e:  # "can't start new thread"
        log.debug("CUDA start-up thread not started, the driver is asked on the main thread error=%s", e)
        return None


def listener(opts: ServeOptions, cfg: Config, stored: dict[str, list[int]]) -> tuple[socket.socket, str | None]:
    """The listening socket and the path bound here (None when systemd passed the socket).

    Takes systemd's socket out of ``stored`` (``listen``, else an unnamed fd), closing any extra one;
    otherwise binds ``opts.listen``, else ``<socket dir>/<gpu>.sock`` with the socket directory
    ``$WEIGHTCACHE_SOCKET_DIR``, else the config's ``[service] socket_dir`` (mode 0660, backlog 128).
    """
    fds = stored.pop("listen", []) or stored.pop("unknown", [])
    if fds:
        for extra in fds[1:]:
            os.close(extra)
        return socket.socket(fileno=fds[0]), None
    where = os.environ.get("WEIGHTCACHE_SOCKET_DIR") or cfg.service.socket_dir
    path = opts.listen or os.path.join(where, f"{opts.gpu}.sock")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    remove_stale(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.bind(path)
    os.chmod(path, 0o660)
    s.listen(128)
    return s, path


def remove_stale(path: str) -> None:
    """Removes what is at ``path`` before the bind, unless a live service answers there.

    A socket nobody listens on (``ECONNREFUSED``: left by a killed service) or anything that cannot be
    connected to is stale and removed, as is a non-socket file.

    Raises:
        ConfigError (`config_invalid`): a connect to ``path`` succeeds (or stays pending: a busy
            service); the path is left alone.
    """
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
            return
    except FileNotFoundError:
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except (socket.timeout, BlockingIOError):  # a full backlog: someone listens
        live = True
    except OSError:  # ECONNREFUSED (stale), ENOENT (gone meanwhile), ...
        live = False
    else:
        live = True
    finally:
        probe.close()
    if live:
        raise ConfigError(f"{path}: another weightcache instance is serving on this socket; stop it first "
                          f"(or give this one another --listen path)", path=path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def socket_id(path: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``path`` (not following a link), None when it does not exist."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def serve(opts: ServeOptions) -> int:
    """Runs the service for one GPU until SIGTERM; SIGHUP reloads the config. Returns the exit status.

    A configuration that does not load is reported (journal, ``STATUS=``,
    ``status``) and the service keeps what it has: the slabs systemd's fd store
    handed back (served as they were configured) and the listening socket
    systemd handed over (its clients get ``model_not_found`` naming the error,
    rather than the socket starting the service again and again until the start
    limit removes it). ``systemctl reload`` applies the fixed file. With neither
    (run by hand), it returns :data:`EXIT_CONFIG` (78).
    """
    from ..checkpoint.header import warm_validation
    from ..journal import setup_logging

    setup_logging(opts.gpu, logging.DEBUG if opts.verbose else logging.INFO)
    # A fatal signal (SIGSEGV, SIGBUS) leaves every thread's Python stack in the journal, not only
    # "status=7/BUS".
    try:
        faulthandler.enable()
    except (RuntimeError, ValueError, OSError):  # no usable stderr: nothing to write the stacks to
        pass
    stored = notify.listen_fds()
    config_error = None
    try:
        cfg = load_config(opts.config)
    except ConfigError as e:
        cfg, config_error = config_kept(opts, stored, e), e
        if cfg is None:
            return rejected(e)
    # The driver's calls (cuInit, the primary context) release the GIL: they run beside the imports of the
    # daemon's modules, then numpy's (the first plan's header check) beside what the driver has left. Two
    # imports at once would only take turns on the GIL, each waiting for the other at every file read.
    start = start_cuda(cfg, opts.backend, opts.gpu)
    from .loop import Daemon

    warm = warm_validation()

    def ended(code: int) -> int:
        # A start that ends here waits for numpy's import on the warm thread first: an interpreter that
        # finalizes while a daemon thread is inside a C extension's import can crash (seen: SIGSEGV at exit,
        # -11 instead of 78, about 1 refused start in 20 under load).
        warm.join(timeout=60)
        return code

    try:
        backend = backend_for(cfg, opts.backend, opts.gpu, kept=config_error is not None, start=start)
    except ConfigError as e:
        held = backend_rejected(opts, stored, e)
        if held is None:
            return ended(rejected(e))
        (backend, cfg), config_error = held, e
    except WeightcacheError as e:  # e.g. the CUDA driver not ready yet: worth a restart
        log.critical("start failed code=%s error=%s", e.code, e.message)
        notify.notify(f"STATUS=start failed: {e.message}")
        return ended(EXIT_FAILED)
    try:
        sock, bound = listener(opts, cfg, stored)
    except ConfigError as e:  # another instance serves on the path (remove_stale)
        log.critical("start refused code=%s error=%s", e.code, e.message)
        notify.notify(f"STATUS=start refused: {e.message}")
        return ended(EXIT_CONFIG)
    mine = socket_id(bound) if bound else None  # the socket bound here, not one a later instance put there
    d = Daemon(cfg, opts.gpu, backend, sock, stored, load_config=lambda: load_config(opts.config),
               config_error=config_error)
    try:
        return d.serve()
    finally:
        if bound and mine is not None and socket_id(bound) == mine:
            try:
                os.unlink(bound)
            except FileNotFoundError:
                pass


def rejected(e: ConfigError) -> int:
    """Logs (journal fields of :func:`~weightcache.daemon.reload.config_rejected_event`) and reports through
    ``STATUS=`` a configuration ``serve`` cannot start with; returns :data:`EXIT_CONFIG`."""
    from .reload import config_rejected_event

    log.critical("configuration rejected code=%s error=%s", e.code, e.message, extra=config_rejected_event(e))
    notify.notify(f"STATUS=configuration rejected: {e.message}")
    return EXIT_CONFIG


def backend_rejected(opts: ServeOptions, stored: dict[str, list[int]], e: ConfigError) -> tuple[Any, Config] | None:
    """What to serve when the configured backend cannot start (``backend = "cuda"`` and the driver does not load).

    Exiting would fail the unit: systemd would drop the fd store (the slabs of the previous process) and every
    engine connecting to the socket would start the service again (issue 26). With the socket systemd handed
    over, the service instead runs on the host backend with no model: the stored slabs stay in the store
    untouched (they are not adopted), engines get ``model_not_found`` naming the error, ``status``, ``STATUS=``
    and the ``weightcache_config_rejected`` gauge say it. A fixed file is applied by ``systemctl reload``; a
    driver that loads now needs ``systemctl restart`` (the backend is chosen at start).

    Returns:
        ``(backend, config)``, or None when there is no socket from systemd (run by hand: exit 78).
    """
    if not (stored.get("listen") or stored.get("unknown")):
        return None
    from ..memory import get_backend
    from .reload import config_rejected_event

    log.critical("backend rejected, serving no model until the configuration is fixed code=%s error=%s", e.code,
                 e.message, extra=config_rejected_event(e))
    return get_backend("host", opts.gpu), Config(service=ServiceConfig(backend="host"), models={},
                                                 files=(str(config_path(opts.config)),))


def config_kept(opts: ServeOptions, stored: dict[str, list[int]], e: ConfigError) -> Config | None:
    """The configuration to serve while the files do not load: the placements recorded beside the slabs
    in the fd store, on their backend; None when there is nothing to keep (no slab, no socket from systemd)."""
    from .fdstore import stored_placements
    from .reload import config_rejected_event
    from .state import describe_config_error

    placements, backend = stored_placements(stored, opts.gpu)
    if not placements and not (stored.get("listen") or stored.get("unknown")):
        return None
    log.warning("configuration rejected, serving what was kept slabs=%d error=%s", len(placements),
                describe_config_error(e), extra=config_rejected_event(e))
    models = {p.model.name: p.model for p in placements}
    return Config(service=ServiceConfig(backend=opts.backend or backend or "auto"), models=models,
                  files=(str(config_path(opts.config)),),
                  realpaths=resolve_paths(m.path for m in models.values()),  # at start, before serving
                  names=account_names((), models.values()))
