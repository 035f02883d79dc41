"""systemd's file descriptor store: put, remove and adopt slabs across restarts.

Owns the names (``FDNAME=slab-<id>`` and ``FDNAME=manifest-<id>``, ``<id>``
being :attr:`~weightcache.daemon.state.Slot.store_id`) and the record kept
beside each slab: a sealed memfd holding one UTF-8 JSON object (format
:data:`RECORD_FORMAT`: backend, slab ``size_bytes``, checkpoint path and the
*packed* manifest's header, :meth:`~weightcache.manifest.Manifest.to_wire`),
a NUL byte, then the packed manifest's payload; the JSON also holds the slot's
``placement`` (the model's config table, ``tp_size``, ``tp_rank``, ``gpu``: see
:func:`placement_to_json`), so that a service whose config no longer loads can
serve the slab as it was configured (:func:`stored_placements`). At start a stored slab is
adopted only when its record's cache key equals the key computed now from the
config and the checkpoint's headers (no tensor is read); every other entry is
dropped with ``FDSTOREREMOVE=1``. A record of another format (an older
release) is dropped the same way: the slab is loaded again.

Outside systemd (no ``$NOTIFY_SOCKET``) :meth:`FdStore.put` does nothing.

Forbidden imports: socket, selectors, threading, weightcache.protocol, weightcache.daemon.transport,
weightcache.daemon.handlers, weightcache.daemon.loads, weightcache.daemon.ticker, weightcache.daemon.loop.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from .. import notify, pipeline
from ..checkpoint import Checkpoint
from ..config import Layout, ModelConfig, Placement
from ..errors import WeightcacheError
from ..journal import event
from ..manifest import Manifest
from ..memory.host import sealed_memfd
from .state import Slot

log = logging.getLogger(__name__)

#: ``format`` of the record beside each stored slab.
RECORD_FORMAT = "weightcache-fdstore-2"
#: A stored record larger than this is not read (a 150k-tensor manifest is about 20 MB).
MAX_RECORD_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Record:
    """What the fd store keeps beside one slab.

    Attributes:
        backend (`str`): ``host`` or ``cuda``.
        size_bytes (`int`): the slab mapping's size.
        checkpoint_path (`str`): the checkpoint directory it was loaded from.
        manifest (`Manifest`): the slab's manifest (packed).
        wire (`tuple[dict, bytes]`): the packed manifest's header and payload as
            stored (what an attach sends), when decoded from the store.
        placement (`dict | None`): :func:`placement_to_json` of the slot (None
            in records of releases before it was kept).
    """

    backend: str
    size_bytes: int
    checkpoint_path: str
    manifest: Manifest
    wire: tuple[dict, bytes] | None = None
    placement: dict | None = None

    def encode(self) -> bytes:
        """The record's bytes: JSON, NUL, packed-manifest payload."""
        header, payload = self.manifest.to_wire()
        obj = {"format": RECORD_FORMAT, "backend": self.backend, "size_bytes": self.size_bytes,
               "checkpoint_path": self.checkpoint_path, "manifest": header}
        if self.placement is not None:
            obj["placement"] = self.placement
        return b"".join((json.dumps(obj, allow_nan=False, separators=(",", ":")).encode(), b"\x00", payload))

    @classmethod
    def decode(cls, raw: bytes) -> "Record":
        """Parses :meth:`encode` output.

        Raises:
            ValueError: not a record of :data:`RECORD_FORMAT`, or a damaged one.
        """
        nul = raw.find(b"\x00")
        if nul < 0:
            raise ValueError(f"stored manifest is not a {RECORD_FORMAT} record (no NUL separator)")
        obj = json.loads(raw[:nul])
        if not isinstance(obj, dict) or obj.get("format") != RECORD_FORMAT:
            got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"stored manifest has format {got!r}, expected {RECORD_FORMAT!r}")
        try:
            header, payload = obj["manifest"], raw[nul + 1:]
            manifest = Manifest.from_wire(header, payload)
            return cls(str(obj["backend"]), int(obj["size_bytes"]), str(obj["checkpoint_path"]), manifest,
                       (header, payload), obj.get("placement"))
        except (KeyError, TypeError) as e:
            raise ValueError(f"stored manifest record is damaged: {e!r}") from None


def placement_to_json(p: Placement) -> dict[str, Any]:
    """The slot's placement as the record keeps it: the model's fields (layouts as ``[tp, [gpus]]``), rank, GPU."""
    m = p.model
    model = {"name": m.name, "path": m.path, "dtype": m.dtype, "naming": m.naming, "kernel": m.kernel,
             "revision": m.revision, "allow_users": list(m.allow_users), "allow_groups": list(m.allow_groups),
             "layouts": [[lay.tp, list(lay.gpus)] for lay in m.layouts], "source": m.source}
    return {"model": model, "tp_size": p.tp_size, "tp_rank": p.tp_rank, "gpu": p.gpu}


def placement_from_json(d: dict[str, Any]) -> Placement:
    """Reverses :func:`placement_to_json`.

    Raises:
        ValueError: a field is missing or of the wrong type.
    """
    try:
        m = dict(d["model"])
        layouts = tuple(Layout(int(tp), tuple(int(g) for g in gpus)) for tp, gpus in m.pop("layouts"))
        model = ModelConfig(**{**m, "allow_users": tuple(m["allow_users"]), "allow_groups": tuple(m["allow_groups"]),
                               "layouts": layouts})
        return Placement(model, int(d["tp_size"]), int(d["tp_rank"]), int(d["gpu"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"stored placement is damaged: {e!r}") from None


def stored_placements(stored: dict[str, list[int]], gpu: int) -> tuple[list[Placement], str | None]:
    """The placements on ``gpu`` recorded beside the stored slabs, and their backend (None when none).

    For a service whose configuration does not load: it serves what it kept
    (:class:`~weightcache.daemon.loop.Daemon` with ``config_error``). Records
    without a placement, damaged or of another backend than the first are skipped
    (their slabs stay in the store). Reads the records; closes nothing.
    """
    out, backend = [], None
    for name, fds in sorted(stored.items()):
        if not name.startswith("manifest-") or len(fds) != 1:
            continue
        try:
            rec = Record.decode(_read_fd(fds[0]))
            if rec.placement is None:
                continue
            p = placement_from_json(rec.placement)
        except (ValueError, OSError) as e:
            log.warning("fd store record unreadable id=%s reason=%s", name.split("-", 1)[1], e)
            continue
        if p.gpu == gpu and backend in (None, rec.backend):
            backend = rec.backend
            out.append(p)
    return out, backend


def _read_fd(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    if size > MAX_RECORD_BYTES:
        raise ValueError(f"stored manifest of {size} bytes exceeds {MAX_RECORD_BYTES}")
    return os.pread(fd, size, 0)


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

    @property
    def enabled(self) -> bool:
        """True under systemd (``$NOTIFY_SOCKET`` set)."""
        return bool(os.environ.get("NOTIFY_SOCKET"))

    def put(self, slot: Slot, sealed: Any, manifest: Manifest) -> None:
        """Stores a freshly sealed slab and its record (``FDSTORE=1``)."""
        if not self.enabled:
            return
        sid = slot.store_id
        rec = Record(self.backend.name, sealed.size_bytes, slot.placement.model.path, manifest,
                     placement=placement_to_json(slot.placement))
        mfd = sealed_memfd(rec.encode(), f"weightcache-manifest-{sid}")
        try:
            notify.notify(f"FDSTORE=1\nFDNAME=slab-{sid}", [sealed.fd])
            notify.notify(f"FDSTORE=1\nFDNAME=manifest-{sid}", [mfd])
        finally:
            os.close(mfd)

    def remove(self, sid: str) -> None:
        """Drops both entries of store id ``sid`` (``FDSTOREREMOVE=1``)."""
        for kind in ("slab", "manifest"):
            notify.notify(f"FDSTOREREMOVE=1\nFDNAME={kind}-{sid}")

    def adopt(self, stored: dict[str, list[int]], slots: list[Slot],
              drop_unknown: bool = True) -> dict[Slot, tuple[Record, Any]]:
        """Takes back the stored slabs that still match their slot; drops and closes everything else.

        Args:
            stored (`dict[str, list[int]]`): fds from ``$LISTEN_FDS`` by ``FDNAME``
                (entries not named ``slab-*``/``manifest-*`` are ignored).
            slots (`list[Slot]`): the configured slots.
            drop_unknown (`bool`): False keeps the entries no slot claims in
                systemd's store (this process closes its copies): a service
                whose config did not load must not lose them.

        Returns:
            `dict`: slot -> (its :class:`Record`, the backend's SealedSlab) for each adopted slab.
        """
        by_id = {s.store_id: s for s in slots}
        ids = {n.split("-", 1)[1] for n in stored if n.startswith(("slab-", "manifest-"))}
        out: dict[Slot, tuple[Record, Any]] = {}
        for sid in sorted(ids):
            slab_fds = stored.get(f"slab-{sid}", [])
            man_fds = stored.get(f"manifest-{sid}", [])
            slot = by_id.get(sid)
            kept = None
            if slot is not None and len(slab_fds) == 1 and len(man_fds) == 1:
                try:
                    kept = self._match(slot, slab_fds[0], man_fds[0])
                except (WeightcacheError, ValueError, OSError) as e:
                    log.warning("fd store slab dropped id=%s reason=%s", sid, e)
            elif slot is None and drop_unknown:
                log.info("fd store slab dropped id=%s reason=no-longer-configured", sid)
            for fd in man_fds + ([] if kept else slab_fds):
                os.close(fd)
            if kept:
                out[slot] = kept
            elif slot is not None or drop_unknown:
                self.remove(sid)
            else:
                self.left.add(sid)
        return out

    def _match(self, slot: Slot, slab_fd: int, manifest_fd: int) -> tuple[Record, Any] | None:
        rec = Record.decode(_read_fd(manifest_fd))
        p = slot.placement
        # The key alone (headers and stat(), no validation, no planning): a match means
        # the slab was planned and filled from exactly this checkpoint and config.
        ck = Checkpoint(p.model.path, validate=False)
        current = pipeline.cache_key(p.model, p.tp_size, p.tp_rank, ck, self.device)
        diff = pipeline.diff_keys(current, rec.manifest.key)
        if rec.backend != self.backend.name:
            diff.append("device.backend")
        if diff:
            log.info("fd store slab dropped model=%s rank=%d reason=key-mismatch fields=%s",
                     p.model.name, p.tp_rank, ",".join(diff[:8]))
            return None
        sealed = self.backend.adopt(slab_fd, rec.size_bytes)
        log.info("adopted slab from fd store model=%s tp_size=%d rank=%d size_bytes=%d",
                 p.model.name, p.tp_size, p.tp_rank, sealed.size_bytes,
                 extra=event("adopted", p.model.name, p.tp_rank))
        return rec, sealed
