"""What the image store counted: writes, reads, rejections, removals (thread-safe; the metrics read it).

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import collections
import threading
from typing import Any


class ImageStats:
    """Counters of one service's image store since it started; any thread may add, the serving loop reads.

    Attributes (through :meth:`snapshot`): ``written``, ``written_bytes``, ``write_seconds``, ``read``,
    ``read_bytes``, ``read_seconds``, ``removed``, ``removed_bytes``, ``write_failures`` and ``rejected``
    (reason -> count: ``digest``, ``identity``, ``key``, ``layout``, ``format``, ``access``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n: collections.Counter[str] = collections.Counter()
        self._f: dict[str, float] = collections.defaultdict(float)
        self._rejected: collections.Counter[str] = collections.Counter()

    def wrote(self, size_bytes: int, seconds: float) -> None:
        """One image written (``size_bytes`` of slab bytes in ``seconds``)."""
        with self._lock:
            self._n["written"] += 1
            self._n["written_bytes"] += size_bytes
            self._f["write_seconds"] += seconds

    def write_failed(self) -> None:
        """A write that did not finish (no room, an I/O error)."""
        with self._lock:
            self._n["write_failures"] += 1

    def read(self, size_bytes: int, seconds: float) -> None:
        """One image read into a slab and found valid."""
        with self._lock:
            self._n["read"] += 1
            self._n["read_bytes"] += size_bytes
            self._f["read_seconds"] += seconds

    def rejected(self, reason: str) -> None:
        """One image refused for ``reason``."""
        with self._lock:
            self._rejected[reason] += 1

    def removed(self, size_bytes: int) -> None:
        """One image removed to keep the directory within its byte limit."""
        with self._lock:
            self._n["removed"] += 1
            self._n["removed_bytes"] += size_bytes

    def snapshot(self) -> dict[str, Any]:
        """The counters as a JSON object (the ``metrics`` reply's ``images``)."""
        with self._lock:
            out: dict[str, Any] = {k: self._n.get(k, 0) for k in ("written", "written_bytes", "read", "read_bytes",
                                                                    "removed", "removed_bytes", "write_failures")}
            out.update({k: round(self._f.get(k, 0.0), 6) for k in ("write_seconds", "read_seconds")})
            out["rejected"] = dict(self._rejected)
            return out
