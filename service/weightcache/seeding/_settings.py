"""What seeding needs from the configuration (``[service]`` ``peers``, ``peers_file``, ``seed_*``), and the
thread-safe counters behind its metrics.

Forbidden imports: torch, socket, weightcache.daemon, weightcache.config (the daemon builds the settings), nixl.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from ._secret import DEFAULT_SECRET_FILE

log = logging.getLogger(__name__)

#: Reasons a receiver falls back to its own load (metrics label ``reason``, journal ``REASON``).
FALLBACK_REASONS = ("no_peer", "unreachable", "not_held", "not_allowed", "busy", "auth", "timeout",
                    "disconnected", "transfer_error", "digest_mismatch", "digest_kind", "wrong_checkpoint",
                    "key_mismatch", "manifest_mismatch", "protocol", "internal")


@dataclass(frozen=True)
class SeedSettings:
    """Peer seeding's configuration (docs/configuration.md, "Peer seeding").

    Attributes:
        peers (`tuple[str, ...]`): ``host:port`` of peer services' seeding listeners, asked in order.
        peers_file (`str`): a file a fleet tool writes, one ``host:port`` per line (``#`` comments); read at
            each load, so it may change at any time ("" : none).
        secret_file (`str`): the fleet's secret (:mod:`weightcache.seeding._secret`).
        listen (`str`): ``host:port`` this node's source listens on; the instance of GPU N adds N to the port
            ("": this node serves no peer).
        transport (`str`): ``UCX`` or ``LIBFABRIC``.
        devices (`tuple[str, ...]`): network devices for the transport (UCX: ``mlx5_0:1``...; empty: all).
        bandwidth_bytes_per_s (`int`): cap of one transfer, bytes/s (0: none).
        timeout_s (`float`): one peer's whole exchange, seconds (connect to ack).
        max_transfers (`int`): transfers a source serves at once.
        max_bytes (`int`): bytes a source has registered for peers at once (0: no cap).
        samples (`int`): random 4 KiB samples of the checkpoint's tensor data compared with the peer's
            checkpoint (:mod:`weightcache.seeding._samples`; 0: trust equal headers alone, read no data).
    """

    peers: tuple[str, ...] = ()
    peers_file: str = ""
    secret_file: str = DEFAULT_SECRET_FILE
    listen: str = ""
    transport: str = "UCX"
    devices: tuple[str, ...] = ()
    bandwidth_bytes_per_s: int = 0
    timeout_s: float = 120.0
    max_transfers: int = 4
    max_bytes: int = 0
    samples: int = 8

    @property
    def enabled(self) -> bool:
        """Whether this node asks peers (``peers``/``peers_file``) or serves them (``listen``)."""
        return bool(self.peers or self.peers_file or self.listen)

    def all_peers(self) -> list[str]:
        """The static peers, then the peers file's (read now; a missing or unreadable file adds none, logged)."""
        out = list(self.peers)
        if self.peers_file:
            try:
                with open(self.peers_file, encoding="utf-8") as f:
                    text = f.read(1 << 20)
            except OSError as e:
                log.warning("seeding: peers file %s not read: %s", self.peers_file, e.strerror)
                return out
            for line in text.splitlines():
                line = line.split("#", 1)[0].strip()
                if line and line not in out:
                    out.append(line)
        return out


@dataclass
class SeedStats:
    """Counters since the service started (any thread).

    Attributes:
        received (`Counter`): ``(model, tp_size, tp_rank, outcome, reason)`` -> count; outcome ``seeded`` or
            ``fallback`` (one per peer that failed, reason as :data:`FALLBACK_REASONS`).
        received_bytes, received_seconds (`Counter`): ``model`` -> bytes and seconds of the READs that seeded.
        served (`Counter`): ``(model, outcome, reason)`` -> count; outcome ``served``, ``refused``.
        served_bytes (`Counter`): ``model`` -> bytes served.
    """

    received: collections.Counter = field(default_factory=collections.Counter)
    received_bytes: collections.Counter = field(default_factory=collections.Counter)
    received_seconds: collections.Counter = field(default_factory=collections.Counter)
    served: collections.Counter = field(default_factory=collections.Counter)
    served_bytes: collections.Counter = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, table: str, key: Any, n: float = 1) -> None:
        """Adds ``n`` to ``key`` of the counter ``table``."""
        with self.lock:
            getattr(self, table)[key] += n

    def seed_counts(self) -> list[tuple[str, str, str, str, int, int, float]]:
        """Rows of :class:`weightcache.protocol.SeedCount`: ``(role, model, outcome, reason, count, bytes,
        seconds)``, ranks of one model summed; bytes and seconds on the ``seeded`` and ``served`` rows."""
        rows: dict[tuple[str, str, str, str], list] = {}
        with self.lock:
            for (model, _tp, _rank, outcome, reason), n in self.received.items():
                rows.setdefault(("received", model, outcome, reason), [0, 0, 0.0])[0] += n
            for model, b in self.received_bytes.items():
                rows.setdefault(("received", model, "seeded", ""), [0, 0, 0.0])[1] += int(b)
            for model, sec in self.received_seconds.items():
                rows.setdefault(("received", model, "seeded", ""), [0, 0, 0.0])[2] += float(sec)
            for (model, outcome, reason), n in self.served.items():
                rows.setdefault(("served", model, outcome, reason), [0, 0, 0.0])[0] += n
            for model, b in self.served_bytes.items():
                rows.setdefault(("served", model, "served", ""), [0, 0, 0.0])[1] += int(b)
        return [(*k, int(v[0]), int(v[1]), float(v[2])) for k, v in sorted(rows.items())]

    def snapshot(self) -> dict[str, list]:
        """Every counter as JSON-able lists: ``{table: [[*key, value], ...]}``."""
        with self.lock:
            return {t: [[*(k if isinstance(k, tuple) else (k,)), v] for k, v in sorted(getattr(self, t).items())]
                    for t in ("received", "received_bytes", "received_seconds", "served", "served_bytes")}
