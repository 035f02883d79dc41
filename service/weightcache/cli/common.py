"""What every ``weightcache`` command shares: exit statuses, the socket directory, asking instances, formatting.

Forbidden imports: torch, weightcache.daemon, weightcache.client, weightcache.pipeline, weightcache.memory.
"""

from __future__ import annotations

import argparse
import os
import pwd
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

from .. import protocol
from ..session import Session, listening_gpus, resolve_socket_dir
from ..config import load_config
from ..errors import ConfigError, DaemonUnavailable, LeaseBusy, WeightcacheError

#: Exit statuses (weightcache(1)): success; a failed model or a refused request; bad usage or configuration;
#: no service answered.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3
#: stdout's reader closed the pipe early (``weightcache status | head -1``): 128 + SIGPIPE, as a shell
#: reports a command that SIGPIPE ended.
EXIT_BROKEN_PIPE = 141


def quiet_broken_pipe() -> None:
    """Points stdout at /dev/null after a :class:`BrokenPipeError`, so the interpreter's final flush of
    the unwritten buffer does not raise again at exit (the recipe of Python's ``signal`` docs, "Note
    on SIGPIPE"). Never raises."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout closed or not a real file: nothing to flush into a pipe
        pass


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def socket_dir_of(args: argparse.Namespace) -> str:
    """``--socket-dir``, else ``$WEIGHTCACHE_SOCKET_DIR``, else the config's
    ``[service] socket_dir`` (when the config loads: ``--config`` where the command has it), else
    ``/run/weightcache``."""
    if args.socket_dir or os.environ.get("WEIGHTCACHE_SOCKET_DIR"):
        return resolve_socket_dir(args.socket_dir)
    try:
        return load_config(getattr(args, "config", None)).service.socket_dir
    except ConfigError:
        return resolve_socket_dir(None)


def gpus_of(args: argparse.Namespace, where: str) -> list[int]:
    """GPU indices to ask: ``--gpu``, else every ``<N>.sock`` in socket directory ``where``."""
    return [args.gpu] if args.gpu is not None else listening_gpus(where)


def ask_each(args: argparse.Namespace, where: str, gpus: list[int],
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


def no_sockets(args: argparse.Namespace) -> str:
    """Why no socket answers: no model configured (so no instance), a config that does not load, or the target."""
    where = socket_dir_of(args)
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
class Unreachable:
    """An instance that did not answer: its GPU index and the error's code and message."""

    gpu: int
    code: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "code": self.code, "message": self.message}


def collect_status(args: argparse.Namespace, where: str | None = None) -> tuple[list[protocol.ServiceStatus],
                                                                        list[Unreachable]]:
    """Status of every reachable instance (sockets in ``where``, default :func:`socket_dir_of`), and the others
    as :class:`Unreachable`."""
    out, errors = [], []
    where = where or socket_dir_of(args)
    for gpu, reply, e in ask_each(args, where, gpus_of(args, where), protocol.Status):
        if e is None:
            out.append(reply.typed())
        elif isinstance(e, DaemonUnavailable):
            errors.append(Unreachable(gpu, e.code, e.message))
        else:
            raise e
    return out, errors


def user_name(uid: int) -> str:
    try:
        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return str(uid)


def lease_holder(le: protocol.LeaseInfo) -> str:
    """Who holds a lease, for humans: ``pid=4242 uid=1000 (alice)``, or ``held by another user`` when the
    service hid the holder from this caller (:data:`~weightcache.protocol.HIDDEN_ID`)."""
    if protocol.HIDDEN_ID in (le.pid, le.uid):
        return "held by another user"
    return f"pid={le.pid} uid={user_name(le.uid)}"


def plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def format_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def leases_on(args: argparse.Namespace, gpu: int, model: str) -> list[str]:
    """Lines naming who holds leases on ``model`` (for a refused evict)."""
    [(_, reply, e)] = ask_each(args, socket_dir_of(args), [gpu], protocol.Status)
    if e is not None:
        return []
    st = reply.typed()
    now = time.time()
    return [f"  {sl.label}: lease {le.lease_id} {lease_holder(le)} mode={le.mode} "
            f"for {format_age(now - le.since)}"
            for sl in st.slabs if model in (sl.model, sl.path) for le in sl.leases]


def per_gpu_request(args: argparse.Namespace, make) -> tuple[list[tuple[int, Any]], int]:
    """Sends ``make()`` to each instance; ``model_not_found`` is skipped unless ``--gpu`` was given."""
    results, rc = [], EXIT_OK
    where = socket_dir_of(args)
    gpus = gpus_of(args, where)
    if not gpus:
        print(no_sockets(args), file=sys.stderr)
        return [], EXIT_UNAVAILABLE
    for gpu, reply, e in ask_each(args, where, gpus, make):
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
                for line in leases_on(args, gpu, e.details.get("model", "")):
                    print(line, file=sys.stderr)
            rc = EXIT_FAILED
    if not results and rc == EXIT_OK:
        model = getattr(args, "model", None)
        print(f"model {model!r} is not configured on any GPU (see `weightcache list`)", file=sys.stderr)
        rc = EXIT_FAILED
    return results, rc


def config_error_text(e: ConfigError) -> str:
    """``e``'s message, with ``(line N)`` added when ``details["line"]`` is set and the message does not say it."""
    line = e.details.get("line")
    return f"{e.message} (line {line})" if line and f"line {line}" not in e.message else e.message


def run_checked(fn, args: argparse.Namespace) -> int:
    """Runs a command, mapping weightcache errors to the exit statuses of the module docstring."""
    try:
        return fn(args)
    except ConfigError as e:
        print(f"weightcache: {config_error_text(e)}", file=sys.stderr)
        return EXIT_USAGE
    except DaemonUnavailable as e:
        print(f"weightcache: {e.message}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except WeightcacheError as e:
        print(f"weightcache: {e.code}: {e.message}", file=sys.stderr)
        return EXIT_FAILED
