"""Peer seeding's settings from the configuration (issue 37): the one place the daemon turns ``[service]``
keys into :class:`weightcache.seeding.SeedSettings`.

Forbidden imports: torch, nixl at module level, weightcache.daemon.transport, weightcache.daemon.handlers,
weightcache.daemon.loop.
"""

from __future__ import annotations

from ..config import ServiceConfig
from ..seeding import SeedSettings


def seed_settings(svc: ServiceConfig) -> SeedSettings:
    """The seeding settings of ``[service]`` (``peers``, ``peers_file``, ``seed_*``)."""
    return SeedSettings(peers=tuple(svc.peers), peers_file=svc.peers_file, secret_file=svc.seed_secret_file,
                        listen=svc.seed_listen, transport=svc.seed_transport, devices=tuple(svc.seed_devices),
                        bandwidth_bytes_per_s=svc.seed_bandwidth_bytes_per_s, timeout_s=float(svc.seed_timeout_s),
                        max_transfers=svc.seed_max_transfers, max_bytes=svc.seed_max_bytes,
                        samples=svc.seed_samples)
