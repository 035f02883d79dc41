"""The operator's wire messages: ``list``, ``status``, ``verify``, ``evict``, ``preload``, ``reload``, ``metrics``
and their replies, frozen self-validating dataclasses as in :mod:`._messages`.

Imported on first use (the first of its wire types decoded by :mod:`._codec`, ``protocol.List``...), never by an
engine's attach, which exchanges only the messages of :mod:`._messages`.

Forbidden imports: socket, selectors, asyncio, torch, weightcache.memory, weightcache.client,
weightcache.daemon.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ._messages import Message
from ._records import ServiceCounters, ServiceStatus, SlabInfo, VerifyResult


@dataclass(frozen=True, slots=True)
class List(Message):
    """Asks for the models placed on this GPU."""


@dataclass(frozen=True, slots=True)
class Status(Message):
    """Asks for the full status (states, progress, leases, memory)."""


@dataclass(frozen=True, slots=True)
class Verify(Message):
    """Recompute the content digests of a resident slab (all ranks if tp_size is None)."""

    model: str
    tp_size: int | None = None
    tp_rank: int | None = None


@dataclass(frozen=True, slots=True)
class Evict(Message):
    """Free a model's slabs and fd-store entries; refused while leased unless ``force``.

    ``to``: ``""`` (evicted: out until ``preload``), ``host`` (demoted to the host tier) or ``disk``
    (dropped; the next attach loads it again).
    """

    model: str
    force: bool = False
    to: str = ""


@dataclass(frozen=True, slots=True)
class Preload(Message):
    """Start (or restart after failure/eviction) the load of a model's slabs on this GPU."""

    model: str


@dataclass(frozen=True, slots=True)
class Reload(Message):
    """Re-read the configuration and apply it (``systemctl reload``, ``weightcache reload``; root or the service user)."""


@dataclass(frozen=True, slots=True)
class ListReply(Message):
    """Answer to ``list``: one :class:`SlabInfo` object per (model, layout, rank) on this GPU."""

    models: list

    def slabs(self) -> tuple[SlabInfo, ...]:
        """The typed records."""
        return tuple(SlabInfo.from_json(m) for m in self.models)


@dataclass(frozen=True, slots=True)
class StatusReply(Message):
    """Answer to ``status``: a :class:`ServiceStatus` object (GPU, backend, memory, every slab, leases)."""

    status: dict

    def typed(self) -> ServiceStatus:
        """The typed record."""
        return ServiceStatus.from_json(self.status)


@dataclass(frozen=True, slots=True)
class VerifyReply(Message):
    """Answer to ``verify``: one :class:`VerifyResult` object per slab."""

    results: list

    def typed(self) -> tuple[VerifyResult, ...]:
        """The typed records."""
        return tuple(VerifyResult.from_json(r) for r in self.results)


@dataclass(frozen=True, slots=True)
class EvictReply(Message):
    """Answer to ``evict``: labels (``model/tpN/rankR``) of the slabs freed."""

    evicted: list


@dataclass(frozen=True, slots=True)
class PreloadReply(Message):
    """Answer to ``preload``: labels of the slabs whose load started."""

    started: list


@dataclass(frozen=True, slots=True)
class ReloadReply(Message):
    """Answer to ``reload`` once the new configuration is applied; labels (``model/tpN/rankR``) of the slabs.

    Attributes:
        added: new or changed placements, now loading.
        dropped: removed or changed placements whose slab was freed (or never loaded).
        retired: removed or changed placements kept while leases hold them (freed at the last release).
        kept: unchanged placements (slab and leases untouched; a failed one is loaded again).
        restart_keys: changed ``[service]`` keys that take effect at the next restart only.
        files: the configuration files read.
        moved: what the memory budget moved to fit a lowered ``memory_budget_bytes`` or ``host_tier_bytes``:
            ``label -> tier`` strings (``host``, ``disk``; ``host (copying)`` while its copy runs).
    """

    added: list
    dropped: list
    retired: list
    kept: list
    restart_keys: list = field(default_factory=list)
    files: list = field(default_factory=list)
    moved: list = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Metrics(Message):
    """Asks for the status and the service's counters (what ``weightcache metrics`` exports)."""


@dataclass(frozen=True, slots=True)
class MetricsReply(Message):
    """Answer to ``metrics``: a :class:`ServiceStatus` object and a :class:`ServiceCounters` object."""

    status: dict
    counters: dict

    def typed(self) -> tuple[ServiceStatus, ServiceCounters]:
        """The typed records."""
        return ServiceStatus.from_json(self.status), ServiceCounters.from_json(self.counters)

