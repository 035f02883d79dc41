"""The source side: a peer asks for a slab this service holds; it gets NIXL descriptors of the sealed memfd.

Off the serving loop: a listener thread accepts, one thread per connection runs the exchange of
:mod:`._channel`. The only thing the serving loop does is :meth:`Offers.answer` (on its wake-up pipe): it
finds the slot, checks the model's ``serve_to_peers``, and hands over *duplicates* of the slab's and the
manifest's fds, so an eviction meanwhile frees nothing under the transfer (the memory goes when the
transfer ends). Bounded: :attr:`SeedSettings.max_transfers` connections at once (more get ``busy``), and
:attr:`SeedSettings.max_bytes` registered at once. The registration is released when the receiver says
``done``, when the connection closes, or at :attr:`SeedSettings.timeout_s`, whichever comes first.

What is offered, by where the slab's bytes are (:func:`_region`): a sealed memfd (the host backend's slab, a
CUDA service's host tier) is duplicated, mapped read-only by the source thread and registered as ``DRAM``; a
CUDA service's GPU slab (``CudaSealedSlab``) is registered as ``VRAM`` at the service's own read-only
mapping, device id = its GPU index, with the GPU's context current, the mapping held by the offer (an
eviction meanwhile unmaps it when the transfer ends). The manifest's digests are the slab's own family
(``xxh3_128`` for host slabs, ``sum64`` for GPU slabs and their host-tier copies); the reply names the
memory kind (``mem``, ``dev``) so the receiver builds its remote descriptors of that kind.

Forbidden imports: torch, weightcache.daemon, nixl (through :mod:`._agent` only).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import mmap
import os
import queue
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import WeightcacheError
from ..hashes import blake2b_hex
from ..journal import event
from ..memory.host import HostSealedSlab
from ._channel import Channel, ChannelError, parse_address
from ._samples import source_samples
from ._secret import Secret
from ._settings import SeedSettings, SeedStats

log = logging.getLogger(__name__)

#: The metrics' model label of a request for a model this service does not have (or not looked up).
OTHER = "(other)"


@dataclass
class Offer:
    """A slab handed to a source thread: fds it owns (and closes), the bytes to register, the key.

    Attributes:
        fd (`int`): a duplicate of the sealed memfd (``DRAM``), or -1 for a GPU slab (``VRAM``).
        size_bytes (`int`): bytes registered.
        mem (`str`): ``DRAM`` or ``VRAM`` (:data:`weightcache.seeding._agent.MEM_TYPES`).
        dev (`int`): the GPU index of a ``VRAM`` slab (0 for ``DRAM``).
        address (`int`): the device address of a ``VRAM`` slab (a ``DRAM`` one is mapped by the thread).
        holder: keeps a ``VRAM`` slab's mapping alive until the offer is dropped.
        current (`callable`): ``() -> context manager``: the GPU's context current (``VRAM``), else nothing.
    """

    fd: int
    size_bytes: int
    manifest_fd: int
    manifest_bytes: int
    key: dict
    #: The checkpoint directory the slab was made from (the samples are read there).
    path: str = ""
    mem: str = "DRAM"
    dev: int = 0
    address: int = 0
    holder: Any = None
    current: Callable[[], Any] = contextlib.nullcontext


@dataclass(eq=False)
class Lookup:
    """One source thread's question to the serving loop, and its answer (``offer``, or ``reason``)."""

    model: str
    tp_size: int
    tp_rank: int
    done: threading.Event = field(default_factory=threading.Event)
    offer: Offer | None = None
    reason: str = "not_held"
    #: A slot of that name and rank exists here (else the metrics label the model ``(other)``: a peer's
    #: request never grows the label set).
    known: bool = False


class Offers:
    """The hand-over between source threads and the serving loop.

    Args:
        wake (`callable`): ``() -> None``, wakes the serving loop (one byte on its pipe).
    """

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._asked: queue.SimpleQueue[Lookup] = queue.SimpleQueue()

    def ask(self, model: str, tp_size: int, tp_rank: int, timeout_s: float) -> Lookup:
        """Asks the serving loop for a slab; returns the answered :class:`Lookup` (``reason`` ``timeout`` when
        the loop did not answer in ``timeout_s`` seconds)."""
        q = Lookup(model, tp_size, tp_rank)
        self._asked.put(q)
        self._wake()
        if not q.done.wait(timeout_s):
            q.reason = "timeout"
        return q

    def answer(self, slots: Iterable[Any]) -> None:
        """Answers every pending lookup from the service's ``slots`` (serving loop only; no I/O but ``dup``)."""
        while True:
            try:
                q = self._asked.get_nowait()
            except queue.Empty:
                return
            try:
                _answer(q, slots)
            except Exception as e:
                log.critical("seeding: answering a peer's lookup failed model=%s error=%r", q.model, e, exc_info=True)
                q.reason = "internal"
            q.done.set()


def _answer(q: Lookup, slots: Iterable[Any]) -> None:
    for s in slots:
        p = s.placement
        if (p.model.name, p.tp_size, p.tp_rank) != (q.model, q.tp_size, q.tp_rank):
            continue
        q.known = True
        if not getattr(p.model, "serve_to_peers", False):
            q.reason = "not_allowed"
            return
        # The resident slab first (a GPU slab: GPU to GPU), else its host-tier copy.
        slab = s.sealed if _region(s.sealed) is not None else s.hosted
        kind = _region(slab)
        if s.state.value not in ("ready", "hosted") or kind is None or s.manifest_file is None or s.manifest is None:
            q.reason = "not_held"
            return
        mfd = os.dup(s.manifest_file.fd)
        try:
            if kind == "DRAM":
                q.offer = Offer(os.dup(slab.fd), slab.size_bytes, mfd, s.manifest_file.size_bytes, s.manifest.key,
                                p.model.path)
            else:
                ptr, gpu, current, holder = slab.device_range()
                q.offer = Offer(-1, slab.size_bytes, mfd, s.manifest_file.size_bytes, s.manifest.key, p.model.path,
                                "VRAM", gpu, ptr, holder, current)
        except BaseException:
            os.close(mfd)
            raise
        q.reason = ""
        return
    q.reason = "not_held"


def _region(slab: Any) -> str | None:
    """The NIXL memory kind a sealed slab is offered as: ``DRAM`` for a sealed memfd (the host backend's
    ``HostSealedSlab``, a CUDA service's host tier ``HostTierSlab``), ``VRAM`` for a CUDA service's GPU slab
    (it has ``device_range``), None for anything else (nothing, or closed)."""
    if slab is None:
        return None
    tier = sys.modules.get("weightcache.memory.cuda_tier")  # loaded only by a CUDA service
    if isinstance(slab, HostSealedSlab) or (tier is not None and isinstance(slab, tier.HostTierSlab)):
        return "DRAM" if slab.fd >= 0 else None
    if callable(getattr(slab, "device_range", None)) and getattr(slab, "mapped", False):
        return "VRAM"
    return None


class Source:
    """The seeding listener of one service.

    Args:
        settings (`SeedSettings`): limits, address, timeout.
        secret (`Secret`): the fleet's secrets.
        agent (`callable`): ``() -> Agent``, this service's NIXL agent (created on first use).
        offers (`Offers`): the hand-over to the serving loop.
        stats (`SeedStats`): counters.
        gpu (`int`): this instance's GPU index (added to the port of ``settings.listen``).
    """

    def __init__(self, settings: SeedSettings, secret: Secret, agent: Callable[[], Any], offers: Offers,
                 stats: SeedStats, gpu: int = 0) -> None:
        self.settings = settings
        self.secret = secret
        self._agent = agent
        self.offers = offers
        self.stats = stats
        host, port = parse_address(settings.listen)
        self.address = (host, port + gpu)
        self._lock = threading.Lock()
        self._active = 0
        self._active_bytes = 0
        self._connections = 0
        #: Connections open at once (authenticated or not): beyond, a new one is closed at once.
        self.max_connections = 4 * settings.max_transfers + 16
        self._sock: socket.socket | None = None

    def start(self) -> None:
        """Binds the listener and starts its thread.

        Raises:
            OSError: the address cannot be bound.
        """
        family = socket.AF_INET6 if ":" in self.address[0] else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(self.address)
        s.listen(64)
        self._sock = s
        threading.Thread(target=self._accept, name="weightcache-seed-source", daemon=True).start()
        log.info("seeding: serving peers on %s:%d transport=%s", *self.address, self.settings.transport)

    def stop(self) -> None:
        """Closes the listener (transfers under way end at their timeout or ``done``)."""
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            with self._lock:  # a stranger's connections (each a thread until it authenticates) are bounded
                full = self._connections >= self.max_connections
                if not full:
                    self._connections += 1
            if full:
                log.debug("seeding: connection from %s:%d closed: %d open", addr[0], addr[1], self.max_connections)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, f"{addr[0]}:{addr[1]}"),
                             name="weightcache-seed-serve", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        conn.settimeout(min(30.0, self.settings.timeout_s))
        ch = Channel(conn, self.secret, server=True)
        model = ""
        try:
            ch.open()
            try:
                req = ch.recv("request")
            except ChannelError as e:
                if e.reason == "auth":
                    log.warning("seeding: refused peer=%s reason=auth: %s", peer, e,
                                extra=event("seed_rejected", reason="auth", peer=peer))
                    self.stats.count("served", (OTHER, "refused", "auth"))
                    ch.refuse_auth()
                raise
            if req.get("probe") is True:  # check-config: both secrets checked, nothing asked, nothing counted
                ch.send("reply", {"ok": True, "probe": True})
                return
            model = str(req.get("model", ""))[:200]
            blobs = req.get("blobs") if isinstance(req.get("blobs"), dict) else None
            self._one(ch, conn, peer, model, int(req.get("tp_size", 0)), int(req.get("tp_rank", -1)),
                      req.get("samples") or [], blobs)
        except ChannelError as e:
            log.info("seeding: exchange with peer=%s ended reason=%s: %s", peer, e.reason, e)
        except (ValueError, TypeError) as e:
            log.warning("seeding: a malformed request from peer=%s: %r", peer, e)
        except Exception as e:
            log.critical("seeding: serving peer=%s failed model=%s error=%r", peer, model, e, exc_info=True)
        finally:
            conn.close()
            with self._lock:
                self._connections -= 1

    def _refuse(self, ch: Channel, peer: str, model: str, reason: str) -> None:
        self.stats.count("served", (model or OTHER, "refused", reason))
        log.info("seeding: not serving peer=%s model=%s reason=%s", peer, model, reason)
        ch.send("reply", {"ok": False, "reason": reason})

    def _one(self, ch: Channel, conn: socket.socket, peer: str, model: str, tp_size: int, tp_rank: int,
             samples: list, blobs: dict | None = None) -> None:
        with self._lock:
            busy = self._active >= self.settings.max_transfers
            if not busy:
                self._active += 1
        if busy:
            return self._refuse(ch, peer, OTHER, "busy")
        try:
            q = self.offers.ask(model, tp_size, tp_rank, 10.0)
            if q.offer is None:
                return self._refuse(ch, peer, model if q.known else OTHER, q.reason)
            self._transfer(ch, conn, peer, model, q.offer, samples, blobs)
        finally:
            with self._lock:
                self._active -= 1

    def _transfer(self, ch: Channel, conn: socket.socket, peer: str, model: str, offer: Offer,
                  samples: list, blobs: dict | None = None) -> None:
        reserved = 0
        mapping = keep = reg = None
        agent = None
        try:
            with self._lock:
                cap = self.settings.max_bytes
                if cap and self._active_bytes + offer.size_bytes > cap:
                    return self._refuse(ch, peer, model, "busy")
                self._active_bytes += offer.size_bytes
                reserved = offer.size_bytes
            try:  # the receiver's samples of the checkpoint, read from ours (its files still the slab's)
                answers = source_samples(offer.path, offer.key.get("checkpoint") or {}, samples, blobs)
            except (ValueError, TypeError) as e:
                log.warning("seeding: malformed samples from peer=%s model=%s: %s", peer, model, e)
                return self._refuse(ch, peer, model, "protocol")
            except (WeightcacheError, OSError) as e:
                log.warning("seeding: cannot read the samples model=%s: %s", model, e)
                return self._refuse(ch, peer, model, "not_held")
            if answers is None:  # the checkpoint changed since the slab was made: not offered
                return self._refuse(ch, peer, model, "not_held")
            answers, my_blobs = answers
            manifest = os.pread(offer.manifest_fd, offer.manifest_bytes, 0)
            if offer.mem == "DRAM":
                mapping = mmap.mmap(offer.fd, offer.size_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
                from ._agent import buffer_address

                address, keep = buffer_address(mapping)
            else:
                address = offer.address
            agent = self._agent()
            with offer.current():
                reg = agent.register(address, offer.size_bytes, offer.mem, offer.dev)
            t0 = time.monotonic()
            ch.send("reply", {"ok": True, "agent": agent.name,
                              "agent_md": base64.b64encode(agent.metadata(reg)).decode(),
                              "descs": [[address, offer.size_bytes]], "mem": offer.mem, "dev": offer.dev,
                              "manifest": base64.b64encode(manifest).decode(), "key": offer.key,
                              "digest": manifest_digest(manifest),
                              "samples": [base64.b64encode(b).decode() for b in answers], "blobs": my_blobs})
            with offer.current():  # UCX stages a GPU source's bytes for TCP with the context current
                _progress_until_readable(agent, conn, time.monotonic() + self.settings.timeout_s)
            conn.settimeout(10.0)
            done = ch.recv("done")
            ch.send("ack", {"ok": True})
            dt = time.monotonic() - t0
            if done.get("ok"):
                self.stats.count("served", (model, "served", ""))
                self.stats.count("served_bytes", model, offer.size_bytes)
                log.info("seeding: served model=%s peer=%s size_bytes=%d duration_ms=%.0f", model, peer,
                         offer.size_bytes, dt * 1e3,
                         extra=event("seed_served", model, size_bytes=offer.size_bytes, duration_ms=dt * 1e3,
                                     peer=peer))
            else:
                reason = str(done.get("reason", "unknown"))[:64]
                self.stats.count("served", (model, "refused_by_peer", reason))
                log.info("seeding: peer=%s did not keep model=%s reason=%s", peer, model, reason)
        finally:
            if reg is not None:
                with offer.current():
                    agent.deregister(reg)
            keep = None  # noqa: F841 - the numpy view goes before the mapping closes
            if mapping is not None:
                mapping.close()
            if offer.fd >= 0:
                os.close(offer.fd)
            os.close(offer.manifest_fd)
            offer.holder = None  # a GPU slab evicted meanwhile is unmapped when the last reference goes
            if reserved:
                with self._lock:
                    self._active_bytes -= reserved
            if reg is not None:
                log.info("seeding: released model=%s for peer=%s nixl_registrations=%d", model, peer,
                         agent.registrations)


def _progress_until_readable(agent: Any, conn: socket.socket, deadline: float) -> None:
    """Progresses NIXL (the peer's READ needs it over TCP) until the peer says something on ``conn`` (its
    ``done``, or a hang-up).

    Raises:
        ChannelError: ``timeout`` past ``deadline`` (``time.monotonic()`` seconds).
    """
    while True:
        ready, _, _ = select.select([conn], [], [], 0.001)
        if ready:
            return
        agent.progress()
        if time.monotonic() > deadline:
            raise ChannelError("timeout", "the peer did not finish its transfer in time")


def manifest_digest(manifest_file: bytes) -> str:
    """The offer's ``digest``: blake2b-128 of the manifest file, which carries every tensor's digest."""
    return blake2b_hex(manifest_file)
