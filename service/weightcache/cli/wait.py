"""``weightcache wait`` and ``weightcache preload``: start loads and follow them to the end, with progress.

Forbidden imports: torch, weightcache.daemon, weightcache.client, weightcache.pipeline, weightcache.memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from .. import protocol
from ..config import Config, load_config
from ..errors import ConfigError
from ..session import sockets_in
from ..wire import UNSETTLED, SlotState
from .common import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, collect_status, no_sockets, per_gpu_request, socket_dir_of
from .status import larger_than_budget, state_text


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
        print(f"{label}: {state_text(sl)}", flush=True)


def _config_of(where: str) -> Config | None:
    """The configuration that describes the instances of socket directory ``where``: the one that loads
    (``$WEIGHTCACHE_CONFIG`` or the default file) when its ``[service] socket_dir`` is ``where``; ``None`` when
    none loads (a client-only node, a typo reported elsewhere) or it describes another directory."""
    try:
        cfg = load_config(None)
    except ConfigError:
        return None
    return cfg if os.path.normpath(cfg.service.socket_dir) == os.path.normpath(where) else None


def never_served(gpu: int, where: str, cfg: Config | None) -> str | None:
    """Why no instance of GPU ``gpu`` will answer in socket directory ``where``, or ``None`` while one may.

    One may: its socket ``<where>/<gpu>.sock`` exists, ``cfg`` places a model on ``gpu`` (its instance has not
    started yet: ``serve ... &`` then ``wait``, or a target still starting), or no configuration describes
    ``where`` (``cfg`` is ``None``, or it places no model at all, as the shipped example file does: an engine
    container with the package installed and the host's socket directory mounted has that file, and it says
    nothing of the host's GPUs). Otherwise the text names the
    configured GPUs and the sockets that listen (:func:`weightcache.session.sockets_in`).
    """
    placed = cfg.gpus() if cfg is not None else ()
    if not placed:
        return None
    off = cfg.service.disabled_gpus
    if gpu in placed and gpu not in off:
        return None
    found, listening = sockets_in(where)
    if gpu in listening:
        return None
    why = ("is in [service] disabled_gpus, so weightcache.target does not start its instance (start it by hand: "
           f"systemctl start weightcache@{gpu}.socket)" if gpu in placed else "has no model placed on it")
    served = [g for g in placed if g not in off]
    return (f"no instance will serve GPU {gpu}: {os.path.join(where, f'{gpu}.sock')} does not exist and GPU {gpu} "
            f"{why} in {', '.join(cfg.files)}, which places models on GPUs {served}; {found}")


def wait_for(args: argparse.Namespace, model: str | None, asked: frozenset[tuple[int, str]] = frozenset()) -> int:
    """Polls status until no matching slab is pending or loading, showing progress.

    While no service answers (none started yet, or its socket not bound yet) it polls for one until
    ``args.wait_timeout`` (seconds), then returns :data:`EXIT_UNAVAILABLE` (3) with why none answers;
    at once when ``--gpu`` names a GPU that no socket serves and the configuration places no model on
    (:func:`never_served`).
    Returns 1 when a slab failed, is larger than the whole ``memory_budget_bytes``, or ended on disk although
    ``preload`` started its load (``asked``: (GPU index, ``model/tpN/rankR``) pairs, as its reply names them), naming each with its error on stderr.

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
    where = socket_dir_of(args)  # once, not a config read per poll
    cfg = _config_of(where) if args.gpu is not None else None
    try:
        while True:
            statuses, errors = collect_status(args, where)
            if not statuses and args.gpu is not None and (why := never_served(args.gpu, where, cfg)):
                print(why, file=sys.stderr)
                return EXIT_UNAVAILABLE
            if not statuses:  # not up yet (``serve ... &`` then ``wait``): poll until the deadline
                if time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                print(errors[0].message if errors else no_sockets(args), file=sys.stderr)
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
    # FAILED; or on disk after ``preload`` asked for it (its load got no room: the reason is its error); or on
    # disk and larger than the whole memory budget, which no attach can ever load.
    def not_loaded(gpu: int, sl: protocol.SlabInfo) -> bool:
        return sl.state is SlotState.ON_DISK and ((gpu, f"{sl.model}/tp{sl.tp_size}/rank{sl.tp_rank}") in asked
                                                  or larger_than_budget(sl) is not None)

    failed = [(gpu, sl) for gpu, sl in slabs if sl.state is SlotState.FAILED or not_loaded(gpu, sl)]
    for gpu, sl in failed:
        err = sl.error or protocol.ErrorInfo("unknown", "no error recorded")
        what = "failed" if sl.state is SlotState.FAILED else "was not loaded (on_disk)"
        print(f"GPU {gpu} {sl.label} {what}: {err.code}: {err.message}", file=sys.stderr)
    if failed:
        return EXIT_FAILED
    return EXIT_UNAVAILABLE if errors else EXIT_OK


def cmd_wait(args: argparse.Namespace) -> int:
    return wait_for(args, args.model)


def cmd_preload(args: argparse.Namespace) -> int:
    results, rc = per_gpu_request(args, lambda: protocol.Preload(args.model))
    for gpu, reply in results:
        for label in reply.started:
            print(f"GPU {gpu}: loading {label}", flush=True)
        if not reply.started:
            print(f"GPU {gpu}: {args.model} is already resident or loading", flush=True)
    if rc == EXIT_OK and not args.no_wait:
        rc = wait_for(args, args.model, frozenset((gpu, label) for gpu, reply in results for label in reply.started))
        if rc == EXIT_FAILED:
            for note in _edited_since_read(args, args.model):
                print(note, file=sys.stderr)
    return rc


def _edited_since_read(args: argparse.Namespace, model: str) -> list[str]:
    """Notes for each failed slab of ``model`` whose checkpoint path in the configuration files differs from
    the one the service runs with: ``preload`` loads the running configuration again, so a path fixed in the
    file (as troubleshooting.md's ``checkpoint_not_found`` says to) needs ``weightcache reload`` first.

    Returns one line per model (empty when the files do not load, or agree with the service).
    """
    try:
        cfg = load_config(None)
    except ConfigError:
        return []
    statuses, _ = collect_status(args, socket_dir_of(args))
    notes: dict[str, str] = {}
    for st in statuses:
        for sl in st.slabs:
            if sl.state is not SlotState.FAILED or model not in (sl.model, sl.path) or sl.model in notes:
                continue
            m = cfg.models.get(sl.model)
            if m is None:
                notes[sl.model] = (f"note: model {sl.model} is no longer in {', '.join(cfg.files)}; the service runs "
                                   f"the configuration it read at its start or last reload: apply the files with "
                                   f"`weightcache reload` (systemctl reload weightcache)")
            elif os.path.normpath(str(m.path)) != os.path.normpath(sl.path):
                notes[sl.model] = (f"note: {m.source} now gives model {sl.model} path = \"{m.path}\", the service "
                                   f"still runs with {sl.path} (read at its start or last reload), and preload loads "
                                   f"that again: apply the file with `weightcache reload` (systemctl reload "
                                   f"weightcache)")
    return list(notes.values())
