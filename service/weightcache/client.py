"""The engine side: ``attach()``, its typed errors, and the disk fallback.

``attach()`` asks the GPU's service for the slab, checks the cache key of the
reply against the checkpoint as it is now (its ``config.json`` and ``stat()``
of its files: never a tensor byte, see :func:`pipeline.check_key`), imports
the received fd read-only and builds tensor views from the manifest. With
``fallback=True`` a missing service, a model not ready in time,
a different key or a refusal makes it load from disk through the very same
pipeline (:mod:`weightcache.pipeline`), so the tensors are bit-identical; the
reason is logged and kept in :attr:`Attachment.fallback_reason`.

Forbidden imports: weightcache.config, weightcache.daemon, selectors.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import grp
import math
import os
import pwd
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterator

from . import pipeline, protocol, quant
from .checkpoint import Checkpoint
from .errors import (
    CacheKeyMismatch,
    ConfigError,
    DaemonUnavailable,
    ManifestInvalid,
    ManifestSlabMismatch,
    ModelLoading,
    RemoteProtocolError,
    UnsupportedQuantization,
    WeightcacheError,
    from_wire,
)
from .fdpass import recv_with_fds
from .journal import event
from .manifest import MAX_MANIFEST_BYTES, LayoutMap, Manifest, build_views, unpack_file
from .spec import DTYPE_NAMES, LoadRequest
from .wire import DEFAULT_DTYPE, DEFAULT_KERNEL, DEFAULT_MODE, DEFAULT_NAMING, NAMINGS, AttachMode

log = logging.getLogger(__name__)

DEFAULT_SOCKET_DIR = "/run/weightcache"
#: First read of a reply, in bytes; the rest of a larger frame is read with one exact-size recv.
#: Below glibc's 128 KiB mmap threshold: a 1 MiB recvmsg buffer costs ~40 µs per read in
#: mmap/munmap and page faults, more than reading a 66 KB manifest frame in two reads.
_RECV = 64 * 1024


def resolve_socket_dir(explicit: str | None = None) -> str:
    """``explicit``, else ``$WEIGHTCACHE_SOCKET_DIR``, else ``/run/weightcache``."""
    return explicit or os.environ.get("WEIGHTCACHE_SOCKET_DIR") or DEFAULT_SOCKET_DIR


def listening_gpus(socket_dir: str) -> list[int]:
    """The GPU indices of the ``<N>.sock`` sockets in ``socket_dir``, increasing ([] when it cannot be read)."""
    try:
        names = os.listdir(socket_dir)
    except OSError:
        return []
    return sorted(int(n[:-5]) for n in names if n.endswith(".sock") and n[:-5].isdigit())


def physical_gpu(index: int, visible: str | None) -> int:
    """The physical GPU index (the service instance) of in-process CUDA device ``index``.

    Instances are numbered as ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` counts GPUs with
    nothing hidden; set that order in the engine too, so that the entries of
    ``CUDA_VISIBLE_DEVICES`` mean the same GPUs.

    Args:
        index (`int`): the torch device index.
        visible (`str`, *optional*): ``$CUDA_VISIBLE_DEVICES``.

    Raises:
        ConfigError (`config_invalid`): ``CUDA_VISIBLE_DEVICES`` names devices
            by UUID or MIG id; pass ``gpu`` to :func:`attach` (vLLM: set ``gpu`` in
            the extra config) instead.

    Example:
        >>> physical_gpu(1, "4,5")
        5
    """
    if not visible:
        return index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries) or not entries[index].isdigit():
        raise ConfigError(
            f"cannot map CUDA device {index} to a weightcache instance through CUDA_VISIBLE_DEVICES={visible!r}; "
            f"pass gpu= to attach() (vLLM: set \"gpu\" in --model-loader-extra-config)", key="gpu")
    return int(entries[index])


_BACKENDS: dict[str, Any] = {}


def local_backend(device: str):
    """The backend that maps slabs onto ``device`` (``cpu``: host memfd; ``cuda:N``: VMM on GPU N).

    One per device string for the life of the process: a CUDA backend retains
    the GPU's primary context and queries its granularity and UUID once, not
    on every attach.
    """
    backend = _BACKENDS.get(device)
    if backend is None:
        from .memory import get_backend

        if device.startswith("cuda"):
            backend = get_backend("cuda", int(device.split(":", 1)[1]) if ":" in device else 0)
        else:
            backend = get_backend("host")
        _BACKENDS[device] = backend
    return backend


def device_info(device: str) -> dict[str, Any]:
    """Cache-key device fields for a torch device string (``cpu``, ``cuda:1``)."""
    return local_backend(device).device_info()


#: Pause between ``connect`` attempts while the service's backlog is full (seconds, first and largest).
_BACKLOG_PAUSE_S = (0.001, 0.05)


def _connect(sock: socket.socket, path: str, deadline: float) -> None:
    """``connect``, waiting while the listen backlog is full (``EAGAIN``) until ``deadline`` (monotonic s).

    A full backlog means the service is busy (starting, or many engines
    connecting at once), not absent: the kernel answers ``EAGAIN`` at once on
    a Unix socket instead of waiting, so this waits for it, backing off from
    1 ms to 50 ms. It is part of connecting within the caller's timeout, not a
    retry of a request; the first wait is logged as a WARNING, each attempt at
    DEBUG, and the number of waits once connected.
    """
    pause, waits = _BACKLOG_PAUSE_S[0], 0
    while True:
        try:
            sock.connect(path)
            if waits:
                log.info("connected after a full backlog socket=%s waits=%d", path, waits)
            return
        except BlockingIOError:
            if time.monotonic() + pause > deadline:
                raise socket.timeout(f"the service's listen backlog stayed full for {waits} attempts") from None
            if not waits:
                log.warning("service backlog full, waiting socket=%s", path)
            waits += 1
            log.debug("connect again after a full backlog socket=%s attempt=%d pause_ms=%.0f", path, waits,
                      pause * 1e3)
            time.sleep(pause)
            pause = min(pause * 2, _BACKLOG_PAUSE_S[1])


def _denied_text(path: str, e: OSError) -> str:
    """Why connecting to ``path`` gave ``EACCES``: who we are, the socket's group, and the fix."""
    uid = os.geteuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    try:
        gid = os.stat(path).st_gid
        group = grp.getgrgid(gid).gr_name
    except (OSError, KeyError):  # the directory is not searchable either, or the gid has no name
        group = "weightcache-clients"
    return (f"no weightcache service at {path}: {e.strerror}: user {user} (uid {uid}) may not connect; the socket "
            f"admits root and group {group}: add the user to it (usermod -aG {group} {user}, then log in again) "
            f"or run the engine with that group")


class Session:
    """A blocking client connection to one service socket (one per attach).

    The connection is the lease: closing it ends every lease taken on it.

    Args:
        path (`str`): the service's socket, e.g. ``/run/weightcache/0.sock``.
        timeout (`float`): seconds for connecting and for each reply.

    Raises:
        DaemonUnavailable (`daemon_unavailable`): nothing listens, connection
            refused, or no reply in time.
    """

    def __init__(self, path: str, timeout: float = 30.0, client: str = "", hello: bool = True) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        try:
            _connect(self.sock, path, time.monotonic() + timeout)
        except PermissionError as e:
            self.sock.close()
            raise DaemonUnavailable(_denied_text(path, e), socket=path) from None
        except (FileNotFoundError, ConnectionRefusedError, socket.timeout, OSError) as e:
            self.sock.close()
            raise DaemonUnavailable(f"no weightcache service at {path}: {e.strerror or e}", socket=path) from None
        self.conn = protocol.Connection(protocol.CLIENT)
        self.client = client or f"pid={os.getpid()}"
        self.hello = self.request(self.hello_message()) if hello else None

    def hello_message(self) -> protocol.Hello:
        return protocol.Hello(protocol.PROTOCOL_VERSION, self.client)

    def pipeline(self, msgs: list[protocol.Message], timeout: float | None = None) -> list[Any]:
        """Sends ``msgs`` in one write, then reads one reply each, in order.

        Saves a round trip per message (``hello`` + ``attach`` in one go). The
        fds of the last reply are in ``self.last_fds``.

        Raises:
            DaemonUnavailable: the service closed the connection or timed out.
            WeightcacheError: the first typed error among the replies.
        """
        self.send(msgs)
        return self.replies(len(msgs), timeout)

    def send(self, msgs: list[protocol.Message]) -> None:
        """Writes ``msgs`` in one write without waiting for replies (see :meth:`replies`).

        Raises:
            DaemonUnavailable: the service went away.
        """
        data = b"".join(self.conn.send(m)[0] for m in msgs)
        try:
            self.sock.sendall(data)
        except OSError as e:
            raise DaemonUnavailable(f"weightcache service at {self.path} went away: {e}", socket=self.path) from None

    def replies(self, count: int, timeout: float | None = None) -> list[Any]:
        """Reads ``count`` replies to what :meth:`send` wrote (fds of the last one in ``self.last_fds``).

        Raises:
            DaemonUnavailable: the service closed the connection or timed out.
            WeightcacheError: the first typed error among the replies.
        """
        if timeout is not None:
            self.sock.settimeout(max(0.001, timeout))
        replies = []
        for _ in range(count):
            reply, fds = self._read_message()
            if isinstance(reply, protocol.Error):
                for fd in fds:
                    os.close(fd)
                raise from_wire(reply.code, reply.message, reply.details)
            self.last_fds = fds
            replies.append(reply)
        return replies

    def request(self, msg: protocol.Message, timeout: float | None = None) -> Any:
        """Sends ``msg`` and returns the reply message (fds in ``self.last_fds``).

        Raises:
            DaemonUnavailable: the service closed the connection or timed out.
            WeightcacheError: the typed error the service replied with.
        """
        return self.pipeline([msg], timeout)[0]

    def _read_message(self) -> tuple[protocol.Message, list[int]]:
        while True:
            try:
                ev = self.conn.next_message()
            except RemoteProtocolError:
                for fd in self.conn.take_all_fds():
                    os.close(fd)
                raise
            if ev is not protocol.NEED_DATA:
                return ev
            try:
                data, fds = recv_with_fds(self.sock, self.conn.bytes_wanted(_RECV), protocol.MAX_FDS_PER_FRAME)
            except socket.timeout:
                raise DaemonUnavailable(f"weightcache service at {self.path} did not answer in time",
                                        socket=self.path) from None
            except OSError as e:
                raise DaemonUnavailable(f"weightcache service at {self.path} went away: {e}",
                                        socket=self.path) from None
            if not data and not fds:
                raise DaemonUnavailable(f"weightcache service at {self.path} closed the connection",
                                        socket=self.path)
            self.conn.receive(data, fds)

    def close(self) -> None:
        for fd in self.conn.take_all_fds():
            os.close(fd)
        self.sock.close()


@dataclass
class Attachment:
    """Weights of one (model, layout, rank), from the service or from disk.

    Attributes:
        tensors (`dict[str, torch.Tensor]`): name -> tensor. ``zero_copy`` from
            the service: read-only views of the shared slab (a write faults),
            valid until :meth:`close`; ``copy``: private writable copies.
            Tied weights are the same tensor object under both names.
        layouts (`Mapping[str, dict]`): processing metadata per tensor (fused
            parts, FP8 view, padding, scale granularity...), decoded on first access.
        manifest (`Manifest`): the full manifest.
        source (`str`): ``"daemon"`` or ``"disk"``.
        fallback_reason (`str | None`): why the disk was used.
        resident_bytes (`int`): bytes of the shared slab mapped into this
            process outside the engine's own allocator (``torch.cuda.memory_allocated()``
            does not see them): subtract them from the memory budget before
            sizing the KV cache. 0 for the disk fallback and ``copy`` mode,
            whose bytes live in torch's allocator.
    """

    tensors: dict[str, Any]
    layouts: Mapping[str, dict]
    manifest: Manifest
    source: str
    fallback_reason: str | None
    resident_bytes: int
    _session: Session | None = None
    _slab: Any = None
    lease_id: int | None = None

    def close(self) -> None:
        """Ends the lease. Zero-copy views must not be used afterwards."""
        if self._session is not None:
            self._session.close()
            self._session = None

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load_request(path: str, dtype: str, naming: str, kernel: str, revision: str = "") -> LoadRequest:
    """The :class:`~weightcache.spec.LoadRequest` of checkpoint directory ``path`` (named after its last component)."""
    return LoadRequest(name=os.path.basename(os.path.normpath(path)) or path, path=path, dtype=dtype,
                       naming=naming, kernel=kernel, revision=revision)


def load_from_disk(model: LoadRequest, tp_size: int, tp_rank: int, device: str) -> tuple[Manifest, Any]:
    """Runs the shared pipeline into private memory on ``device``.

    Returns:
        ``(manifest, slab)``: the slab is a private 1-D ``uint8`` tensor.
    """
    import torch

    pl = pipeline.plan(model, tp_size, tp_rank, device_info(device))
    slab = torch.empty(pl.slab_size_bytes, dtype=torch.uint8, device=device)
    manifest = pipeline.execute(pl, slab, with_digests=False)
    return manifest, slab


def _copy_views(views: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    by_id: dict[int, Any] = {}
    for name, t in views.items():
        if id(t) not in by_id:
            by_id[id(t)] = t.clone()
        out[name] = by_id[id(t)]
    return out


@dataclass(frozen=True)
class AttachRequest:
    """The options of one :func:`attach`, validated once (see :func:`attach` for each field).

    Attributes:
        model (`str`): checkpoint directory, or a model name from the service's config.
        tp_size, tp_rank (`int`): the layout and this engine's rank.
        device (`str`): ``cpu`` or ``cuda:N``.
        mode (`AttachMode`): ``zero_copy`` or ``copy`` (a string is parsed into the member).
        fallback (`bool`): load from disk when the service cannot serve.
        timeout (`float`): seconds to wait for the service, a load in progress included.
        socket_dir (`str | None`): see :func:`resolve_socket_dir`.
        gpu (`int | None`): the service instance; None: the physical index of ``device`` (``CUDA_VISIBLE_DEVICES`` mapped back).
        dtype, naming, kernel (`str`): what to ask for when attaching by path.

    Raises:
        ValueError: ``mode`` is not ``zero_copy`` or ``copy``.
        ConfigError (`config_invalid`): another field no service could accept;
            ``details["key"]`` names it.
    """

    model: str
    tp_size: int = 1
    tp_rank: int = 0
    device: str = "cpu"
    mode: AttachMode = DEFAULT_MODE
    fallback: bool = True
    timeout: float = 30.0
    socket_dir: str | None = None
    gpu: int | None = None
    dtype: str = DEFAULT_DTYPE
    naming: str = DEFAULT_NAMING
    kernel: str = DEFAULT_KERNEL

    def __post_init__(self) -> None:
        try:  # the engine's API raises ValueError (documented); the wire message parses the same enum
            object.__setattr__(self, "mode", AttachMode(self.mode))
        except ValueError:
            raise ValueError(f"mode must be one of {', '.join(repr(m.value) for m in AttachMode)}, "
                             f"got {self.mode!r}") from None
        # A pathlib.Path or a torch.device is as good as its string.
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        if not isinstance(self.device, str) and type(self.device).__name__ == "device":
            object.__setattr__(self, "device", str(self.device))
        for problem, key in _arg_problems(self):
            raise ConfigError(f"attach(): {problem}", key=key)

    @property
    def socket_path(self) -> str:
        """The service's socket: ``<socket dir>/<gpu>.sock``, ``gpu`` defaulting to the physical index of ``device``."""
        gpu = self.gpu
        if gpu is None:  # ``cuda`` is device 0 of the process, as local_backend() maps it
            gpu = (physical_gpu(int(self.device.partition(":")[2] or 0), os.environ.get("CUDA_VISIBLE_DEVICES"))
                   if self.device.startswith("cuda") else 0)
        return os.path.join(resolve_socket_dir(self.socket_dir), f"{gpu}.sock")

    def load_request(self, path: str, dtype: str | None = None, naming: str | None = None,
                     kernel: str | None = None, revision: str = "") -> LoadRequest:
        """What the pipeline needs for checkpoint ``path``: this request's choices unless overridden."""
        return load_request(path, dtype or self.dtype, naming or self.naming, kernel or self.kernel, revision)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _arg_problems(req: AttachRequest) -> Iterator[tuple[str, str]]:
    """``(message, key)`` for each argument of ``req`` that no service or disk load could accept."""
    if not isinstance(req.model, str) or not req.model or "\0" in req.model:
        yield f"model {req.model!r} must be a checkpoint directory or a configured model name", "model"
    if not _is_int(req.tp_size) or req.tp_size < 1:
        yield f"tp_size {req.tp_size!r} must be an integer >= 1", "tp_size"
    elif not _is_int(req.tp_rank) or not 0 <= req.tp_rank < req.tp_size:
        yield f"tp_rank {req.tp_rank!r} must be an integer in [0, {req.tp_size}) for tp_size={req.tp_size}", "tp_rank"
    if not isinstance(req.device, str) or not re.fullmatch(r"cpu|cuda(:[0-9]+)?", req.device):
        yield f"device {req.device!r} must be 'cpu', 'cuda' or 'cuda:N'", "device"
    if isinstance(req.timeout, bool) or not isinstance(req.timeout, (int, float)) or not (
            math.isfinite(req.timeout) and req.timeout >= 0):
        yield f"timeout {req.timeout!r} must be a finite number of seconds >= 0", "timeout"
    if req.gpu is not None and (not _is_int(req.gpu) or req.gpu < 0):
        yield f"gpu {req.gpu!r} must be a GPU index (an integer >= 0) or None", "gpu"
    if req.dtype not in DTYPE_NAMES:
        yield f"dtype {req.dtype!r} is not one of {', '.join(DTYPE_NAMES)}", "dtype"
    if req.naming not in NAMINGS:
        yield f"naming {req.naming!r} is not one of {', '.join(NAMINGS)}", "naming"
    if not isinstance(req.kernel, str):
        yield f"kernel {req.kernel!r} must be a string such as 'cutlass'", "kernel"


def attach(model: str, tp_size: int = 1, tp_rank: int = 0, device: str = "cpu", mode: str = DEFAULT_MODE,
           fallback: bool = True, timeout: float = 30.0, socket_dir: str | None = None, gpu: int | None = None,
           dtype: str = DEFAULT_DTYPE, naming: str = DEFAULT_NAMING, kernel: str = DEFAULT_KERNEL) -> Attachment:
    """Attaches the weights of one tensor-parallel rank.

    Args:
        model (`str`): checkpoint directory (recommended), or a model name
            from the service's config.
        tp_size (`int`, *optional*, defaults to 1), tp_rank (`int`, *optional*,
            defaults to 0): the layout and this engine's rank.
        device (`str`, *optional*, defaults to ``"cpu"``): ``"cpu"`` (host
            backend) or ``"cuda:N"``.
        mode (`str`, *optional*, defaults to ``"zero_copy"``): ``"zero_copy"``
            (shared read-only views) or ``"copy"`` (private writable copies;
            the lease ends at once).
        fallback (`bool`, *optional*, defaults to `True`): load from disk
            through the same pipeline when the service cannot serve.
        timeout (`float`, *optional*, defaults to 30): seconds to wait for the
            service, including a load in progress.
        socket_dir (`str`, *optional*): see :func:`resolve_socket_dir`.
        gpu (`int`, *optional*): service instance; defaults to the physical
            index of ``device`` (``cuda:0`` under ``CUDA_VISIBLE_DEVICES=1``
            is instance 1, see :func:`physical_gpu`; 0 for ``cpu``).
        dtype, naming, kernel (`str`, *optional*): what to ask for when
            attaching by path (must match the service's config for that path).

    Returns:
        `Attachment`.

    Raises:
        DaemonUnavailable (`daemon_unavailable`): no service (``fallback=False``).
        ModelLoading (`model_loading`): not ready within ``timeout`` (``fallback=False``).
        CacheKeyMismatch (`cache_key_mismatch`): the service holds another key;
            ``details["fields"]`` lists the differing fields (``fallback=False``).
        ModelNotFound, ModelLoadFailed, AccessDenied: from the service (``fallback=False``).
        ConfigError (`config_invalid`): an argument no service could accept
            (``details["key"]`` names it: ``tp_size``, ``tp_rank``, ``device``,
            ``timeout``, ``gpu``, ``dtype``, ``naming``, ...), checked before
            connecting; or ``gpu`` not given and ``CUDA_VISIBLE_DEVICES``
            names the device by UUID or MIG id.
        ManifestInvalid (`manifest_invalid`), ManifestSlabMismatch
            (`manifest_slab_mismatch`): the service's manifest cannot be used (``fallback=False``).
        ValueError: ``mode`` is neither ``zero_copy`` nor ``copy``.
        UnsupportedQuantization (`unsupported_quantization`): always, whatever ``fallback`` says.
        CheckpointNotFound, CheckpointCorrupt: the disk load failed.

    Example:
        >>> w = attach("/srv/models/all-MiniLM-L6-v2", device="cpu")
        >>> w.tensors["embeddings.word_embeddings.weight"].shape
        torch.Size([30522, 384])
        >>> w.source, w.fallback_reason
        ('daemon', None)
    """
    req = AttachRequest(model, tp_size, tp_rank, device, mode, fallback, timeout, socket_dir, gpu, dtype, naming,
                        kernel)
    with _gc_paused():
        return _attach(req)


def _attach(req: AttachRequest) -> Attachment:
    model, tp_size, tp_rank, device, timeout = req.model, req.tp_size, req.tp_rank, req.device, req.timeout
    is_path = os.path.isdir(model)
    sock_path = req.socket_path
    deadline = time.monotonic() + timeout
    # The request goes out first; the local cache key is computed while the service answers.
    session: Session | None = None
    unavailable: WeightcacheError | None = None  # why the service cannot serve (raised, or the fallback's reason)
    try:
        session = Session(sock_path, timeout=max(0.001, timeout), hello=False)
        session.send([session.hello_message(), protocol.Attach(
            model=os.path.realpath(model) if is_path else model, tp_size=tp_size, tp_rank=tp_rank,
            wait_ms=int(max(0.0, deadline - time.monotonic() - 0.25) * 1000), dtype=req.dtype if is_path else None,
            naming=req.naming if is_path else None, mode=req.mode)])
    except WeightcacheError as e:
        if session is not None:
            session.close()
            session = None
        if not is_path:
            if req.fallback and isinstance(e, DaemonUnavailable):
                raise DaemonUnavailable(f"{e.message}; no disk fallback: {model[:200]!r} is not a checkpoint "
                                        f"directory on this machine (a model name needs the service)",
                                        **e.details) from None
            raise
        unavailable = e  # raised (or fallen back from) once the local checks have run
    local_ck = expected = None
    if is_path:
        try:
            # No safetensors validation, not even a header read for an unquantized checkpoint: the
            # service validated at load, the key check is stat() (pipeline.check_key), and the
            # disk fallback's own plan() opens the checkpoint with validation.
            local_ck = Checkpoint(model, validate=False)
            # Configuration errors are not cache misses: they raise whatever the service holds.
            scheme = quant.detect(local_ck, req.kernel)
            if session is not None:
                expected = pipeline.key_fields(req.load_request(str(local_ck.path)), tp_size,
                                               tp_rank, local_ck, local_backend(device).device_info(), scheme)
        except BaseException:
            if session is not None:
                session.close()
            raise
    if session is not None:
        try:
            return _attach_daemon(req, local_ck, expected, session, deadline)
        except UnsupportedQuantization:
            raise
        except WeightcacheError as e:
            if local_ck is None:
                raise
            unavailable = e
    # The service cannot serve. A broken checkpoint is the engine's problem whatever the service
    # said (and no fallback could load it): its own error, not a cache miss.
    _check_files(local_ck)
    if not req.fallback:
        raise unavailable
    reason = f"{unavailable.code}: {unavailable.message}"
    log.warning("fallback to disk checkpoint=%s tp_size=%d tp_rank=%d reason=%s", model, tp_size, tp_rank, reason,
                extra=event("fallback", model, tp_rank))
    manifest, slab = load_from_disk(req.load_request(str(local_ck.path)), tp_size, tp_rank, device)
    views = build_views(slab, manifest)
    return Attachment(views, LayoutMap(manifest), manifest, "disk", reason,
                      0, _slab=slab)  # private memory inside torch's own allocator


def _check_files(ck: Checkpoint) -> None:
    """Reads ``ck``'s file list and safetensors headers (no tensor data).

    Raises:
        CheckpointNotFound (`checkpoint_not_found`): no safetensors file, or
            one the index lists is missing.
        CheckpointCorrupt (`checkpoint_corrupt`): an invalid index, a stray
            shard, or a file too short for its header.
    """
    ck.raw_headers  # noqa: B018 - lists the files and reads each header, raising on the first problem


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Holds off Python's cyclic GC while a manifest is decoded and its views built.

    Those steps allocate thousands of small containers; a full collection
    triggered in the middle (tens of ms in a process that imported torch) was
    the p99 of attach. Nothing here creates reference cycles.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def read_manifest_file(fd: int, size_bytes: int) -> Manifest:
    """The manifest in the manifest file ``fd`` that came with an ``attach_reply`` (``size_bytes`` announced).

    Raises:
        ManifestInvalid (`manifest_invalid`): the file's size differs from the
            announced one or exceeds ``MAX_MANIFEST_BYTES``, or its content is invalid.
    """
    size = os.fstat(fd).st_size
    if size != size_bytes or size > MAX_MANIFEST_BYTES:
        raise ManifestInvalid(f"manifest file holds {size} bytes, the reply announced {size_bytes} "
                              f"(limit {MAX_MANIFEST_BYTES})", section="file", size_bytes=size)
    return unpack_file(os.pread(fd, size, 0))[1]


def _attach_daemon(req: AttachRequest, local_ck: Checkpoint | None, expected: dict[str, Any] | None,
                   session: Session, deadline: float) -> Attachment:
    """Reads the replies to the pipelined ``hello`` + ``attach`` and maps the slab.

    ``expected`` is :func:`pipeline.key_fields` computed from ``local_ck`` (by
    path); by name it is computed here from the operator's choices in the
    reply's key. The checkpoint's identity is checked by ``stat()``
    (:meth:`Checkpoint.identity_diff`).
    Closes ``session`` on any error.
    """
    sock_path, model, tp_size, tp_rank, device, mode = session.path, req.model, req.tp_size, req.tp_rank, \
        req.device, req.mode
    try:
        session.hello, reply = session.replies(2, timeout=max(0.001, deadline - time.monotonic()))
        if isinstance(reply, protocol.Loading):
            raise ModelLoading(
                f"model {model!r} is still loading on {sock_path} ({reply.done_bytes}/{reply.total_bytes} bytes) "
                f"after the timeout", model=model, done_bytes=reply.done_bytes, total_bytes=reply.total_bytes)
        if not isinstance(reply, protocol.AttachReply):
            raise RemoteProtocolError(f"attach: unexpected reply {reply.tag()!r}")
        fd, manifest_fd = session.last_fds
        try:
            try:
                manifest = read_manifest_file(manifest_fd, reply.manifest_size_bytes)
            except ManifestInvalid as e:
                raise ManifestInvalid(f"attach_reply from {sock_path} has an invalid manifest: {e.message}",
                                      socket=sock_path, **e.details) from None
            finally:
                os.close(manifest_fd)
            key = manifest.key
            backend = local_backend(device)
            if expected is not None:  # by path: what this engine asked for
                ck = local_ck
                # The revision is the operator's label in the config, which an engine cannot know.
                expected["revision"] = key.get("revision", "")
            else:  # by name: the operator's choices, checked against the checkpoint as it is now
                ck = Checkpoint(reply.checkpoint_path, validate=False)
                mc = load_request(str(ck.path), key.get("dtype", DEFAULT_DTYPE), key.get("naming", DEFAULT_NAMING),
                                  key.get("kernel") or DEFAULT_KERNEL, key.get("revision", ""))
                expected = pipeline.key_fields(mc, tp_size, tp_rank, ck, backend.device_info())
            # A slab of another backend (host slab, cuda:N engine) differs in device.backend.
            try:
                diff = pipeline.check_key(expected, ck, key)
            except (KeyError, TypeError, AttributeError) as e:
                raise RemoteProtocolError(f"attach_reply from {sock_path} has a malformed cache key: {e!r}") from None
            if diff:
                _check_files(ck)  # a broken checkpoint is reported as such, not as a key mismatch
                raise CacheKeyMismatch(
                    f"service at {sock_path} holds a different {model!r}: differing key fields "
                    f"{', '.join(diff[:10])}", fields=diff, socket=sock_path)
            # Map the whole shared allocation (memfd pages, or the 2 MiB-rounded VMM slab).
            size = os.fstat(fd).st_size if reply.backend == "host" else manifest.slab_size_bytes
            slab = backend.import_fd(fd, size, device)
        finally:
            os.close(fd)
        try:
            views = build_views(slab.tensor, manifest)
        except (ManifestInvalid, ValueError, IndexError, RuntimeError) as e:
            slab.close()
            raise ManifestSlabMismatch(f"attach_reply from {sock_path}: manifest does not fit the slab "
                                       f"({manifest.slab_size_bytes} bytes declared, {slab.size_bytes} mapped): {e}",
                                       socket=sock_path, slab_size_bytes=manifest.slab_size_bytes) from None
        layouts = LayoutMap(manifest)
        if mode is AttachMode.COPY:
            views = _copy_views(views)
            session.close()
            slab.close()
            return Attachment(views, layouts, manifest, "daemon", None, 0,
                              lease_id=reply.lease_id)
        return Attachment(views, layouts, manifest, "daemon", None, slab.size_bytes, session, slab,
                          reply.lease_id)
    except BaseException:
        session.close()
        raise
