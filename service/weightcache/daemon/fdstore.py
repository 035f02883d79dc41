"""systemd's file descriptor store: put, remove and adopt slabs across restarts.

Owns the names (``FDNAME=slab-<id>`` and ``FDNAME=manifest-<id>``, ``<id>``
being :attr:`~weightcache.daemon.state.Slot.store_id`). Beside each slab the
store keeps the slab's manifest file, the very sealed memfd every attach sends
(:mod:`weightcache.manifest`; its JSON carries ``backend``,
``size_bytes``, ``checkpoint_path``, ``dtypes_served`` and the slot's ``placement``,
:meth:`~weightcache.config.Placement.to_json`, so that a service whose config
no longer loads can serve the slab as it was configured: :func:`stored_placements`). At start a stored slab is adopted
only when its manifest's cache key equals the key computed now from the config
and the checkpoint's headers (no tensor is read); every other entry is dropped
with ``FDSTOREREMOVE=1``. A manifest of another format (an older release) is
dropped the same way: the slab is loaded again.

Outside systemd (no ``$NOTIFY_SOCKET``) :meth:`FdStore.put` does nothing.

Forbidden imports: socket, selectors, threading, weightcache.protocol directly (``state`` builds
the records), weightcache.daemon.transport,
weightcache.daemon.handlers, weightcache.daemon.loads, weightcache.daemon.ticker, weightcache.daemon.loop.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from .. import identity, notify
from ..checkpoint import Checkpoint
from ..config import Placement
from ..errors import WeightcacheError
from ..journal import event
from ..manifest import Manifest
from ..manifest import read_file
from ..memory.host import F_GET_SEALS, F_SEAL_GROW, F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_WRITE, SealedFile
from .state import Publication, Slot

log = logging.getLogger(__name__)


#: Seals every memfd the service stores carries (weightcache.memory.host): nothing can write, grow or shrink it.
REQUIRED_SEALS = F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE


def _check_sealed(fd: int, what: str) -> None:
    """Raises ValueError unless memfd ``fd`` carries :data:`REQUIRED_SEALS` (an entry some other process put in
    the store, or a writable one, is never served)."""
    try:
        seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError as e:
        raise ValueError(f"stored {what} is not a sealed memfd ({e.strerror})") from None
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise ValueError(f"stored {what} lacks the service's seals (has {seals:#x}, needs {REQUIRED_SEALS:#x})")


@dataclass(frozen=True, slots=True)
class Adopted:
    """A slab taken back from the store: its manifest, the backend's SealedSlab and its manifest file, and
    the dtype names it serves as its manifest file records them (``None`` from an older release)."""

    manifest: Manifest
    sealed: Any
    manifest_file: SealedFile
    #: ``gpu`` (``slab-<id>``), or ``host``: a host-tier copy (``host-<id>``).
    tier: str = "gpu"
    #: The dtype names it serves, as its manifest file records them (``None``: a file of an older release).
    dtypes_served: frozenset[str] | None = None


def stored_placements(stored: dict[str, list[int]], gpu: int) -> tuple[list[Placement], str | None]:
    """The placements on ``gpu`` recorded beside the stored slabs, and their backend (None when none).

    For a service whose configuration does not load: it serves what it kept
    (:class:`~weightcache.daemon.loop.Daemon` with ``config_error``). Manifest
    files without a placement (older releases), damaged, or of another backend
    than the first are skipped (their slabs stay in the store). Reads the files;
    closes nothing.
    """
    out, backend = [], None
    for name, fds in sorted(stored.items()):
        if not name.startswith("manifest-") or len(fds) != 1:
            continue
        try:
            fields = read_file(fds[0]).fields
            if fields.get("placement") is None or fields.get("publication") is not None:
                continue  # a publication is no configured placement: it is adopted beside its model's
            p = Placement.from_json(fields["placement"])
        except (WeightcacheError, ValueError, OSError) as e:
            log.warning("fd store manifest unreadable id=%s reason=%s", name.split("-", 1)[1], e)
            continue
        if p.gpu == gpu and backend in (None, fields.get("backend")):
            backend = fields.get("backend")
            out.append(p)
    return out, backend


class FdStore:
    """The service's side of systemd's fd store.

    Args:
        backend: the slab backend (``name``, ``adopt``).
        device (`dict`): the backend's ``device_info()`` (part of the cache key).
    """

    def __init__(self, backend: Any, device: dict[str, Any]) -> None:
        self.backend = backend
        self.device = device
        #: Store ids :meth:`adopt` left in systemd's store unclaimed (``drop_unknown=False``).
        self.left: set[str] = set()
        #: Store id -> the slab's entry kind this process put or adopted there (``slab`` or ``host``).
        self._kinds: dict[str, str] = {}

    @property
    def enabled(self) -> bool:
        """True under systemd (``$NOTIFY_SOCKET`` set)."""
        return bool(os.environ.get("NOTIFY_SOCKET"))

    def put(self, slot: Slot, sealed: Any, manifest_file: SealedFile, kind: str = "slab") -> None:
        """Stores a freshly sealed slab (``kind`` ``slab``; ``host``: a host-tier copy) and its manifest file
        (``FDSTORE=1``), replacing the slot's earlier entries; both stay open here too."""
        if not self.enabled:
            return
        sid = slot.store_id
        if sid in self._kinds:  # a tier move: the slot's earlier entries go first
            self.remove(sid)
        self._kinds[sid] = kind
        notify.notify(f"FDSTORE=1\nFDNAME={kind}-{sid}", [sealed.fd])
        notify.notify(f"FDSTORE=1\nFDNAME=manifest-{sid}", [manifest_file.fd])

    def put_host(self, slot: Slot, hosted: Any, manifest_file: SealedFile) -> None:
        """Stores the host tier's copy of a slab (``host-<id>``) and its manifest file, replacing the slab's
        entries: a restart takes it back into the host tier."""
        self.put(slot, hosted, manifest_file, "host")

    def remove(self, sid: str, kind: str | None = None) -> None:
        """Drops both entries of store id ``sid`` (``FDSTOREREMOVE=1``): the slab's (``kind``: ``slab`` or
        ``host``; by default what this process put or adopted there, else ``slab``) and the manifest's."""
        kind = kind or self._kinds.get(sid, "slab")
        self._kinds.pop(sid, None)
        for name in (kind, "manifest"):
            notify.notify(f"FDSTOREREMOVE=1\nFDNAME={name}-{sid}")

    def adopt(self, stored: dict[str, list[int]], slots: list[Slot], drop_unknown: bool = True,
              publication_slot: Any = None) -> dict[Slot, Adopted]:
        """Takes back the stored slabs that still match their slot; drops and closes everything else.

        Args:
            stored (`dict[str, list[int]]`): fds from ``$LISTEN_FDS`` by ``FDNAME``
                (entries not named ``slab-*``/``manifest-*`` are ignored).
            slots (`list[Slot]`): the configured slots.
            drop_unknown (`bool`): False keeps the entries no slot claims in
                systemd's store (this process closes its copies): a service
                whose config did not load must not lose them.
            publication_slot (`callable`, *optional*): ``(placement, publication) -> Slot | None``: a new slot
                for a publication whose manifest file records them, or None when its model is no longer
                configured here from that checkpoint. A publication's slot is not among ``slots``; it is
                adopted like any slab (its key checked against the checkpoint as it is now) and returned.

        Returns:
            `dict`: slot -> :class:`Adopted` for each adopted slab (its fds now owned by the caller).
        """
        by_id = {s.store_id: s for s in slots}
        ids = {n.split("-", 1)[1] for n in stored if n.startswith(("slab-", "manifest-", "host-"))}
        out: dict[Slot, Adopted] = {}
        for sid in sorted(ids):
            host_fds = stored.get(f"host-{sid}", [])
            tier = "host" if host_fds and not stored.get(f"slab-{sid}") else "gpu"
            slab_fds = stored.get(f"slab-{sid}", []) + host_fds
            man_fds = stored.get(f"manifest-{sid}", [])
            slot = by_id.get(sid)
            if slot is None and publication_slot is not None and len(man_fds) == 1:
                slot = self._publication(sid, man_fds[0], publication_slot)
            kept = None
            if slot is not None and len(slab_fds) == 1 and len(man_fds) == 1:
                try:
                    kept = self._match(slot, slab_fds[0], man_fds[0], tier)
                except (WeightcacheError, ValueError, KeyError, TypeError, OSError) as e:
                    log.warning("fd store slab dropped id=%s reason=%s", sid, e)
            elif slot is None and drop_unknown:
                log.info("fd store slab dropped id=%s reason=no-longer-configured", sid)
            for fd in [] if kept else man_fds + slab_fds:
                os.close(fd)
            if kept:
                out[slot] = kept
                self._kinds[sid] = "host" if kept.tier == "host" else "slab"
            elif slot is not None or drop_unknown:
                self.remove(sid, "host" if host_fds else "slab")
            else:
                self.left.add(sid)
        return out

    @staticmethod
    def _publication(sid: str, manifest_fd: int, publication_slot: Any) -> Slot | None:
        """The slot of the publication whose manifest file is ``manifest_fd`` (store id ``sid``), or None (not a
        publication, damaged, its model no longer configured here, or another store id)."""
        try:
            fields = read_file(manifest_fd).fields
            if fields.get("publication") is None:
                return None
            slot = publication_slot(Placement.from_json(fields["placement"]),
                                    Publication.from_json(fields["publication"]))
        except (WeightcacheError, ValueError, KeyError, TypeError, OSError) as e:
            log.warning("fd store publication unreadable id=%s reason=%s", sid, e)
            return None
        return slot if slot is not None and slot.store_id == sid else None

    def _match(self, slot: Slot, slab_fd: int, manifest_fd: int, tier: str = "gpu") -> Adopted | None:
        _check_sealed(manifest_fd, "manifest file")
        if self.backend.name == "host" or tier == "host":  # a cuda slab is a VMM handle, not a memfd
            _check_sealed(slab_fd, "slab")
        mf = read_file(manifest_fd)
        manifest = mf.manifest
        p = slot.placement
        # The key alone (headers and stat(), no validation, no planning): a match means
        # the slab was planned and filled from exactly this checkpoint and config.
        ck = Checkpoint(p.model.path, validate=False)
        if slot.publication is not None:  # the engine's key as recorded, the checkpoint and device as they are now
            current = identity.published_key(slot.publication.engine_key, ck, self.device)
        else:
            current = identity.cache_key(p, ck, self.device)
        diff = identity.diff_keys(current, manifest.key)
        if mf.backend != self.backend.name:
            diff.append("device.backend")
        if diff:
            log.info("fd store slab dropped model=%s tp_size=%d rank=%d reason=key-mismatch fields=%s",
                     p.model.name, p.tp_size, p.tp_rank, ",".join(diff[:8]))
            return None
        adopt = self.backend.adopt_host if tier == "host" else self.backend.adopt
        sealed = adopt(slab_fd, int(mf.fields["size_bytes"]))
        log.info("adopted slab from fd store model=%s tp_size=%d rank=%d size_bytes=%d tier=%s",
                 p.model.name, p.tp_size, p.tp_rank, sealed.size_bytes, tier,
                 extra=event("adopted", p.model.name, p.tp_rank, tp_size=p.tp_size, size_bytes=sealed.size_bytes,
                             tier=tier))
        return Adopted(manifest, sealed, SealedFile(manifest_fd, mf.size_bytes), tier, mf.dtypes_served)


#: In ``$RUNTIME_DIRECTORY`` (``/run/weightcache/N``, kept across restarts like the fd store, removed on stop):
#: the store ids of the READY slabs that had no lease, known or unknown, when the process stopped cleanly.
RELEASED_FILE = "released-at-stop.json"


def record_released(slots: list[Slot]) -> None:
    """Writes :data:`RELEASED_FILE` as the serving loop stops (before its connections close and end their
    leases): the next process may move those slabs at once. Nothing without ``$RUNTIME_DIRECTORY``."""
    where = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if not where:
        return
    from .tiers import unknown_leases

    ids = sorted(s.store_id for s in slots if s.sealed is not None and not s.leases and not unknown_leases(s))
    tmp = os.path.join(where, f".{RELEASED_FILE}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump({"released": ids}, f)
        os.replace(tmp, os.path.join(where, RELEASED_FILE))
    except OSError as e:
        log.warning("released slabs not recorded path=%s error=%s: after the restart they count as leased", where,
                    e.strerror)


def released_at_last_stop() -> set[str]:
    """Reads and removes :data:`RELEASED_FILE`: the store ids :func:`record_released` wrote, empty after a crash
    (no file) or outside systemd. Removed so that a crash after this start does not reuse it."""
    where = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if not where:
        return set()
    path = os.path.join(where, RELEASED_FILE)
    try:
        with open(path) as f:
            ids = json.load(f)["released"]
        os.unlink(path)
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    return {i for i in ids if isinstance(i, str)}
