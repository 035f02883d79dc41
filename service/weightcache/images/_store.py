"""The image directory: names, access rules, finding and checking an image, reading it into a slab,
moving a bad one aside, listing, and keeping the directory within its byte limit.

Access (the checkpoint's containment rules, docs/reliability.md): the directory is the service user's,
mode 0700 (made so when the service creates it; refused, and images off, when it is a symlink, someone
else's, or open to group or others); an image is opened with ``O_NOFOLLOW | O_NONBLOCK`` and refused
(``access``) unless it is a regular file of the service user with no group or other bits. Files are
written 0600.

Validity (:meth:`ImageStore.find`, then :meth:`ImageStore.fill`), in order, each with its reason:
``access``; ``format`` (not an image, truncated: a write that did not finish never has the final name,
see :mod:`._writer`); ``identity`` (the checkpoint identity the service computes from the files now
differs from the key's); ``key`` (another field of the key differs: engine, pipeline version, dtype,
naming, ranks, backend, compute capability; the GPU's UUID is not compared: the bytes depend on the
compute capability, and an image outlives the card); ``layout`` (the plan's tensor records differ from
the image's); ``digest`` (the manifest differs from its digest, or a tensor's bytes read differ from
its recorded digest). A rejected image is renamed ``<name>.rejected`` (one kept per slab), counted and
logged (``image_rejected``), and the slab is made the ordinary way.

Forbidden imports: torch, socket, selectors, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import digest, identity
from ..errors import CheckpointCorrupt, CheckpointNotFound, CheckpointUnreadable
from ..hashes import blake2b_hex
from ..journal import event
from ..manifest import Manifest, TensorRecord
from ..reader import LoaderOptions, ReadTask, read_direct
from ._format import (
    REJECTED_SUFFIX,
    SUFFIX,
    TENSOR_NAME,
    ImageFormatError,
    ImageHeader,
    read_header,
)
from ._stats import ImageStats

log = logging.getLogger(__package__)

#: ``[service] image_dir`` by default: a subdirectory of the unit's ``CacheDirectory=weightcache``.
DEFAULT_IMAGE_DIR = "/var/cache/weightcache/images"
#: Prefix of a write in progress: ``.<image name>.tmp-<pid>-<random>`` (never loaded; removed at start
#: when its writer's pid is gone).
TMP_MARK = ".tmp-"
_TMP_RE = re.compile(r"^\..*\.tmp-(\d+)-[0-9a-f]+$")


@dataclass(frozen=True)
class Image:
    """An image found for a slab whose header passed :meth:`ImageStore.find`'s checks.

    Attributes:
        path (`str`): the image file.
        header (`ImageHeader`): what it says about itself.
        size_bytes (`int`): the file's length.
    """

    path: str
    header: ImageHeader
    size_bytes: int


@dataclass(frozen=True)
class ImageEntry:
    """One file of the image directory as :meth:`ImageStore.entries` lists it.

    Attributes:
        name (`str`), path (`str`): the file.
        size_bytes (`int`): its length.
        written_at (`float`): Unix seconds of its rename into place (``mtime``).
        last_used (`float`): Unix seconds of its last read into a slab (``atime``, set explicitly).
        model (`str`), tp_size, tp_rank (`int`): the slab it holds ("" and -1 when its header is damaged).
        key (`dict`): a summary of its key (architecture, dtype, naming, quant_scheme, pipeline_version,
            backend, compute_capability, checkpoint files); empty when damaged.
        rejected (`bool`): a ``.rejected`` file kept for the operator to look at.
        publication (`dict | None`): a published slab's engine, engine version, engine key hash and scope.
    """

    name: str
    path: str
    size_bytes: int
    written_at: float
    last_used: float
    model: str = ""
    tp_size: int = -1
    tp_rank: int = -1
    key: dict | None = None
    rejected: bool = False
    publication: dict | None = None

    def to_json(self) -> dict[str, Any]:
        """As ``weightcache images --json`` prints it."""
        return {"name": self.name, "path": self.path, "size_bytes": self.size_bytes, "written_at": self.written_at,
                "last_used": self.last_used, "model": self.model, "tp_size": self.tp_size, "tp_rank": self.tp_rank,
                "key": self.key or {}, "rejected": self.rejected, "publication": self.publication}


class Rejected(Exception):
    """An image not served: ``reason`` (see the module docstring) and what differed."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def image_name(placement: Any, backend: str, publication: Any = None) -> str:
    """The file name of the image of ``placement`` (a :class:`weightcache.config.Placement`) on ``backend``.

    ``<model>.tp<N>.rank<R>.<16 hex digits>.safetensors``: the hash covers the checkpoint path, the
    dtype, naming, kernel, revision and the backend, so two configurations of one model never share a
    file, while the instances of several GPUs (one per GPU) with the same rank do. A publication
    (``publication``: its ``engine_key_blake2b``, ``shared``, ``publisher_uid``) adds
    ``.pub-<16 hex digits of the engine key>`` (and ``-uid<N>`` when private to one uid).
    """
    m = placement.model
    h = blake2b_hex(f"{m.path}\0{m.dtype}\0{m.naming}\0{m.kernel}\0{m.revision}\0{backend}".encode(), digest_size=8)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", m.name)[:80]
    pub = ""
    if publication is not None:
        pub = f".pub-{publication.engine_key_blake2b[:16]}" + ("" if publication.shared
                                                                 else f"-uid{publication.publisher_uid}")
    return f"{safe}.tp{placement.tp_size}.rank{placement.tp_rank}.{h}{pub}{SUFFIX}"


def comparable_key(key: dict[str, Any]) -> dict[str, Any]:
    """``key`` without ``checkpoint`` and without ``device.gpu_uuid`` (what an image's key must equal)."""
    out = {k: v for k, v in key.items() if k != "checkpoint"}
    if isinstance(out.get("device"), dict):
        out["device"] = {k: v for k, v in out["device"].items() if k != "gpu_uuid"}
    return out


def _layout(records: Any) -> list[tuple]:
    return [(r.name, r.dtype, tuple(r.shape), tuple(r.stride), r.offset_bytes, r.size_bytes, r.alias_of)
            for r in records]


class ImageStore:
    """The image directory of one service.

    Args:
        directory (`str`): ``[service] image_dir``.
        limit_bytes (`int`): ``[service] image_max_bytes``; 0: no limit of its own (the disk's).
        backend (`str`): ``host`` or ``cuda`` (part of each image's name).
        stats (`ImageStats`, *optional*): the counters to feed.
        clock (`callable`, *optional*): Unix seconds (``time.time``).
    """

    def __init__(self, directory: str, limit_bytes: int, backend: str, stats: ImageStats | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.directory = directory
        self.limit_bytes = limit_bytes
        self.backend = backend
        self.stats = stats or ImageStats()
        self.clock = clock
        #: Why images are off (the directory was refused), or None.
        self.disabled: str | None = None

    # --- the directory -----------------------------------------------------------------

    def prepare(self) -> bool:
        """Creates the directory (0700) if missing, checks it, removes writes that did not finish.

        Returns False (and logs why: :attr:`disabled`) when the directory cannot be used: a symlink,
        not a directory, someone else's, open to group or others and not ours to fix, or not creatable.
        Never raises for the directory's state: the service runs without images then.
        """
        try:
            os.makedirs(os.path.dirname(self.directory) or "/", exist_ok=True)
            try:
                os.mkdir(self.directory, 0o700)
            except FileExistsError:
                pass
            st = os.lstat(self.directory)
            why = None
            if stat.S_ISLNK(st.st_mode):
                why = "is a symlink"
            elif not stat.S_ISDIR(st.st_mode):
                why = "is not a directory"
            elif st.st_uid != os.getuid():
                why = f"belongs to uid {st.st_uid}, not the service user (uid {os.getuid()})"
            elif st.st_mode & 0o077:
                os.chmod(self.directory, 0o700, follow_symlinks=False)
        except OSError as e:
            why = f"cannot be used: {e.strerror or e}"
        if why is not None:
            self.disabled = f"image directory {self.directory} {why}; images are off"
            log.warning("images off dir=%s reason=%s", self.directory, why)
            return False
        self._remove_stale()
        return True

    def _remove_stale(self) -> None:
        """Removes ``.<name>.tmp-<pid>-<hex>`` files whose writer process is gone (a crash or ``kill -9``)."""
        for name in os.listdir(self.directory):
            m = _TMP_RE.match(name)
            if m is None:
                continue
            pid = int(m.group(1))
            if pid != os.getpid() and _alive(pid):
                continue  # another instance (another GPU) is writing it
            try:
                os.unlink(os.path.join(self.directory, name))
                log.info("image write left unfinished removed file=%s pid=%d", name, pid)
            except FileNotFoundError:
                pass

    def path_for(self, placement: Any, publication: Any = None) -> str:
        """The image file of ``placement`` (and ``publication``, for a published slab) in this directory."""
        return os.path.join(self.directory, image_name(placement, self.backend, publication))

    # --- reading -------------------------------------------------------------------------

    def find(self, placement: Any, key: dict[str, Any], records: Any, slab_size_bytes: int,
             publication: Any = None) -> Image | None:
        """The image of ``placement`` if one is there and its header fits what is asked; None otherwise.

        Reads the header only. An image that does not fit (``access``, ``format``, ``identity``, ``key``,
        ``layout``; ``digest`` of the manifest) is moved aside (:meth:`reject`) and None returned.

        Args:
            placement (`Placement`): the slab asked for.
            key (`dict`): the cache key the plan made from the checkpoint as it is now.
            records (`list[TensorRecord] | None`): the plan's records (offsets, shapes; no digests); None for a
                publication (no plan: its records are the engine's).
            slab_size_bytes (`int | None`): the plan's slab size (None with ``records``).
            publication (`Publication`, *optional*): the published slab's publication (names the file).
        """
        if self.disabled is not None:
            return None
        path = self.path_for(placement, publication)
        try:
            fd = _open_image(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                self.reject(placement, path, Rejected("access", "the image is a symlink"))
            else:
                log.warning("image unreadable model=%s file=%s error=%s", placement.model.name, path, e)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Rejected("access", "the image is not a regular file")
            if st.st_uid != os.getuid():
                raise Rejected("access", f"the image belongs to uid {st.st_uid}, not the service user")
            if st.st_mode & 0o077:
                raise Rejected("access", f"the image's mode is {stat.S_IMODE(st.st_mode):04o}, not 0600")
            try:
                header = read_header(fd, st.st_size)
            except ImageFormatError as e:
                raise Rejected(e.reason, str(e)) from None
            self.check(header, key, records, slab_size_bytes)
            return Image(path, header, st.st_size)
        except Rejected as r:
            self.reject(placement, path, r)
            return None
        finally:
            os.close(fd)

    def check(self, header: ImageHeader, key: dict[str, Any], records: Any, slab_size_bytes: int) -> None:
        """Raises :class:`Rejected` (``identity``, ``key``, ``layout``) when ``header`` does not fit what is asked
        (``records`` None: a publication, whose records are only checked to lie inside the data)."""
        if header.key.get("checkpoint") != key.get("checkpoint"):
            diff = identity.diff_keys(key.get("checkpoint"), header.key.get("checkpoint"), "checkpoint.")
            raise Rejected("identity", f"the checkpoint changed since the image was written ({', '.join(diff[:4])})")
        want, have = comparable_key(key), comparable_key(header.key)
        if want != have or header.backend != self.backend:
            diff = identity.diff_keys(want, have) or ["backend"]
            raise Rejected("key", f"the image was made for another key ({', '.join(diff[:4])})")
        if records is None:  # a publication: its records are the engine's; they must lie inside the data
            if any(r.offset_bytes + r.size_bytes > header.data_bytes for r in header.manifest.tensors):
                raise Rejected("layout", "a tensor record lies outside the image's data")
            return
        if header.data_bytes != slab_size_bytes or _layout(header.manifest.tensors) != _layout(records):
            raise Rejected("layout", "the image's tensor records differ from the plan's")

    def fill(self, image: Image, placement: Any, key: dict[str, Any], writable: Any, opts: LoaderOptions,
             progress: Callable[[int], None] | None = None) -> tuple[Manifest, float, float] | None:
        """Reads ``image``'s bytes into ``writable`` with the parallel reader (no torch), then checks every
        tensor's digest where the bytes are (:func:`weightcache.digest.slab_digests`).

        Returns:
            ``(manifest, read_s, digest_s)``: the image's records under ``key`` (the plan's; the GPU's UUID
            is this one's); None when a digest differs (the image is moved aside: the caller makes the
            slab the ordinary way, in a fresh allocation).

        Raises:
            The reader's errors (``checkpoint_corrupt`` when the file ends early, and the like).
        """
        h = image.header
        t0 = time.monotonic()
        try:
            read_direct([ReadTask(image.path, h.data_offset, h.data_bytes, 0, TENSOR_NAME)], writable, opts, progress,
                        with_digests=False)
        except (CheckpointCorrupt, CheckpointNotFound, CheckpointUnreadable, OSError) as e:
            # The image's own fault (ended early, removed, replaced by a non-regular file): the checkpoint then.
            # A cancel or timeout raised by ``progress`` is the load's and goes up as it is.
            self.reject(placement, image.path, Rejected("format", f"read failed: {getattr(e, 'message', e)}"))
            return None
        t1 = time.monotonic()
        stored = [r for r in h.manifest.tensors if r.alias_of is None]
        now = digest.slab_digests(writable, [(r.name, r.offset_bytes, r.size_bytes) for r in stored], opts.threads)
        t2 = time.monotonic()
        bad = [r.name for r in stored if now[r.name] != r.digest]
        if bad:
            self.reject(placement, image.path, Rejected("digest", f"{len(bad)} tensors differ from their digests "
                                                                  f"(first: {bad[0]})"))
            return None
        try:
            os.utime(image.path, (self.clock(), os.stat(image.path).st_mtime), follow_symlinks=False)  # last use
        except OSError:
            pass
        records = tuple(TensorRecord(r.name, r.dtype, tuple(r.shape), tuple(r.stride), r.offset_bytes, r.size_bytes,
                                     r.digest, dict(r.layout), r.alias_of) for r in h.manifest.tensors)
        m = Manifest(placement.model.name, placement.tp_size, placement.tp_rank, key, h.data_bytes, records)
        self.stats.read(h.data_bytes, t2 - t0)
        log.info("image read model=%s tp_size=%d rank=%d size_bytes=%d duration_ms=%.0f read_gbps=%.2f file=%s",
                 placement.model.name, placement.tp_size, placement.tp_rank, h.data_bytes, (t2 - t0) * 1e3,
                 h.data_bytes / max(t1 - t0, 1e-9) / 1e9, image.path,
                 extra=event("image_read", placement.model.name, placement.tp_rank, size_bytes=h.data_bytes,
                             duration_ms=(t2 - t0) * 1e3, tp_size=placement.tp_size, file=image.path))
        return m, t1 - t0, t2 - t1

    def reject(self, placement: Any, path: str, r: Rejected) -> None:
        """Moves the image at ``path`` aside (``<path>.rejected``, replacing an older one), counts and logs it."""
        aside = path + REJECTED_SUFFIX
        try:
            os.rename(path, aside)
        except OSError as e:
            aside = f"(not moved: {e.strerror or e})"
        self.stats.rejected(r.reason)
        p = placement
        log.warning("image rejected model=%s tp_size=%d rank=%d reason=%s detail=%s file=%s moved_to=%s",
                    p.model.name, p.tp_size, p.tp_rank, r.reason, r, path, aside,
                    extra=event("image_rejected", p.model.name, p.tp_rank, tp_size=p.tp_size, reason=r.reason,
                                file=path))

    # --- listing and room ----------------------------------------------------------------

    def entries(self, headers: bool = True) -> list[ImageEntry]:
        """Every image (and kept ``.rejected`` file) of the directory, oldest use first.

        Args:
            headers (`bool`): read each file's header for the model and key summary.
        """
        out = []
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        for name in names:
            rejected = name.endswith(SUFFIX + REJECTED_SUFFIX)
            if name.startswith(".") or not (name.endswith(SUFFIX) or rejected):
                continue
            path = os.path.join(self.directory, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            e = ImageEntry(name, path, st.st_size, st.st_mtime, st.st_atime, rejected=rejected)
            if headers:
                e = _with_header(e)
            out.append(e)
        out.sort(key=lambda e: e.last_used)
        return out

    def publications(self) -> list[tuple[str, ImageHeader]]:
        """``(path, header)`` of every publication image whose header reads (the service's own files only:
        regular, ``O_NOFOLLOW``, the service user's); what a start offers back as publications."""
        out = []
        for e in self.entries(headers=False):
            if e.rejected or ".pub-" not in e.name:
                continue
            try:
                fd = _open_image(e.path)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                    continue
                h = read_header(fd, st.st_size)
            except (ImageFormatError, OSError):
                continue
            finally:
                os.close(fd)
            if h.publication is not None:
                out.append((e.path, h))
        return out

    def used_bytes(self) -> int:
        """Bytes of every file of the directory (images, rejected ones, writes under way)."""
        total = 0
        for name in os.listdir(self.directory):
            try:
                st = os.lstat(os.path.join(self.directory, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
        return total

    def make_room(self, size_bytes: int, keep: str, priority_of: Callable[[str], int | None]) -> bool:
        """Removes images until ``size_bytes`` more fit within :attr:`limit_bytes`; True when they fit.

        Order: ``.rejected`` files, then images of models no longer configured (``priority_of`` gives
        None), then the lowest ``priority``, least recently used first. ``keep`` (the image being
        replaced) is not removed here: the rename replaces it.
        """
        if not self.limit_bytes:
            return True
        if size_bytes > self.limit_bytes:
            return False
        used = self.used_bytes()
        if used + size_bytes <= self.limit_bytes:
            return True
        victims = []
        for e in self.entries():
            if e.path == keep:
                used -= e.size_bytes  # the rename frees it
                continue
            pr = priority_of(e.model) if not e.rejected else None
            victims.append((0 if e.rejected else 1 if pr is None else 2, pr or 0, e.last_used, e))
        victims.sort(key=lambda v: v[:3])
        for _, _, _, e in victims:
            if used + size_bytes <= self.limit_bytes:
                break
            try:
                os.unlink(e.path)
            except FileNotFoundError:
                pass
            used -= e.size_bytes
            self.stats.removed(e.size_bytes)
            log.info("image removed for room model=%s tp_size=%d rank=%d size_bytes=%d file=%s limit_bytes=%d",
                     e.model, e.tp_size, e.tp_rank, e.size_bytes, e.path, self.limit_bytes)
        return used + size_bytes <= self.limit_bytes


def _open_image(path: str) -> int:
    """Opens the image at ``path`` read-only, not following a symlink, without touching its ``atime``.

    ``atime`` is the image's last use (set explicitly once it is read into a slab, see :meth:`ImageStore.load`);
    a read of its header alone (``weightcache images``, the publications offered at start) must not move it,
    which a ``relatime`` mount does on the first read after a change and once a day. ``O_NOATIME`` needs the
    file's owner (or ``CAP_FOWNER``): anyone else opens it without (``EPERM``) and may move it.

    Returns:
        `int`: the file descriptor (``O_CLOEXEC``).

    Raises:
        OSError: as ``os.open`` (``ELOOP`` for a symlink, ``ENOENT``...).
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_NOATIME)
    except PermissionError:
        return os.open(path, flags)


def _with_header(e: ImageEntry) -> ImageEntry:
    """``e`` with its model, ranks and key summary from the file's header (unchanged when unreadable)."""
    try:
        fd = _open_image(e.path)
    except OSError:
        return e
    try:
        h = read_header(fd, os.fstat(fd).st_size)
    except (ImageFormatError, OSError):
        return e
    finally:
        os.close(fd)
    k = h.key
    dev = k.get("device") or {}
    summary = {"architecture": k.get("architecture"), "dtype": k.get("dtype"), "naming": k.get("naming"),
               "quant_scheme": k.get("quant_scheme"), "pipeline_version": k.get("pipeline_version"),
               "backend": dev.get("backend"), "compute_capability": dev.get("compute_capability"),
               "files": len((k.get("checkpoint") or {}).get("files", {})),
               "path": (h.placement.get("model") or {}).get("path")}
    pub = None
    if h.publication is not None:
        ek = h.publication.get("engine_key") or {}
        pub = {"engine": ek.get("engine"), "engine_version": ek.get("engine_version"),
               "engine_key_blake2b": h.publication.get("engine_key_blake2b"), "shared": h.publication.get("shared")}
    return ImageEntry(e.name, e.path, e.size_bytes, e.written_at, e.last_used, h.manifest.model, h.manifest.tp_size,
                      h.manifest.tp_rank, summary, e.rejected, pub)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

