"""``weightcache check-config``: validates a configuration and plans every slab from headers alone.

Run as root, it reads every file as the service user (a forked child drops to
it), as ``weightcache@.service`` will.

Forbidden imports: torch at module level, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import sys
import traceback
from typing import Any

from ..checkpoint.header import import_validation_modules
from ..config import Config, Placement, config_path, load_config
from ..errors import ENGINE_LAYOUT_CODES, ConfigError, WeightcacheError
from . import SERVICE_USER
from .common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, human_bytes, plural, run_checked
from .check_seeding import check_seeding


def _check_as(args: argparse.Namespace) -> int | None:
    """Runs the rest of ``check-config`` as the service user when asked, or by default as root.

    Returns the exit status of the child that did the checks as that user, or
    ``None`` when this process goes on itself (not root, or ``--as-user root``).
    """
    user = args.as_user
    if user is None:
        if os.geteuid() != 0:
            me = pwd.getpwuid(os.geteuid()).pw_name
            if me != SERVICE_USER:  # issue 26: say whose permissions the file checks use
                print(f"checking as user {me} (uid {os.geteuid()}), not as {SERVICE_USER}, the service's user: "
                      f"files {me} may read may still be unreadable to the service; run as root "
                      f"(sudo weightcache check-config) to check as {SERVICE_USER}")
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
    try:  # the child checks what the user may read of the checkpoints, not of this interpreter's install
        import_validation_modules()
    except ImportError:  # the child's check reports it
        pass
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
                code = run_checked(cmd_check_config, args)
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
    from .. import memory, pipeline

    rc = _check_as(args)
    if rc is not None:
        return rc
    cfg = load_config(args.config)
    host = {"backend": "host", "gpu_uuid": "", "compute_capability": ""}
    problems: list[str] = []
    print(f"config: {', '.join(cfg.files) if cfg.files else config_path(args.config)}")
    print(f"socket_dir={cfg.service.socket_dir} backend={cfg.service.backend}")
    off = sorted(cfg.service.disabled_gpus)
    if off:
        print(f"disabled_gpus={off}: weightcache.target starts no instance for these GPUs")
    if cfg.metrics.web_config:
        problems += _web_config(cfg.metrics.web_config)
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
                pl = pipeline.plan(p, host)
            except WeightcacheError as e:
                if p.model.naming == "vllm" and e.code in ENGINE_LAYOUT_CODES:  # the service shows it waiting
                    lines.append(f"  {p.model.name:<24} tp={p.tp_size} rank={p.tp_rank}  gpus=[{gpus}]  "
                                 f"waiting_for_engine ({e.code}): the service cannot lay it out; the first "
                                 f"engine started with --load-format weightcache publishes it  {p.model.path}")
                    continue
                problems.append(f"model {p.model.name} tp={p.tp_size} rank={p.tp_rank} (GPU {gpu}, defined in "
                                f"{p.model.source}): {e.code}: {e.message}")
                lines.append(f"  {p.model.name:<24} tp={p.tp_size} rank={p.tp_rank}  gpus=[{gpus}]  "
                             f"ERROR {e.code}  {p.model.path}")
                continue
            planned.append((p, pl))
            total += pl.slab_size_bytes
            over = p.model.slab_over_cap(pl.slab_size_bytes, p.label)
            if over is not None:  # every load of it is refused checkpoint_corrupt, every publication refused
                problems.append(f"model {p.model.name} tp={p.tp_size} rank={p.tp_rank} (GPU {gpu}, defined in "
                                f"{p.model.source}): {over}")
            lines.append(f"  {p.model.name:<24} tp={p.tp_size} rank={p.tp_rank}  {'gpus=[' + gpus + ']':<12} "
                         f"{human_bytes(pl.slab_size_bytes):>10}  {len(pl.records)} tensors  {p.model.path}")
        print(f"GPU {gpu}: {plural(len(placements), 'slab')}, {human_bytes(total)} planned"
              f"{' (disabled_gpus: not started by weightcache.target)' if gpu in off else ''}")
        for line in lines:
            print(line)
        here = [(p, pl) for p, pl in planned if p.gpu == gpu]
        too_big = _larger_than_budget(cfg, gpu, here)
        problems += too_big.values()
        warnings += _over_budget(cfg, gpu, [(p, pl) for p, pl in here if p.label not in too_big])
    warnings += _same_slab_twice(planned)
    line, more = _images(cfg, planned)
    if line:
        print(line)
    warnings += more
    seed_lines, seed_warnings, seed_problems = check_seeding(cfg.service, cfg.gpus() or [0])
    for line in seed_lines:
        print(line)
    warnings += seed_warnings
    problems += seed_problems
    for msg in warnings:
        print(f"warning: {msg}", file=sys.stderr)
    for msg in problems:
        print(f"error: {msg}", file=sys.stderr)
    return EXIT_FAILED if problems else EXIT_OK


def _web_config(path: str) -> list[str]:
    """``[metrics] web_config``: one line on what the endpoint will do; the problem when the file does not load.

    Checked as the user check-config runs as: the endpoint reads it as weightcache-metrics, so a certificate
    key this user may read can still be unreadable there (``systemctl status weightcache-metrics`` says so)."""
    from ..metrics_web import load_web_config

    try:
        web = load_web_config(path)
    except ConfigError as e:
        print(f"metrics endpoint: web_config={path} does not load")
        return [f"[metrics] web_config: {e.message}"]
    print(f"metrics endpoint: web_config={path}: {'TLS' if web.ssl_context else 'plain HTTP'}, "
          f"basic_auth_users={len(web.users)}")
    return []


def _larger_than_budget(cfg: Config, gpu: int, planned: list[tuple[Placement, Any]]) -> dict[str, str]:
    """Errors, by slab label, for each slab planned on ``gpu`` larger than the whole explicit
    ``memory_budget_bytes``: no attach can ever load it (the service refuses it ``insufficient_memory``)."""
    budget = cfg.service.memory_budget_bytes
    if budget is None:
        return {}
    return {p.label: f"model {p.model.name} tp={p.tp_size} rank={p.tp_rank} (GPU {gpu}, defined in {p.model.source}): "
                     f"its slab of {pl.slab_size_bytes} bytes ({human_bytes(pl.slab_size_bytes)}) is larger than "
                     f"memory_budget_bytes = {budget} ({human_bytes(budget)}): it can never be loaded (an attach "
                     f"gets insufficient_memory); raise memory_budget_bytes or give the model more GPUs (tp)"
            for p, pl in planned if pl.slab_size_bytes > budget}


def _over_budget(cfg: Config, gpu: int, planned: list[tuple[Placement, Any]]) -> list[str]:
    """Warnings when the slabs planned on ``gpu`` exceed an explicit ``memory_budget_bytes``: which wait at
    start (in the start-up order of :func:`weightcache.daemon.tiers.start_order`), and pinned slabs the
    budget cannot hold."""
    budget = cfg.service.memory_budget_bytes
    if budget is None or sum(pl.slab_size_bytes for _, pl in planned) <= budget:
        return []
    order = sorted(planned, key=lambda x: (not x[0].model.pin, -x[0].model.priority))
    used, waiting, pinned_over = 0, [], []
    for p, pl in order:
        if p.model.preload == "gpu" and used + pl.slab_size_bytes <= budget:
            used += pl.slab_size_bytes
        else:
            waiting.append(f"{p.label} ({'host tier' if p.model.preload == 'host' else 'disk'})")
            if p.model.pin:
                pinned_over.append(p.label)
    out = [f"GPU {gpu}: the slabs planned exceed memory_budget_bytes = {budget} ({human_bytes(budget)}); at start "
           f"these wait until an attach brings them in (demoting unleased, unpinned slabs of lowest priority): "
           f"{', '.join(waiting)}"]
    if pinned_over:
        out.append(f"GPU {gpu}: pinned slabs do not all fit memory_budget_bytes: {', '.join(pinned_over)} wait on "
                   f"disk, and a pinned slab on the GPU never makes room for them; raise the budget or unpin one")
    return out


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
        refused = ([f'backend = "cuda" but this node has no usable CUDA driver ({p.reason}): `weightcache serve` '
                    f'on this node would refuse to start (config_invalid, exit 78); fine if this config is for '
                    f'another node, else install the driver or set backend = "auto"']
                   if cfg.service.backend == "cuda" else [])
        return f"GPUs on this node: unknown, GPU indices not checked against them ({p.reason})", refused
    out = []
    for gpu in cfg.gpus():
        if gpu >= p.devices:
            names = sorted({pl.model.name for pl in cfg.placements(gpu)})
            out.append(f"GPU {gpu} ({'models' if len(names) > 1 else 'model'} {', '.join(names)}) is not on this "
                       f"node: the CUDA driver reports {plural(p.devices, 'GPU')} (indices 0..{p.devices - 1}), so "
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
                   f"same dtype, naming and kernel, so the service holds {human_bytes(pl.slab_size_bytes)} "
                   f"twice and an attach by path gets {a.model.name}; keep one of the two [models] tables")
    return out


def _images(cfg: Config, planned: list[tuple[Placement, Any]]) -> tuple[str, list[str]]:
    """The ``images:`` line (empty when no model has ``image = true``) and its warnings: a directory the
    service would refuse (a symlink, another user's, not a directory), a byte limit below a slab's image."""
    import stat

    on = sorted(name for name, m in cfg.models.items() if m.image)
    if not on:
        return "", []
    svc = cfg.service
    image_dir = svc.image_directory({"CACHE_DIRECTORY": "/var/cache/weightcache"})  # as the unit gives it
    limit = human_bytes(svc.image_max_bytes) if svc.image_max_bytes else "no limit"
    rate = f"{human_bytes(svc.image_write_bytes_per_s)}/s" if svc.image_write_bytes_per_s else "no cap"
    line = (f"images: dir={image_dir} limit={limit} write_rate={rate} stop_write_s={svc.image_stop_write_s:g} "
            f"models={','.join(on)}")
    warnings = []
    try:
        st = os.lstat(image_dir)
    except FileNotFoundError:
        st = None
    except OSError as e:
        warnings.append(f"[service] image_dir {image_dir}: {e.strerror}; the service runs without images")
        st = None
    if st is not None:
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            warnings.append(f"[service] image_dir {image_dir} is a symlink or not a directory: the service "
                            f"refuses it and runs without images")
        elif st.st_uid != os.getuid():
            warnings.append(f"[service] image_dir {image_dir} belongs to uid {st.st_uid}, not uid {os.getuid()} "
                            f"(the user checked as): the service refuses it and runs without images")
    if svc.image_max_bytes:
        for p, pl in planned:
            size = _image_bytes(p, pl) if p.model.image else 0
            if size > svc.image_max_bytes:
                warnings.append(f"model {p.model.name} tp={p.tp_size} rank={p.tp_rank}: its image "
                                f"({human_bytes(size)}, {size} bytes with its header) is larger than [service] "
                                f"image_max_bytes ({limit}): it is never written")
    return line, warnings


def _image_bytes(p: Placement, pl: Any) -> int:
    """Bytes of the image file the service would write for plan ``pl`` of ``p``: its header (manifest with a
    host digest per tensor, key, placement; padded to the data alignment) and the slab's bytes, as
    ``image_max_bytes`` counts them."""
    import dataclasses

    from ..images import build_header
    from ..manifest import Manifest

    records = tuple(dataclasses.replace(r, digest="xxh3_128:" + "0" * 32) for r in pl.records)
    m = Manifest(p.model.name, p.tp_size, p.tp_rank, pl.key, pl.slab_size_bytes, records)
    return len(build_header(m, pl.key, p.to_json(), "host", 0.0)) + pl.slab_size_bytes
