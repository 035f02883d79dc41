"""The service's side of processed images (issue 36): the store and its writer, and what the serving loop
asks of them.

Owns :class:`Imaging`: made at start from ``[service] image_dir`` (else ``$CACHE_DIRECTORY/images``),
``image_max_bytes`` and ``image_write_bytes_per_s`` (:func:`from_config`); :meth:`Imaging.written_after_load`
schedules the write of a slab the loader made from the checkpoint, for a model with ``image = true``;
:meth:`Imaging.written_after_publish` that of a publication (unless ``image = false``);
:meth:`Imaging.publication_slots` the slots a start makes for the publication images it finds. The loader reads images
itself (``LoadSettings.images``, :meth:`weightcache.images.ImageStore.find` and ``fill``), before the
checkpoint's tensors, whenever a slab is wanted and no fd-store entry holds it (start-up preload, an
attach of an ``on_disk`` slab, ``preload``). A slab that came from an image or from a publication is not
written again; one taken back from the fd store (:meth:`Imaging.written_after_adopt`) is written only when
the directory holds no valid image of it (the last stop abandoned its write, or it was never made).
:meth:`Imaging.finish_writes` at stop lets the write under way end within ``image_stop_write_s``.

The bytes of a host slab are read by the writer through a duplicate of its memfd (an eviction meanwhile
frees nothing under it); a CUDA slab is first copied to a host memfd on the writer's thread
(``backend.demote``; host memory of the slab's size while it is written), held meanwhile in the
OffLoop's read count (:attr:`Imaging.reader_hold`), so that an eviction's FreeSlab waits for the copy.

Forbidden imports: socket, selectors, torch, weightcache.daemon.transport, weightcache.daemon.loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from ..config import Config, Placement
from ..images import ImageStats, ImageStore, ImageWriter, WriteJob
from .state import Publication, Slot

log = logging.getLogger(__name__)


class Imaging:
    """The image store, its writer and the configuration's model priorities.

    Args:
        store (`ImageStore`): the directory (prepared).
        writer (`ImageWriter`): its writer thread.
        backend: the slab backend (``name``; ``demote`` for CUDA slabs).
        config (`Config`): for each model's ``priority`` (room) and ``image``.
    """

    def __init__(self, store: ImageStore, writer: ImageWriter, backend: Any, config: Config) -> None:
        self.store, self.writer, self.backend = store, writer, backend
        #: ``(hold, release)`` for a GPU slab the writer copies: ``hold(sealed)`` on the serving loop when the
        #: write is scheduled, ``release(sealed)`` on the writer's thread once it is done (the serving loop
        #: wires them to its OffLoop, so that an eviction meanwhile waits for the copy). None: host slabs only.
        self.reader_hold: tuple[Callable[[Any], None], Callable[[Any], None]] | None = None
        self.configure(config)

    def configure(self, config: Config) -> None:
        """Takes a (re)loaded configuration's byte limit, rate cap and priorities (the directory stays)."""
        svc = config.service
        self.store.limit_bytes = svc.image_max_bytes
        self.writer.rate_bytes_per_s = svc.image_write_bytes_per_s
        self.stop_write_s = svc.image_stop_write_s
        self._priorities = {name: m.priority for name, m in config.models.items()}

    def priority_of(self, model: str) -> int | None:
        """The configured priority of ``model``; None when no model of that name is configured."""
        return self._priorities.get(model)

    def written_after_load(self, slot: Slot, source: str, promoted: bool) -> bool:
        """Schedules the image write of ``slot`` (just READY or HOSTED) when it was made from the checkpoint
        and its model has ``image = true``; True when scheduled. Serving loop only; returns at once."""
        p = slot.placement
        if source != "checkpoint" or promoted or not p.model.images_for(False) or self.store.disabled is not None:
            return False
        slab = slot.sealed if slot.sealed is not None else slot.hosted
        if slab is None or slot.manifest is None:
            return False
        source, drop = self._source(slab, p.label)
        return self._schedule(WriteJob(p, slot.manifest, dict(slot.manifest.key), source, self.priority_of,
                                       drop_source=drop), slab)

    def written_after_publish(self, slot: Slot) -> bool:
        """Schedules the image write of a publication just committed (READY), unless its model has
        ``image = false``; True when scheduled. Serving loop only."""
        if not slot.placement.model.images_for(True) or self.store.disabled is not None or slot.sealed is None:
            return False
        source, drop = self._source(slot.sealed, slot.label)
        return self._schedule(WriteJob(slot.placement, slot.manifest, dict(slot.manifest.key), source,
                                       self.priority_of, slot.publication, drop_source=drop), slot.sealed)

    def written_after_adopt(self, slot: Slot) -> bool:
        """Schedules the image write of ``slot`` (READY or HOSTED, taken back from the fd store at start) when its
        model has images on (``image = true``; a publication unless ``image = false``), to be done only if the
        directory holds no valid image of it (the check runs on the writer's thread); True when scheduled.
        Serving loop only."""
        pub = slot.publication is not None
        slab = slot.sealed if slot.sealed is not None else slot.hosted
        if (slot.source != "fd_store" or not slot.placement.model.images_for(pub) or self.store.disabled is not None
                or slab is None or slot.manifest is None):
            return False
        source, drop = self._source(slab, slot.label)
        return self._schedule(WriteJob(slot.placement, slot.manifest, dict(slot.manifest.key), source,
                                       self.priority_of, slot.publication, unless_valid=True, drop_source=drop),
                              slab)

    def finish_writes(self) -> bool:
        """At stop (the serving loop has stopped serving): the write under way ends without the rate cap if it can
        within ``[service] image_stop_write_s``, else is abandoned; queued ones are dropped
        (:meth:`weightcache.images.ImageWriter.finish`). True when no write is left under way."""
        return self.writer.finish(self.stop_write_s)

    def _schedule(self, job: WriteJob, slab: Any) -> bool:
        """Queues ``job``; a GPU slab is held for the writer's read (:attr:`reader_hold`) until it is done."""
        gpu = self.backend.name != "host" and hasattr(slab, "digests")
        if gpu and self.reader_hold is not None:
            hold, release = self.reader_hold
            job.on_done = lambda: release(slab)
            if not self.writer.schedule(job):
                return False
            hold(slab)  # on the serving loop, before the writer's thread can reach on_done's post
            return True
        return self.writer.schedule(job)

    def publication_slots(self, slots: list[Slot], make_slot: Callable[[Any, Publication], Slot | None],
                          gpu: int) -> list[Slot]:
        """New PENDING slots for the publication images in the directory that no slot holds yet (the fd store
        did not keep them), of models configured here from the same checkpoint path, at a (tp_size, tp_rank)
        the configuration places on this GPU. Reads headers only; the loader checks and reads each
        (:meth:`weightcache.daemon.loads.Loader._publication_image`)."""
        held = {s.store_id for s in slots}
        placed = {(s.placement.model.name, s.placement.tp_size, s.placement.tp_rank) for s in slots
                  if s.publication is None and s.placement.gpu == gpu}
        out = []
        for path, h in self.store.publications():
            try:
                placement = Placement.from_json(h.placement)
                pub = Publication.from_json(h.publication)
            except ValueError as e:
                log.warning("publication image ignored file=%s error=%s", path, e)
                continue
            m = placement.model
            if (m.name, placement.tp_size, placement.tp_rank) not in placed or not m.images_for(True):
                continue
            slot = make_slot(placement, pub)
            if slot is None or slot.store_id in held or not slot.placement.model.images_for(True):
                continue
            if self.store.path_for(slot.placement, pub) != path:
                continue  # written for another configuration of the model (path, dtype, naming...)
            held.add(slot.store_id)
            out.append(slot)
            log.info("publication image found model=%s tp_size=%d rank=%d slab=%s file=%s", m.name,
                     placement.tp_size, placement.tp_rank, slot.label, path)
        return out

    def _source(self, slab: Any, label: str) -> tuple[Callable[[], tuple[int, Callable[[], None]]],
                                                       Callable[[], None] | None]:
        """``(open_source, drop_source)`` of a :class:`WriteJob` of ``slab``."""
        fd = getattr(slab, "fd", -1)
        if self.backend.name == "host" or not hasattr(slab, "digests"):
            dup = [os.dup(fd)]  # now, on the serving loop: the slab may be freed before the writer runs

            def close() -> None:  # once: by the write that read it, or for a job that never opened it
                if dup:
                    os.close(dup.pop())

            def host() -> tuple[int, Callable[[], None]]:
                return dup[0], close

            return host, close

        def cuda() -> tuple[int, Callable[[], None]]:  # on the writer's thread: a host copy of the GPU slab
            hosted = self.backend.demote(slab, f"image:{label}")
            return hosted.fd, hosted.close

        return cuda, None


def from_config(config: Config, backend: Any, stats: ImageStats | None = None) -> Imaging | None:
    """The service's :class:`Imaging`, or None when no model on this service has ``image = true`` or the
    directory cannot be used (logged by :meth:`ImageStore.prepare`)."""
    if not any(m.image is not False for m in config.models.values()):  # unset: publications get images
        return None
    svc = config.service
    directory = svc.image_directory()
    if directory is None:  # run by hand: no CacheDirectory= and no image_dir
        if any(m.image for m in config.models.values()):
            log.warning("images off: a model has image = true but [service] image_dir is unset and no "
                        "CACHE_DIRECTORY is given (the unit's CacheDirectory=); set image_dir")
        return None
    store = ImageStore(directory, svc.image_max_bytes, backend.name, stats)
    if not store.prepare():
        return None
    log.info("images on dir=%s limit_bytes=%d write_bytes_per_s=%d", directory, svc.image_max_bytes,
             svc.image_write_bytes_per_s)
    return Imaging(store, ImageWriter(store, svc.image_write_bytes_per_s), backend, config)
