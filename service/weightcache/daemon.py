"""The per-GPU service: socket activation, loads, leases, fd store, sd_notify.

One process serves one GPU (``weightcache serve --gpu N``). The main thread
runs a ``selectors`` loop over the listening socket, the client connections
and a wake-up pipe; one loader thread runs the pipeline for every (model,
layout, rank) placed on the GPU, one after the other. Clients are served while
loads run: an ``attach`` for a model still loading waits (up to its
``wait_ms``) or gets a ``loading`` reply with progress.

Each sealed slab goes to systemd's fd store (``FDSTORE=1``,
``FDNAME=slab-<id>``) together with its manifest in a sealed memfd
(``FDNAME=manifest-<id>``). At start, stored slabs whose cache key still
matches the config and the checkpoint's headers are adopted without reading
any tensor data; others are dropped with ``FDSTOREREMOVE=1``.

Trust boundary: a malformed frame, a protocol violation or a dead client ends
that connection only; a bad model fails alone. The socket's group decides who
may connect; per-model allow lists are checked against ``SO_PEERCRED``.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import gc
import grp
import hashlib
import json
import logging
import os
import pwd
import queue
import selectors
import signal
import socket
import struct
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from . import notify, pipeline, protocol
from .checkpoint import Checkpoint
from .config import Config, Placement
from .errors import (
    AccessDenied,
    InternalError,
    LeaseBusy,
    ModelLoadFailed,
    ModelNotFound,
    OutOfMemory,
    RemoteProtocolError,
    WeightcacheError,
)
from .fdpass import recv_with_fds, send_some
from .journal import event
from .loader import LoaderOptions
from .manifest import Manifest
from .memory import Backend
from .memory.host import F_ADD_SEALS, F_SEAL_GROW, F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_WRITE

log = logging.getLogger(__name__)

RECV_BYTES = 256 * 1024
#: A client whose unread replies exceed this is dropped (its leases end).
MAX_OUTBOX_BYTES = 64 * 1024 * 1024
STATUS_PERIOD_S = 1.0
EXTEND_TIMEOUT_S = 30.0
MAX_FDS_IN = protocol.MAX_FDS_PER_FRAME


@dataclass
class Lease:
    """One attach held by one connection: ends with ``release`` or the connection.

    ``pid``/``uid``/``gid`` come from ``SO_PEERCRED``; ``since`` is a Unix time
    in seconds; ``mode`` is ``zero_copy`` or ``copy``.
    """
    lease_id: int
    slot: "Slot"
    pid: int
    uid: int
    gid: int
    since: float
    mode: str


@dataclass
class Slot:
    """One (model, layout, rank) on this GPU and its slab.

    States: ``pending`` -> ``loading`` -> ``ready`` | ``failed``; ``evicted``
    after an eviction.
    """

    placement: Placement
    state: str = "pending"
    done_bytes: int = 0
    total_bytes: int = 0
    error: WeightcacheError | None = None
    manifest: Manifest | None = None
    manifest_wire: Any = None  # (protocol.PreEncoded header, payload) of the packed manifest, once per slab
    sealed: Any = None
    adopted: bool = False
    started_at: float = 0.0
    ready_at: float = 0.0
    leases: dict[int, Lease] = field(default_factory=dict)

    @property
    def store_id(self) -> str:
        p = self.placement
        raw = f"{p.model.name}\0{p.tp_size}\0{p.tp_rank}\0{p.gpu}".encode()
        return hashlib.blake2b(raw, digest_size=8).hexdigest()

    @property
    def label(self) -> str:
        return self.placement.label

    @property
    def rate_bytes_per_s(self) -> float:
        if self.state != "loading" or not self.started_at:
            return 0.0
        return self.done_bytes / max(1e-6, time.monotonic() - self.started_at)


@dataclass
class Client:
    """One accepted connection: its protocol state, peer credentials, leases,
    attaches waiting for a load (with their deadlines, ``time.monotonic()``
    seconds) and the outbox of replies not yet written.
    """
    sock: socket.socket
    conn: protocol.Connection
    pid: int
    uid: int
    gid: int
    leases: dict[int, Lease] = field(default_factory=dict)
    waiting: list[tuple[protocol.Attach, "Slot", float]] = field(default_factory=list)
    closed: bool = False
    #: Frames not yet written: [bytes, dup'ed fds to attach to their first byte].
    outbox: collections.deque = field(default_factory=collections.deque)
    outbox_bytes: int = 0


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the peer, from ``SO_PEERCRED``."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def _user_groups(uid: int, gid: int) -> tuple[str | None, set[str]]:
    try:
        name = pwd.getpwuid(uid).pw_name
        gids = set(os.getgrouplist(name, gid))
    except KeyError:
        name, gids = None, {gid}
    groups = set()
    for g in gids:
        try:
            groups.add(grp.getgrgid(g).gr_name)
        except KeyError:
            groups.add(str(g))
    return name, groups


def _manifest_wire(manifest: Manifest) -> tuple[protocol.PreEncoded, bytes]:
    """The packed manifest of a slab as sent in every ``attach_reply``: header encoded once, payload."""
    header, payload = manifest.to_wire()
    return protocol.PreEncoded(header), payload


def _sealed_memfd(data: bytes, name: str) -> int:
    import fcntl

    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL)
    return fd


def _read_fd(fd: int, limit: int = 64 * 1024 * 1024) -> bytes:
    size = os.fstat(fd).st_size
    if size > limit:
        raise ValueError(f"stored manifest of {size} bytes exceeds {limit}")
    return os.pread(fd, size, 0)


class Daemon:
    """The service for one GPU.

    Args:
        config (`Config`): the merged configuration.
        gpu (`int`): the GPU index this instance serves (``CUDA_DEVICE_ORDER=PCI_BUS_ID``).
        backend (`Backend`): the slab backend (``host`` or ``cuda``).
        listener (`socket.socket`): the listening Unix stream socket.
        stored_fds (`dict[str, list[int]]`, *optional*): fds handed back by
            systemd's fd store, by ``FDNAME``.
    """

    def __init__(self, config: Config, gpu: int, backend: Backend, listener: socket.socket,
                 stored_fds: dict[str, list[int]] | None = None) -> None:
        self.config = config
        self.gpu = gpu
        self.backend = backend
        self.device = backend.device_info()
        self.listener = listener
        listener.setblocking(False)
        self.slots = [Slot(p) for p in config.placements(gpu)]
        self.clients: dict[int, Client] = {}
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._queue: queue.Queue[Slot | None] = queue.Queue()
        self._lock = threading.Lock()
        self._next_lease = 1
        self._realpaths: dict[str, str] = {}
        self._stop = False
        self._accept_paused = False
        self._ready_sent = False
        self._loads_done = 0  # loads finished (ready or failed); gc.freeze() after each settled batch
        self._frozen_at = -1
        self._last_status = ""
        self._last_status_t = 0.0
        self._last_extend_t = 0.0
        self._watchdog_s = notify.watchdog_interval_s()
        self._last_watchdog_t = 0.0
        self.handlers: dict[type, Callable[[Client, Any], None]] = {
            protocol.Hello: self._on_hello,
            protocol.List: self._on_list,
            protocol.Status: self._on_status,
            protocol.Attach: self._on_attach,
            protocol.Release: self._on_release,
            protocol.Verify: self._on_verify,
            protocol.Evict: self._on_evict,
            protocol.Preload: self._on_preload,
        }
        self._adopt(stored_fds or {})

    # --- fd store ------------------------------------------------------------

    def _adopt(self, stored: dict[str, list[int]]) -> None:
        by_id = {s.store_id: s for s in self.slots}
        ids = {n.split("-", 1)[1] for n in stored if n.startswith(("slab-", "manifest-"))}
        for sid in sorted(ids):
            slab_fds = stored.get(f"slab-{sid}", [])
            man_fds = stored.get(f"manifest-{sid}", [])
            slot = by_id.get(sid)
            keep = False
            if slot is not None and len(slab_fds) == 1 and len(man_fds) == 1:
                try:
                    rec = json.loads(_read_fd(man_fds[0]))
                    manifest = Manifest.from_json(rec["manifest"])
                    p = slot.placement
                    # The key alone (headers and stat(), no validation, no planning): a match means
                    # the slab was planned and filled from exactly this checkpoint and config.
                    ck = Checkpoint(p.model.path, validate=False)
                    current = pipeline.cache_key(p.model, p.tp_size, p.tp_rank, ck, self.device)
                    diff = pipeline.diff_keys(current, manifest.key)
                    if rec.get("backend") != self.backend.name:
                        diff.append("device.backend")
                    if diff:
                        log.info("fd store slab dropped model=%s rank=%d reason=key-mismatch fields=%s",
                                 p.model.name, p.tp_rank, ",".join(diff[:8]))
                    else:
                        slot.sealed = self.backend.adopt(slab_fds[0], int(rec["size_bytes"]))
                        slot.manifest = manifest
                        slot.state = "ready"
                        slot.adopted = True
                        slot.total_bytes = slot.done_bytes = sum(
                            t.size_bytes for t in manifest.tensors if t.alias_of is None)
                        slot.ready_at = time.monotonic()
                        keep = True
                        log.info("adopted slab from fd store model=%s tp_size=%d rank=%d size_bytes=%d",
                                 p.model.name, p.tp_size, p.tp_rank, slot.sealed.size_bytes,
                                 extra=event("adopted", p.model.name, p.tp_rank))
                except (WeightcacheError, ValueError, KeyError, OSError) as e:
                    log.warning("fd store slab dropped id=%s reason=%s", sid, e)
            elif slot is None:
                log.info("fd store slab dropped id=%s reason=no-longer-configured", sid)
            for fd in man_fds + ([] if keep else slab_fds):
                os.close(fd)
            if not keep:
                self._fdstore_remove(sid)

    def _fdstore_put(self, slot: Slot, sealed: Any, manifest: Manifest) -> None:
        if not os.environ.get("NOTIFY_SOCKET"):
            return
        sid = slot.store_id
        rec = {"manifest": manifest.to_json(), "size_bytes": sealed.size_bytes,
               "backend": self.backend.name, "checkpoint_path": slot.placement.model.path}
        mfd = _sealed_memfd(json.dumps(rec).encode(), f"weightcache-manifest-{sid}")
        try:
            notify.notify(f"FDSTORE=1\nFDNAME=slab-{sid}", [sealed.fd])
            notify.notify(f"FDSTORE=1\nFDNAME=manifest-{sid}", [mfd])
        finally:
            os.close(mfd)

    def _fdstore_remove(self, sid: str) -> None:
        for kind in ("slab", "manifest"):
            notify.notify(f"FDSTOREREMOVE=1\nFDNAME={kind}-{sid}")

    # --- loading -------------------------------------------------------------

    def _loader(self) -> None:
        while True:
            slot = self._queue.get()
            if slot is None:
                return
            try:
                self._load(slot)
            except Exception as e:  # noqa: BLE001 - the loader thread must outlive any one model
                log.critical("loader error model=%s error=%r", slot.placement.model.name, e)
            os.write(self._wake_w, b"l")

    def _load(self, slot: Slot) -> None:
        p = slot.placement
        with self._lock:
            slot.state, slot.error, slot.done_bytes = "loading", None, 0
            slot.started_at = time.monotonic()
        writable = None
        try:
            pl = pipeline.plan(p.model, p.tp_size, p.tp_rank, self.device)
            slot.total_bytes = pl.payload_bytes
            writable = self.backend.allocate(pl.slab_size_bytes, p.label)

            limit_s = self.config.service.load_timeout_s

            def progress(done: int, total: int) -> None:
                slot.done_bytes = done
                if time.monotonic() - slot.started_at > limit_s:
                    raise ModelLoadFailed(
                        f"model {p.model.name}: load exceeded service.load_timeout_s = {limit_s:g} s "
                        f"({done}/{total} bytes read); raise it in {self.config.files[0] if self.config.files else 'the config'}",
                        model=p.model.name, cause="timeout")

            opts = LoaderOptions(threads=self.config.service.read_threads,
                                 staging_bytes=self.config.service.staging_bytes)
            manifest = pipeline.execute(pl, writable.tensor, progress, opts)
            wire = _manifest_wire(manifest)  # here, not in the serving loop at the first attach
            sealed = writable.seal()
            writable = None
        except WeightcacheError as e:
            self._fail(slot, e, writable)
            return
        except MemoryError as e:
            self._fail(slot, OutOfMemory(f"model {p.model.name}: out of host memory: {e}", model=p.model.name),
                       writable)
            return
        except Exception as e:  # a bug or an unexpected library error: fail this model only
            log.critical("load crashed model=%s rank=%d error=%r\n%s", p.model.name, p.tp_rank, e,
                         traceback.format_exc(), extra=event("load_failed", p.model.name, p.tp_rank))
            self._fail(slot, ModelLoadFailed(f"model {p.model.name}: internal error while loading: {e!r}",
                                             model=p.model.name, cause="internal"), writable, logged=True)
            return
        dt = time.monotonic() - slot.started_at
        self._fdstore_put(slot, sealed, manifest)
        with self._lock:
            slot.manifest, slot.sealed, slot.manifest_wire = manifest, sealed, wire
            slot.state, slot.ready_at = "ready", time.monotonic()
            self._loads_done += 1
        log.info("loaded model=%s tp_size=%d rank=%d tensors=%d size_bytes=%d duration_ms=%.0f rate_gbps=%.2f",
                 p.model.name, p.tp_size, p.tp_rank, len(manifest.tensors), slot.total_bytes, dt * 1e3,
                 slot.total_bytes / max(dt, 1e-9) / 1e9, extra=event("loaded", p.model.name, p.tp_rank))

    def _fail(self, slot: Slot, e: WeightcacheError, writable: Any, logged: bool = False) -> None:
        if writable is not None:
            try:
                writable.abort()
            except Exception as ae:  # noqa: BLE001 - best effort; the original error matters
                log.warning("abort of partial slab failed model=%s error=%r", slot.placement.model.name, ae)
        with self._lock:
            slot.state, slot.error = "failed", e
            self._loads_done += 1
        if not logged:
            p = slot.placement
            log.error("load failed model=%s rank=%d code=%s error=%s", p.model.name, p.tp_rank, e.code, e.message,
                      extra=event("load_failed", p.model.name, p.tp_rank))

    # --- notify --------------------------------------------------------------

    def _status_line(self) -> str:
        loading = [s for s in self.slots if s.state in ("loading", "pending")]
        ready = sum(s.state == "ready" for s in self.slots)
        failed = [s for s in self.slots if s.state == "failed"]
        if loading:
            cur = next((s for s in loading if s.state == "loading"), loading[0])
            if not cur.total_bytes:  # planning: headers read, size not known yet
                return f"loading {cur.label}: planning; {ready}/{len(self.slots)} ready"
            pct = 100.0 * cur.done_bytes / cur.total_bytes
            return (f"loading {cur.label}: {pct:.0f}% ({cur.done_bytes / 1e6:.0f}/{cur.total_bytes / 1e6:.0f} MB, "
                    f"{cur.rate_bytes_per_s / 1e9:.2f} GB/s); {ready}/{len(self.slots)} ready")
        line = f"ready: {ready}/{len(self.slots)} slabs resident"
        if failed:
            line += f"; failed: {', '.join(s.label + ' (' + (s.error.code if s.error else '?') + ')' for s in failed)}"
        return line

    def _tick(self) -> None:
        now = time.monotonic()
        settled = all(s.state not in ("pending", "loading") for s in self.slots)
        status = self._status_line()
        if status != self._last_status and (now - self._last_status_t >= STATUS_PERIOD_S or settled):
            msg = f"STATUS={status}"
            if not self._ready_sent and now - self._last_extend_t >= EXTEND_TIMEOUT_S / 3:
                msg += f"\nEXTEND_TIMEOUT_USEC={int(EXTEND_TIMEOUT_S * 1e6)}"
                self._last_extend_t = now
            notify.notify(msg)
            self._last_status, self._last_status_t = status, now
        elif not self._ready_sent and now - self._last_extend_t >= EXTEND_TIMEOUT_S / 3:
            notify.notify(f"EXTEND_TIMEOUT_USEC={int(EXTEND_TIMEOUT_S * 1e6)}")
            self._last_extend_t = now
        if settled and not self._ready_sent:
            notify.notify(f"READY=1\nSTATUS={status}")
            self._ready_sent = True
            log.info("ready slabs=%d failed=%d", sum(s.state == "ready" for s in self.slots),
                     sum(s.state == "failed" for s in self.slots))
        if settled and self._frozen_at != self._loads_done:
            # Everything alive now (torch, the config, manifests) lives for the service's life:
            # keep it out of every later collection, so that a full collection in the middle of an
            # attach scans what that attach allocated, not the whole heap (was a 40 ms reply on CPU).
            gc.freeze()
            self._frozen_at = self._loads_done
        if self._watchdog_s and now - self._last_watchdog_t >= self._watchdog_s:
            notify.notify("WATCHDOG=1")
            self._last_watchdog_t = now

    # --- I/O -----------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                # Out of fds: leave new connections in the backlog until a client leaves
                # (re-armed in _drop), rather than spinning on a readable listener or dying.
                log.warning("accept paused clients=%d error=%s", len(self.clients), e.strerror)
                self.sel.unregister(self.listener)
                self._accept_paused = True
                return
            sock.set_inheritable(False)
            try:
                pid, uid, gid = peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            sock.setblocking(False)  # replies queue in the client's outbox; a slow reader blocks no one
            c = Client(sock, protocol.Connection(protocol.SERVER), pid, uid, gid)
            self.clients[sock.fileno()] = c
            self.sel.register(sock, selectors.EVENT_READ, c)
            # A client writes its hello (and attach) right after connect: answer now rather than
            # one loop pass later (nothing is read if nothing arrived yet).
            self._recv(c)

    def _recv(self, c: Client) -> None:
        try:
            data, fds = recv_with_fds(c.sock, RECV_BYTES, MAX_FDS_IN, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except RemoteProtocolError as e:
            self._violation(c, e)
            return
        except OSError:
            self._drop(c, "recv failed")
            return
        if not data and not fds:
            self._drop(c, "peer closed")
            return
        if fds:
            for fd in fds:
                os.close(fd)
            self._violation(c, RemoteProtocolError("requests carry no fds; fds sent to the service are refused"))
            return
        c.conn.receive(data)
        while not c.closed:
            try:
                ev = c.conn.next_message()
            except RemoteProtocolError as e:
                self._violation(c, e)
                return
            if ev is protocol.NEED_DATA:
                return
            msg, _ = ev  # no fds: _recv refused any before they reached the protocol
            try:
                self.handlers[type(msg)](c, msg)
            except WeightcacheError as e:
                self._send(c, protocol.Error.from_exc(e))
            except Exception as e:  # noqa: BLE001 - one request must never take the service down
                log.error("request failed peer_pid=%d type=%s error=%r\n%s", c.pid, msg.tag(), e,
                          traceback.format_exc())
                self._send(c, protocol.Error.from_exc(InternalError(
                    f"the service failed to handle {msg.tag()!r}: {e!r}"[:4096], request=msg.tag())))

    def _violation(self, c: Client, e: RemoteProtocolError) -> None:
        log.warning("rejected frame peer_pid=%d code=%s error=%s", c.pid, e.code, e.message,
                    extra=event("rejected"))
        for fd in c.conn.take_all_fds():
            os.close(fd)
        if not c.outbox:  # best effort, and never in the middle of a half-sent frame
            with contextlib.suppress(OSError):
                send_some(c.sock, protocol.encode(protocol.Error.from_exc(e)))
        self._drop(c, "protocol violation")

    def _send(self, c: Client, msg: protocol.Message, fds: list[int] | tuple[int, ...] = ()) -> bool:
        """Queues ``msg`` (and dups of ``fds``) in the client's outbox and writes what the socket takes.

        A client that does not read its replies only fills its own outbox; past
        :data:`MAX_OUTBOX_BYTES` it is dropped. Returns False if the client was dropped.
        """
        if c.closed:
            return False
        try:
            data, fds = c.conn.send(msg, fds)
        except WeightcacheError as e:
            self._drop(c, f"send failed: {e}")
            return False
        c.outbox.append([memoryview(data), [os.dup(fd) for fd in fds]])
        c.outbox_bytes += len(data)
        if c.outbox_bytes > MAX_OUTBOX_BYTES:
            log.warning("dropped client peer_pid=%d reason=not-reading-replies queued_bytes=%d", c.pid,
                        c.outbox_bytes, extra=event("rejected"))
            self._drop(c, "outbox full")
            return False
        return self._flush(c)

    def _flush(self, c: Client) -> bool:
        """Writes queued frames until the socket would block; returns False if the client was dropped."""
        while c.outbox:
            data, fds = c.outbox[0]
            try:
                n = send_some(c.sock, data, fds)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self._drop(c, f"send failed: {e}")
                return False
            for fd in fds:  # the kernel has its own references now
                os.close(fd)
            c.outbox_bytes -= n
            if n < len(data):
                c.outbox[0] = [data[n:], []]
                break
            c.outbox.popleft()
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if c.outbox else 0)
        try:
            if self.sel.get_key(c.sock).events != want:
                self.sel.modify(c.sock, want, c)
        except (KeyError, ValueError):
            pass
        return True

    def _drop(self, c: Client, reason: str) -> None:
        if c.closed:
            return
        c.closed = True
        for fd in c.conn.take_all_fds():
            os.close(fd)
        for _, fds in c.outbox:
            for fd in fds:
                os.close(fd)
        c.outbox.clear()
        for lease in list(c.leases.values()):
            self._end_lease(c, lease)
        try:
            self.sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        self.clients.pop(c.sock.fileno(), None)
        c.sock.close()
        if self._accept_paused and not self._stop:
            self._accept_paused = False
            self.sel.register(self.listener, selectors.EVENT_READ, "listen")
            log.info("accept resumed clients=%d", len(self.clients))
        log.debug("connection closed peer_pid=%d reason=%s", c.pid, reason)

    def _end_lease(self, c: Client, lease: Lease) -> None:
        c.leases.pop(lease.lease_id, None)
        lease.slot.leases.pop(lease.lease_id, None)
        log.info("released model=%s rank=%d peer_pid=%d lease=%d", lease.slot.placement.model.name,
                 lease.slot.placement.tp_rank, c.pid, lease.lease_id,
                 extra=event("released", lease.slot.placement.model.name, lease.slot.placement.tp_rank))

    # --- handlers ------------------------------------------------------------

    def _on_hello(self, c: Client, msg: protocol.Hello) -> None:
        if msg.protocol_version != protocol.PROTOCOL_VERSION:
            self._violation(c, RemoteProtocolError(
                f"protocol version {msg.protocol_version} is not supported; this service speaks "
                f"{protocol.PROTOCOL_VERSION}: upgrade the client or the service", field="protocol_version"))
            return
        self._send(c, protocol.HelloReply(protocol.PROTOCOL_VERSION, self.gpu, self.device.get("gpu_uuid", ""),
                                          self.backend.name, ["attach", "release", "status", "list", "verify",
                                                              "evict", "preload", "wait"]))

    def _slot_summary(self, s: Slot) -> dict[str, Any]:
        p = s.placement
        d: dict[str, Any] = {
            "model": p.model.name, "path": p.model.path, "tp_size": p.tp_size, "tp_rank": p.tp_rank,
            "state": s.state, "done_bytes": s.done_bytes, "total_bytes": s.total_bytes,
            "rate_bytes_per_s": round(s.rate_bytes_per_s),
            "resident_bytes": s.sealed.size_bytes if s.sealed is not None else 0,
            "adopted": s.adopted, "dtype": p.model.dtype, "naming": p.model.naming,
            "tensors": len(s.manifest.tensors) if s.manifest else 0,
        }
        if s.error is not None:
            d["error"] = s.error.to_wire()
        if s.manifest is not None:
            k = s.manifest.key
            d["key"] = {"architecture": k.get("architecture"), "quant_scheme": k.get("quant_scheme"),
                        "pipeline_version": k.get("pipeline_version"),
                        "files": len(k.get("checkpoint", {}).get("files", {}))}
        d["leases"] = [{"lease_id": l.lease_id, "pid": l.pid, "uid": l.uid, "gid": l.gid,
                        "since": l.since, "mode": l.mode} for l in s.leases.values()]
        return d

    def _on_list(self, c: Client, msg: protocol.List) -> None:
        self._send(c, protocol.ListReply([self._slot_summary(s) for s in self.slots]))

    def _memory(self) -> dict[str, int]:
        if self.backend.name == "cuda":
            free, total = self.backend.mem_info()
            return {"free_bytes": int(free), "total_bytes": int(total)}
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0]) * 1024
        return {"free_bytes": info.get("MemAvailable", 0), "total_bytes": info.get("MemTotal", 0)}

    def _on_status(self, c: Client, msg: protocol.Status) -> None:
        self._send(c, protocol.StatusReply({
            "gpu": self.gpu, "pid": os.getpid(), "backend": self.backend.name, "device": self.device,
            "memory": self._memory(), "slabs": [self._slot_summary(s) for s in self.slots],
            "clients": len(self.clients), "status_line": self._status_line(),
        }))

    def find_slots(self, model: str, tp_size: int | None = None, tp_rank: int | None = None,
                   dtype: str | None = None, naming: str | None = None) -> list[Slot]:
        """Slots matching a model name or checkpoint path (and layout, when given).

        Raises:
            ModelNotFound (`model_not_found`): nothing matches; the message lists
                what this GPU holds.
        """
        if "\0" in model:  # os.path.realpath raises on NUL; no model or path can contain one
            raise ModelNotFound(f"GPU {self.gpu} has no model {model[:200]!r}: names and paths contain no NUL byte",
                                model=model[:200], gpu=self.gpu)
        real = os.path.realpath(model) if os.sep in model else None
        out = []
        for s in self.slots:
            m = s.placement.model
            if m.name != model and (real is None or self._realpath(m.path) != real):
                continue
            if tp_size is not None and s.placement.tp_size != tp_size:
                continue
            if tp_rank is not None and s.placement.tp_rank != tp_rank:
                continue
            if dtype is not None and not pipeline.dtype_matches(m, s.placement.tp_size, s.placement.tp_rank, dtype,
                                                               s.manifest.key if s.manifest else None):
                continue
            if naming is not None and m.naming != naming:
                continue
            out.append(s)
        if not out:
            held = ", ".join(s.label for s in self.slots) or "nothing"
            raise ModelNotFound(
                f"GPU {self.gpu} has no model {model!r} with tp_size={tp_size} tp_rank={tp_rank}"
                f"{'' if dtype is None else ' dtype=' + dtype}{'' if naming is None else ' naming=' + naming}; "
                f"it holds: {held}", model=model, tp_size=tp_size, tp_rank=tp_rank, gpu=self.gpu)
        return out

    def _realpath(self, path: str) -> str:
        """``os.path.realpath`` of a configured checkpoint path, resolved once."""
        real = self._realpaths.get(path)
        if real is None:
            real = self._realpaths[path] = os.path.realpath(path)
        return real

    def _check_access(self, c: Client, slot: Slot) -> None:
        m = slot.placement.model
        if not m.allow_users and not m.allow_groups:
            return
        if c.uid == os.getuid():
            return
        name, groups = _user_groups(c.uid, c.gid)
        if (name is not None and name in m.allow_users) or str(c.uid) in m.allow_users or groups & set(m.allow_groups):
            return
        log.warning("rejected attach model=%s peer_pid=%d peer_uid=%d user=%s reason=not-on-allow-list",
                    m.name, c.pid, c.uid, name, extra=event("rejected", m.name, slot.placement.tp_rank,
                                                            peer_uid=c.uid))
        raise AccessDenied(
            f"user {name or c.uid} (uid {c.uid}) may not attach model {m.name!r}: not in allow_users "
            f"{list(m.allow_users)} or allow_groups {list(m.allow_groups)} of {m.source}",
            model=m.name, uid=c.uid)

    def _on_attach(self, c: Client, msg: protocol.Attach) -> None:
        if msg.mode not in ("zero_copy", "copy"):
            raise RemoteProtocolError(f"attach: mode must be zero_copy or copy, got {msg.mode!r}", field="mode")
        slot = self.find_slots(msg.model, msg.tp_size, msg.tp_rank, msg.dtype, msg.naming)[0]
        self._check_access(c, slot)
        if slot.state in ("pending", "loading") and msg.wait_ms > 0:
            c.waiting.append((msg, slot, time.monotonic() + msg.wait_ms / 1e3))
            return
        self._answer_attach(c, msg, slot)

    def _answer_attach(self, c: Client, msg: protocol.Attach, slot: Slot) -> None:
        p = slot.placement
        if slot.state == "ready":
            lease = Lease(self._next_lease, slot, c.pid, c.uid, c.gid, time.time(), msg.mode)
            self._next_lease += 1
            if slot.manifest_wire is None:  # adopted from the fd store
                slot.manifest_wire = _manifest_wire(slot.manifest)
            header, payload = slot.manifest_wire
            if self._send(c, protocol.AttachReply(lease.lease_id, header, p.model.path, self.backend.name, payload),
                          [slot.sealed.fd]):
                c.leases[lease.lease_id] = lease
                slot.leases[lease.lease_id] = lease
                log.info("attached model=%s tp_size=%d rank=%d peer_pid=%d peer_uid=%d lease=%d mode=%s",
                         p.model.name, p.tp_size, p.tp_rank, c.pid, c.uid, lease.lease_id, msg.mode,
                         extra=event("attached", p.model.name, p.tp_rank, peer_pid=c.pid))
        elif slot.state == "failed":
            e = slot.error
            raise ModelLoadFailed(f"model {p.model.name} ({p.label}) failed to load: {e.message}",
                                  model=p.model.name,
                                  cause=e.details.get("cause", e.code) if isinstance(e, ModelLoadFailed) else e.code,
                                  cause_details=e.details)
        elif slot.state == "evicted":
            raise ModelLoadFailed(f"model {p.model.name} ({p.label}) was evicted; run `weightcache preload "
                                  f"{p.model.name}` to load it again", model=p.model.name, cause="evicted")
        else:
            self._send(c, protocol.Loading(p.model.name, slot.done_bytes, slot.total_bytes, slot.state))

    def _service_waiting(self) -> None:
        now = time.monotonic()
        for c in list(self.clients.values()):
            still = []
            for msg, slot, deadline in c.waiting:
                if slot.state in ("pending", "loading") and now < deadline:
                    still.append((msg, slot, deadline))
                    continue
                try:
                    self._answer_attach(c, msg, slot)
                except WeightcacheError as e:
                    self._send(c, protocol.Error.from_exc(e))
            c.waiting = still

    def _on_release(self, c: Client, msg: protocol.Release) -> None:
        lease = c.leases.get(msg.lease_id)
        if lease is None:
            raise RemoteProtocolError(f"release: lease {msg.lease_id} is not held by this connection",
                                      lease_id=msg.lease_id)
        self._end_lease(c, lease)
        self._send(c, protocol.ReleaseReply(msg.lease_id))

    def _on_verify(self, c: Client, msg: protocol.Verify) -> None:
        results = []
        for s in self.find_slots(msg.model, msg.tp_size, msg.tp_rank):
            if s.state != "ready":
                results.append({"model": s.placement.model.name, "tp_size": s.placement.tp_size,
                                "tp_rank": s.placement.tp_rank, "state": s.state, "mismatched": []})
                continue
            bad = pipeline.verify(s.manifest, s.sealed.tensor)
            results.append({"model": s.placement.model.name, "tp_size": s.placement.tp_size,
                            "tp_rank": s.placement.tp_rank, "state": s.state,
                            "tensors": len(s.manifest.tensors), "mismatched": bad})
        self._send(c, protocol.VerifyReply(results))

    def _on_evict(self, c: Client, msg: protocol.Evict) -> None:
        slots = self.find_slots(msg.model)
        leased = [s for s in slots if s.leases]
        if leased and not msg.force:
            raise LeaseBusy(f"model {msg.model!r} has {sum(len(s.leases) for s in leased)} active leases; "
                            f"use --force to evict anyway (engines keep their mappings)", model=msg.model)
        evicted = []
        for s in slots:
            if s.state != "ready":
                continue
            with self._lock:
                sealed, s.sealed, s.manifest, s.state, s.adopted = s.sealed, None, None, "evicted", False
                s.manifest_wire = None
            self._fdstore_remove(s.store_id)
            sealed.close()
            evicted.append(s.label)
            log.info("evicted model=%s rank=%d forced=%s", s.placement.model.name, s.placement.tp_rank, msg.force,
                     extra=event("evicted", s.placement.model.name, s.placement.tp_rank))
        self._send(c, protocol.EvictReply(evicted))

    def _on_preload(self, c: Client, msg: protocol.Preload) -> None:
        started = []
        for s in self.find_slots(msg.model):
            if s.state in ("failed", "evicted"):
                with self._lock:
                    s.state, s.error = "pending", None
                self._queue.put(s)
                started.append(s.label)
        self._send(c, protocol.PreloadReply(started))

    # --- main loop -----------------------------------------------------------

    def request_stop(self, *_: Any) -> None:
        self._stop = True
        try:
            os.write(self._wake_w, b"s")
        except OSError:
            pass

    def serve(self) -> int:
        """Runs until SIGTERM/SIGINT. Returns the process exit status."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        loader = threading.Thread(target=self._loader, name="weightcache-loader", daemon=True)
        loader.start()
        for s in self.slots:
            if s.state == "pending":
                self._queue.put(s)
        log.info("serving gpu=%d backend=%s slabs=%d", self.gpu, self.backend.name, len(self.slots))
        while not self._stop:
            self._tick()
            timeout = 0.2 if any(c.waiting for c in self.clients.values()) else 0.5
            for key, events in self.sel.select(timeout):
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                else:
                    if events & selectors.EVENT_WRITE and not self._flush(key.data):
                        continue
                    if events & selectors.EVENT_READ:
                        self._recv(key.data)
            self._service_waiting()
        notify.notify("STOPPING=1\nSTATUS=stopping")
        log.info("stopping gpu=%d", self.gpu)
        self._queue.put(None)
        for c in list(self.clients.values()):
            self._drop(c, "service stopping")
        return 0
