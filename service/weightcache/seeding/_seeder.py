"""One service's peer seeding: its settings, secret, NIXL agent, source and counters, composed.

Forbidden imports: torch, weightcache.daemon, nixl (through :mod:`._agent` only).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from ._agent import Agent, NixlMissing, nixl_installed
from ._receiver import Seeded, fetch, target_of
from ._secret import SecretError, load_secret
from ._settings import SeedSettings, SeedStats
from ._source import Offers, Source

log = logging.getLogger(__name__)


class Seeder:
    """Peer seeding of one service (one GPU).

    Build it with :meth:`create`, which returns None (one log line saying why) when seeding is off: not
    configured, NIXL not installed, or the secret unusable.

    Args:
        settings (`SeedSettings`), secret (`Secret`), gpu (`int`), wake (`callable`): the serving loop's wake-up.
    """

    def __init__(self, settings: SeedSettings, secret: Any, gpu: int, wake: Callable[[], None]) -> None:
        self.settings = settings
        self.secret = secret
        self.gpu = gpu
        self.stats = SeedStats()
        self.offers = Offers(wake)
        self._agent: Agent | None = None
        self._lock = threading.Lock()
        self.source = Source(settings, secret, self.agent, self.offers, self.stats, gpu) if settings.listen else None

    @classmethod
    def create(cls, settings: SeedSettings, gpu: int, wake: Callable[[], None]) -> Seeder | None:
        """The service's seeder, or None when seeding is off (logged once, with the reason)."""
        if not settings.enabled:
            return None
        try:
            nixl_installed()
        except NixlMissing as e:
            log.warning("seeding off: %s", e)
            return None
        try:
            secret = load_secret(settings.secret_file)
        except SecretError as e:
            log.error("seeding off: %s", e)
            return None
        return cls(settings, secret, gpu, wake)

    def agent(self) -> Agent:
        """This service's NIXL agent, created on first use (any thread).

        Raises:
            NixlMissing, RuntimeError: see :class:`Agent`.
        """
        with self._lock:
            if self._agent is None:
                name = f"weightcache-{socket.gethostname()}-gpu{self.gpu}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                self._agent = Agent(name, self.settings.transport, self.settings.devices)
            return self._agent

    def start(self) -> None:
        """Creates the NIXL agent on a thread (UCX's start takes about a second: off the first load's path) and
        starts the source's listener when ``listen`` is set (an unbindable address: logged, source off)."""
        threading.Thread(target=self._warm, name="weightcache-seed-agent", daemon=True).start()
        if self.source is None:
            return
        try:
            self.source.start()
        except OSError as e:
            log.error("seeding: cannot listen on %s:%d (%s); this node serves no peer", *self.source.address,
                      e.strerror)
            self.source = None

    def _warm(self) -> None:
        try:
            self.agent()
        except Exception as e:  # noqa: BLE001 - the first transfer meets (and reports) the same error
            log.warning("seeding: NIXL agent not created at start: %r", e)

    def stop(self) -> None:
        """Closes the source's listener."""
        if self.source is not None:
            self.source.stop()

    @property
    def asks_peers(self) -> bool:
        """Whether loads ask peers first (``peers`` or ``peers_file`` set)."""
        return bool(self.settings.peers or self.settings.peers_file)

    def fill(self, plan: Any, writable: Any, threads: int = 4,
             progress: Callable[[int, int], None] | None = None) -> Seeded | None:
        """Fills ``writable`` (a host memfd slab, or a CUDA service's GPU slab) from a peer; None: read the
        checkpoint (reasons logged).

        See :func:`weightcache.seeding._receiver.fetch`.
        """
        if not self.asks_peers or target_of(writable) is None:
            return None
        try:
            self.agent()
        except Exception as e:  # noqa: BLE001 - NIXL installed but not loadable here: the checkpoint, as without
            log.warning("seeding: model=%s not asked of peers: the NIXL agent is unavailable (%r)",
                        plan.rank.model.name, e)
            return None
        try:
            return fetch(self.settings, self.secret, self.agent, self.stats, plan, writable, threads, progress)
        finally:
            held = self.held()
            log.info("seeding: transfer attempts of model=%s ended nixl_registrations=%d remote_agents=%d",
                     plan.rank.model.name, held["registrations"], held["remote_agents"])

    def answer(self, slots: Iterable[Any]) -> None:
        """Answers the source threads' lookups (serving loop only)."""
        self.offers.answer(slots)

    def held(self) -> dict[str, int]:
        """NIXL registrations and remote agents held now (0 and 0 between transfers)."""
        a = self._agent
        return {"registrations": a.registrations if a else 0, "remote_agents": a.remote_agents if a else 0}
