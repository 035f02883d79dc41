"""The loader thread: runs the pipeline for one slot after another and posts what happened.

Owns the loader thread, its queue, the load timeout
(``service.load_timeout_s``) and the result records it posts (defined in
:mod:`weightcache.daemon.load_results`: ``Started``, ``Planned``, ``Progress``,
``Loaded``, ``Failed``...). The thread never writes the service's state: it
appends a result to a queue and writes one byte to the serving loop's wake-up
pipe; the serving loop calls :func:`~weightcache.daemon.load_results.apply`, so
only its thread moves a slot through the transition table.

``load_timeout_s`` holds whatever the read does: each load runs on a worker
thread of its own, and the loader thread waits for it at most until the
deadline. A load still running then (a read blocked on a hung NFS server, a
device that never answers) fails that model with ``cause=timeout`` and the
loader goes on with the next model; the stuck worker is abandoned (a daemon
thread): if its read ever returns, it aborts its partial slab (or closes the
sealed one) and posts nothing. While the read blocks, that worker keeps its
partial slab and its open file.

A load whose tensors are all placements of checkpoint byte ranges (any TP
layout, either naming, ModelOpt FP8; everything but a dtype cast) runs
without torch (:func:`weightcache.pipeline.fill`), so the first slab is
ready before the seconds ``import torch`` takes are spent. When a model
queued behind the current load may need torch (a dtype to cast to:
:func:`weightcache.pipeline.may_need_torch`), torch is imported on a
background thread (:func:`warm_torch`) while the current load reads. A
service whose models need no torch does not import it (``verify`` of a host
slab hashes its mapping, of a CUDA slab runs an NVRTC kernel).

The loader reads only a slot's ``placement`` (immutable) and the set of
slots a reload cancelled (:meth:`Loader.cancel`, under a lock): a cancelled
slot is skipped, or its load stops at the next progress report; whatever it
still posts for a DROPPED slot the serving loop passes to
:func:`~weightcache.daemon.load_results.discard`. It also writes the
slab's manifest file (:func:`weightcache.manifest.pack_file`, a sealed memfd):
a manifest over the limit fails the load (``manifest_too_large``), so no
slab is ever READY that an engine could not attach. With the plan it posts
which dtype names the slab serves (:func:`dtype_served`: the plan's
``dtypes_served``, worked out once from the headers it read), so that matching an
attach's dtype on the serving loop reads no header; the manifest file records
them too (``dtypes_served``). A
load that raises anything fails that model alone: a :class:`~weightcache.errors.WeightcacheError`
as itself, ``MemoryError`` as ``out_of_memory``, anything else as
``model_load_failed`` with ``cause=internal`` and a CRITICAL log with the traceback.

Forbidden imports: socket, selectors, weightcache.protocol directly (``state`` builds the
records), weightcache.fdpass,
weightcache.daemon.transport, weightcache.daemon.handlers, weightcache.daemon.ticker,
weightcache.daemon.fdstore, weightcache.daemon.loop.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from .. import identity, pipeline, quant
from ..checkpoint import Checkpoint
from ..errors import CheckpointCorrupt, ModelLoadFailed, OutOfMemory, WeightcacheError
from ..journal import event
from ..manifest import Manifest, pack_file
from ..reader import LoaderOptions
from ..memory.host import SealedFile
from ..spec import DTYPE_NAMES
from .state import Slot
from .load_results import Failed, Loaded, NeedRoom, Planned, Progress, Refused, Skipped, Started, close_abandoned

#: Owners whose symlinks on the way to a checkpoint directory the service follows: root and itself.
TRUSTED_LINK_OWNERS = frozenset({0, os.getuid()})

log = logging.getLogger(__name__)

#: Progress is posted at most this often (seconds): STATUS= shows it once a second.
PROGRESS_PERIOD_S = 0.05


class _NoRoom(Exception):
    def __init__(self, error: WeightcacheError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True, slots=True)
class LoadSettings:
    """What every load needs from the service.

    Attributes:
        backend: the slab backend (``allocate``).
        device (`dict`): the backend's ``device_info()`` (part of the cache key).
        timeout_s (`float`): ``service.load_timeout_s``.
        options (`LoaderOptions`): read threads and staging bytes.
        config_source (`str`): the config file, named in the timeout error.
        ask_room (`bool`): post a :class:`NeedRoom` before each allocation and wait for the serving loop's
            answer (the memory budget); False (in-process tests) allocates without asking.
        registry (`quant.Registry`): the quantization scheme families plans are made with.
        max_tensors (`int`, *optional*): ``service.max_tensors_per_checkpoint``; None: no cap.
        images (`weightcache.images.ImageStore`, *optional*): the image directory; a model with ``image = true``
            is read from its valid image there before the checkpoint's tensors are (None: no images).
        seeder (`weightcache.seeding.Seeder`, *optional*): peer seeding (issue 37); None: off.
    """

    backend: Any
    device: dict
    timeout_s: float
    options: LoaderOptions
    config_source: str
    ask_room: bool = False
    max_tensors: int | None = None
    registry: quant.Registry = quant.REGISTRY
    images: Any = None
    seeder: Any = None


def _seal(writable: Any, manifest_bytes: bytes, name: str) -> tuple[SealedFile, Any]:
    """The end of every fill: the manifest file (``manifest_bytes``, sealed memfd ``name``), then the slab sealed;
    returns ``(manifest_file, sealed)``. The manifest file is closed if the seal fails (the caller aborts the
    writable slab)."""
    manifest_file = SealedFile.create(manifest_bytes, name)
    try:
        return manifest_file, writable.seal()
    except BaseException:
        manifest_file.close()
        raise


class Loader:
    """The loader thread.

    Args:
        settings (`LoadSettings`): see there.
        wake_fd (`int`): the serving loop's wake-up pipe (non-blocking write end).
    """

    def __init__(self, settings: LoadSettings, wake_fd: int) -> None:
        self.settings = settings
        self._wake_fd = wake_fd
        self._jobs: queue.SimpleQueue[Slot | None] = queue.SimpleQueue()
        self._cancelled: set[Slot] = set()  # dropped by a reload: skipped, or stopped at a progress report
        self._results: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued: list[Slot] = []  # submitted, not yet taken: what the torch look-ahead reads
        self._thread = threading.Thread(target=self._run, name="weightcache-loader", daemon=True)
        #: Slots to plan without loading (:meth:`probe`), and the thread that plans them (started at the first).
        self._probes: queue.SimpleQueue[Slot | None] = queue.SimpleQueue()
        self._probe_thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts the thread."""
        self._thread.start()

    def submit(self, slot: Slot) -> None:
        """Queues a PENDING ``slot``."""
        with self._lock:
            self._queued.append(slot)
        self._jobs.put(slot)

    def cancel(self, slot: Slot) -> None:
        """Skips ``slot`` if still queued, or stops its load at the next progress report (a reload dropped it)."""
        with self._lock:
            self._cancelled.add(slot)
            if slot in self._queued:  # nor does the torch look-ahead count it
                self._queued.remove(slot)

    def _is_cancelled(self, slot: Slot) -> bool:
        with self._lock:
            return slot in self._cancelled

    def stop(self) -> None:
        """Asks the thread to end after the current load (it is a daemon thread: exit does not wait)."""
        self._jobs.put(None)
        self._probes.put(None)

    def probe(self, slot: Slot) -> None:
        """Queues a plan of ``slot`` that loads nothing, on a thread of its own (never behind a load): its
        :class:`Planned` (payload, dtypes served, slab size; no checkpoint identity) gives the slot the
        :attr:`Slot.first_slab_bytes` a load would, so that the room of a restricted model never loaded is held
        back from others' loads as for one that was (issue 38, P3). A plan that fails, or is over the model's
        ``max_slab_bytes``, posts nothing: that model's load will fail the same way, and it keeps no room."""
        with self._lock:
            if self._probe_thread is None:
                self._probe_thread = threading.Thread(target=self._run_probes, name="weightcache-size-probe",
                                                      daemon=True)
                self._probe_thread.start()
        self._probes.put(slot)

    def _run_probes(self) -> None:
        while True:
            slot = self._probes.get()
            if slot is None:
                return
            if slot.first_slab_bytes:  # planned by its own load meanwhile
                continue
            p, st = slot.placement, self.settings
            ck = None
            try:
                ck = Checkpoint(p.model.path, root=slot.realpath or None, trusted_link_owners=TRUSTED_LINK_OWNERS,
                                max_tensors=st.max_tensors)
                pl = pipeline.plan(p, st.device, checkpoint=ck, registry=st.registry)
            except (WeightcacheError, OSError, ValueError, KeyError, TypeError, RecursionError, MemoryError) as e:
                log.info("size probe failed model=%s tp_size=%d rank=%d error=%s: it keeps no room until a load "
                         "plans it", p.model.name, p.tp_size, p.tp_rank, getattr(e, "code", None) or repr(e)[:200])
                continue
            except Exception as e:  # noqa: BLE001 - a bug in planning: logged, the service goes on
                log.critical("size probe crashed model=%s tp_size=%d rank=%d error=%r\n%s", p.model.name, p.tp_size,
                             p.tp_rank, e, traceback.format_exc())
                continue
            finally:
                if ck is not None:
                    ck.close()
            if p.model.slab_over_cap(pl.slab_size_bytes, p.label) is not None:
                continue
            log.debug("size probe model=%s tp_size=%d rank=%d slab_bytes=%d", p.model.name, p.tp_size, p.tp_rank,
                      pl.slab_size_bytes)
            self._post(Planned(slot, pl.payload_bytes, dtype_served(pl), None, pl.slab_size_bytes))

    def results(self) -> list[Any]:
        """Every result posted since the last call, in order (serving loop only)."""
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def _post(self, result: Any) -> None:
        self._results.put(result)
        try:
            os.write(self._wake_fd, b"l")
        except (BlockingIOError, InterruptedError):
            pass  # the pipe is full: the loop is woken already

    def _run(self) -> None:
        while True:
            slot = self._jobs.get()
            if slot is None:
                return
            with self._lock:
                if slot in self._queued:
                    self._queued.remove(slot)
                skip = slot in self._cancelled
                if skip:
                    self._cancelled.discard(slot)
            if skip:
                if slot.hosted is not None:  # a promotion a reload cancelled: its discard frees the host copy
                    self._post(Skipped(slot))
                continue
            self._post(self._supervise(slot))
            with self._lock:
                self._cancelled.discard(slot)

    def _look_ahead(self) -> None:
        """Imports torch in the background when a model queued behind this load may need it."""
        with self._lock:
            later = [s.placement.model for s in self._queued]
        if later and "torch" not in sys.modules and not _warm_thread:
            threading.Thread(target=_warm_if_needed, args=(later,), name="weightcache-torch-lookahead",
                             daemon=True).start()

    def _supervise(self, slot: Slot) -> Loaded | Failed:
        """Runs one load on its own worker thread; past ``load_timeout_s`` fails it with ``cause=timeout``."""
        job = _Job()
        started = time.monotonic()
        self._post(Started(slot, started))

        def work() -> None:
            result = self._load(slot, started, job)
            with job.lock:
                if not job.abandoned:
                    job.result = result
                    job.done.set()
                    return
            close_abandoned(result)  # the loader gave up on it: nothing of it reaches the state

        # Planning and packing allocate a few objects per tensor and create no cycles; the cyclic
        # GC's full passes over a heap that grows by 150k records made a 150k-tensor load 2x slower.
        # Off while this load runs, on again when it ends or is abandoned (never left off by a stuck read).
        was = gc.isenabled()
        gc.disable()
        try:
            threading.Thread(target=work, name=f"weightcache-load-{slot.label}", daemon=True).start()
            # A little past the deadline: a load that notices the timeout itself (in progress()) reports it.
            job.done.wait(self.settings.timeout_s + 1.0)
        finally:
            if was:
                gc.enable()
        with job.lock:
            if job.result is not None:
                return job.result
            job.abandoned = True
        p = slot.placement
        log.error("load abandoned model=%s tp_size=%d rank=%d timeout_s=%g reason=read-did-not-return", p.model.name,
                  p.tp_size, p.tp_rank, self.settings.timeout_s,
                  extra=event("load_failed", p.model.name, p.tp_rank, error_code="model_load_failed", cause="timeout",
                              tp_size=p.tp_size))
        return Failed(slot, self._timeout(slot, "the read did not return"), logged=True)

    def _timeout(self, slot: Slot, what: str) -> ModelLoadFailed:
        p, st = slot.placement, self.settings
        return ModelLoadFailed(f"model {p.model.name}: load exceeded service.load_timeout_s = {st.timeout_s:g} s "
                               f"({what}); raise it in {st.config_source}, or fix the storage it reads from",
                               model=p.model.name, cause="timeout")

    def _room(self, slot: Slot, size_bytes: int, tier: str, started: float, job: "_Job") -> None:
        """Asks the serving loop for ``size_bytes`` of ``tier`` and waits for the answer (within the load's timeout).

        Raises:
            _NoRoom: refused (``insufficient_memory``); ModelLoadFailed (``cause=timeout``): no answer in time.
        """
        if not self.settings.ask_room:
            return
        if tier == "gpu":  # what the allocation will take: the backend rounds up to its granularity
            g = int(getattr(self.settings.backend, "granularity", 1) or 1)
            size_bytes = max(g, -(-size_bytes // g) * g)
        req = NeedRoom(slot, size_bytes, tier)
        with job.lock:
            if job.abandoned:
                raise self._timeout(slot, "planning did not return in time")
            self._post(req)
        if not req.wait(self.settings.timeout_s - (time.monotonic() - started)):
            raise self._timeout(slot, "waiting for room in the memory budget")
        if req.refusal is not None:
            raise _NoRoom(req.refusal)

    def _promote(self, slot: Slot, started: float, job: "_Job") -> Loaded:
        """Host tier -> GPU: room in the budget, the backend's copy, the digests (when copied) checked."""
        p, st = slot.placement, self.settings
        hosted, manifest, manifest_file = slot.hosted, slot.manifest, slot.manifest_file
        total = sum(t.size_bytes for t in manifest.tensors if t.alias_of is None)
        with job.lock:
            if not job.abandoned:
                self._post(Planned(slot, total))
        self._room(slot, hosted.size_bytes, "gpu", started, job)
        t0 = time.monotonic()
        checked: dict[str, list[str]] = {}

        def check_host_copy() -> None:  # while the copy runs: the host copy's bytes against the load's digests
            checked["bad"] = promoted_mismatches(manifest, hosted, None, st.options.threads)

        sealed = st.backend.promote(hosted, p.label, check_host_copy)
        t1 = time.monotonic()
        if sealed is not hosted:
            bad = checked.get("bad", []) + promoted_mismatches(manifest, None, sealed, st.options.threads)
            if bad:
                sealed.close()
                then = ("the publication is dropped" if slot.publication is not None else
                        f"the host copy is kept, `weightcache evict --to disk {p.model.name}` drops it")
                raise ModelLoadFailed(f"model {p.model.name}: {len(bad)} tensors differ from their digests after "
                                      f"the promotion from the host tier (first: {bad[0]}); {then}",
                                      model=p.model.name, cause="digest_mismatch", tensors=bad[:16])
        end = time.monotonic()
        return Loaded(slot, manifest, sealed, manifest_file, end - started,
                      {"room": t0 - started, "copy": t1 - t0, "digest": end - t1}, True, promoted_from=hosted)

    def _load(self, slot: Slot, started: float, job: "_Job") -> Loaded | Failed | Refused:
        p, st = slot.placement, self.settings
        writable = None
        last_post = [0.0]
        stages: dict[str, float] = {}
        tier = slot.target
        ck = None
        try:
            if slot.hosted is not None:
                return self._promote(slot, started, job)
            if slot.publication is not None:  # a publication's image (daemon.imaging): no plan, no checkpoint read
                return self._publication_image(slot, started, job)
            prepare = getattr(st.backend, "prepare_fill", None)
            if prepare is not None and tier != "host":  # pinned staging and GPU kernels, while the plan runs
                prepare(st.options.threads, st.options.buffer_bytes)
            # Containment by fd (weightcache.checkpoint): the directory the path resolved to when the
            # configuration was read, symlinks followed only when root or the service user owns them.
            ck = Checkpoint(p.model.path, root=slot.realpath or None, trusted_link_owners=TRUSTED_LINK_OWNERS,
                            max_tensors=self.settings.max_tensors)
            pl = pipeline.plan(p, st.device, checkpoint=ck, registry=st.registry)
            _check_size(slot, pl.slab_size_bytes)
            with job.lock:
                if job.abandoned:
                    raise self._timeout(slot, "planning did not return in time")
                self._post(Planned(slot, pl.payload_bytes, dtype_served(pl), pl.key.get("checkpoint"),
                                   pl.slab_size_bytes))
            self._look_ahead()  # after the plan: every slot the serving loop queued at start is queued by now
            self._room(slot, pl.slab_size_bytes, tier, started, job)
            # A valid image is read before the checkpoint's tensors (the plan read headers only): its header
            # checked here against the key the plan made from the files now, its bytes' digests after the read.
            image = None
            if st.images is not None and p.model.images_for(published=False):
                image = st.images.find(p, pl.key, pl.records, pl.slab_size_bytes)
            t_plan = time.monotonic()
            allocate = st.backend.allocate_host if tier == "host" else st.backend.allocate
            writable = allocate(pl.slab_size_bytes, p.label)
            t_alloc = time.monotonic()
            stages.update(plan=t_plan - started, allocate=t_alloc - t_plan)

            def progress(done: int, total: int) -> None:
                now = time.monotonic()
                if self._is_cancelled(slot):
                    raise ModelLoadFailed(f"model {p.model.name}: load cancelled, a reload removed it",
                                          model=p.model.name, cause="cancelled")
                if now - started > st.timeout_s or job.abandoned:
                    raise self._timeout(slot, f"{done}/{total} bytes read")
                if now - last_post[0] >= PROGRESS_PERIOD_S:
                    last_post[0] = now
                    with job.lock:
                        if not job.abandoned:
                            self._post(Progress(slot, done))

            filled, source, seeded = None, "checkpoint", None
            if image is not None:
                done, done_lock = [0], threading.Lock()

                def advance(n: int) -> None:  # the reader's threads: bytes of each piece
                    with done_lock:
                        done[0] += n
                        now_done = done[0]
                    progress(min(now_done, pl.payload_bytes), pl.payload_bytes)

                got = st.images.fill(image, p, pl.key, writable, st.options, advance)
                if got is None:  # a digest differed: the image is moved aside; a fresh slab from the checkpoint
                    writable.abort()
                    writable = None
                    writable = allocate(pl.slab_size_bytes, p.label)
                else:
                    manifest, read_s, digest_s = got
                    filled, source = pipeline.Filled(manifest, True, read_s, digest_s, pl.payload_bytes), "image"
            if filled is None and st.seeder is not None:
                # Issue 37: no image, so the peers (when configured) before the checkpoint; a seeded slab was
                # checked against this plan's key, records and the peer's digests (weightcache.seeding).
                seeded = st.seeder.fill(pl, writable, st.options.threads, progress)
                if seeded is not None:
                    filled, source = pipeline.Filled(seeded.manifest, True, seeded.read_s, seeded.digest_s,
                                                     seeded.bytes_read), "peer"
            if filled is None:
                filled = pipeline.fill(pl, writable, progress, st.options)
            t_filled = time.monotonic()
            manifest = filled.manifest
            # Here, not at the first attach: a manifest no engine could read fails the load, by name.
            raw = pack_file(manifest, backend=st.backend.name, size_bytes=writable.size_bytes,
                            checkpoint_path=p.model.path, placement=p.to_json(),
                            dtypes_served=sorted(pl.dtypes_served))
            manifest_file, sealed = _seal(writable, raw, f"weightcache-manifest:{p.label}")
            writable = None
            end = time.monotonic()
            stages.update(read=filled.read_s, digest=filled.digest_s, seal=end - t_filled)
            return Loaded(slot, manifest, sealed, manifest_file, end - started, stages, filled.torch_free, tier,
                          source=source, seeded_from=seeded.peer if seeded is not None else "")
        except _NoRoom as e:
            return Refused(slot, e.error)
        except WeightcacheError as e:
            return self._fail(slot, e, writable)
        except MemoryError as e:
            return self._fail(slot, OutOfMemory(f"model {p.model.name}: out of host memory: {e}",
                                                model=p.model.name), writable)
        except Exception as e:  # noqa: BLE001 - a bug or an unexpected library error: fail this model only
            log.critical("load crashed model=%s tp_size=%d rank=%d error=%r\n%s", p.model.name, p.tp_size, p.tp_rank, e,
                         traceback.format_exc(),
                         extra=event("load_failed", p.model.name, p.tp_rank, error_code="model_load_failed",
                                     tp_size=p.tp_size))
            return self._fail(slot, ModelLoadFailed(f"model {p.model.name}: internal error while loading: {e!r}",
                                                    model=p.model.name, cause="internal"), writable, logged=True)
        finally:
            if ck is not None:  # its directory fds; the error kept in the slot must not hold them
                ck.close()

    def _publication_image(self, slot: Slot, started: float, job: "_Job") -> Loaded | Failed | Refused:
        """A publication made again from its image: the checkpoint identity computed from the files now and the
        rest of the key (the engine key as published, this device) checked against the image's, room, the
        parallel read, the digests, the seal. No image that passes: ``model_load_failed`` (``cause =
        image_rejected``): the serving loop drops the slot, and the next engine loads and publishes."""
        p, st, pub = slot.placement, self.settings, slot.publication
        writable = None
        try:
            ck = Checkpoint(p.model.path, validate=False)
            try:
                key = identity.published_key(pub.engine_key, ck, st.device)
            finally:
                ck.close()
            image = st.images.find(p, key, None, None, pub) if st.images is not None else None
            if image is None:
                raise ModelLoadFailed(f"model {p.model.name}: the image of publication {slot.label} is missing or "
                                      f"refused; the next engine loads and publishes it", model=p.model.name,
                                      cause="image_rejected")
            size = image.header.data_bytes
            with job.lock:
                if not job.abandoned:
                    self._post(Planned(slot, sum(r.size_bytes for r in image.header.manifest.tensors
                                                 if r.alias_of is None), None, key.get("checkpoint"), size))
            self._room(slot, size, "gpu", started, job)
            t0 = time.monotonic()
            writable = st.backend.allocate(size, slot.label)
            done, done_lock = [0], threading.Lock()

            def advance(n: int) -> None:  # the reader's threads: bytes of each piece
                with done_lock:
                    done[0] += n
                    now_done = done[0]
                if time.monotonic() - started > st.timeout_s or job.abandoned:
                    raise self._timeout(slot, f"{now_done} bytes of the image read")
                with job.lock:
                    if not job.abandoned:
                        self._post(Progress(slot, now_done))

            got = st.images.fill(image, p, key, writable, st.options, advance)
            if got is None:
                raise ModelLoadFailed(f"model {p.model.name}: the image of publication {slot.label} was refused "
                                      f"(digest); the next engine loads and publishes it", model=p.model.name,
                                      cause="image_rejected")
            manifest, read_s, digest_s = got
            raw = pack_file(manifest, backend=st.backend.name, size_bytes=writable.size_bytes,
                            checkpoint_path=p.model.path, placement=p.to_json(), publication=pub.to_json())
            manifest_file, sealed = _seal(writable, raw, f"weightcache:manifest:{slot.label}")
            writable = None
            end = time.monotonic()
            return Loaded(slot, manifest, sealed, manifest_file, end - started,
                          {"allocate": t0 - started, "read": read_s, "digest": digest_s}, True, source="image")
        except _NoRoom as e:
            return Refused(slot, e.error)
        except WeightcacheError as e:
            return self._fail(slot, e, writable)

    def _fail(self, slot: Slot, e: WeightcacheError, writable: Any, logged: bool = False) -> Failed:
        if writable is not None:
            try:
                writable.abort()
            except Exception as ae:  # noqa: BLE001 - best effort; the original error matters
                log.warning("abort of partial slab failed model=%s error=%r", slot.placement.model.name, ae)
        return Failed(slot, e, logged)


def dtype_served(pl: pipeline.Plan) -> dict[str, bool]:
    """For every dtype name (:data:`weightcache.spec.DTYPE_NAMES`), whether an engine asking for it gets this
    plan's slab (:attr:`weightcache.pipeline.Plan.dtypes_served`, the rule of
    :func:`weightcache.identity.served_dtypes`), as :attr:`Slot.dtype_served` holds it. Reads no file."""
    return {r: r in pl.dtypes_served for r in DTYPE_NAMES}


def promoted_mismatches(manifest: Manifest, hosted: Any, sealed: Any, threads: int) -> list[str]:
    """Names of the tensors of a promotion whose bytes differ from the digests recorded at load.

    With ``hosted`` (a host-tier slab with ``buffer``): the tensors with host digests (``xxh3_128``,
    ``xxh3c``), hashed on ``threads`` threads without torch (run during the copy to the GPU). With
    ``sealed`` (the GPU slab after the copy): the tensors with GPU digests (``sum64``: torch-free CUDA loads
    and the torch pipeline), by the NVRTC kernel (:meth:`CudaSealedSlab.digests`) where it loads, else torch.
    """
    stored = [r for r in manifest.tensors if r.alias_of is None]
    if sealed is not None:
        gpu = [r for r in stored if r.digest.startswith("sum64:")]
        if not gpu:
            return []
        from ..memory import kernels

        if hasattr(sealed, "digests") and kernels.available():  # the NVRTC kernel: no torch, no host copy
            now = sealed.digests([(r.name, r.offset_bytes, r.size_bytes) for r in gpu])
            return [r.name for r in gpu if now[r.name] != r.digest]
        from .. import digest

        t = sealed.tensor
        return [r.name for r in gpu if not digest.matches(t[r.offset_bytes : r.offset_bytes + r.size_bytes], r.digest)]
    from concurrent.futures import ThreadPoolExecutor

    from .. import digest

    host = [r for r in stored if not r.digest.startswith("sum64:")]
    buf = hosted.buffer

    def bad(r: Any) -> str | None:
        ok = digest.matches_buffer(buf[r.offset_bytes : r.offset_bytes + r.size_bytes], r.digest)
        return None if ok else r.name

    try:
        with ThreadPoolExecutor(max_workers=max(1, threads)) as ex:
            return [n for n in ex.map(bad, host) if n is not None]
    finally:
        buf.release()


class _Job:
    """One load between the loader thread and its worker: the result, or the loader's giving up."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.result: Loaded | Failed | None = None
        self.abandoned = False


def _warm_if_needed(later: list[Any]) -> None:
    """Starts :func:`warm_torch` when a model queued behind the current load may need torch."""
    if any(pipeline.may_need_torch(m) for m in later):
        warm_torch()


_warm_lock = threading.Lock()
_warm_thread: list[threading.Thread] = []


def warm_torch() -> threading.Thread | None:
    """Imports torch on a background daemon thread, once per process; returns that thread (None: already imported).

    Whatever needs torch later (``import torch`` anywhere) waits on the same
    import instead of starting its own; nothing waits for it otherwise.
    """
    if "torch" in sys.modules and not _warm_thread:
        return None
    with _warm_lock:
        if not _warm_thread:
            def run() -> None:
                t0 = time.monotonic()
                try:
                    import torch  # noqa: F401 - the import is the point
                except Exception as e:  # noqa: BLE001 - whoever needs torch will meet the error itself
                    log.warning("background import of torch failed error=%r", e)
                    return
                log.debug("torch imported in the background duration_ms=%.0f", (time.monotonic() - t0) * 1e3)

            th = threading.Thread(target=run, name="weightcache-torch-import", daemon=True)
            th.start()
            _warm_thread.append(th)
        return _warm_thread[0]


def _check_size(slot: Slot, slab_bytes: int) -> None:
    """Refuses a plan larger than the slot's first (:attr:`Slot.first_slab_bytes`): the operator sized the
    model when it configured it; a checkpoint rewritten larger since (a sparse file of holes is as large as its
    length says) waits for a reload, which takes the new size.

    The operator's own bound comes first: ``[models.X] max_slab_bytes`` (:meth:`ModelConfig.slab_over_cap`).

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): ``details.cause`` ``grew``, ``size_bytes``, ``first_size_bytes``;
            or ``details.cause`` ``over_max_slab_bytes`` with ``limit`` (``models.X.max_slab_bytes``), ``value``
            and ``actual`` (bytes).
    """
    first, p = slot.first_slab_bytes, slot.placement
    over = p.model.slab_over_cap(slab_bytes, p.label)
    if over is not None:
        raise CheckpointCorrupt(f"{over}; the checkpoint at {p.model.path} is not loaded", file=p.model.path,
                                cause="over_max_slab_bytes", limit=f"models.{p.model.name}.max_slab_bytes",
                                value=p.model.max_slab_bytes, actual=slab_bytes, model=p.model.name)
    if first and slab_bytes > first:
        raise CheckpointCorrupt(
            f"model {p.model.name} ({p.label}) now plans a slab of {slab_bytes} bytes, more than the {first} of its "
            f"first load: the checkpoint at {p.model.path} grew since; systemctl reload weightcache takes the new "
            f"size (the operator decides how much of the budget a model may take)", file=p.model.path,
            cause="grew", size_bytes=slab_bytes, first_size_bytes=first)
