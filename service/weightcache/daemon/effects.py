"""What a handler takes and returns: its :class:`Context`, and the :class:`Outcome` the serving loop carries out.

Owns the records of :mod:`weightcache.daemon.handlers`' contract (h11's way:
handlers return what the I/O layer must do): :class:`Reply` frames for the
requester and the effects (:class:`StartLoad`, :class:`FreeSlab`,
:class:`CancelLoad`, :class:`Reconfigure`, :class:`Refuse`,
:class:`StartVerify`, :class:`StoreSlab`), gathered in an :class:`Outcome`; and :class:`Context`,
what handlers read besides the state.

Forbidden imports: socket, selectors, threading, torch, weightcache.notify, weightcache.fdpass,
weightcache.daemon.transport, weightcache.daemon.loads, weightcache.daemon.fdstore,
weightcache.daemon.ticker, weightcache.daemon.loop, weightcache.daemon.handlers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import protocol
from ..config import Config, ServiceConfig
from ..errors import RemoteProtocolError
from . import access, tiers
from .state import ServiceState, Slot


@dataclass(frozen=True, slots=True)
class Reply:
    """A frame for the requester: ``msg`` and the fds that travel with it (the I/O layer dups them)."""

    msg: protocol.Message
    fds: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StartLoad:
    """Effect: queue ``slot`` (now PENDING) on the loader."""

    slot: Slot


@dataclass(frozen=True, slots=True)
class FreeSlab:
    """Effect: drop the fd-store entries ``store_id`` (when not None), close ``sealed`` (the backend's
    SealedSlab) and its manifest file (when not None)."""

    store_id: str | None
    sealed: Any
    manifest_file: Any


@dataclass(frozen=True, slots=True)
class StoreSlab:
    """Effect: put ``slot``'s sealed slab and manifest file in systemd's fd store (a publication just made)."""

    slot: Slot


@dataclass(frozen=True, slots=True)
class CancelLoad:
    """Effect: the loader skips ``slot`` (DROPPED) if queued, or stops its load at the next progress report."""

    slot: Slot


@dataclass(frozen=True, slots=True)
class Reconfigure:
    """Effect: ``config`` is applied; the loader's settings come from it for the next load."""

    config: Config


@dataclass(frozen=True, slots=True)
class Refuse:
    """Effect: a protocol violation; send ``error`` if possible and close the connection."""

    error: RemoteProtocolError


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one request produced: replies for the requester, then effects for the I/O layer."""

    replies: tuple[Reply, ...] = ()
    effects: tuple[Any, ...] = ()


@dataclass
class Context:
    """What handlers read besides the state: clocks and the backend's memory figures.

    Attributes:
        state (`ServiceState`): the service's state.
        mem_info (`callable`): ``() -> (free_bytes, total_bytes)`` of the backend.
        load_config (`callable`): ``() -> Config``, reading the files again (``reload``);
            raises ConfigError (`config_invalid`).
        service_config (`ServiceConfig`): ``[service]`` of the configuration applied.
        monotonic (`callable`): seconds, for deadlines (``time.monotonic``).
        wall (`callable`): Unix time in seconds, for lease timestamps (``time.time``).
        pid (`int`): the service's pid, as ``status`` reports it.
        policy (`access.Policy`, *optional*): the service uid and operator groups (default: the
            state's ``service_uid``, no operator groups).
        counters (`Counters`, *optional*): the service's counters
            (:class:`weightcache.daemon.metrics.Counters`), for ``metrics``.
        tiers (`tiers.Tiers`, *optional*): the memory budget and the host tier (default: from
            ``service_config`` and ``mem_info``'s total, moves without a copy as on the host backend).
        adopt_publication (`callable`, *optional*): ``(fd, size_bytes) -> SealedSlab``, the backend's
            ``adopt_publication`` (seals a publisher's memfd and owns a dup of it); None: the backend takes no
            publication (``publish`` is ``publication_invalid``).
        defer_publication (`callable`, *optional*): ``(source, size_bytes, label) -> Adoption``, the cuda backend's
            ``defer_publication`` (:class:`weightcache.memory.cuda_publish.Adoption`: the copy into the service's
            own slab, run by the publication's worker); None: ``publish`` takes ``adopt_publication``'s path on
            the serving loop, and ``publish_cuda_ipc`` is ``publication_invalid``.
        changed_checkpoints (`dict`): set around a ``reload`` only: slot identity
            (:func:`weightcache.daemon.reload.identity`) -> (the manifest it was checked against, the changed
            identity fields), for the resident slabs whose checkpoint files were replaced on disk since
            their load (found by the reload's worker, :func:`weightcache.daemon.offloop.changed_checkpoints`).
    """

    state: ServiceState
    mem_info: Callable[[], tuple[int, int]]
    load_config: Callable[[], Config] | None = None
    service_config: ServiceConfig = field(default_factory=ServiceConfig)
    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    pid: int = field(default_factory=os.getpid)
    policy: access.Policy | None = None
    counters: Any = None
    tiers: tiers.Tiers | None = None
    changed_checkpoints: dict = field(default_factory=dict)
    adopt_publication: Callable[[int, int], Any] | None = None
    defer_publication: Callable[[Any, int, str], Any] | None = None

    def __post_init__(self) -> None:
        if self.policy is None:  # no operator groups: root and the service user
            self.policy = access.Policy(self.state.service_uid)
        if self.tiers is None:
            self.tiers = tiers.Tiers(self.service_config.budget_bytes(int(self.mem_info()[1])),
                                     self.service_config.host_tier_bytes)


def one_reply(msg: protocol.Message, fds: tuple[int, ...] = ()) -> Outcome:
    """An outcome of one reply and no effect."""
    return Outcome((Reply(msg, fds),))


@dataclass(frozen=True, slots=True)
class VerifyItem:
    """One slab to verify, as it was when ``verify`` arrived: ``manifest``/``sealed`` None unless READY."""

    model: str
    tp_size: int
    tp_rank: int
    state: str
    manifest: Any
    sealed: Any


@dataclass(frozen=True, slots=True)
class StartVerify:
    """Effect: run :func:`verify_reply` on ``items`` off the serving loop, then send its reply to ``request``."""

    request: protocol.Verify
    items: tuple[VerifyItem, ...]
