"""``weightcache metrics`` and ``weightcache serve-metrics``: the node's metrics (:mod:`weightcache.metrics`).

Forbidden imports: torch, weightcache.daemon, weightcache.client, weightcache.pipeline, weightcache.memory.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..config import config_path, load_config, load_metrics_config
from ..errors import ConfigError
from .common import EXIT_OK, socket_dir_of

log = logging.getLogger("weightcache")


def _metrics_registry(args: argparse.Namespace):
    """The node's metrics registry: the socket directory's instances and the config's GPUs (read at each scrape)."""
    from .. import metrics

    def gpus() -> dict[int, int] | list[int]:
        """GPU -> slabs placed there (0 for one of ``disabled_gpus``): weightcache_configured_slabs."""
        try:
            cfg = load_config(args.config)
        except ConfigError as e:
            log.warning("metrics: configuration not read, only the sockets are reported: %s", e.message)
            return []
        counts = dict.fromkeys(cfg.gpus(), 0)
        for p in cfg.placements():
            if p.gpu not in cfg.service.disabled_gpus:
                counts[p.gpu] += 1
        return counts

    return metrics.registry(socket_dir_of(args), gpus, args.timeout)


def cmd_metrics(args: argparse.Namespace) -> int:
    """``weightcache metrics``: the Prometheus text of every running instance; never starts one."""
    from .. import metrics

    reg = _metrics_registry(args)
    if args.output:
        metrics.write_textfile(args.output, reg)
    else:
        sys.stdout.write(metrics.exposition(reg).decode())
    return EXIT_OK


def web_config_of(args: argparse.Namespace):
    """The endpoint's web config (``--web-config``, else ``[metrics] web_config``), loaded; None for plain HTTP.

    Raises:
        ConfigError: the config files cannot be parsed (whether TLS is asked cannot be told: the endpoint
            does not start rather than serve in the clear), or the web config file does not load.
    """
    from ..metrics_web import WebConfigFile

    path = getattr(args, "web_config", None)
    if path is None:
        path = load_metrics_config(args.config).web_config
    return WebConfigFile(path) if path else None


def cmd_serve_metrics(args: argparse.Namespace) -> int:
    """``weightcache serve-metrics``: answers GET /metrics on the socket systemd passes (or ``--listen``)."""
    from .. import metrics_http
    from ..journal import setup_logging

    setup_logging(None)
    listener = metrics_http.listener_from_systemd()
    if listener is None:
        if not args.listen:
            m = load_metrics_config(args.config)  # the address the socket unit would have: the config's
            host = f"[{m.address}]" if ":" in m.address else m.address
            raise ConfigError("serve-metrics: no socket from systemd ($LISTEN_FDS) and no --listen HOST:PORT; "
                              f"start weightcache-metrics.socket, or give --listen {host}:{m.port} "
                              f"([metrics] address and port of {config_path(args.config)})", key="--listen")
        try:
            listener = metrics_http.bind(args.listen)
        except (ValueError, OSError) as e:
            raise ConfigError(f"serve-metrics: cannot listen on {args.listen}: {e}", key="--listen") from None
    web = web_config_of(args)
    metrics_http.serve(listener, _metrics_registry(args), web)
    return EXIT_OK
