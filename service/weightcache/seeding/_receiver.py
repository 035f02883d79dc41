"""The receiver side: before a slab is read from the checkpoint, ask the peers for it.

:func:`fetch` runs on the loader's worker thread with the load's own plan (made from this node's headers:
the key, every tensor's record, the slab size) and the writable slab: a host memfd mapping (the host
backend; a CUDA service's host-tier load), READ as ``DRAM``, or a CUDA service's ``CudaWritableSlab``, READ
as ``VRAM`` straight into its device memory (:func:`target_of`). For each peer in
order: connect, authenticate, ask for (model, tp_size, tp_rank); check the offered key against the plan's
(:func:`weightcache.seeding._keys.key_differences`: another checkpoint is refused by its portable identity)
and the offered manifest's records against the plan's; READ the bytes with NIXL straight into the slab's
mapping (no Python buffer in between); check every tensor's digest and the manifest digest; say ``done``
and wait for the source's ``ack``. Only then is the slab the peer's: the manifest kept is the plan's records
with the peer's (checked) digests and **this node's key**, so engines here check it against their own
``stat()``. Any failure (no peer, unreachable, refused, timeout, disconnect, digest mismatch, wrong
checkpoint) zeroes what was written (``memset``, ``cuMemsetD8`` on the GPU) and tries the next peer; after the
last one the caller reads the checkpoint itself. Each failure is counted and logged with its reason.

Digests are checked where the bytes land (:func:`check_digests`): in GPU memory by the ``sum64`` kernel (no
host copy); in host memory by ``xxh3_128``/``xxh3c`` (xxhash) or ``sum64`` (numpy: a GPU slab or its host-tier
copy read into a CUDA service's host tier). An offer a GPU slab cannot check there (xxh3 digests: a host-tier
slab a CUDA peer loaded with ``preload = "host"``) is refused before the READ, reason ``digest_kind``: a host
copy of the whole slab to hash it would cost as much as the transfer, and the checkpoint is the fallback.

Forbidden imports: torch, weightcache.daemon, nixl (through :mod:`._agent` only).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import logging
import select
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..digest import buffer_digests, sum64_buffer, xxh3c_buffer
from ..errors import WeightcacheError
from ..journal import event
from ..manifest import Manifest, TensorRecord, unpack_file
from . import _samples
from ._agent import MEM_TYPES, TransferError, buffer_address
from ._channel import Channel, ChannelError, parse_address
from ._keys import key_differences, record_differences
from ._secret import Secret
from ._settings import SeedSettings, SeedStats
from ._source import manifest_digest

log = logging.getLogger(__name__)


class Refused(Exception):
    """One peer's offer was not taken; ``reason`` is one of :data:`~._settings.FALLBACK_REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        #: The READ had started: the slab holds some of the peer's bytes (zeroed before the next try).
        self.written = False


#: Digest families a receiver checks, by where the bytes land (:func:`check_digests`).
CHECKABLE = {"DRAM": ("xxh3_128", "xxh3c", "sum64"), "VRAM": ("sum64",)}


@dataclass
class Target:
    """Where a writable slab's bytes are, for NIXL: ``mem`` (``DRAM``/``VRAM``), ``dev`` (GPU index), the
    first byte's ``address``, ``keep`` (a numpy view of a host mapping, dropped after the READ) and
    ``current`` (``() -> context manager``: the GPU's context for a ``VRAM`` slab)."""

    mem: str
    dev: int
    address: int
    keep: Any = None
    current: Callable[[], Any] = contextlib.nullcontext


def target_of(writable: Any) -> Target | None:
    """The NIXL memory kind of a writable slab, chosen by what it is: a host mapping (``buffer``): ``DRAM``;
    a CUDA VMM slab (``ptr``, ``gpu``, ``current``, ``digests``): ``VRAM`` on its GPU; None for anything else
    (no peer is asked)."""
    buf = getattr(writable, "buffer", None)
    if buf is not None:
        address, keep = buffer_address(buf)
        return Target("DRAM", 0, address, keep)
    if all(hasattr(writable, a) for a in ("ptr", "gpu", "current", "digests", "zero")):
        return Target("VRAM", int(writable.gpu), int(writable.ptr), None, writable.current)
    return None


def digest_kind_refusal(mem: str, digests: list[str]) -> str:
    """Why digests ``digests`` (``algo:hex``) cannot be checked in ``mem`` memory; "" when they can."""
    kinds = sorted({d.split(":", 1)[0] for d in digests} - set(CHECKABLE.get(mem, ())))
    if not kinds:
        return ""
    where = "GPU memory (the sum64 kernel)" if mem == "VRAM" else "host memory"
    return (f"the peer's digests are {', '.join(kinds)}, which this node cannot check in {where}; "
            f"it checks {', '.join(CHECKABLE.get(mem, ()))} there")


def check_digests(writable: Any, mem: str, stored: list, threads: int) -> list[str]:
    """Names of the ``stored`` records (:class:`~weightcache.manifest.TensorRecord`) whose bytes in
    ``writable`` differ from their digest, computed where the bytes are: on the GPU (``sum64`` kernel,
    ``writable.digests``) for ``VRAM``; on the host mapping for ``DRAM`` (``xxh3_128`` on ``threads``
    threads, ``xxh3c``, ``sum64`` by numpy).

    Raises:
        ValueError: a digest family :data:`CHECKABLE` does not list for ``mem`` (checked before the READ).
    """
    bad = digest_kind_refusal(mem, [t.digest for t in stored])
    if bad:
        raise ValueError(bad)
    if mem == "VRAM":
        got = writable.digests([(t.name, t.offset_bytes, t.size_bytes) for t in stored]) if stored else {}
        return [t.name for t in stored if got[t.name] != t.digest]
    buf = writable.buffer  # the slab's own view (not released here)
    xxh = [t for t in stored if t.digest.startswith("xxh3_128:")]
    got = buffer_digests(buf, [(t.name, t.offset_bytes, t.size_bytes) for t in xxh], threads)
    rest = [t for t in stored if t.name not in got]

    def one(t: Any) -> tuple[str, str]:
        view = buf[t.offset_bytes:t.offset_bytes + t.size_bytes]
        try:
            return t.name, sum64_buffer(view) if t.digest.startswith("sum64:") else xxh3c_buffer(view)
        finally:
            view.release()

    if rest:
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(rest)))) as ex:
            got.update(ex.map(one, rest))
    return [t.name for t in stored if got[t.name] != t.digest]


@dataclass
class Seeded:
    """A slab filled from a peer.

    Attributes:
        manifest (`Manifest`): the plan's records with the peer's checked digests, and this node's key.
        peer (`str`): ``host:port`` it came from.
        bytes_read (`int`): bytes READ. read_s (`float`): seconds of the READ. digest_s (`float`): of the check.
    """

    manifest: Manifest
    peer: str
    bytes_read: int
    read_s: float
    digest_s: float


def fetch(settings: SeedSettings, secret: Secret, agent: Callable[[], Any], stats: SeedStats, plan: Any,
          writable: Any, threads: int = 4, progress: Callable[[int, int], None] | None = None) -> Seeded | None:
    """Fills ``writable`` from the first peer that holds the plan's slab; None when none did (reasons logged).

    Args:
        settings, secret, agent, stats: the service's seeding (``agent() -> Agent``).
        plan (`weightcache.pipeline.Plan`): this load's plan (key, records, slab size, rank).
        writable (`HostWritableSlab | CudaWritableSlab`): the slab being filled (:func:`target_of`).
        threads (`int`): digest threads.
        progress (`callable`, *optional*): the loader's ``progress(done_bytes, total_bytes)``; what it raises
            (a :class:`~weightcache.errors.WeightcacheError`: the load was cancelled or timed out) ends the
            seeding and is raised here, what was written zeroed.
    """
    r = plan.rank
    label = (r.model.name, r.tp_size, r.tp_rank)
    peers = settings.all_peers()
    reasons = []
    if not peers:
        reasons.append(("-", "no_peer"))
    try:  # what tells checkpoints with equal headers apart: hub blob names, else our bytes at random places
        blobs = _samples.hub_blobs(plan.checkpoint)
        chosen = _samples.choose(plan.checkpoint, settings.samples)
    except (WeightcacheError, OSError, ValueError) as e:
        log.warning("seeding: model=%s: cannot read samples of the checkpoint (%s); not asking peers",
                    r.model.name, e)
        return None
    own = _Samples(plan.checkpoint, chosen, blobs)
    for peer in peers:
        t0 = time.monotonic()
        try:
            got = _from_peer(settings, secret, agent, plan, writable, peer, threads, own, progress)
        except WeightcacheError:  # the loader's progress: cancelled by a reload, or past load_timeout_s
            _zero(writable, plan.slab_size_bytes)
            raise
        except Refused as e:
            if e.written:
                _zero(writable, plan.slab_size_bytes)
            reasons.append((peer, e.reason))
            stats.count("received", (*label, "fallback", e.reason))
            log.warning("seeding: peer=%s did not seed model=%s tp_size=%d rank=%d reason=%s: %s", peer, *label,
                        e.reason, e)
            continue
        except Exception as e:
            _zero(writable, plan.slab_size_bytes)
            reasons.append((peer, "internal"))
            stats.count("received", (*label, "fallback", "internal"))
            log.critical("seeding: fetching model=%s from peer=%s failed error=%r", r.model.name, peer, e,
                         exc_info=True)
            continue
        dt = time.monotonic() - t0
        stats.count("received", (*label, "seeded", ""))
        stats.count("received_bytes", r.model.name, got.bytes_read)
        stats.count("received_seconds", r.model.name, got.read_s)
        log.info("seeding: seeded model=%s tp_size=%d rank=%d from peer=%s size_bytes=%d duration_ms=%.0f "
                 "read_gbps=%.2f digest_ms=%.0f", *label, peer, got.bytes_read, dt * 1e3,
                 got.bytes_read / max(got.read_s, 1e-9) / 1e9, got.digest_s * 1e3,
                 extra=event("seeded", r.model.name, r.tp_rank, size_bytes=got.bytes_read, duration_ms=dt * 1e3,
                             tp_size=r.tp_size, peer=peer))
        return got
    summary = ", ".join(f"{p}: {why}" for p, why in reasons)
    log.warning("seeding: model=%s tp_size=%d rank=%d not seeded by any peer (%s); reading the checkpoint",
                *label, summary,
                extra=event("seed_fallback", r.model.name, r.tp_rank, tp_size=r.tp_size,
                            reason=reasons[-1][1], reasons=summary))
    return None


def _alive(sock: socket.socket) -> Callable[[], bool]:
    def alive() -> bool:
        try:
            ready, _, _ = select.select([sock], [], [], 0)
            return not ready or sock.recv(1, socket.MSG_PEEK) != b""
        except OSError:
            return False
    return alive


def _from_peer(settings: SeedSettings, secret: Secret, agent: Callable[[], Any], plan: Any, writable: Any,
               peer: str, threads: int, samples: _Samples,
               progress: Callable[[int, int], None] | None = None) -> Seeded:
    r = plan.rank
    deadline = time.monotonic() + settings.timeout_s
    dirty = [False]
    try:
        host, port = parse_address(peer)
    except ValueError as e:
        raise Refused("unreachable", str(e)) from None
    try:
        sock = socket.create_connection((host, port), timeout=min(10.0, settings.timeout_s))
    except OSError as e:
        raise Refused("unreachable", f"cannot connect: {e}") from None
    try:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        ch = Channel(sock, secret, server=False)
        try:
            ch.open()
            ch.send("request", {"model": r.model.name, "tp_size": r.tp_size, "tp_rank": r.tp_rank,
                                "samples": samples.chosen, "blobs": samples.blobs})
            reply = ch.recv("reply")
        except ChannelError as e:
            raise Refused(e.reason, str(e)) from None
        if not reply.get("ok"):
            reason = str(reply.get("reason", "not_held"))
            raise Refused(reason if reason in ("not_held", "not_allowed", "busy") else "not_held",
                          f"the peer answered {reason}")
        got = _take(settings, agent, plan, writable, reply, deadline, _alive(sock), threads, peer, samples,
                    progress, dirty)
        try:
            ch.send("done", {"ok": True})
            ch.recv("ack")
        except ChannelError as e:
            raise Refused("disconnected" if e.reason in ("timeout", "disconnected") else e.reason,
                          f"the peer did not confirm the transfer: {e}") from None
        return got
    except Refused as e:
        e.written = dirty[0]
        if e.reason in ("digest_mismatch", "digest_kind", "wrong_checkpoint", "key_mismatch", "manifest_mismatch"):
            try:  # tell the source why (its log and counters); it may be gone
                ch.send("done", {"ok": False, "reason": e.reason})
            except ChannelError:
                pass
        raise
    finally:
        sock.close()


def _take(settings: SeedSettings, agent: Callable[[], Any], plan: Any, writable: Any, reply: dict,
          deadline: float, alive: Callable[[], bool], threads: int, peer: str, own: _Samples,
          progress: Callable[[int, int], None] | None = None, dirty: list[bool] | None = None) -> Seeded:
    """Checks an offer, READs it into ``writable`` and checks its digests (``dirty[0]`` set as the READ starts)."""
    why, fields = key_differences(plan.key, reply.get("key"))
    if why:
        raise Refused(why, f"the peer's slab has another cache key (fields: {', '.join(fields[:8])})")
    their_blobs = reply.get("blobs")
    if own.blobs is not None and isinstance(their_blobs, dict):  # both hub snapshots: content hashes decide
        if their_blobs != own.blobs:
            raise Refused("wrong_checkpoint", "the peer's checkpoint files are other hub blobs (sha256) than ours")
    else:
        try:
            theirs = [base64.b64decode(b, validate=True) for b in reply.get("samples") or []]
        except (TypeError, ValueError) as e:
            raise Refused("protocol", f"the peer's samples are malformed: {e!r}") from None
        mine = own.data()
        if theirs != mine:
            differ = sum(a != b for a, b in zip(theirs, mine)) + abs(len(theirs) - len(mine))
            raise Refused("wrong_checkpoint", f"{differ} of {len(mine)} samples of the tensor data differ: "
                                              f"another checkpoint with the same headers (a fine-tune of the "
                                              f"same base?)")
    try:
        raw = base64.b64decode(reply["manifest"], validate=True)
        _, offered = unpack_file(raw)
        remote_md = base64.b64decode(reply["agent_md"], validate=True)
        descs = [(int(a), int(n)) for a, n in reply["descs"]]
    except (KeyError, TypeError, ValueError, WeightcacheError) as e:
        raise Refused("protocol", f"the peer's offer is malformed: {e!r}") from None
    if manifest_digest(raw) != reply.get("digest"):
        raise Refused("digest_mismatch", "the offer's digest is not its manifest's")
    if offered.slab_size_bytes != plan.slab_size_bytes:
        raise Refused("manifest_mismatch", f"the peer's slab is {offered.slab_size_bytes} bytes, the plan's "
                                           f"{plan.slab_size_bytes}")
    offered_records = list(offered.tensors)
    bad = record_differences(plan.records, offered_records)
    if bad:
        raise Refused("manifest_mismatch", f"{len(bad)} tensors laid out otherwise than this node's plan "
                                           f"(first: {bad[0]})")
    stored = [t for t in offered_records if t.alias_of is None]
    target = target_of(writable)
    if target is None:
        raise Refused("internal", f"the slab being filled ({type(writable).__name__}) is neither host nor GPU memory")
    why = digest_kind_refusal(target.mem, [t.digest for t in stored])
    if why:
        raise Refused("digest_kind", why)
    remote_mem, remote_dev = reply.get("mem", "DRAM"), reply.get("dev", 0)
    if remote_mem not in MEM_TYPES or not isinstance(remote_dev, int) or remote_dev < 0:
        raise Refused("protocol", f"the peer's memory kind {str(remote_mem)[:16]!r} device {str(remote_dev)[:16]} "
                                  f"is not one of {MEM_TYPES} and a GPU index")
    if dirty is not None:
        dirty[0] = True
    try:
        try:
            read_s = agent().read(remote_md, descs, target.address, plan.slab_size_bytes, deadline,
                                  settings.bandwidth_bytes_per_s, alive, progress, local_mem=target.mem,
                                  local_dev=target.dev, remote_mem=remote_mem, remote_dev=remote_dev,
                                  current=target.current)
        except TransferError as e:
            raise Refused(e.reason, str(e)) from None
    finally:
        target.keep = None
    t0 = time.monotonic()
    wrong = check_digests(writable, target.mem, stored, threads)
    digest_s = time.monotonic() - t0
    if wrong:
        raise Refused("digest_mismatch", f"{len(wrong)} tensors differ from their digests after the READ "
                                         f"(first: {wrong[0]})")
    digests = {t.name: t.digest for t in offered_records}
    records = tuple(TensorRecord(t.name, t.dtype, t.shape, t.stride, t.offset_bytes, t.size_bytes,
                                 digests.get(t.alias_of or t.name, ""), t.layout, t.alias_of) for t in plan.records)
    manifest = Manifest(plan.rank.model.name, plan.rank.tp_size, plan.rank.tp_rank, plan.key, plan.slab_size_bytes, records)
    return Seeded(manifest, peer, plan.slab_size_bytes, read_s, digest_s)


class _Samples:
    """This load's content check: hub blob names (or None), the sample ranges chosen, their bytes read here on
    first need (never, when every peer answers with equal blob names)."""

    def __init__(self, ck: Any, chosen: list, blobs: dict[str, str] | None) -> None:
        self._ck, self.chosen, self.blobs = ck, chosen, blobs
        self._data: list[bytes] | None = None

    def data(self) -> list[bytes]:
        """The sampled bytes of this node's checkpoint.

        Raises:
            Refused (``internal``): they cannot be read.
        """
        if self._data is None:
            try:
                self._data = _samples.read(self._ck, self.chosen)
            except (WeightcacheError, OSError, ValueError) as e:
                raise Refused("internal", f"cannot read samples of this node's checkpoint: {e}") from None
        return self._data


def _zero(writable: Any, size_bytes: int) -> None:
    """Zeroes what a failed offer may have written, so the checkpoint's load starts from a clean slab: a host
    mapping by ``memset``, a GPU slab by its ``zero`` (``cuMemsetD8``)."""
    buf = getattr(writable, "buffer", None)
    if buf is None:
        if hasattr(writable, "zero"):
            writable.zero([(0, min(size_bytes, int(writable.size_bytes)))])
        return
    address, keep = buffer_address(buf)
    ctypes.memset(address, 0, min(size_bytes, len(buf)))
    del keep
