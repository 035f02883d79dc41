"""NIXL, the transfer library: one agent per service, registrations and READs of host or GPU memory.

NIXL (PyPI ``nixl``, UCX bundled) is optional (``weightcache[seeding]``). Its modules are imported here and
only here, lazily: ``nixl_cu12`` (or ``nixl_cu13``) directly, because ``import nixl`` imports torch when it
is installed to guess the CUDA major. Without NIXL, :func:`nixl_api` raises :class:`NixlMissing` and
seeding is off (one log line, :mod:`weightcache.seeding._seeder`).

The agent exchanges its metadata over the authenticated control channel (``get_agent_metadata`` /
``add_remote_agent``), never over NIXL's own listener (``enable_listen_thread`` stays off: that port
would hand this node's registrations to anyone who asks). It is created with
``NIXL_THREAD_SYNC_STRICT``: the source's connection threads and the loader use it at once; and without
NIXL's progress thread, which polls without pause (half a core of an idle service on the test machine):
the transport progresses when the receiver polls its READ and while the source waits for a peer's ``done``
(:meth:`Agent.progress`), so an idle service spends nothing on it.

Memory kinds (:data:`MEM_TYPES`): ``DRAM`` (a memfd mapping: the host backend's slabs, a CUDA service's host
tier) and ``VRAM`` (a CUDA VMM mapping; NIXL's ``VRAM_SEG``, device id = the GPU index). Each side names the
kind of its own memory; a READ may pair any two (UCX moves GPU memory with ``cuda_copy`` / ``cuda_ipc`` on one
node, GPUDirect RDMA across nodes). A ``VRAM`` registration and READ run with the slab's CUDA context current
(``current``: the slab's context manager), as UCX's CUDA transports need.

Forbidden imports: torch, weightcache.daemon; nixl at module level.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

log = logging.getLogger(__name__)

#: Bytes of one READ request; a bandwidth cap is kept between requests.
CHUNK_BYTES = 64 * 1024 * 1024
#: Transports the configuration may name (NIXL backend plugins).
TRANSPORTS = ("UCX", "LIBFABRIC")
#: NIXL memory kinds a slab registers as: host memory, GPU memory (device id = the GPU index).
MEM_TYPES = ("DRAM", "VRAM")


def _no_context() -> AbstractContextManager[None]:
    return contextlib.nullcontext()


class NixlMissing(Exception):
    """NIXL is not installed (or does not load here); the message says how to install it."""


class TransferError(Exception):
    """A READ failed; ``reason``: ``transfer_error``, ``timeout``, ``disconnected``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def nixl_api() -> Any:
    """NIXL's Python API module (``nixl_cu12._api`` or ``nixl_cu13._api``), without importing torch.

    Raises:
        NixlMissing: neither imports.
    """
    errors = []
    for name in ("nixl_cu12", "nixl_cu13"):
        try:
            return __import__(f"{name}._api", fromlist=["_api"])
        except Exception as e:  # noqa: BLE001 - ImportError, or a shared library that does not load here
            errors.append(f"{name}: {e!r}"[:200])
    raise NixlMissing("NIXL is not installed (pip install 'weightcache[seeding]', i.e. nixl==1.5.1; "
                      "weightcache-setup-runtime installs it when the config names peers): " + "; ".join(errors))


def nixl_installed() -> None:
    """Checks that a NIXL package is installed without importing it (the import takes 0.2 s: it happens on the
    agent's thread, off the service's start).

    Raises:
        NixlMissing: neither ``nixl_cu12`` nor ``nixl_cu13`` is installed.
    """
    import importlib.util

    if not any(importlib.util.find_spec(n) is not None for n in ("nixl_cu12", "nixl_cu13")):
        raise NixlMissing("NIXL is not installed (pip install 'weightcache[seeding]', i.e. nixl==1.5.1; "
                          "weightcache-setup-runtime installs it when the config names peers)")


def buffer_address(buf: Any) -> tuple[int, Any]:
    """``(address, keepalive)`` of a bytes-like object's first byte (a memfd mapping; read-only is fine).

    The caller keeps ``keepalive`` (a numpy view) while NIXL may touch the memory, then drops it so the
    mapping can be closed.
    """
    import numpy as np

    arr = np.frombuffer(buf, dtype=np.uint8)
    return int(arr.ctypes.data), arr


class Agent:
    """This service's NIXL agent.

    Args:
        name (`str`): unique in the fleet (host, GPU, pid).
        transport (`str`): :data:`TRANSPORTS`.
        devices (`tuple[str, ...]`): network devices (UCX: ``UCX_NET_DEVICES``, e.g. ``mlx5_0:1``; empty: all).

    Raises:
        NixlMissing: no NIXL. RuntimeError: NIXL could not create the agent or the backend.
    """

    def __init__(self, name: str, transport: str = "UCX", devices: tuple[str, ...] = ()) -> None:
        api = nixl_api()
        if devices and transport == "UCX":
            os.environ.setdefault("UCX_NET_DEVICES", ",".join(devices))
        # No progress thread: NIXL's spins (pthrDelay 0) and took half a core of an idle service here; the
        # initiator progresses while it polls its READ, the source while a peer reads (progress()).
        cfg = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[transport],
                                    sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._api = api
        self.agent = api.nixl_agent(name, cfg)
        if transport not in self.agent.backends:
            raise RuntimeError(f"NIXL has no {transport} backend here (plugins: {self.agent.plugin_list})")
        self.name = name
        self.transport = transport
        self._lock = threading.Lock()
        #: Registrations and remote agents held now (the tests and ``status`` check they go back to 0).
        self.registrations = 0
        self.remote_agents = 0

    def progress(self) -> None:
        """Lets the transport serve what peers ask of this agent (a READ of a registration over TCP needs the
        target's progress): the source calls it while a peer reads. Notifications are not used (dropped)."""
        self.agent.get_new_notifs()

    def metadata(self, reg: Any = None) -> bytes:
        """This agent's metadata for the peer's ``add_remote_agent``: its connection info and, with ``reg`` (a
        :meth:`register` handle), that registration only (NIXL's partial metadata: a peer learns nothing of the
        other slabs registered for other peers at the same time); without ``reg``, every registration."""
        if reg is None:
            return self.agent.get_agent_metadata()
        return self.agent.get_partial_agent_metadata(reg, inc_conn_info=True, backends=[self.transport])

    def register(self, address: int, size_bytes: int, mem_type: str = "DRAM", dev_id: int = 0) -> Any:
        """Registers ``[address, address + size_bytes)``; returns the handle :meth:`deregister` takes.

        Args:
            mem_type (`str`): :data:`MEM_TYPES`: ``DRAM`` (host memory) or ``VRAM`` (GPU memory, with the
                GPU's CUDA context current on this thread).
            dev_id (`int`): the GPU index for ``VRAM`` (0 for ``DRAM``).

        Raises:
            ValueError: another ``mem_type``. Whatever NIXL raises when it refuses the memory.
        """
        if mem_type not in MEM_TYPES:
            raise ValueError(f"NIXL memory type {mem_type!r}: not one of {MEM_TYPES}")
        reg = self.agent.register_memory([(address, size_bytes, dev_id, "")], mem_type, backends=[self.transport])
        with self._lock:
            self.registrations += 1
        return reg

    def deregister(self, reg: Any) -> None:
        """Releases a registration (best effort: logged when NIXL refuses)."""
        try:
            self.agent.deregister_memory(reg, backends=[self.transport])
        except Exception as e:  # noqa: BLE001 - a release must not mask the caller's error
            log.warning("seeding: NIXL deregistration failed error=%r", e)
        with self._lock:
            self.registrations -= 1

    def read(self, remote_md: bytes, remote: list[tuple[int, int]], local_address: int, size_bytes: int,
             deadline: float, bandwidth_bytes_per_s: int = 0, alive: Callable[[], bool] = lambda: True,
             progress: Callable[[int, int], None] | None = None, local_mem: str = "DRAM", local_dev: int = 0,
             remote_mem: str = "DRAM", remote_dev: int = 0,
             current: Callable[[], AbstractContextManager[Any]] = _no_context) -> float:
        """READs ``size_bytes`` from the remote agent's ``remote`` regions (``(address, length)``, in order) into
        local memory at ``local_address``, in :data:`CHUNK_BYTES` requests; returns the seconds it took.

        The local range is registered for the read and released after; the remote agent is added from
        ``remote_md`` and removed after, whatever happens. ``local_mem``/``local_dev`` name the kind of the
        local range, ``remote_mem``/``remote_dev`` the peer's (:data:`MEM_TYPES`, the GPU index); ``current``
        is entered around the registration and each request (a GPU slab's CUDA context).

        Args:
            deadline (`float`): ``time.monotonic()`` seconds by which it must be done.
            bandwidth_bytes_per_s (`int`): 0: no cap; else the requests are paced to stay under it.
            alive (`callable`): ``() -> bool``, polled while waiting: False (the control connection closed)
                ends the read with ``disconnected``.
            progress (`callable`, *optional*): ``progress(done_bytes, total_bytes)`` after each request (the
                loader's: it raises to cancel the load, which ends the read, everything released).

        Raises:
            TransferError: ``transfer_error`` (NIXL reported an error, or the remote regions are too short),
                ``timeout``, ``disconnected``.
        """
        if local_mem not in MEM_TYPES or remote_mem not in MEM_TYPES:
            raise TransferError("transfer_error", f"memory types {local_mem!r} <- {remote_mem!r}: not {MEM_TYPES}")
        if sum(n for _, n in remote) < size_bytes:
            raise TransferError("transfer_error", f"the peer offered {sum(n for _, n in remote)} bytes, "
                                                  f"the slab needs {size_bytes}")
        try:
            with current():  # UCX unpacks a GPU peer's keys (cuda_ipc) with the context current
                peer = self.agent.add_remote_agent(remote_md)
        except Exception as e:  # noqa: BLE001 - NIXL's own error types
            # UCX connects to the peer's worker here: a peer that is gone fails this, and its connection is closed
            raise TransferError("transfer_error" if alive() else "disconnected",
                                f"NIXL refused the peer's metadata: {e!r}") from None
        peer = peer.decode() if isinstance(peer, bytes) else peer
        with self._lock:
            self.remote_agents += 1
        reg = None
        try:
            try:
                with current():
                    reg = self.register(local_address, size_bytes, local_mem, local_dev)
            except Exception as e:  # noqa: BLE001 - NIXL's own error types
                raise TransferError("transfer_error", f"NIXL could not register the local {local_mem} range: "
                                                      f"{e!r}") from None
            t0 = time.monotonic()
            done = 0
            for raddr, rlen in remote:
                off = 0
                while off < rlen and done < size_bytes:
                    n = min(CHUNK_BYTES, rlen - off, size_bytes - done)
                    with current():
                        self._one(peer, (raddr + off, remote_mem, remote_dev),
                                  (local_address + done, local_mem, local_dev), n, deadline, alive)
                    off += n
                    done += n
                    if progress is not None:
                        progress(done, size_bytes)
                    if bandwidth_bytes_per_s > 0:
                        ahead = done / bandwidth_bytes_per_s - (time.monotonic() - t0)
                        if ahead > 0:
                            time.sleep(min(ahead, max(0.0, deadline - time.monotonic())))
            return time.monotonic() - t0
        finally:
            if reg is not None:
                with current():
                    self.deregister(reg)
            try:
                with current():
                    self.agent.remove_remote_agent(peer)
            except Exception as e:  # noqa: BLE001
                log.warning("seeding: NIXL could not remove remote agent %s error=%r", peer, e)
            with self._lock:
                self.remote_agents -= 1

    def _one(self, peer: str, far: tuple[int, str, int], near: tuple[int, str, int], n: int, deadline: float,
             alive: Callable[[], bool]) -> None:
        """One READ request of ``n`` bytes: ``far`` and ``near`` are ``(address, mem_type, dev_id)``."""
        local = self.agent.get_xfer_descs([(near[0], n, near[2])], near[1])
        remote = self.agent.get_xfer_descs([(far[0], n, far[2])], far[1])
        try:
            h = self.agent.initialize_xfer("READ", local, remote, peer, b"", backends=[self.transport])
        except Exception as e:  # noqa: BLE001
            raise TransferError("transfer_error", f"NIXL could not prepare the READ: {e!r}") from None
        try:
            try:
                state = self.agent.transfer(h)
                polls = 0
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise TransferError("timeout", "the READ did not finish in time")
                    polls += 1
                    if polls % 64 == 0 and not alive():
                        raise TransferError("disconnected", "the peer closed the control connection mid-transfer")
                    time.sleep(0.0002 if polls < 1000 else 0.002)
                    state = self.agent.check_xfer_state(h)
            except TransferError:
                raise
            except Exception as e:  # noqa: BLE001 - NIXL raises e.g. nixlRemoteDisconnectError: terminal
                gone = "DISCONNECT" in repr(e).upper() or not alive()
                raise TransferError("disconnected" if gone else "transfer_error",
                                    f"NIXL failed the READ: {e!r}") from None
            if state != "DONE":
                if not alive():  # the peer's process is gone: its connection closed with it
                    raise TransferError("disconnected", f"NIXL reported {state} for the READ and the peer closed "
                                                        f"the control connection")
                raise TransferError("transfer_error", f"NIXL reported {state} for the READ")
        finally:
            try:
                h.release()
            except Exception as e:  # noqa: BLE001 - an active transfer that cannot be cancelled
                log.warning("seeding: NIXL could not release a transfer handle error=%r", e)
