"""``weightcache serve``: runs the service for one GPU (:func:`weightcache.daemon.bootstrap.serve`).

Forbidden imports: torch, weightcache.client, weightcache.daemon at module level.
"""

from __future__ import annotations

import argparse


def cmd_serve(args: argparse.Namespace) -> int:
    """``weightcache serve``: runs the service for one GPU until SIGTERM; SIGHUP reloads the config.

    Returns the exit status of :func:`weightcache.daemon.bootstrap.serve` (78 on
    an invalid configuration when the service has nothing to keep serving).
    """
    from ..daemon.bootstrap import ServeOptions, serve

    return serve(ServeOptions(gpu=args.gpu, config=args.config, listen=args.listen, backend=args.backend,
                              verbose=args.verbose))
