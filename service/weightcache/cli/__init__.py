"""Command line: ``weightcache serve|status|list|check-config|verify|evict|preload|wait|reload|metrics|serve-metrics|
publish``.

Thin: this module holds the argument parser and :func:`main`; each command is
a small function in the module named for it (``status``: status and list,
``check_config``, ``slabs``: verify, evict and reload, ``wait``: wait and
preload, ``prometheus``: metrics and serve-metrics, ``publish`` (vLLM's own load, published), ``serve``, which hands
over to :mod:`weightcache.daemon.bootstrap`), imported only when that command
runs. The commands are documented in ``weightcache(1)`` and docs/, and
tests/integration/test_cli.py drives each against live services. Exit status:
0 success, 1 a failed model or a refused request, 2 bad usage or
configuration, 3 no service (``serve``: 78 on an invalid configuration when
it has nothing to keep serving, see :func:`weightcache.daemon.bootstrap.serve`).
141 when the reader of stdout went away (``| head``). Human output goes to stdout, diagnostics to stderr; ``--json`` output is the
services' own status records.

Forbidden imports: torch, weightcache.daemon, weightcache.client at module level,
weightcache.pipeline at module level, weightcache.memory at module level.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: The user weightcache@.service runs as (units/weightcache.sysusers); ``check-config`` reads files as it.
SERVICE_USER = "weightcache"


def build_parser() -> argparse.ArgumentParser:
    """The ``weightcache`` argument parser: one sub-command per operator task (see weightcache(1))."""
    p = argparse.ArgumentParser(
        prog="weightcache", description="LLM weights resident in GPU memory. See weightcache(1).",
        epilog="exit status: 0 success; 1 a model failed or a request was refused; 2 bad usage or configuration; "
               "3 no service answered; 78 (serve) the configuration or runtime was rejected.")
    from .. import __version__

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
    sp.set_defaults(fn="serve:cmd_serve")

    sp = sub.add_parser("status", help="what is resident, loading or failed; who holds leases")
    client_opts(sp)
    sp.add_argument("--json", action="store_true", help="machine-readable output (the services' status replies)")
    sp.set_defaults(fn="status:cmd_status")

    sp = sub.add_parser("list", help="one line per (model, layout, rank)")
    client_opts(sp)
    sp.add_argument("--json", action="store_true", help="machine-readable output, one object per slab")
    sp.set_defaults(fn="status:cmd_list")

    sp = sub.add_parser("check-config", help="validate a config and print the placement of every rank")
    sp.add_argument("--config", default=None, help="main config file (default $WEIGHTCACHE_CONFIG or "
                                                   "/etc/weightcache/weightcache.toml); conf.d/ beside it is read too")
    sp.add_argument("--as-user", default=None, metavar="USER",
                    help="read the config and checkpoints as USER (needs root); default when run as root: "
                         f"{SERVICE_USER}, the service user; 'root' checks as root")
    sp.set_defaults(fn="check_config:cmd_check_config")

    sp = sub.add_parser("verify", help="recompute content digests of resident slabs")
    sp.add_argument("model")
    client_opts(sp)
    sp.set_defaults(fn="slabs:cmd_verify")

    sp = sub.add_parser("evict", help="free a model's slabs (refused while leased unless --force)")
    sp.add_argument("model")
    sp.add_argument("--force", action="store_true", help="evict even while engines hold leases (they keep their "
                                                         "mappings; the memory is freed when they detach)")
    sp.add_argument("--to", choices=("host", "disk"), default=None,
                    help="move the unleased slabs to the host tier, or drop them to disk, instead of evicting: "
                         "the next attach brings them back")
    client_opts(sp)
    sp.set_defaults(fn="slabs:cmd_evict")

    sp = sub.add_parser("preload", help="(re)load a failed, evicted, host-tier or on-disk model and wait for it")
    sp.add_argument("model")
    sp.add_argument("--no-wait", action="store_true", help="start the load and return at once")
    sp.add_argument("--wait-timeout", type=float, default=3600.0, help="seconds to wait for the load (default 3600)")
    client_opts(sp)
    sp.set_defaults(fn="wait:cmd_preload")

    sp = sub.add_parser("reload", help="apply the configuration files again, without a restart "
                                       "(systemctl reload runs it)")
    client_opts(sp)
    sp.add_argument("--running", action="store_true",
                    help="only instances whose weightcache@N.service runs (never starts one that only listens); "
                         "systemctl reload weightcache runs this")
    # --timeout: by default the config's reload_timeout_s plus 10 s (slabs.reload_reply_timeout): an instance
    # answers once it has read the files, which may take up to that long.
    sp.set_defaults(fn="slabs:cmd_reload", timeout=None)

    sp = sub.add_parser("wait", help="wait until loads finish, with progress")
    sp.add_argument("model", nargs="?", default=None, help="only this model (default: every slab)")
    sp.add_argument("--wait-timeout", type=float, default=3600.0, help="seconds to wait (default 3600)")
    client_opts(sp)
    sp.set_defaults(fn="wait:cmd_wait")

    sp = sub.add_parser("metrics", help="the node's metrics in Prometheus' text format (never starts an instance)")
    client_opts(sp, gpu=False)
    sp.add_argument("--config", default=None, help="config file naming the GPUs to report besides the sockets found")
    sp.add_argument("-o", "--output", metavar="FILE", default=None,
                    help="write FILE atomically instead of stdout (node_exporter's textfile collector: *.prom)")
    sp.set_defaults(fn="prometheus:cmd_metrics", timeout=5.0)

    sp = sub.add_parser("publish", help="load a model with vLLM's own loader and publish every rank to the services "
                                        "(run with the engine's interpreter)")
    sp.add_argument("model", help="checkpoint directory (as the engines give it to vLLM)")
    sp.add_argument("--tp", type=int, default=1, help="tensor-parallel size (every rank is published)")
    sp.add_argument("--dtype", default=None, help="vLLM's --dtype (default: vLLM's auto)")
    sp.add_argument("--quantization", default=None, help="vLLM's --quantization (default: from the checkpoint)")
    sp.add_argument("--max-model-len", dest="max_model_len", type=int, default=None, help="vLLM's --max-model-len")
    client_opts(sp)
    sp.set_defaults(fn="publish:cmd_publish", timeout=60.0)

    sp = sub.add_parser("images", help="the processed images on disk: size, key summary, age, last use")
    sp.add_argument("--config", help="config file (default: $WEIGHTCACHE_CONFIG or /etc/weightcache/weightcache.toml)")
    sp.add_argument("--dir", help="the image directory (default: the config's [service] image_dir)")
    sp.add_argument("--json", action="store_true", help="one JSON object per image")
    sp.set_defaults(fn="images:cmd_images")

    sp = sub.add_parser("serve-metrics", help="answer GET /metrics over HTTP (weightcache-metrics.service)")
    client_opts(sp, gpu=False)
    sp.add_argument("--config", default=None, help="main config file (default $WEIGHTCACHE_CONFIG or "
                                                   "/etc/weightcache/weightcache.toml)")
    sp.add_argument("--listen", metavar="HOST:PORT", default=None,
                    help="bind this address when not socket-activated (e.g. 127.0.0.1:9661)")
    sp.add_argument("--web-config", dest="web_config", metavar="FILE", default=None,
                    help="Prometheus web config file (tls_server_config, basic_auth_users); default: the "
                         "config's [metrics] web_config; \"\" for plain HTTP")
    sp.set_defaults(fn="prometheus:cmd_serve_metrics", timeout=5.0)
    return p

def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``weightcache`` console script (and ``python -m weightcache``): returns the exit status.

    A reader that closes stdout early (``weightcache status | head -1``) ends the command quietly
    with 141 (128 + SIGPIPE, what a shell reports for a command killed by SIGPIPE), no traceback:
    see :func:`weightcache.cli.common.quiet_broken_pipe`."""
    from .common import EXIT_BROKEN_PIPE, quiet_broken_pipe, run_checked

    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:  # --help and usage errors: argparse printed, then exits
            sys.stdout.flush()
            raise
        module, name = args.fn.split(":")
        rc = run_checked(getattr(importlib.import_module(f"{__name__}.{module}"), name), args)
        sys.stdout.flush()  # a closed pipe raises here, not in the interpreter's final flush
        return rc
    except BrokenPipeError:
        quiet_broken_pipe()
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
