"""The memory budget's eviction policy: which slabs leave the GPU so that another fits. Pure, no I/O.

Owns :class:`Holding` (what the policy knows of one slab), :func:`eviction_key`
(the order in which slabs leave), :func:`make_room` (the victims of one
request for room) and :func:`fit_host` (the host tier's own trim). The
service's state is turned into holdings, and the answer carried out, by
:mod:`weightcache.daemon.tiers`; this module decides and changes nothing.

The rules (docs/operations.md, "Tiers"):

- a slab with a lease, a pinned slab (``pin = true``) and a slab whose load or
  promotion is under way (``busy``) never moves;
- the others leave in :func:`eviction_key` order: lowest ``priority`` first,
  then least recently used (``last_used``), then by label (a stable order);
- a victim goes to the host tier (``demote``) when the host tier has room for
  it, making that room by dropping host-tier slabs that rank below the victim;
  otherwise it is dropped to disk (``drop``);
- when the victims cannot free enough, :func:`make_room` says how many bytes
  are missing (``short_bytes``) and the caller moves nothing;
- a load asked for by a client (:class:`Requester`, issue 38, P4 and P6)
  displaces only slabs of at most its own model's ``priority`` that the
  client may attach itself (a restricted model is never moved for someone
  off its allow lists), host-tier slabs included;
- and it may not use the room of the models that client may not attach
  while they are off the GPU (``reserved_bytes``, P3): their share of the
  budget waits for them.

docs/design.md ("Memory budget: who may displace whom") has the policy as a
table; ``tests/unit/test_budget_policy.py`` checks every row.

Forbidden imports: torch, socket, threading, weightcache.memory, weightcache.protocol, weightcache.config,
weightcache.daemon.state, weightcache.daemon.handlers, weightcache.daemon.loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

#: The places a slab can be, as ``status``, ``list`` and metrics show them.
TIERS = ("gpu", "host", "disk")


@dataclass(frozen=True, slots=True)
class Holding:
    """One slab as the policy weighs it.

    Attributes:
        label (`str`): the slot's label (``model/tpN/rankR``), what the answer names.
        size_bytes (`int`): bytes it holds in its tier (the slab mapping's size).
        leases (`int`): leases held on it (> 0: never moved).
        pinned (`bool`): ``pin = true`` in its model's table (never moved by the budget).
        priority (`int`): ``priority`` of its model (higher stays longer).
        last_used (`float`): ``time.monotonic()`` seconds of its last attach or release (or load).
        busy (`bool`): a load or promotion into this slab is under way (never moved).
        host_copy (`bool`): (a GPU holding) the host tier already holds its bytes, kept after its promotion:
            demoting it takes no more host-tier room (that copy, listed in the host tier under the same
            label, becomes the demoted slab).
    """

    label: str
    size_bytes: int
    leases: int = 0
    pinned: bool = False
    priority: int = 0
    last_used: float = 0.0
    busy: bool = False
    host_copy: bool = False

    @property
    def movable(self) -> bool:
        """True when the budget may move it: no lease, not pinned, not busy."""
        return not (self.leases or self.pinned or self.busy)


def eviction_key(h: Holding) -> tuple[int, float, str]:
    """The order in which movable slabs leave a tier: (``priority``, ``last_used``, ``label``), lowest first."""
    return (h.priority, h.last_used, h.label)


@dataclass(frozen=True, slots=True)
class Requester:
    """Whose load asks for room, as the policy weighs it (issue 38, P4 and P6).

    Attributes:
        priority (`int`): ``priority`` of the model being loaded: no slab of a higher priority is displaced.
        may_displace (`frozenset[str] | None`): labels of the slabs the client may attach (only those can be
            displaced for it); None: every slab (root, the service user).
        reserved_bytes (`int`): budget held back from this load: the room of the models the client may not
            attach that are not on the GPU now (their last slab size), so that its loads (and the leases it
            then holds) cannot keep them out (issue 38, P3).
    """

    priority: int = 0
    may_displace: frozenset[str] | None = None
    reserved_bytes: int = 0

    def allows(self, h: Holding) -> bool:
        """Whether ``h`` may leave for this requester's load: movable, of at most its priority, attachable by it."""
        return (h.movable and h.priority <= self.priority
                and (self.may_displace is None or h.label in self.may_displace))


#: A requester that may displace any movable slab (the policy before issue 38; reloads and tests).
ANYONE = Requester(priority=1 << 31)


@dataclass(frozen=True, slots=True)
class Room:
    """The answer of :func:`make_room`.

    Attributes:
        demote (`tuple[str]`): labels to move GPU -> host tier, in order.
        drop (`tuple[str]`): labels to drop from the GPU to disk, in order.
        drop_host (`tuple[str]`): host-tier labels to drop to disk (room for the demoted ones).
        short_bytes (`int`): bytes still missing after every movable victim (0: the request fits);
            when > 0 the caller must move nothing (``demote``/``drop`` then list what *would* have moved).
        free_bytes (`int`): budget bytes free before any move.
    """

    demote: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    drop_host: tuple[str, ...] = ()
    short_bytes: int = 0
    free_bytes: int = 0

    @property
    def fits(self) -> bool:
        """True when the moves make enough room."""
        return self.short_bytes == 0

    @property
    def moves(self) -> int:
        """How many slabs the answer moves."""
        return len(self.demote) + len(self.drop) + len(self.drop_host)


@dataclass
class _HostTier:
    capacity: int
    held: list[Holding] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    requester: Requester = ANYONE

    @property
    def used(self) -> int:
        return sum(h.size_bytes for h in self.held)

    def take(self, victim: Holding) -> bool:
        """Makes room for ``victim`` by dropping movable holdings ranking below it; False (nothing dropped)
        when it cannot."""
        kept = next((h for h in self.held if victim.host_copy and h.label == victim.label), None)
        if kept is not None:  # its copy is there already: it becomes the demoted slab, ranked as the victim
            self.held[self.held.index(kept)] = victim
            return True
        if victim.size_bytes > self.capacity:
            return False
        free = self.capacity - self.used
        out = []
        for h in sorted((h for h in self.held if self.requester.allows(h)), key=eviction_key):
            if free >= victim.size_bytes or eviction_key(h) >= eviction_key(victim):
                break
            out.append(h)
            free += h.size_bytes
        if free < victim.size_bytes:
            return False
        for h in out:
            self.held.remove(h)
            self.dropped.append(h.label)
        self.held.append(victim)
        return True


def make_room(need_bytes: int, budget_bytes: int, gpu: Sequence[Holding], host_tier_bytes: int = 0,
              host: Sequence[Holding] = (), evict: bool = True, requester: Requester = ANYONE) -> Room:
    """The slabs to move so that ``need_bytes`` more fit on the GPU under ``budget_bytes``.

    Args:
        need_bytes (`int`): bytes the new slab needs (0: bring the GPU back under the budget, as a
            reload that lowers it does).
        budget_bytes (`int`): ``[service] memory_budget_bytes``.
        gpu (`Sequence[Holding]`): what the GPU tier holds now (in-flight loads as ``busy``).
        host_tier_bytes (`int`): ``[service] host_tier_bytes`` (0: no host tier, victims are dropped).
        host (`Sequence[Holding]`): what the host tier holds now.
        evict (`bool`): False forbids moving anything (a start-up load waits on disk instead).
        requester (`Requester`, *optional*): whose load it is: only slabs it :meth:`~Requester.allows` move
            (default: any movable slab).

    Returns:
        `Room`: the moves, and ``short_bytes`` > 0 when they cannot make enough room (then nothing
        is to be moved). With ``need_bytes = 0`` the moves bring the GPU as far under the budget as
        the movable slabs allow, and ``short_bytes`` is what leased, pinned and busy slabs keep above it.

    Example:
        >>> a, b = Holding("a", 6, last_used=1.0), Holding("b", 6, last_used=2.0)
        >>> make_room(6, 12, [a, b]).drop
        ('a',)
    """
    used = sum(h.size_bytes for h in gpu)
    free = budget_bytes - requester.reserved_bytes - used
    if need_bytes <= free:
        return Room(free_bytes=free)
    if not evict:
        return Room(short_bytes=need_bytes - free, free_bytes=free)
    tier = _HostTier(host_tier_bytes, list(host), requester=requester)
    demote, drop = [], []
    room = free
    for h in sorted((h for h in gpu if requester.allows(h)), key=eviction_key):
        if room >= need_bytes:
            break
        (demote if tier.take(h) else drop).append(h.label)
        room += h.size_bytes
    # A victim demoted above and displaced from the host tier by a higher-ranked one goes straight to disk.
    displaced = set(tier.dropped) & set(demote)
    demote = [lb for lb in demote if lb not in displaced]
    drop = [h.label for h in sorted((h for h in gpu if h.label in displaced or h.label in drop), key=eviction_key)]
    drop_host = [lb for lb in tier.dropped if lb not in displaced]
    return Room(tuple(demote), tuple(drop), tuple(drop_host), max(0, need_bytes - room), free)


def fit_host(host_tier_bytes: int, host: Sequence[Holding]) -> tuple[tuple[str, ...], int]:
    """The host-tier slabs to drop so that the tier holds at most ``host_tier_bytes`` (a lowered
    ``host_tier_bytes``): movable ones in :func:`eviction_key` order.

    Returns:
        `tuple`: (labels to drop, bytes still over the size after them: pinned slabs stay).
    """
    over = sum(h.size_bytes for h in host) - host_tier_bytes
    out = []
    for h in sorted((h for h in host if h.movable), key=eviction_key):
        if over <= 0:
            break
        out.append(h.label)
        over -= h.size_bytes
    return tuple(out), max(0, over)
