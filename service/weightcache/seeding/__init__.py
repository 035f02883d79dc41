"""Peer seeding (issue 37): a service that lacks a slab fetches it, processed, from a peer's service over NIXL.

The face of the package. Its rooms:

- :mod:`._secret`: the fleet's shared secret file and the HMAC (rotation: several lines);
- :mod:`._channel`: the authenticated request/reply over TCP (the control channel);
- :mod:`._keys`: the checkpoint's portable identity and the checks of a peer's key and manifest;
- :mod:`._samples`: random samples of the tensor data, which tell checkpoints with equal headers apart;
- :mod:`._agent`: NIXL (optional, imported lazily): the agent, registrations (``DRAM``, ``VRAM``), READs;
- :mod:`._settings`: :class:`SeedSettings` and the counters;
- :mod:`._source`: serving this node's slabs (host memfds, a CUDA service's GPU slabs and host tier) to peers, off the serving loop;
- :mod:`._receiver`: asking peers before reading the checkpoint, with every check;
- :mod:`._seeder`: :class:`Seeder`, the composition a service holds.

docs/design.md, "Peer seeding", says why and how.

Forbidden imports: torch, weightcache.daemon, weightcache.config; nixl at module level.
"""

from __future__ import annotations

from ._agent import TRANSPORTS, Agent, NixlMissing, TransferError, nixl_api
from ._channel import Channel, ChannelError, parse_address
from ._keys import key_differences, portable_identity
from ._receiver import Seeded
from ._secret import DEFAULT_SECRET_FILE, Secret, SecretError, load_secret
from ._seeder import Seeder
from ._settings import FALLBACK_REASONS, SeedSettings, SeedStats
from ._source import Offer, manifest_digest

__all__ = [
           "DEFAULT_SECRET_FILE",
           "FALLBACK_REASONS",
           "TRANSPORTS",
           "Agent",
           "Channel",
           "ChannelError",
           "NixlMissing",
           "Offer",
           "Secret",
           "SecretError",
           "SeedSettings",
           "SeedStats",
           "Seeded",
           "Seeder",
           "TransferError",
           "key_differences",
           "load_secret",
           "manifest_digest",
           "nixl_api",
           "parse_address",
           "portable_identity",
]
