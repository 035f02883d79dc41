"""Command line: ``weightcache serve|status|list|check-config|verify|evict|preload|wait``.

Thin: each command parses arguments, talks to a service (or runs it) and
prints. Exit status: 0 success, 1 a failed model or a refused request,
2 bad usage or configuration, 3 no service.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from typing import Any

from . import protocol
from .client import Session, resolve_socket_dir
from .config import Config, load_config
from .errors import ConfigError, DaemonUnavailable, WeightcacheError

log = logging.getLogger("weightcache")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _backend_for(cfg: Config, explicit: str | None, gpu: int):
    from .memory import cuda_available, get_backend

    name = explicit or cfg.service.backend
    if name == "auto":
        name = "cuda" if cuda_available() else "host"
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
    from . import notify
    from .daemon import Daemon
    from .journal import setup_logging

    setup_logging(args.gpu, logging.DEBUG if args.verbose else logging.INFO)
    stored = notify.listen_fds()
    try:
        cfg = load_config(args.config)
        backend = _backend_for(cfg, args.backend, args.gpu)
    except WeightcacheError as e:
        log.critical("configuration rejected code=%s error=%s", e.code, e.message)
        notify.notify(f"STATUS=configuration rejected: {e.message}")
        return EXIT_USAGE
    listener, bound = _listener(args, cfg, stored)
    d = Daemon(cfg, args.gpu, backend, listener, stored)
    try:
        return d.serve()
    finally:
        if bound:
            try:
                os.unlink(bound)
            except FileNotFoundError:
                pass


def _session(args: argparse.Namespace, gpu: int) -> Session:
    path = os.path.join(resolve_socket_dir(args.socket_dir), f"{gpu}.sock")
    return Session(path, timeout=args.timeout, client="weightcache-cli")


def _gpus(args: argparse.Namespace) -> list[int]:
    if args.gpu is not None:
        return [args.gpu]
    d = resolve_socket_dir(args.socket_dir)
    try:
        found = sorted(int(f[:-5]) for f in os.listdir(d) if f.endswith(".sock") and f[:-5].isdigit())
    except FileNotFoundError:
        found = []
    return found


def _collect(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    out, errors = [], []
    for gpu in _gpus(args):
        try:
            s = _session(args, gpu)
        except DaemonUnavailable as e:
            errors.append({"gpu": gpu, "code": e.code, "message": e.message})
            continue
        try:
            out.append(s.request(protocol.Status()).status)
        finally:
            s.close()
    return out, errors


def cmd_status(args: argparse.Namespace) -> int:
    statuses, errors = _collect(args)
    failed = any(sl["state"] == "failed" for st in statuses for sl in st["slabs"])
    if args.json:
        print(json.dumps({"gpus": statuses, "unreachable": errors}, indent=2))
    else:
        if not statuses and not errors:
            print(f"no weightcache sockets in {resolve_socket_dir(args.socket_dir)}")
        for st in statuses:
            mem = st["memory"]
            print(f"GPU {st['gpu']}  backend={st['backend']}  uuid={st['device'].get('gpu_uuid') or '-'}  "
                  f"pid={st['pid']}  free={_human_bytes(mem['free_bytes'])}/{_human_bytes(mem['total_bytes'])}  "
                  f"clients={st['clients']}")
            print(f"  {st['status_line']}")
            for sl in st["slabs"]:
                state = sl["state"] + (" (adopted from fd store)" if sl["adopted"] else "")
                if sl["state"] == "loading":
                    state += (f" {_human_bytes(sl['done_bytes'])}/{_human_bytes(sl['total_bytes'])} "
                              f"{sl['rate_bytes_per_s'] / 1e9:.2f} GB/s")
                print(f"  {sl['model']:<24} tp={sl['tp_size']} rank={sl['tp_rank']}  {state:<16} "
                      f"resident={_human_bytes(sl['resident_bytes'])}  tensors={sl['tensors']}  "
                      f"leases={len(sl['leases'])}")
                if "error" in sl:
                    print(f"      failed: {sl['error']['code']}: {sl['error']['message']}")
                if "key" in sl:
                    k = sl["key"]
                    print(f"      key: arch={k['architecture']} quant={k['quant_scheme'] or 'none'} "
                          f"files={k['files']} pipeline=v{k['pipeline_version']}")
                for le in sl["leases"]:
                    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(le["since"]))
                    print(f"      lease {le['lease_id']}: pid={le['pid']} uid={le['uid']} mode={le['mode']} "
                          f"since {since}")
        for e in errors:
            print(f"GPU {e['gpu']}  unreachable: {e['message']}")
    if errors and not statuses:
        return EXIT_UNAVAILABLE
    return EXIT_FAILED if failed else EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    statuses, errors = _collect(args)
    rows = [dict(sl, gpu=st["gpu"]) for st in statuses for sl in st["slabs"]]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'GPU':<4} {'MODEL':<24} {'TP':>3} {'RANK':>4} {'STATE':<9} {'RESIDENT':>10}  PATH")
        for r in rows:
            print(f"{r['gpu']:<4} {r['model']:<24} {r['tp_size']:>3} {r['tp_rank']:>4} {r['state']:<9} "
                  f"{_human_bytes(r['resident_bytes']):>10}  {r['path']}")
        for e in errors:
            print(f"GPU {e['gpu']} unreachable: {e['message']}", file=sys.stderr)
    return EXIT_UNAVAILABLE if errors and not statuses else EXIT_OK


def cmd_check_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    from . import sharding
    from .checkpoint import Checkpoint

    problems = 0
    print(f"config: {', '.join(cfg.files)}")
    for gpu in cfg.gpus():
        print(f"GPU {gpu}:")
        for p in cfg.placements(gpu):
            print(f"  {p.model.name:<24} tp={p.tp_size} rank={p.tp_rank}  {p.model.path}")
    for m in cfg.models.values():
        try:
            ck = Checkpoint(m.path)
            for lay in m.layouts:
                check = getattr(sharding, "check_supported", None)
                if check is not None:
                    check(ck.config, lay.tp, m.naming)
            from . import quant

            quant.detect(ck)
        except WeightcacheError as e:
            problems += 1
            print(f"error: model {m.name}: {e.code}: {e.message}", file=sys.stderr)
    return EXIT_FAILED if problems else EXIT_OK


def _per_gpu_request(args: argparse.Namespace, make) -> tuple[list[tuple[int, Any]], int]:
    results, rc = [], EXIT_OK
    gpus = _gpus(args)
    if not gpus:
        print(f"no weightcache sockets in {resolve_socket_dir(args.socket_dir)}", file=sys.stderr)
        return [], EXIT_UNAVAILABLE
    for gpu in gpus:
        try:
            s = _session(args, gpu)
        except DaemonUnavailable as e:
            print(f"GPU {gpu}: {e.message}", file=sys.stderr)
            rc = EXIT_UNAVAILABLE
            continue
        try:
            results.append((gpu, s.request(make())))
        except WeightcacheError as e:
            if e.code == "model_not_found" and args.gpu is None:
                continue
            print(f"GPU {gpu}: {e.code}: {e.message}", file=sys.stderr)
            rc = EXIT_FAILED
        finally:
            s.close()
    return results, rc


def cmd_verify(args: argparse.Namespace) -> int:
    results, rc = _per_gpu_request(args, lambda: protocol.Verify(args.model))
    if not results and rc == EXIT_OK:
        print(f"model {args.model!r} is not on any GPU", file=sys.stderr)
        return EXIT_FAILED
    for gpu, reply in results:
        for r in reply.results:
            if r["state"] != "ready":
                print(f"GPU {gpu} {r['model']} tp={r['tp_size']} rank={r['tp_rank']}: {r['state']}, nothing to verify")
            elif r["mismatched"]:
                rc = EXIT_FAILED
                print(f"GPU {gpu} {r['model']} tp={r['tp_size']} rank={r['tp_rank']}: MISMATCH in "
                      f"{len(r['mismatched'])}/{r['tensors']} tensors: {', '.join(r['mismatched'][:10])}")
            else:
                print(f"GPU {gpu} {r['model']} tp={r['tp_size']} rank={r['tp_rank']}: ok ({r['tensors']} tensors)")
    return rc


def cmd_evict(args: argparse.Namespace) -> int:
    results, rc = _per_gpu_request(args, lambda: protocol.Evict(args.model, args.force))
    for gpu, reply in results:
        for label in reply.evicted:
            print(f"GPU {gpu}: evicted {label}")
    return rc


def cmd_preload(args: argparse.Namespace) -> int:
    results, rc = _per_gpu_request(args, lambda: protocol.Preload(args.model))
    for gpu, reply in results:
        for label in reply.started:
            print(f"GPU {gpu}: loading {label}")
    if rc == EXIT_OK and not args.no_wait:
        return _wait(args, args.model)
    return rc


def _wait(args: argparse.Namespace, model: str | None) -> int:
    """Polls status until no matching slab is pending/loading; prints progress."""
    tty = sys.stdout.isatty()
    deadline = time.monotonic() + args.wait_timeout
    last = ""
    progress = None
    if tty:
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        progress = Progress("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn())
        progress.start()
    tasks: dict[str, Any] = {}
    try:
        while True:
            statuses, errors = _collect(args)
            if errors and not statuses:
                print(errors[0]["message"], file=sys.stderr)
                return EXIT_UNAVAILABLE
            slabs = [dict(sl, gpu=st["gpu"]) for st in statuses for sl in st["slabs"]
                     if model is None or sl["model"] == model]
            for sl in slabs:
                label = f"GPU {sl['gpu']} {sl['model']} tp={sl['tp_size']} rank={sl['tp_rank']}"
                if progress is not None:
                    if label not in tasks:
                        tasks[label] = progress.add_task(label, total=sl["total_bytes"] or None)
                    progress.update(tasks[label], completed=sl["done_bytes"], total=sl["total_bytes"] or None)
                else:
                    line = f"{label}: {sl['state']} {sl['done_bytes']}/{sl['total_bytes']} bytes"
                    if line not in last:
                        print(line, flush=True)
            last = "\n".join(f"GPU {sl['gpu']} {sl['model']} tp={sl['tp_size']} rank={sl['tp_rank']}: {sl['state']} "
                             f"{sl['done_bytes']}/{sl['total_bytes']} bytes" for sl in slabs)
            if not any(sl["state"] in ("pending", "loading") for sl in slabs):
                failed = [sl for sl in slabs if sl["state"] == "failed"]
                for sl in failed:
                    print(f"GPU {sl['gpu']} {sl['model']} rank={sl['tp_rank']} failed: {sl['error']['message']}",
                          file=sys.stderr)
                if model is not None and not slabs:
                    print(f"model {model!r} is not on any GPU", file=sys.stderr)
                    return EXIT_FAILED
                return EXIT_FAILED if failed else EXIT_OK
            if time.monotonic() > deadline:
                print("timed out waiting for the loads", file=sys.stderr)
                return EXIT_FAILED
            time.sleep(0.2)
    finally:
        if progress is not None:
            progress.stop()


def cmd_wait(args: argparse.Namespace) -> int:
    return _wait(args, args.model)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightcache", description="LLM weights resident in GPU memory.")
    sub = p.add_subparsers(dest="command", required=True)

    def client_opts(sp: argparse.ArgumentParser, gpu: bool = True) -> None:
        if gpu:
            sp.add_argument("--gpu", type=int, default=None, help="only this GPU's instance (default: all sockets)")
        sp.add_argument("--socket-dir", default=None, help="socket directory (default $WEIGHTCACHE_SOCKET_DIR or "
                                                           "/run/weightcache)")
        sp.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each reply")

    sp = sub.add_parser("serve", help="run the service for one GPU (under systemd: weightcache@N.service)")
    sp.add_argument("--gpu", type=int, required=True)
    sp.add_argument("--config", default=None, help="main config file (default $WEIGHTCACHE_CONFIG or "
                                                   "/etc/weightcache/weightcache.toml)")
    sp.add_argument("--listen", default=None, help="bind this socket path when not socket-activated")
    sp.add_argument("--backend", choices=("auto", "cuda", "host"), default=None)
    sp.add_argument("-v", "--verbose", action="store_true")
    sp.set_defaults(fn=cmd_serve)

    sp = sub.add_parser("status", help="what is resident, loading or failed; who holds leases")
    client_opts(sp)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_status)

    sp = sub.add_parser("list", help="one line per (model, layout, rank)")
    client_opts(sp)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_list)

    sp = sub.add_parser("check-config", help="validate a config and print the placement of every rank")
    sp.add_argument("--config", default=None)
    sp.set_defaults(fn=cmd_check_config)

    sp = sub.add_parser("verify", help="recompute content digests of resident slabs")
    sp.add_argument("model")
    client_opts(sp)
    sp.set_defaults(fn=cmd_verify)

    sp = sub.add_parser("evict", help="free a model's slabs (refused while leased unless --force)")
    sp.add_argument("model")
    sp.add_argument("--force", action="store_true")
    client_opts(sp)
    sp.set_defaults(fn=cmd_evict)

    sp = sub.add_parser("preload", help="(re)load a failed or evicted model and wait for it")
    sp.add_argument("model")
    sp.add_argument("--no-wait", action="store_true")
    sp.add_argument("--wait-timeout", type=float, default=3600.0)
    client_opts(sp)
    sp.set_defaults(fn=cmd_preload)

    sp = sub.add_parser("wait", help="wait until loads finish, with progress")
    sp.add_argument("model", nargs="?", default=None)
    sp.add_argument("--wait-timeout", type=float, default=3600.0)
    client_opts(sp)
    sp.set_defaults(fn=cmd_wait)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``weightcache`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"weightcache: {e.message}", file=sys.stderr)
        return EXIT_USAGE
    except DaemonUnavailable as e:
        print(f"weightcache: {e.message}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except WeightcacheError as e:
        print(f"weightcache: {e.code}: {e.message}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
