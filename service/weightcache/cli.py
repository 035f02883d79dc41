"""Command line: ``weightcache serve|status|list|check-config|verify|evict|preload|wait|reload|metrics|serve-metrics``.

Thin: each command parses arguments, talks to a service (or runs it) and
prints; the commands are documented in ``weightcache(1)`` and docs/, and
tests/integration/test_cli.py drives each against live services. Exit status:
0 success, 1 a failed model or a refused request, 2 bad usage or
configuration, 3 no service (``serve``: 78 on an invalid configuration when
it has nothing to keep serving, see :func:`cmd_serve`).
Human output goes to stdout, diagnostics to stderr; ``--json`` output is the
services' own status records.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pwd
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Iterator

from . import protocol
from .client import Session, listening_gpus, resolve_socket_dir
from .config import Config, load_config
from .errors import ConfigError, DaemonUnavailable, LeaseBusy, WeightcacheError
from .wire import UNSETTLED, SlotState

log = logging.getLogger("weightcache")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3
#: sysexits.h EX_CONFIG: the unit's RestartPreventExitStatus=78 stops restart loops on a bad config.
EXIT_CONFIG = 78


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _backend_for(cfg: Config, explicit: str | None, gpu: int):
    """The slab backend for ``serve``: ``--backend``, else the config's; ``auto`` asks the driver.

    Raises:
        ConfigError (`config_invalid`): ``cuda`` without a usable driver (see
            :func:`weightcache.memory.select_backend`).
    """
    from .memory import get_backend, select_backend

    name, reason = select_backend(explicit or cfg.service.backend)
    log.info("backend selected backend=%s gpu=%d reason=%s", name, gpu, reason)
    return get_backend(name, gpu)


def _listener(args: argparse.Namespace, cfg: Config, stored: dict[str, list[int]]) -> tuple[socket.socket, str | None]:
    fds = stored.pop("listen", []) or stored.pop("unknown", [])
    if fds:
        for extra in fds[1:]:
            os.close(extra)
        return socket.socket(fileno=fds[0]), None
    path = args.listen or os.path.join(resolve_socket_dir(cfg.service.socket_dir if not os.environ.get(
        "WEIGHTCACHE_SOCKET_DIR") else None), f"{args.gpu}.sock")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.bind(path)
    os.chmod(path, 0o660)
    s.listen(128)
    return s, path


def cmd_serve(args: argparse.Namespace) -> int:
    """``weightcache serve``: runs the service for one GPU until SIGTERM; SIGHUP reloads the config.

    A configuration that does not load is reported (journal, ``STATUS=``,
    ``status``) and the service keeps what it has: the slabs systemd's fd store
    handed back (served as they were configured) and the listening socket
    systemd handed over (its clients get ``model_not_found`` naming the error,
    rather than the socket starting the service again and again until the start
    limit removes it). ``systemctl reload`` applies the fixed file. With neither
    (run by hand), it exits 78.
    """
    from . import notify
    from .checkpoint import warm_validation
    from .daemon import Daemon
    from .journal import setup_logging

    setup_logging(args.gpu, logging.DEBUG if args.verbose else logging.INFO)
    warm_validation()  # numpy for the first plan's header check, beside the config read and the driver's init
    stored = notify.listen_fds()
    config_error = None
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        cfg, config_error = _config_kept(args, stored, e), e
        if cfg is None:
            return _rejected(e)
    try:
        backend = _backend_for(cfg, args.backend, args.gpu)
    except ConfigError as e:
        return _rejected(e)
    except WeightcacheError as e:  # e.g. the CUDA driver not ready yet: worth a restart
        log.critical("start failed code=%s error=%s", e.code, e.message)
        notify.notify(f"STATUS=start failed: {e.message}")
        return EXIT_FAILED
    listener, bound = _listener(args, cfg, stored)
    d = Daemon(cfg, args.gpu, backend, listener, stored, load_config=lambda: load_config(args.config),
               config_error=config_error)
    try:
        return d.serve()
    finally:
        if bound:
            try:
                os.unlink(bound)
            except FileNotFoundError:
                pass


def _rejected(e: ConfigError) -> int:
    """Logs (journal fields of :func:`~weightcache.daemon.reload.config_rejected_event`) and reports through
    ``STATUS=`` a configuration ``serve`` cannot start with; returns :data:`EXIT_CONFIG`."""
    from . import notify
    from .daemon.reload import config_rejected_event

    log.critical("configuration rejected code=%s error=%s", e.code, e.message, extra=config_rejected_event(e))
    notify.notify(f"STATUS=configuration rejected: {e.message}")
    return EXIT_CONFIG


def _config_kept(args: argparse.Namespace, stored: dict[str, list[int]], e: ConfigError) -> Config | None:
    """The configuration to serve while the files do not load: the placements recorded beside the slabs
    in the fd store, on their backend; None when there is nothing to keep (no slab, no socket from systemd)."""
    from .config import ServiceConfig, config_path
    from .daemon.fdstore import stored_placements
    from .daemon.reload import config_rejected_event
    from .daemon.state import describe_config_error

    placements, backend = stored_placements(stored, args.gpu)
    if not placements and not (stored.get("listen") or stored.get("unknown")):
        return None
    log.warning("configuration rejected, serving what was kept slabs=%d error=%s", len(placements),
                describe_config_error(e), extra=config_rejected_event(e))
    models = {p.model.name: p.model for p in placements}
    return Config(service=ServiceConfig(backend=args.backend or backend or "auto"), models=models,
                  files=(str(config_path(args.config)),))


def _socket_dir(args: argparse.Namespace) -> str:
    """``--socket-dir``, else ``$WEIGHTCACHE_SOCKET_DIR``, else the config's
    ``[service] socket_dir`` (when the config loads), else ``/run/weightcache``."""
    if args.socket_dir or os.environ.get("WEIGHTCACHE_SOCKET_DIR"):
        return resolve_socket_dir(args.socket_dir)
    try:
        return load_config(None).service.socket_dir
    except ConfigError:
        return resolve_socket_dir(None)


def _gpus(args: argparse.Namespace, where: str) -> list[int]:
    """GPU indices to ask: ``--gpu``, else every ``<N>.sock`` in socket directory ``where``."""
    return [args.gpu] if args.gpu is not None else listening_gpus(where)


def _ask_each(args: argparse.Namespace, where: str, gpus: list[int],
              make) -> Iterator[tuple[int, Any, WeightcacheError | None]]:
    """Sends ``make()`` to the instance of each of ``gpus`` (sockets in ``where``), one connection each.

    Yields ``(gpu, reply, None)``, or ``(gpu, None, error)`` when connecting or
    the request failed; the connection is closed before each yield.
    """
    for gpu in gpus:
        try:
            s = Session(os.path.join(where, f"{gpu}.sock"), timeout=args.timeout, client="weightcache-cli")
            try:
                reply = s.request(make())
            finally:
                s.close()
        except WeightcacheError as e:
            yield gpu, None, e
            continue
        yield gpu, reply, None


def _no_sockets(args: argparse.Namespace) -> str:
    """Why no socket answers: no model configured (so no instance), a config that does not load, or the target."""
    where = _socket_dir(args)
    try:
        cfg = load_config(None)
    except ConfigError as e:
        if e.details.get("cause") != "not_found":  # a node with no config at all may be a client only
            return f"no weightcache sockets in {where}; the configuration does not load: {e.message}"
    else:
        if not cfg.models:
            return (f"no weightcache sockets in {where}: no model is configured in {', '.join(cfg.files)}; add a "
                    f"[models.NAME] table (weightcache.toml(5)), check it with `weightcache check-config`, then "
                    f"`systemctl daemon-reload && systemctl restart weightcache.target`")
    return (f"no weightcache sockets in {where} (is weightcache.target started? "
            f"set --socket-dir or $WEIGHTCACHE_SOCKET_DIR if the service listens elsewhere)")


@dataclass(frozen=True)
class _Unreachable:
    """An instance that did not answer: its GPU index and the error's code and message."""

    gpu: int
    code: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "code": self.code, "message": self.message}


def _collect(args: argparse.Namespace, where: str | None = None) -> tuple[list[protocol.ServiceStatus],
                                                                        list[_Unreachable]]:
    """Status of every reachable instance (sockets in ``where``, default :func:`_socket_dir`), and the others
    as :class:`_Unreachable`."""
    out, errors = [], []
    where = where or _socket_dir(args)
    for gpu, reply, e in _ask_each(args, where, _gpus(args, where), protocol.Status):
        if e is None:
            out.append(reply.typed())
        elif isinstance(e, DaemonUnavailable):
            errors.append(_Unreachable(gpu, e.code, e.message))
        else:
            raise e
    return out, errors


def _user(uid: int) -> str:
    try:
        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return str(uid)


def _holder(le: protocol.LeaseInfo) -> str:
    """Who holds a lease, for humans: ``pid=4242 uid=1000 (alice)``, or ``held by another user`` when the
    service hid the holder from this caller (:data:`~weightcache.protocol.HIDDEN_ID`)."""
    if protocol.HIDDEN_ID in (le.pid, le.uid):
        return "held by another user"
    return f"pid={le.pid} uid={_user(le.uid)}"


def _n(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _progress(sl: protocol.SlabInfo) -> str:
    """``1.2 GiB/12.6 GiB (9%) 2.10 GB/s, ~5s left`` for a loading slab."""
    done, total, rate = sl.done_bytes, sl.total_bytes, sl.rate_bytes_per_s
    text = f"{_human_bytes(done)}/{_human_bytes(total)}"
    if total:
        text += f" ({100.0 * done / total:.0f}%)"
    text += f" {rate / 1e9:.2f} GB/s"
    if rate > 0 and total > done:
        text += f", ~{_age((total - done) / rate)} left"
    return text


def _state_text(sl: protocol.SlabInfo) -> str:
    """The slab's state for humans: its :class:`~weightcache.wire.SlotState` value first, then what it means."""
    match sl.state:
        case SlotState.LOADING:
            return f"loading {_progress(sl)}"
        case SlotState.READY if sl.adopted:
            return "ready (adopted from fd store)"
        case SlotState.FAILED if sl.error is not None:
            return f"failed: {sl.error.code}"
        case SlotState.EVICTED:
            return "evicted (run `weightcache preload` to load again)"
        case SlotState.RETIRED:
            return f"retired: removed from the config, freed when its {_n(len(sl.leases), 'lease')} end"
        case SlotState.DROPPED:
            return "dropped: removed from the config"
    return sl.state.value  # pending, and ready or failed without more to say


def _print_status(st: protocol.ServiceStatus, now: float) -> None:
    dev = st.device
    resident = sum(sl.resident_bytes for sl in st.slabs)
    leases = sum(len(sl.leases) for sl in st.slabs)
    where = "GPU" if st.backend == "cuda" else "host RAM"
    head = f"GPU {st.gpu}  backend={st.backend}"
    if dev.gpu_uuid:
        head += f"  uuid={dev.gpu_uuid}"
    if dev.compute_capability:
        head += f"  sm={dev.compute_capability}"
    print(f"{head}  service pid={st.pid}")
    slabs = _n(sum(sl.resident_bytes > 0 for sl in st.slabs), "slab")
    print(f"  resident {_human_bytes(resident)} in {slabs}; "
          f"{where} free {_human_bytes(st.free_bytes)} of {_human_bytes(st.total_bytes)}; "
          f"{_n(leases, 'lease')}")
    print(f"  {st.status_line}")
    if st.config_error is not None:
        d = st.config_error.details
        print(f"  configuration rejected: {st.config_error.message}" + (f" (line {d['line']})" if d.get("line") else ""))
        print(f"      serving the previous configuration; fix the file, check it with `weightcache check-config`, "
              f"then `systemctl reload weightcache@{st.gpu}`")
    for sl in st.slabs:
        print(f"  {sl.label:<32} {_state_text(sl)}")
        if sl.resident_bytes or sl.tensors:
            print(f"      resident {_human_bytes(sl.resident_bytes)} ({sl.resident_bytes} bytes), "
                  f"{sl.tensors} tensors, {sl.path}")
        else:
            print(f"      {sl.path}")
        if sl.error is not None:
            print(f"      reason: {sl.error.message}")
        if sl.key is not None:
            k = sl.key
            print(f"      key: arch={k.architecture} dtype={sl.dtype} naming={sl.naming} "
                  f"quant={k.quant_scheme or 'none'} files={k.files} pipeline=v{k.pipeline_version}")
        for le in sl.leases:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(le.since))
            print(f"      lease {le.lease_id}: {_holder(le)} mode={le.mode} "
                  f"since {since} ({_age(now - le.since)} ago)")


def cmd_status(args: argparse.Namespace) -> int:
    statuses, errors = _collect(args)
    failed = any(sl.state is SlotState.FAILED for st in statuses for sl in st.slabs) or any(
        st.config_error is not None for st in statuses)
    if args.json:
        print(json.dumps({"gpus": [st.to_json() for st in statuses], "unreachable": [e.to_json() for e in errors]},
                         indent=2))
    else:
        if not statuses and not errors:
            print(_no_sockets(args), file=sys.stderr)
        now = time.time()
        for st in statuses:
            _print_status(st, now)
        for e in errors:
            print(f"GPU {e.gpu}  unreachable: {e.message}")
            if "Permission denied" not in e.message:  # that message names its own fix
                print(f"      under systemd, why: systemctl status weightcache@{e.gpu}.socket weightcache@{e.gpu}"
                      f".service; journalctl -u weightcache@{e.gpu}")
    if not statuses:
        return EXIT_UNAVAILABLE
    if failed:
        return EXIT_FAILED
    return EXIT_UNAVAILABLE if errors else EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    statuses, errors = _collect(args)
    rows = [(st.gpu, sl) for st in statuses for sl in st.slabs]
    if args.json:
        print(json.dumps([dict(sl.to_json(), gpu=gpu) for gpu, sl in rows], indent=2))
    elif statuses:
        print(f"{'GPU':<4} {'MODEL':<24} {'TP':>3} {'RANK':>4} {'STATE':<9} {'RESIDENT':>10} {'LEASES':>6}  PATH")
        for gpu, sl in rows:
            state = sl.state.value + ("*" if sl.adopted else "")
            print(f"{gpu:<4} {sl.model:<24} {sl.tp_size:>3} {sl.tp_rank:>4} {state:<9} "
                  f"{_human_bytes(sl.resident_bytes):>10} {len(sl.leases):>6}  {sl.path}")
        if any(sl.adopted for _, sl in rows):
            print("* adopted from the fd store")
    if not args.json:
        if not statuses and not errors:
            print(_no_sockets(args), file=sys.stderr)
        for e in errors:
            print(f"GPU {e.gpu} unreachable: {e.message}", file=sys.stderr)
    return EXIT_UNAVAILABLE if not statuses else EXIT_OK


#: The user weightcache@.service runs as (units/weightcache.sysusers).
SERVICE_USER = "weightcache"


def _check_as(args: argparse.Namespace) -> int | None:
    """Runs the rest of ``check-config`` as the service user when asked, or by default as root.

    Returns the exit status of the child that did the checks as that user, or
    ``None`` when this process goes on itself (not root, or ``--as-user root``).
    """
    user = args.as_user
    if user is None:
        if os.geteuid() != 0:
            return None
        user = SERVICE_USER
        try:
            pwd.getpwnam(user)
        except KeyError:
            print(f"checking as root: user {user} does not exist here, so what it may read is not checked")
            return None
    if user == "root" or (os.geteuid() != 0 and pwd.getpwuid(os.geteuid()).pw_name == user):
        return None
    if os.geteuid() != 0:
        raise ConfigError(f"--as-user {user}: checking as another user needs root (run with sudo, or leave "
                          f"--as-user out to check as yourself)", key="--as-user")
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise ConfigError(f"--as-user {user}: no such user (the service runs as {SERVICE_USER})",
                          key="--as-user") from None
    print(f"checking as user {user} (uid {pw.pw_uid}), as weightcache@.service reads the files")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child drops to the user and does the checks; the parent only waits
        code = EXIT_FAILED
        try:
            try:
                os.setgroups(os.getgrouplist(user, pw.pw_gid))
                os.setgid(pw.pw_gid)
                os.setuid(pw.pw_uid)
            except OSError as e:
                print(f"weightcache: --as-user {user}: cannot switch to uid {pw.pw_uid}: {e.strerror}",
                      file=sys.stderr)
                code = EXIT_USAGE
            else:
                args.as_user = "root"  # already switched: the child checks as itself
                code = _run_checked(cmd_check_config, args)
        except BaseException:  # os._exit below skips the interpreter's own traceback printing
            traceback.print_exc()
            code = EXIT_FAILED
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validates the config and plans every slab from headers alone (no tensor is read),
    reading every file as the service user when run as root (see :func:`_check_as`)."""
    from . import memory, pipeline
    from .config import Placement, config_path

    rc = _check_as(args)
    if rc is not None:
        return rc
    cfg = load_config(args.config)
    host = {"backend": "host", "gpu_uuid": "", "compute_capability": ""}
    problems: list[str] = []
    print(f"config: {', '.join(cfg.files) if cfg.files else config_path(args.config)}")
    print(f"socket_dir={cfg.service.socket_dir} backend={cfg.service.backend}")
    if not cfg.models:
        print("no models configured")
    warnings: list[str] = []
    if cfg.models:
        node, beyond = _gpus_beyond_the_node(cfg, memory.probe_cuda)
        print(node)
        warnings += beyond
    planned: list[tuple[Placement, pipeline.Plan]] = []
    for gpu in cfg.gpus():
        placements = cfg.placements(gpu)
        total = 0
        lines = []
        for p in placements:
            gpus = ",".join(str(g) for g in next(lay.gpus for lay in p.model.layouts if lay.tp == p.tp_size
                                                 and lay.gpus[p.tp_rank] == gpu))
            try:
                pl = pipeline.plan(p.model, p.tp_size, p.tp_rank, host)
            except WeightcacheError as e:
                problems.append(f"model {p.model.name} tp={p.tp_size} rank={p.tp_rank} (GPU {gpu}, defined in "
                                f"{p.model.source}): {e.code}: {e.message}")
                lines.append(f"  {p.model.name:<24} tp={p.tp_size} rank={p.tp_rank}  gpus=[{gpus}]  "
                             f"ERROR {e.code}  {p.model.path}")
                continue
            planned.append((p, pl))
            total += pl.slab_size_bytes
            lines.append(f"  {p.model.name:<24} tp={p.tp_size} rank={p.tp_rank}  {'gpus=[' + gpus + ']':<12} "
                         f"{_human_bytes(pl.slab_size_bytes):>10}  {len(pl.records)} tensors  {p.model.path}")
        print(f"GPU {gpu}: {_n(len(placements), 'slab')}, {_human_bytes(total)} planned")
        for line in lines:
            print(line)
    warnings += _same_slab_twice(planned)
    for msg in warnings:
        print(f"warning: {msg}", file=sys.stderr)
    for msg in problems:
        print(f"error: {msg}", file=sys.stderr)
    return EXIT_FAILED if problems else EXIT_OK


def _gpus_beyond_the_node(cfg: Config, probe) -> tuple[str, list[str]]:
    """Checks the configured GPU indices against the devices the CUDA driver reports.

    Args:
        cfg (`Config`): the configuration checked.
        probe (`Callable[[], CudaProbe]`): :func:`weightcache.memory.probe_cuda` (never raises).

    Returns:
        `tuple[str, list[str]]`: a line saying how many GPUs the node has (or
        why that is unknown, or not asked with ``backend = "host"``), and a
        warning per configured index at or past that count, naming its models.
        Warnings, not errors: the config may be written before the driver is
        installed, or for another node.
    """
    if cfg.service.backend == "host":
        return "GPUs on this node: not checked (backend = host: the GPU indices only number the instances)", []
    p = probe()
    if not p.usable:
        return f"GPUs on this node: unknown, GPU indices not checked against them ({p.reason})", []
    out = []
    for gpu in cfg.gpus():
        if gpu >= p.devices:
            names = sorted({pl.model.name for pl in cfg.placements(gpu)})
            out.append(f"GPU {gpu} ({'models' if len(names) > 1 else 'model'} {', '.join(names)}) is not on this "
                       f"node: the CUDA driver reports {_n(p.devices, 'GPU')} (indices 0..{p.devices - 1}), so "
                       f"weightcache@{gpu} would find no device; fix the layouts' gpus (see `nvidia-smi -L`), "
                       f"unless the config is meant for another node")
    return f"GPUs on this node: {p.devices} ({p.reason})", out


def _same_slab_twice(planned: list[tuple[Placement, Any]]) -> list[str]:
    """Warnings for models that plan the same slab on the same GPU: one checkpoint (through a symlink or
    by the same path) with the same effective dtype, naming, kernel, TP size and rank.

    Args:
        planned (`list[tuple[Placement, pipeline.Plan]]`): every rank that planned, in config order.

    Returns:
        `list[str]`: one warning per later model, naming it and the first one; the cache keys are
        compared without ``revision`` (the operator's label changes no byte).
    """
    first: dict[tuple[int, str], Placement] = {}
    out = []
    for p, pl in planned:
        same = json.dumps({k: v for k, v in pl.key.items() if k != "revision"}, sort_keys=True, default=str)
        a = first.setdefault((p.gpu, same), p)
        if a is p:
            continue
        out.append(f"models {a.model.name} and {p.model.name} are the same slab on GPU {p.gpu} (tp={p.tp_size} "
                   f"rank={p.tp_rank}): {a.model.path} and {p.model.path} are the same checkpoint files with the "
                   f"same dtype, naming and kernel, so the service holds {_human_bytes(pl.slab_size_bytes)} "
                   f"twice and an attach by path gets {a.model.name}; keep one of the two [models] tables")
    return out


def _leases_on(args: argparse.Namespace, gpu: int, model: str) -> list[str]:
    """Lines naming who holds leases on ``model`` (for a refused evict)."""
    [(_, reply, e)] = _ask_each(args, _socket_dir(args), [gpu], protocol.Status)
    if e is not None:
        return []
    st = reply.typed()
    now = time.time()
    return [f"  {sl.label}: lease {le.lease_id} {_holder(le)} mode={le.mode} "
            f"for {_age(now - le.since)}"
            for sl in st.slabs if model in (sl.model, sl.path) for le in sl.leases]


def _per_gpu_request(args: argparse.Namespace, make) -> tuple[list[tuple[int, Any]], int]:
    """Sends ``make()`` to each instance; ``model_not_found`` is skipped unless ``--gpu`` was given."""
    results, rc = [], EXIT_OK
    where = _socket_dir(args)
    gpus = _gpus(args, where)
    if not gpus:
        print(_no_sockets(args), file=sys.stderr)
        return [], EXIT_UNAVAILABLE
    for gpu, reply, e in _ask_each(args, where, gpus, make):
        if e is None:
            results.append((gpu, reply))
        elif isinstance(e, DaemonUnavailable):
            print(f"GPU {gpu}: {e.message}", file=sys.stderr)
            rc = EXIT_UNAVAILABLE
        elif e.code == "model_not_found" and args.gpu is None:
            continue
        else:
            print(f"GPU {gpu}: {e.code}: {e.message}", file=sys.stderr)
            if isinstance(e, LeaseBusy):
                for line in _leases_on(args, gpu, e.details.get("model", "")):
                    print(line, file=sys.stderr)
            rc = EXIT_FAILED
    if not results and rc == EXIT_OK:
        model = getattr(args, "model", None)
        print(f"model {model!r} is not configured on any GPU (see `weightcache list`)", file=sys.stderr)
        rc = EXIT_FAILED
    return results, rc


def cmd_verify(args: argparse.Namespace) -> int:
    results, rc = _per_gpu_request(args, lambda: protocol.Verify(args.model))
    for gpu, reply in results:
        for r in reply.typed():
            label = f"GPU {gpu} {r.label}"
            if r.state is not SlotState.READY:
                rc = rc or EXIT_FAILED
                print(f"{label}: {r.state}, not resident: nothing to verify")
            elif r.mismatched:
                rc = rc or EXIT_FAILED
                more = f" (+{len(r.mismatched) - 10} more)" if len(r.mismatched) > 10 else ""
                print(f"{label}: MISMATCH in {len(r.mismatched)}/{r.tensors} tensors: "
                      f"{', '.join(r.mismatched[:10])}{more}; evict and preload it (`weightcache evict --force "
                      f"{r.model} && weightcache preload {r.model}`)")
            else:
                print(f"{label}: ok, {r.tensors} tensors match their load-time digests")
    return rc


def cmd_evict(args: argparse.Namespace) -> int:
    results, rc = _per_gpu_request(args, lambda: protocol.Evict(args.model, args.force))
    for gpu, reply in results:
        for label in reply.evicted:
            print(f"GPU {gpu}: evicted {label}")
        if not reply.evicted:
            print(f"GPU {gpu}: nothing resident to evict for {args.model}")
    return rc


def cmd_preload(args: argparse.Namespace) -> int:
    results, rc = _per_gpu_request(args, lambda: protocol.Preload(args.model))
    for gpu, reply in results:
        for label in reply.started:
            print(f"GPU {gpu}: loading {label}", flush=True)
        if not reply.started:
            print(f"GPU {gpu}: {args.model} is already resident or loading", flush=True)
    if rc == EXIT_OK and not args.no_wait:
        return _wait(args, args.model)
    return rc


class _Lines:
    """Plain progress lines (no terminal): a line per state change, and at most
    one progress line per slab per :attr:`period_s` while loading."""

    period_s = 1.0

    def __init__(self) -> None:
        self.last: dict[str, tuple[str, float]] = {}

    def update(self, label: str, sl: protocol.SlabInfo) -> None:
        now = time.monotonic()
        prev = self.last.get(label)
        if prev is not None and prev[0] == sl.state and (sl.state is not SlotState.LOADING or now - prev[1] < self.period_s):
            return
        self.last[label] = (sl.state, now)
        print(f"{label}: {_state_text(sl)}", flush=True)


def _wait(args: argparse.Namespace, model: str | None) -> int:
    """Polls status until no matching slab is pending or loading, showing progress.

    A rich progress bar on a terminal; plain lines otherwise (journal, CI, pipes).
    """
    deadline = time.monotonic() + args.wait_timeout
    progress = None
    lines = _Lines()
    if sys.stdout.isatty():
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        progress = Progress("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn())
        progress.start()
    tasks: dict[str, Any] = {}
    where = _socket_dir(args)  # once, not a config read per poll
    try:
        while True:
            statuses, errors = _collect(args, where)
            if not statuses:
                print(errors[0].message if errors else _no_sockets(args), file=sys.stderr)
                return EXIT_UNAVAILABLE
            slabs = [(st.gpu, sl) for st in statuses for sl in st.slabs
                     if model is None or model in (sl.model, sl.path)]
            for gpu, sl in slabs:
                label = f"GPU {gpu} {sl.label}"
                if progress is not None:
                    total = sl.total_bytes or None
                    if label not in tasks:
                        tasks[label] = progress.add_task(label, total=total)
                    progress.update(tasks[label], completed=sl.done_bytes, total=total)
                else:
                    lines.update(label, sl)
            if not any(sl.state in UNSETTLED for _, sl in slabs):
                break
            if time.monotonic() > deadline:
                print(f"timed out after {args.wait_timeout:.0f}s waiting for the loads", file=sys.stderr)
                return EXIT_FAILED
            time.sleep(0.2)
    finally:
        if progress is not None:
            progress.stop()
    if model is not None and not slabs:
        print(f"model {model!r} is not configured on any GPU (see `weightcache list`)", file=sys.stderr)
        return EXIT_FAILED
    failed = [(gpu, sl) for gpu, sl in slabs if sl.state is SlotState.FAILED]
    for gpu, sl in failed:
        err = sl.error or protocol.ErrorInfo("unknown", "no error recorded")
        print(f"GPU {gpu} {sl.label} failed: {err.code}: {err.message}", file=sys.stderr)
    if failed:
        return EXIT_FAILED
    return EXIT_UNAVAILABLE if errors else EXIT_OK


def cmd_reload(args: argparse.Namespace) -> int:
    """``weightcache reload``: each instance reads the configuration again and applies it (``ExecReload=``).

    Exit status: 0 applied everywhere; 2 an instance refused the files (it keeps
    serving the previous configuration); 3 an instance did not answer; 1 another refusal.
    """
    where = _socket_dir(args)
    gpus = _gpus(args, where)
    if not gpus:
        print(_no_sockets(args), file=sys.stderr)
        return EXIT_UNAVAILABLE
    rc = EXIT_OK
    for gpu, r, e in _ask_each(args, where, gpus, protocol.Reload):
        if isinstance(e, DaemonUnavailable):
            print(f"GPU {gpu}: {e.message}", file=sys.stderr)
            rc = max(rc, EXIT_UNAVAILABLE)
            continue
        if isinstance(e, ConfigError):
            print(f"GPU {gpu}: reload refused, still serving the previous configuration: {_config_error_text(e)}",
                  file=sys.stderr)
            rc = max(rc, EXIT_USAGE)
            continue
        if e is not None:
            print(f"GPU {gpu}: {e.code}: {e.message}", file=sys.stderr)
            rc = max(rc, EXIT_FAILED)
            continue
        print(f"GPU {gpu}: reloaded {', '.join(r.files)}: {_n(len(r.added), 'slab')} added (loading), "
              f"{len(r.dropped)} dropped, {len(r.retired)} kept while leased, {len(r.kept)} unchanged")
        for label in r.added:
            print(f"  loading  {label}")
        for label in r.dropped:
            print(f"  dropped  {label}")
        for label in r.retired:
            print(f"  retired  {label} (freed when its last lease is released)")
        if r.restart_keys:
            print(f"  [service] {', '.join(r.restart_keys)} changed: takes effect at the next "
                  f"`systemctl restart weightcache@{gpu}`")
    return rc


def cmd_wait(args: argparse.Namespace) -> int:
    return _wait(args, args.model)


def _metrics_registry(args: argparse.Namespace):
    """The node's metrics registry: the socket directory's instances and the config's GPUs (read at each scrape)."""
    from . import metrics

    def gpus() -> list[int]:
        try:
            return load_config(args.config).gpus()
        except ConfigError as e:
            log.warning("metrics: configuration not read, only the sockets are reported: %s", e.message)
            return []

    return metrics.registry(_socket_dir(args), gpus, args.timeout)


def cmd_metrics(args: argparse.Namespace) -> int:
    """``weightcache metrics``: the Prometheus text of every running instance; never starts one."""
    from . import metrics

    reg = _metrics_registry(args)
    if args.output:
        metrics.write_textfile(args.output, reg)
    else:
        sys.stdout.write(metrics.exposition(reg).decode())
    return EXIT_OK


def cmd_serve_metrics(args: argparse.Namespace) -> int:
    """``weightcache serve-metrics``: answers GET /metrics on the socket systemd passes (or ``--listen``)."""
    from . import metrics_http
    from .journal import setup_logging

    setup_logging(None)
    listener = metrics_http.listener_from_systemd()
    if listener is None:
        if not args.listen:
            raise ConfigError("serve-metrics: no socket from systemd ($LISTEN_FDS) and no --listen HOST:PORT; "
                              "start weightcache-metrics.socket, or give --listen 127.0.0.1:9661", key="--listen")
        try:
            listener = metrics_http.bind(args.listen)
        except (ValueError, OSError) as e:
            raise ConfigError(f"serve-metrics: cannot listen on {args.listen}: {e}", key="--listen") from None
    metrics_http.serve(listener, _metrics_registry(args))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The ``weightcache`` argument parser: one sub-command per operator task (see weightcache(1))."""
    p = argparse.ArgumentParser(
        prog="weightcache", description="LLM weights resident in GPU memory. See weightcache(1).",
        epilog="exit status: 0 success; 1 a model failed or a request was refused; 2 bad usage or configuration; "
               "3 no service answered; 78 (serve) the configuration or runtime was rejected.")
    from . import __version__

    p.add_argument("--version", action="version", version=f"weightcache {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def client_opts(sp: argparse.ArgumentParser, gpu: bool = True) -> None:
        if gpu:
            sp.add_argument("--gpu", type=int, default=None, help="only this GPU's instance (default: all sockets)")
        sp.add_argument("--socket-dir", default=None,
                        help="socket directory (default $WEIGHTCACHE_SOCKET_DIR, else the config's "
                             "[service] socket_dir, else /run/weightcache)")
        sp.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each reply")

    sp = sub.add_parser("serve", help="run the service for one GPU (under systemd: weightcache@N.service)")
    sp.add_argument("--gpu", type=int, required=True,
                    help="GPU index this instance serves (CUDA_DEVICE_ORDER=PCI_BUS_ID); the unit passes %%i")
    sp.add_argument("--config", default=None, help="main config file (default $WEIGHTCACHE_CONFIG or "
                                                   "/etc/weightcache/weightcache.toml)")
    sp.add_argument("--listen", default=None, help="bind this socket path when not socket-activated")
    sp.add_argument("--backend", choices=("auto", "cuda", "host"), default=None,
                    help="slab memory: cuda (VMM), host (sealed memfd) or auto (cuda when the driver sees a GPU); "
                         "default: the config's [service] backend")
    sp.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sp.set_defaults(fn=cmd_serve)

    sp = sub.add_parser("status", help="what is resident, loading or failed; who holds leases")
    client_opts(sp)
    sp.add_argument("--json", action="store_true", help="machine-readable output (the services' status replies)")
    sp.set_defaults(fn=cmd_status)

    sp = sub.add_parser("list", help="one line per (model, layout, rank)")
    client_opts(sp)
    sp.add_argument("--json", action="store_true", help="machine-readable output, one object per slab")
    sp.set_defaults(fn=cmd_list)

    sp = sub.add_parser("check-config", help="validate a config and print the placement of every rank")
    sp.add_argument("--config", default=None, help="main config file (default $WEIGHTCACHE_CONFIG or "
                                                   "/etc/weightcache/weightcache.toml); conf.d/ beside it is read too")
    sp.add_argument("--as-user", default=None, metavar="USER",
                    help="read the config and checkpoints as USER (needs root); default when run as root: "
                         f"{SERVICE_USER}, the service user; 'root' checks as root")
    sp.set_defaults(fn=cmd_check_config)

    sp = sub.add_parser("verify", help="recompute content digests of resident slabs")
    sp.add_argument("model")
    client_opts(sp)
    sp.set_defaults(fn=cmd_verify)

    sp = sub.add_parser("evict", help="free a model's slabs (refused while leased unless --force)")
    sp.add_argument("model")
    sp.add_argument("--force", action="store_true", help="evict even while engines hold leases (they keep their "
                                                         "mappings; the memory is freed when they detach)")
    client_opts(sp)
    sp.set_defaults(fn=cmd_evict)

    sp = sub.add_parser("preload", help="(re)load a failed or evicted model and wait for it")
    sp.add_argument("model")
    sp.add_argument("--no-wait", action="store_true", help="start the load and return at once")
    sp.add_argument("--wait-timeout", type=float, default=3600.0, help="seconds to wait for the load (default 3600)")
    client_opts(sp)
    sp.set_defaults(fn=cmd_preload)

    sp = sub.add_parser("reload", help="apply the configuration files again, without a restart "
                                       "(systemctl reload runs it)")
    client_opts(sp)
    sp.set_defaults(fn=cmd_reload)

    sp = sub.add_parser("wait", help="wait until loads finish, with progress")
    sp.add_argument("model", nargs="?", default=None, help="only this model (default: every slab)")
    sp.add_argument("--wait-timeout", type=float, default=3600.0, help="seconds to wait (default 3600)")
    client_opts(sp)
    sp.set_defaults(fn=cmd_wait)

    sp = sub.add_parser("metrics", help="the node's metrics in Prometheus' text format (never starts an instance)")
    client_opts(sp, gpu=False)
    sp.add_argument("--config", default=None, help="config file naming the GPUs to report besides the sockets found")
    sp.add_argument("-o", "--output", metavar="FILE", default=None,
                    help="write FILE atomically instead of stdout (node_exporter's textfile collector: *.prom)")
    sp.set_defaults(fn=cmd_metrics, timeout=5.0)

    sp = sub.add_parser("serve-metrics", help="answer GET /metrics over HTTP (weightcache-metrics.service)")
    client_opts(sp, gpu=False)
    sp.add_argument("--config", default=None, help="main config file (default $WEIGHTCACHE_CONFIG or "
                                                   "/etc/weightcache/weightcache.toml)")
    sp.add_argument("--listen", metavar="HOST:PORT", default=None,
                    help="bind this address when not socket-activated (e.g. 127.0.0.1:9661)")
    sp.set_defaults(fn=cmd_serve_metrics, timeout=5.0)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``weightcache`` console script."""
    args = build_parser().parse_args(argv)
    return _run_checked(args.fn, args)


def _config_error_text(e: ConfigError) -> str:
    """``e``'s message, with ``(line N)`` added when ``details["line"]`` is set and the message does not say it."""
    line = e.details.get("line")
    return f"{e.message} (line {line})" if line and f"line {line}" not in e.message else e.message


def _run_checked(fn, args: argparse.Namespace) -> int:
    """Runs a command, mapping weightcache errors to the exit statuses of the module docstring."""
    try:
        return fn(args)
    except ConfigError as e:
        print(f"weightcache: {_config_error_text(e)}", file=sys.stderr)
        return EXIT_USAGE
    except DaemonUnavailable as e:
        print(f"weightcache: {e.message}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except WeightcacheError as e:
        print(f"weightcache: {e.code}: {e.message}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
