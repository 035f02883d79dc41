"""The engine side: ``attach()``: the request to the service, its reply checked and mapped.

``attach()`` asks the GPU's service for the slab, checks the cache key of the
reply against the checkpoint as it is now (its ``config.json`` and ``stat()``
of its files: never a tensor byte, see :func:`identity.check_key`), imports
the received fd read-only and builds tensor views from the manifest. With
``fallback=True`` a missing service, a model not ready in time,
a different key or a refusal makes it load from disk through the very same
pipeline (:mod:`weightcache.pipeline`), so the tensors are bit-identical; the
reason is logged and kept in :attr:`Attachment.fallback_reason`.

The load pipeline (:mod:`weightcache.pipeline`, :mod:`weightcache.quant`,
:mod:`weightcache.sharding`, :mod:`weightcache.reader`), numpy and torch are
imported by the functions that use them, never when this module is imported:
an engine that only attaches pays for what attaching needs (tests/unit/test_lazy_imports.py).
What only a CUDA attach needs (``cuda.bindings.driver``...) is imported on a thread from
this module's import on, where plausible (:mod:`weightcache.client._imports`). The options and
the checked request of an attach are :mod:`weightcache.client._request`'s; the disk fallback is
:mod:`weightcache.client._fallback`'s.

Forbidden imports: weightcache.config, weightcache.daemon, asyncio, weightcache.pipeline at module level,
weightcache.quant at module level, weightcache.sharding at module level, weightcache.reader at module level,
numpy at module level, torch at module level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import sys
import time
from typing import Any, Iterator

from .. import protocol
from ..checkpoint import Checkpoint
from ..errors import (
    CacheKeyMismatch,
    CheckpointNotFound,
    DaemonUnavailable,
    ManifestInvalid,
    ManifestSlabMismatch,
    ModelLoading,
    RemoteProtocolError,
    UnsupportedQuantization,
    WeightcacheError,
)
from ..journal import event
from ..manifest import LayoutMap, Manifest, ManifestFile, build_views, read_file, warm_up_views
from ..session import Session
from ..spec import RankRequest
from ..wire import DEFAULT_DTYPE, DEFAULT_KERNEL, DEFAULT_MODE, DEFAULT_NAMING, AttachMode
from . import _imports
from ._attachment import Attachment, copy_views
from ._device import device_info, local_backend
from ._fallback import check_files, detect_scheme, fall_back
from ._request import AttachOptions, AttachRequest, Retry, load_request

log = logging.getLogger(__package__)  # the package's logger: a room is no logger name of its own


def attach(model: str, tp_size: int = 1, tp_rank: int = 0, *, device: str = "cpu",
           mode: AttachMode | str = DEFAULT_MODE, fallback: bool = True, timeout: float = 30.0,
           socket_dir: str | None = None, gpu: int | None = None, dtype: Any = None, naming: str | None = None,
           kernel: str = DEFAULT_KERNEL, retry: Retry | None = None,
           options: AttachOptions | None = None) -> Attachment:
    """Attaches the weights of one tensor-parallel rank.

    The options after ``tp_rank`` are keywords, the fields of
    :class:`AttachOptions`: give them one by one (``device="cuda:0"``), or as
    one ``options=`` record, or both: a keyword given with a value other than
    its default overrides the record's field (one left at its default keeps the record's).

    Args:
        model (`str`): checkpoint directory (recommended), or a model name
            from the service's config.
        tp_size (`int`, *optional*, defaults to 1), tp_rank (`int`, *optional*,
            defaults to 0): the layout and this engine's rank.
        options (`AttachOptions`, *optional*): the keyword options below, grouped.
        device (`str`, *optional*, defaults to ``"cpu"``): ``"cpu"`` (host
            backend) or ``"cuda:N"``.
        mode (`str`, *optional*, defaults to ``"zero_copy"``): ``"zero_copy"``
            (shared read-only views) or ``"copy"`` (private writable copies;
            the lease ends at once).
        fallback (`bool`, *optional*, defaults to `True`): load from disk
            through the same pipeline when the service cannot serve.
        timeout (`float`, *optional*, defaults to 30): seconds to wait for the
            service, including a load in progress; 0 to 1e9.
        socket_dir (`str`, *optional*): see :func:`resolve_socket_dir`.
        gpu (`int`, *optional*): service instance; defaults to the physical
            index of ``device`` (``cuda:0`` under ``CUDA_VISIBLE_DEVICES=1``
            is instance 1, see :func:`physical_gpu`; 0 for ``cpu``).
        dtype, naming (`str`, *optional*): what to ask for (``dtype`` may
            also be a ``torch.dtype``: ``torch.bfloat16`` is ``"bfloat16"``). By path they
            default to ``"auto"`` and ``"hf"`` and must match the service's
            config for that path. By name, left out, the slab is as the
            operator configured it; given, the service must hold the name
            with that dtype and naming, else ``model_not_found`` (never a slab
            of another dtype or naming).
        kernel (`str`, *optional*, defaults to ``"cutlass"``): the kernel
            layout target of quantized weights.
        retry (`Retry`, *optional*): ask the service again after a retryable
            error (it went away in a restart, a cap, no room in the budget)
            before falling back or raising, within ``timeout``; each retry is
            logged at WARNING. Off by default (see :class:`Retry`).

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
        TypeError: a keyword that is not a field of :class:`AttachOptions`.
        ModuleNotFoundError: torch is not installed in this interpreter (the message names the runtime to use).
        UnsupportedQuantization (`unsupported_quantization`): always, whatever ``fallback`` says.
        DeviceError (`device_error`): ``device`` cannot be set up (a CUDA driver call failed), whatever
            ``fallback`` says: the disk fallback loads onto that device, so it is not tried (the log says
            ``no fallback to disk, the device fails``).
        CheckpointNotFound, CheckpointCorrupt: the disk load failed; or
            (``checkpoint_not_found``) by name, this engine cannot open the
            checkpoint directory the service holds it from (the key check needs it).

    Example:
        >>> w = attach("/srv/models/all-MiniLM-L6-v2", device="cpu")
        >>> w.tensors["embeddings.word_embeddings.weight"].shape
        torch.Size([30522, 384])
        >>> w.source, w.fallback_reason
        ('daemon', None)
    """
    given = {"device": device, "mode": mode, "fallback": fallback, "timeout": timeout, "socket_dir": socket_dir,
             "gpu": gpu, "dtype": dtype, "naming": naming, "kernel": kernel, "retry": retry}
    if options is None:
        opts = AttachOptions(**given)
    else:  # a keyword left at its default keeps the record's field
        opts = dataclasses.replace(options, **{k: v for k, v in given.items()
                                               if not _is_default(v, getattr(_DEFAULT_OPTIONS, k))})
    req = AttachRequest.of(model, tp_size, tp_rank, opts)
    _require_torch()
    with _gc_paused():
        return _attach(req)


_DEFAULT_OPTIONS = AttachOptions()


def _is_default(value: Any, default: Any) -> bool:
    """``value`` is the default ``default`` itself (``True == 1``, so the type is compared too)."""
    return value is default or (type(value) is type(default) and value == default)

#: What to say when torch is missing: the interpreter an engine (or a check) should run under.
RUNTIME_HINT = ("run it with the interpreter of the torch runtime (weightcache-setup-runtime creates "
                "/opt/weightcache/venv; WEIGHTCACHE_PYTHON in /etc/default/weightcache names it), or install torch "
                "into this one")


def _require_torch() -> None:
    """Raises ModuleNotFoundError naming the runtime when torch cannot be imported (attach builds torch views)."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise ModuleNotFoundError(f"weightcache.attach() needs torch, which {sys.executable} cannot import "
                                  f"({e}); {RUNTIME_HINT}", name="torch") from None


class _RetryAttach(Exception):
    """Raised by :func:`_attach_once` when the attach's :class:`Retry` policy asks for another attempt."""

    def __init__(self, error: WeightcacheError, delay_s: float) -> None:
        super().__init__(error.message)
        self.error, self.delay_s = error, delay_s


def _attach(req: AttachRequest) -> Attachment:
    """:func:`_attach_once`, again after each error the request's :class:`Retry` policy retries (logged at WARNING)."""
    deadline = time.monotonic() + req.timeout
    attempt = 1
    while True:
        policy = req.retry if req.retry is not None and attempt <= req.retry.retries else None

        def retry_in(e: WeightcacheError) -> float | None:
            """Seconds to wait before the next attempt after ``e``; None: no more attempts (the caller goes on)."""
            if policy is None or not e.retryable or isinstance(e, ModelLoading):
                return None
            delay = policy.delay(attempt)
            if time.monotonic() + delay >= deadline:
                return None
            try:  # a device that cannot be set up fails every attempt and the disk fallback alike: no retry
                device_info(req.device)
            except WeightcacheError:
                return None
            return delay

        try:
            return _attach_once(req, deadline, retry_in)
        except _RetryAttach as r:
            log.warning("attach retry checkpoint=%s tp_size=%d tp_rank=%d attempt=%d attempts=%d delay_s=%.3f "
                        "reason=%s: %s", req.model, req.tp_size, req.tp_rank, attempt + 1, req.retry.retries + 1,
                        r.delay_s, r.error.code, r.error.message,
                        extra=event("attach_retry", req.model, req.tp_rank, tp_size=req.tp_size))
            time.sleep(r.delay_s)
            attempt += 1


def _attach_once(req: AttachRequest, deadline: float, retry_in: Any) -> Attachment:
    """One attempt: the request to the service, then its reply, the disk fallback, or the error.

    ``retry_in(error)`` says whether an error from the service is retried
    (:class:`_RetryAttach`) rather than fallen back from or raised.
    """
    model, tp_size, tp_rank, device = req.model, req.tp_size, req.tp_rank, req.device
    timeout = max(0.0, deadline - time.monotonic())
    is_path = os.path.isdir(model)
    sock_path = req.socket_path
    # The request goes out first; the local cache key is computed while the service answers.
    session: Session | None = None
    unavailable: WeightcacheError | None = None  # why the service cannot serve (raised, or the fallback's reason)
    try:
        session = Session(sock_path, timeout=max(0.001, timeout), hello=False)
        session.send([session.hello_message(), protocol.Attach(
            model=os.path.realpath(model) if is_path else model, tp_size=tp_size, tp_rank=tp_rank,
            wait_ms=int(max(0.0, deadline - time.monotonic() - 0.25) * 1000),
            # By name, only what the engine gave: the service then refuses a slab held otherwise.
            dtype=req.path_dtype if is_path else req.dtype,
            naming=req.path_naming if is_path else req.naming, mode=req.mode)])
    except WeightcacheError as e:
        if session is not None:
            session.close()
            session = None
        if (delay := retry_in(e)) is not None:
            raise _RetryAttach(e, delay) from None
        if not is_path:
            if req.fallback and isinstance(e, DaemonUnavailable):
                raise DaemonUnavailable(f"{e.message}; no disk fallback: {model[:200]!r} is not a checkpoint "
                                        f"directory on this machine (a model name needs the service)",
                                        **e.details) from None
            raise
        unavailable = e  # raised (or fallen back from) once the local checks have run
    if session is not None:
        _prepare_backend(device)
    local_ck = None
    if is_path:
        # No safetensors validation, not even a header read for an unquantized checkpoint: the
        # service validated at load, the key check is stat() (identity.check_key), and the
        # disk fallback's own plan() opens the checkpoint with validation. The key fields are
        # worked out once the reply is in (_expected_fields): the quantization scheme is
        # detected here only when the slab is quantized or the service cannot serve.
        try:
            local_ck = Checkpoint(model, validate=False)
            if session is None:
                detect_scheme(local_ck, req.kernel)  # configuration errors are not cache misses
        except BaseException:
            if session is not None:
                session.close()
            raise
    if session is not None:
        try:
            return _attach_daemon(req, local_ck, session, deadline)
        except UnsupportedQuantization:
            raise
        except WeightcacheError as e:
            if (delay := retry_in(e)) is not None:
                raise _RetryAttach(e, delay) from None
            if local_ck is None:
                raise
            unavailable = e
            detect_scheme(local_ck, req.kernel)  # configuration errors raise whatever the service said
    return fall_back(req, local_ck, unavailable)


def _prepare_backend(device: str) -> None:
    """Sets up the local backend of ``device`` and reads its key fields while the service answers the attach.

    A process's first attach pays the backend's set-up here (CUDA: ``cuInit``,
    the primary context, the VMM granularity, the GPU's UUID and compute
    capability; once per process, :func:`local_backend`) and torch's set-up of
    the view operations (:func:`~weightcache.manifest.warm_up_views`) in the
    time the service takes to answer (0.6-0.8 ms on the H200 host), instead of
    after the reply. An error is left to the attach's own :func:`local_backend`
    call after the reply, which raises it where it did before: a reply that says
    the service cannot serve (or a fallback to disk) goes first, as without this.
    """
    try:
        local_backend(device).device_info()
    except Exception:  # noqa: BLE001 - raised again, in its place, by the attach's own call
        pass
    warm_up_views()


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
    return read_file(fd, size_bytes).manifest


def _expected_fields(req: AttachRequest, local_ck: Checkpoint | None, mf: ManifestFile, checkpoint_path: str,
                     device: dict[str, Any]) -> tuple[dict, Checkpoint, bool]:
    """The key fields this engine expects of the slab, the checkpoint to check its identity against, and
    whether the checkpoint's quantization scheme was detected here.

    By path: the engine's own request (the ``revision`` is the operator's
    label, which an engine cannot know); by name: the operator's rank request
    as the manifest file carries it (an older service's file without one: its
    key's choices), checked against the checkpoint as it is now. The dtype is
    the key's when the manifest file says the slab serves the requested dtype
    (else it is worked out here from the headers). The scheme is detected (importing
    :mod:`weightcache.quant`) only when the key names one: for an unquantized
    slab the service found no quantization config in the very ``config.json``
    and ``hf_quant_config.json`` whose hashes the key's checkpoint identity
    carries, and :func:`identity.check_key` compares those with the files as
    they are now; on any difference the caller detects before reporting it.

    Raises:
        UnsupportedQuantization, CheckpointCorrupt: the slab is quantized and
            the checkpoint's scheme cannot be served with ``req.kernel``.
        CheckpointNotFound (`checkpoint_not_found`): by name, the checkpoint the service
            holds is not at that path for this engine (``details["model"]`` is the name).
    """
    from .. import identity

    key = mf.manifest.key
    if local_ck is not None:
        rank, ck = req.rank_request(str(local_ck.path)), local_ck
    else:
        try:
            ck = Checkpoint(checkpoint_path, validate=False)
        except CheckpointNotFound as e:
            raise CheckpointNotFound(
                f"attach by name {req.model!r}: the service holds it from {checkpoint_path}, which this engine "
                f"cannot open ({e.message}); the client checks the slab's cache key against the checkpoint's files "
                f"(stat() and config.json), so the engine must see that directory at the same path (mount it there, "
                f"docs/deployment.md)", model=req.model, **e.details) from None
        rank = mf.request
        if rank is None:
            rank = RankRequest(load_request(str(ck.path), key.get("dtype", DEFAULT_DTYPE),
                                            key.get("naming", DEFAULT_NAMING), key.get("kernel") or DEFAULT_KERNEL,
                                            key.get("revision", "")),
                               req.tp_size, req.tp_rank)
        else:  # the checkpoint as the service names it now (its path as the reply gives it)
            rank = RankRequest(dataclasses.replace(rank.model, path=str(ck.path)), rank.tp_size, rank.tp_rank)
    detected = bool(key.get("quant_scheme"))
    scheme = detect_scheme(ck, req.kernel if local_ck is not None else None) if detected else None
    expected = identity.key_fields(rank, ck, device, scheme, dtype="auto")
    if local_ck is not None:
        expected["revision"] = key.get("revision", "")
    served = mf.dtypes_served
    if served is not None and rank.model.dtype in served:
        expected["dtype"] = key.get("dtype")
    elif rank.model.dtype == "auto":
        expected["dtype"] = "auto"
    else:
        expected["dtype"] = identity.effective_dtype(rank.model.dtype, identity.rank_cast_dtypes(rank, ck))
    return expected, ck, detected


def _attach_daemon(req: AttachRequest, local_ck: Checkpoint | None, session: Session,
                   deadline: float) -> Attachment:
    """Reads the replies to the pipelined ``hello`` + ``attach`` and maps the slab.

    The expected key fields are :func:`identity.key_fields` of the engine's
    request on ``local_ck`` (by path) or of the operator's rank request the
    manifest file carries (by name), see :func:`_expected_fields`. The checkpoint's identity is checked by ``stat()``
    (:meth:`Checkpoint.identity_diff`).
    Closes ``session`` on any error.
    """
    from .. import identity  # the cache key check

    sock_path, model, device, mode = session.path, req.model, req.device, req.mode
    try:
        session.hello, reply = session.replies(2, timeout=max(0.001, deadline - time.monotonic()))
        if isinstance(reply, protocol.Loading):
            raise ModelLoading(
                f"model {model!r} is still loading on {sock_path} ({reply.done_bytes}/{reply.total_bytes} bytes) "
                f"after the timeout", model=model, done_bytes=reply.done_bytes, total_bytes=reply.total_bytes)
        if not isinstance(reply, protocol.AttachReply):
            raise RemoteProtocolError(f"attach: unexpected reply {reply.tag()!r}")
        fd, manifest_fd = slab_and_manifest_fds(session)
        try:
            try:
                mf = read_file(manifest_fd, reply.manifest_size_bytes)
                manifest = mf.manifest
            except ManifestInvalid as e:
                raise ManifestInvalid(f"attach_reply from {sock_path} has an invalid manifest: {e.message}",
                                      socket=sock_path, **e.details) from None
            finally:
                os.close(manifest_fd)
            key = manifest.key
            backend = local_backend(device)
            # A slab of another backend (host slab, cuda:N engine) differs in device.backend.
            try:
                expected, ck, detected = _expected_fields(req, local_ck, mf, reply.checkpoint_path,
                                                          backend.device_info())
                diff = identity.check_key(expected, ck, key)
            except (KeyError, TypeError, AttributeError) as e:
                raise RemoteProtocolError(f"attach_reply from {sock_path} has a malformed cache key: {e!r}") from None
            if diff:
                if not detected:  # configuration errors are not cache misses
                    detect_scheme(ck, req.kernel if local_ck is not None else None)
                check_files(ck)  # a broken checkpoint is reported as such, not as a key mismatch
                raise CacheKeyMismatch(
                    f"service at {sock_path} holds a different {model!r}: differing key fields "
                    f"{', '.join(diff[:10])}", fields=diff, socket=sock_path)
            slab = import_slab(backend, fd, reply, manifest, device)
        finally:
            os.close(fd)
        return attachment_of(slab, manifest, reply, mode, session)
    except BaseException:
        session.close()
        raise


def slab_and_manifest_fds(session: Session) -> tuple[int, int]:
    """The two fds of the ``attach_reply`` just read: the slab's and its manifest file's.

    Raises:
        ManifestSlabMismatch (`manifest_slab_mismatch`): another count of fds (all closed): whoever answers at
            the socket path chose them.
    """
    fds = session.last_fds
    if len(fds) != 2:
        for x in fds:
            os.close(x)
        raise ManifestSlabMismatch(f"attach_reply from {session.path} came with {len(fds)} fds, not 2 (the slab "
                                   f"and its manifest)", socket=session.path, slab_size_bytes=0)
    return fds[0], fds[1]


def import_slab(backend: Any, fd: int, reply: protocol.AttachReply, manifest: Manifest, device: str) -> Any:
    """Maps the whole shared allocation of an ``attach_reply``'s slab fd read-only (the memfd's pages, or the
    2 MiB-rounded VMM slab); ``fd`` stays the caller's. A host slab's fd is checked first
    (:func:`weightcache.memory.host.check_sealed_memfd`): a sealed memfd of at least the manifest's size.

    Raises:
        ManifestSlabMismatch (`manifest_slab_mismatch`): a host slab fd that is not such a memfd.
    """
    if backend.name == "host":
        size = max(os.fstat(fd).st_size, manifest.slab_size_bytes)
    else:
        size = manifest.slab_size_bytes
    return backend.import_fd(fd, size, device)


def attachment_of(slab: Any, manifest: Manifest, reply: protocol.AttachReply, mode: AttachMode,
                  session: Session) -> Attachment:
    """The :class:`Attachment` of an imported ``slab``: views built from ``manifest``; in ``copy`` mode private
    copies, the slab and the session (the lease) closed at once.

    Raises:
        ManifestSlabMismatch (`manifest_slab_mismatch`): a view does not fit the slab (``slab`` is closed).
    """
    try:
        views = build_views(slab.tensor, manifest)
    except (ManifestInvalid, ValueError, IndexError, RuntimeError) as e:
        slab.close()
        raise ManifestSlabMismatch(f"attach_reply from {session.path}: manifest does not fit the slab "
                                   f"({manifest.slab_size_bytes} bytes declared, {slab.size_bytes} mapped): {e}",
                                   socket=session.path, slab_size_bytes=manifest.slab_size_bytes) from None
    layouts = LayoutMap(manifest)
    if mode is AttachMode.COPY:
        views = copy_views(views)
        session.close()
        slab.close()
        return Attachment(views, layouts, manifest, "daemon", None, 0, lease_id=reply.lease_id)
    return Attachment(views, layouts, manifest, "daemon", None, slab.size_bytes, session, slab, reply.lease_id)


# Last, the client whole: the CUDA attach path's imports on a thread (none without an NVIDIA device node).
_imports.start()
