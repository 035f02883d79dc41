"""``weightcache verify``, ``weightcache evict`` and ``weightcache reload``: operator requests to every instance.

Forbidden imports: torch, weightcache.daemon, weightcache.client, weightcache.pipeline, weightcache.memory.
"""

from __future__ import annotations

import argparse
import sys

from .. import protocol
from ..errors import ConfigError, DaemonUnavailable
from ..wire import SlotState
from .common import (EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, ask_each, config_error_text, gpus_of,
                     no_sockets, per_gpu_request, plural, socket_dir_of)


def cmd_verify(args: argparse.Namespace) -> int:
    results, rc = per_gpu_request(args, lambda: protocol.Verify(args.model))
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
    results, rc = per_gpu_request(args, lambda: protocol.Evict(args.model, args.force, args.to or ""))
    for gpu, reply in results:
        for label in reply.evicted:
            print(f"GPU {gpu}: {'moved ' + label + ' to ' + args.to if args.to else 'evicted ' + label}")
        if not reply.evicted:
            print(f"GPU {gpu}: nothing resident to evict for {args.model}")
    return rc


#: States of weightcache@N.service in which ``reload --running`` asks it: the process runs (or starts), so the
#: connect starts nothing; ``unknown``: no systemd, which nothing can socket-activate.
RUNNING_STATES = frozenset({"active", "reloading", "activating", "unknown"})


def running_gpus(gpus: list[int], where: str) -> list[int]:
    """Those of ``gpus`` whose ``weightcache@N.service`` runs (:data:`RUNNING_STATES`), asked read-only
    (:func:`weightcache.metrics.service_states`: ``systemctl show``, else the ``RuntimeDirectory=`` under
    ``where``): connecting to an instance that only listens would start it and all its loads."""
    from ..metrics import service_states

    states = service_states(gpus, where)
    return [g for g in gpus if states.get(g, "unknown") in RUNNING_STATES]


#: Seconds ``reload`` gives its own read of the configuration (for ``reload_timeout_s``) before it uses the
#: default: a file on a hung mount must not hang the command, which the instance answers ``config_invalid``.
CONFIG_READ_S = 5.0


def reload_reply_timeout() -> float:
    """Seconds ``reload`` waits for each instance's answer when ``--timeout`` is not given: the configuration's
    ``reload_timeout_s`` (at least its default, 30; the instance answers once it has read the files and checked
    the checkpoints, within the ``reload_timeout_s`` it runs with) plus 10 s. It waited 10 s, so a reload
    reading its files for longer was reported as not answering (exit 3) and then applied. The files are read
    on a daemon thread given :data:`CONFIG_READ_S`; unreadable or invalid, the default applies."""
    import threading

    from ..config import ServiceConfig, load_config

    got: list[float] = []

    def read() -> None:
        try:
            got.append(load_config(None).service.reload_timeout_s)
        except Exception:  # noqa: BLE001 - the instance says what is wrong with the files
            pass

    t = threading.Thread(target=read, name="weightcache-reload-config", daemon=True)
    t.start()
    t.join(CONFIG_READ_S)
    return max([ServiceConfig().reload_timeout_s, *got]) + 10.0


def cmd_reload(args: argparse.Namespace) -> int:
    """``weightcache reload``: each instance reads the configuration again and applies it (``ExecReload=``).

    With ``--running`` (the umbrella ``weightcache.service``'s ``ExecReload=``), only the instances that run:
    the command returns once each has applied the files or refused them, so ``systemctl reload weightcache``
    does too, and fails when one refused.

    Exit status: 0 applied everywhere (or no instance runs, with ``--running``, also when there is no socket);
    2 an instance refused the files (it keeps serving the previous configuration); 3 an instance did not
    answer; 1 another refusal.
    """
    from .unwired import warnings

    if getattr(args, "timeout", None) is None:
        args.timeout = reload_reply_timeout()
    where = socket_dir_of(args)
    gpus = gpus_of(args, where)
    if not gpus and getattr(args, "running", False):  # no socket: no instance runs either
        print(f"no instance runs: nothing to reload ({no_sockets(args)})")
        return EXIT_OK
    if not gpus:
        print(no_sockets(args), file=sys.stderr)
        return EXIT_UNAVAILABLE
    if getattr(args, "running", False):
        gpus = running_gpus(gpus, where)
        if not gpus:
            print("no instance runs: nothing to reload (an instance that only listens reads the files when it "
                  "starts)")
            return EXIT_OK
    rc = EXIT_OK
    for line in warnings(where, gpus) if args.gpu is None else ():
        print(line, file=sys.stderr)
    for gpu, r, e in ask_each(args, where, gpus, protocol.Reload):
        if isinstance(e, DaemonUnavailable):
            print(f"GPU {gpu}: {e.message}", file=sys.stderr)
            rc = max(rc, EXIT_UNAVAILABLE)
            continue
        if isinstance(e, ConfigError):
            print(f"GPU {gpu}: reload refused, still serving the previous configuration: {config_error_text(e)}",
                  file=sys.stderr)
            rc = max(rc, EXIT_USAGE)
            continue
        if e is not None:
            print(f"GPU {gpu}: {e.code}: {e.message}", file=sys.stderr)
            rc = max(rc, EXIT_FAILED)
            continue
        print(f"GPU {gpu}: reloaded {', '.join(r.files)}: {plural(len(r.added), 'slab')} added (loading), "
              f"{len(r.dropped)} dropped, {len(r.retired)} kept while leased, {len(r.kept)} unchanged")
        for label in r.added:
            print(f"  loading  {label}")
        for label in r.dropped:
            print(f"  dropped  {label}")
        for label in r.retired:
            print(f"  retired  {label} (freed when its last lease is released)")
        for move in r.moved:  # the budget, to fit a lowered memory_budget_bytes or host_tier_bytes
            print(f"  moved    {move} (memory budget)")
        if r.restart_keys:
            print(f"  [service] {', '.join(r.restart_keys)} changed: takes effect at the next "
                  f"`systemctl restart weightcache@{gpu}`")
    return rc
