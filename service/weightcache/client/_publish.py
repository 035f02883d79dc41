"""Publication, the engine side: :func:`publish` hands the service the tensors an engine processed itself, and
:func:`attach_published` maps them again, zero-copy, by the engine's key (DESIGN §6.4, docs/protocol.md,
"Publication").

:func:`publish` packs the tensors into a memfd (tied names recorded as aliases, views of one storage kept as
views of one copy of it, strides kept), writes the manifest beside it (names, dtypes, shapes, strides, offsets and
each tensor's ``attrs``), unmaps its writable mapping (the service seals the memfd against writes, which the
kernel refuses while one remains), sends both fds with ``publish`` and returns the service's answer. From then on
the service owns the bytes: nobody can change them.

:func:`attach_published` asks for the publication of the model's rank under the engine's key, checks the reply's
key (the engine's fields, the checkpoint identity by ``stat()``, the device) and maps the slab read-only.

Forbidden imports: weightcache.config, weightcache.daemon, asyncio, weightcache.pipeline, weightcache.quant,
weightcache.sharding, weightcache.reader, numpy, torch at module level, weightcache.identity at module level,
weightcache.memory at module level.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import protocol
from ..checkpoint import Checkpoint
from ..errors import CacheKeyMismatch, RemoteProtocolError
from ..journal import event
from ..manifest import DTYPES, Manifest, TensorRecord, align, pack_file, read_file
from ..session import Session
from ..wire import DEFAULT_MODE, AttachMode
from ._attach import attachment_of, import_slab, slab_and_manifest_fds
from ._attachment import Attachment
from ._device import local_backend
from ._request import AttachOptions, AttachRequest

log = logging.getLogger(__package__)


@dataclass(frozen=True)
class Published:
    """What the service answered a :func:`publish`.

    Attributes:
        label (`str`): the slab's label in ``weightcache status`` (``model/tpN/rankR+pub:<key hash>``).
        created (`bool`): this publication made the slab; False: an identical one was already held (this one's
            memory was dropped).
        size_bytes (`int`): the slab's size in bytes.
        engine_key_blake2b (`str`): the hash of the engine key it is held under.
    """

    label: str
    created: bool
    size_bytes: int
    engine_key_blake2b: str


def _socket_path(model: str, tp_size: int, tp_rank: int, device: str, socket_dir: str | None,
                 gpu: int | None, timeout: float) -> str:
    return AttachRequest.of(model, tp_size, tp_rank, AttachOptions(device=device, socket_dir=socket_dir, gpu=gpu,
                                                                   timeout=timeout)).socket_path


def _wire_model(model: str) -> str:
    """What the request names: the checkpoint directory's ``realpath`` (as :func:`weightcache.attach` sends it),
    or a model name."""
    return os.path.realpath(model) if os.path.isdir(model) else model


def pack(tensors: Mapping[str, Any], attrs: Mapping[str, dict] | None = None) -> tuple[list[TensorRecord], int,
                                                                                          list[tuple[Any, int, int, int]]]:
    """Plans a slab for ``tensors``: the manifest records, the slab's size, and the copies to make.

    A name whose tensor has the very view of an earlier one (same storage, offset, dtype, shape and strides: a
    tied weight) is an alias of it; tensors on one storage at byte offsets that are multiples of 256 share one
    copy of the storage's span they reach (views stay views); any other tensor gets a copy of its own extent.
    Strides are kept (a transposed view stays transposed).

    Args:
        tensors (`Mapping[str, torch.Tensor]`): name -> tensor (CPU or CUDA; any strides).
        attrs (`Mapping[str, dict]`, *optional*): name -> JSON-able attributes the engine needs back (vLLM's
            ``output_dim``, ``input_dim``...); recorded as the tensor's layout ``attrs``.

    Returns:
        `tuple`: (records in slab order, slab size in bytes, copies as ``(storage tensor, src_byte_offset,
        dst_offset_bytes, size_bytes)``).

    Raises:
        PublicationInvalid (`publication_invalid`): a tensor of a dtype without a safetensors code, or on the meta
            device.
    """
    import torch

    from ..errors import PublicationInvalid

    codes = {getattr(torch, v[0]): k for k, v in DTYPES.items() if hasattr(torch, v[0])}
    records: list[TensorRecord] = []
    copies: list[tuple[Any, int, int, int]] = []
    views: dict[tuple, str] = {}
    # name -> (tensor, dtype code, shape, stride, byte offset in its storage, extent in bytes): each asked of torch
    # once (1,200 CUDA tensors: each torch call costs microseconds, and this runs inside the publication's time)
    info: dict[str, tuple[Any, str, tuple, tuple, int, int]] = {}
    groups: dict[tuple, list[str]] = {}
    order: list[tuple[str, str | None]] = []
    for name, t in tensors.items():
        dtype, device = t.dtype, t.device
        if dtype not in codes or device.type == "meta":
            raise PublicationInvalid(f"publish: tensor {name!r} is {dtype} on {device}, which has no safetensors "
                                     f"dtype code or no bytes", reason="tensor", tensor=name[:200])
        st = t.untyped_storage()
        shape, stride, soff = tuple(t.shape), tuple(t.stride()), t.storage_offset()
        sid = (st.data_ptr(), device)
        view = (sid, soff, dtype, shape, stride)
        if view in views:
            order.append((name, views[view]))
            continue
        views[view] = name
        order.append((name, None))
        es = t.element_size()
        extent = 0 if 0 in shape else (1 + sum((d - 1) * s for d, s in zip(shape, stride))) * es
        info[name] = (st, codes[dtype], shape, stride, soff * es, extent)
        groups.setdefault(sid if soff * es % 256 == 0 else (name,), []).append(name)
    placed: dict[str, int] = {}
    pos = 0
    for members in groups.values():
        lo = min(info[m][4] for m in members) // 256 * 256
        hi = max(info[m][4] + info[m][5] for m in members)
        if len(members) == 1 and info[members[0]][4] % 256:  # a view at an unaligned offset: its own copy
            lo = info[members[0]][4]
        base = align(pos)
        if hi > lo:
            copies.append((info[members[0]][0], lo, base, hi - lo))
        for m in members:
            placed[m] = base + info[m][4] - lo
        pos = base + max(hi - lo, 0)
    by_name: dict[str, TensorRecord] = {}
    for name, target in order:
        if target is not None:
            r = by_name[target]
            rec = TensorRecord(name, r.dtype, r.shape, r.stride, r.offset_bytes, r.size_bytes, layout=r.layout,
                               alias_of=target)
        else:
            _, code, shape, stride, _, extent = info[name]
            layout = {"attrs": dict(attrs[name])} if attrs and name in attrs else {}
            rec = TensorRecord(name, code, shape, stride, placed[name], extent, layout=layout)
        by_name[name] = rec
        records.append(rec)
    return records, max(align(pos), 256), copies


def _copy_into(dst: Any, copies: list[tuple[Any, int, int, int]]) -> None:
    """Makes the planned ``copies`` into ``dst`` (a 1-D ``uint8`` tensor over the slab, host or CUDA)."""
    import torch

    dsts, srcs = [], []
    for storage, src_off, dst_off, n in copies:
        src = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        dsts.append(dst[dst_off:dst_off + n])
        srcs.append(src[src_off:src_off + n])
    if dsts:
        # one multi-tensor copy: 1,200 copy_ calls cost about 10 ms of launches on a GPU publication
        torch._foreach_copy_(dsts, srcs)


def _fill_cuda(copies: list[tuple[Any, int, int, int]], size_bytes: int, device: str) -> Any:
    """A VMM allocation on ``device`` (``cuda:N``) holding the planned copies, sealed: its exported fd goes with
    ``publish``, and the service copies it into an allocation of its own (DESIGN §6.3). The caller closes it."""
    w = local_backend(device).allocate_publication(size_bytes)
    try:
        _copy_into(w.tensor, copies)
        return w.seal()  # cuCtxSynchronize: every copy has landed before the fd leaves
    except BaseException:
        w.abort()
        raise


def _fill(copies: list[tuple[Any, int, int, int]], size_bytes: int) -> int:
    """A memfd of ``size_bytes`` (rounded up to the page size) holding the planned copies, unmapped; returns it."""
    import torch

    size = max(mmap.PAGESIZE, -(-size_bytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    fd = os.memfd_create("weightcache:publish", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            dst = torch.frombuffer(mm, dtype=torch.uint8)
            _copy_into(dst, copies)
            del dst  # the view of the mapping goes before the mapping
        finally:
            mm.close()  # the service seals against writes: no writable mapping may remain
    except BaseException:
        os.close(fd)
        raise
    return fd


def _in_place(copies: list[tuple[Any, int, int, int]], slab_bytes: int, home: Any) -> bool:
    """Whether every planned copy's bytes already sit at their slab offset in ``home`` (a ``CudaWritableSlab``
    of the slab's size, rounded up to its granularity), so that ``home`` can go to the service as the staging
    allocation."""
    if not 0 <= home.size_bytes - slab_bytes < home.granularity:
        return False
    return all(st.data_ptr() + src == home.ptr + dst for st, src, dst, _ in copies)


def allocate_home(tensors: Mapping[str, Any], attrs: Mapping[str, dict] | None = None, *, device: str,
                  margin_bytes: int = 1 << 30) -> tuple[Any, list[tuple[Any, int, int, int]]] | None:
    """A VMM allocation on ``device`` (``cuda:N``) laid out as the slab :func:`publish` would plan for
    ``tensors`` now, and that plan's copies; None when the GPU has no room for it beside the tensors (plus
    ``margin_bytes``). An engine moves its freshly built model there
    (:func:`weightcache.integrations.params.move_storages`) before reading its checkpoint into it, and passes the
    allocation as ``publish(home=...)``: the publication is then the service's copy alone.

    Returns:
        `tuple | None`: (the ``CudaWritableSlab``; ``(storage, src_byte_offset, dst_byte_offset, size_bytes)``
        per storage).
    """
    import torch

    _, slab_bytes, copies = pack(tensors, attrs)
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    if free < slab_bytes + margin_bytes:
        return None
    return local_backend(device).allocate_publication(slab_bytes), copies


#: Bytes kept free beside a staging allocation and the service's copy before ``cuda_path="auto"`` stages.
STAGING_MARGIN_BYTES = 1 << 30


def _room_to_stage(slab_bytes: int, device: str) -> bool:
    """Whether ``device``'s free memory holds a staging allocation of ``slab_bytes`` and the service's copy of it
    (plus :data:`STAGING_MARGIN_BYTES`): staging is faster (benchmarks/RESULTS.md), IPC needs room for the
    service's copy only."""
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return free >= 2 * slab_bytes + STAGING_MARGIN_BYTES


def _ipc_request(copies: list[tuple[Any, int, int, int]], slab_bytes: int, device: str,
                 required: bool) -> tuple[int, list[int], dict] | None:
    """``(size_bytes, fds, fields)`` of a ``publish_cuda_ipc`` for the planned ``copies`` on ``device``: the CUDA
    IPC handles of the allocations they come from; None when one cannot be exported (and not ``required``).

    Raises:
        PublicationInvalid (`publication_invalid`, ``reason = "ipc"``): ``required`` and an allocation cannot be
            exported by IPC.
    """
    import torch

    from ..errors import PublicationInvalid
    from ..sizes import round_up

    backend = local_backend(device)
    torch.cuda.synchronize(device)  # the service reads the tensors on its own context: every write has landed
    try:
        segments, where = backend.ipc_export([st.data_ptr() + off for st, off, _, _ in copies])
    except Exception as e:  # noqa: BLE001 - CudaDriverError (a VMM allocation): the caller stages a copy
        if required:
            raise PublicationInvalid(f"publish: an allocation of the tensors cannot be exported by CUDA IPC ({e}); "
                                     f"use cuda_path='staging'", reason="ipc") from None
        log.info("publish: CUDA IPC cannot export an allocation (%s); staging a copy instead", e)
        return None
    from ..memory.cuda_publish import IpcSource

    table = IpcSource(tuple(segments), tuple((seg, off, dst, n) for (seg, off), (_, _, dst, n) in zip(where, copies)))
    size = max(backend.granularity, round_up(slab_bytes, backend.granularity))
    return size, [], {"table": table.to_json()}


def _send(sock_path: str, timeout: float, model: str, tp_size: int, tp_rank: int, key_fields: dict[str, Any],
          manifest_data: bytes, how: tuple[int, list[int], dict]) -> protocol.Message:
    """Sends one ``publish`` (``how``: the slab's size, its fd in a list, no fields) or ``publish_cuda_ipc`` (no
    fd, the IPC ``table``: sent as a sealed memfd) with the manifest file; returns the service's reply."""
    from ..memory.host import sealed_memfd

    size, fds, ipc = how
    mine: list[int] = []  # the memfds made here, closed when the reply is in
    try:
        if ipc:
            mine.append(sealed_memfd(ipc["table"], "weightcache:publish-ipc-table"))
            fds = [mine[-1]]
            msg: protocol.Message = protocol.PublishCudaIpc(_wire_model(model), tp_size, tp_rank, key_fields, size,
                                                            len(manifest_data), len(ipc["table"]))
        else:
            msg = protocol.Publish(_wire_model(model), tp_size, tp_rank, key_fields, size, len(manifest_data))
        mine.append(sealed_memfd(manifest_data, "weightcache:publish-manifest"))
        session = Session(sock_path, timeout=timeout)
        try:
            session.send_with_fds(msg, [*fds, mine[-1]])
            return session.replies(1, timeout)[0]
        finally:
            session.close()
    finally:
        for fd in mine:
            os.close(fd)


def publish(model: str, key_fields: dict[str, Any], tensors: Mapping[str, Any], tp_size: int = 1, tp_rank: int = 0,
            *, attrs: Mapping[str, dict] | None = None, device: str = "cpu", socket_dir: str | None = None,
            gpu: int | None = None, timeout: float = 60.0, cuda_path: str = "auto", home: Any = None) -> Published:
    """Hands the service of ``device``'s GPU the tensors this engine processed for one rank of ``model``.

    Args:
        model (`str`): the checkpoint directory (recommended) or a model name of the service's configuration.
        key_fields (`dict`): the engine's key (:func:`weightcache.identity.engine_key` lists the fields: engine
            and version, architecture, dtype, quantization method and config hash, every parallel rank and size,
            draft role, kernel backends, compute capability); the service adds the checkpoint identity it
            computes from the files and the slab's device.
        tensors (`Mapping[str, torch.Tensor]`): the engine's parameters and buffers after its processing, by name;
            tied names may map to one tensor. Copied here (CPU or CUDA source), not changed.
        tp_size (`int`, *optional*, defaults to 1), tp_rank (`int`, *optional*, defaults to 0): the rank; equal to
            ``key_fields["parallel"]``'s.
        attrs (`Mapping[str, dict]`, *optional*): JSON-able Python-side attributes per name, given back by
            :func:`attach_published` in the tensor's layout (``layouts[name]["attrs"]``).
        device (`str`, *optional*, defaults to ``"cpu"``), socket_dir (`str`, *optional*), gpu (`int`,
            *optional*): which service, as :func:`weightcache.attach` picks it. On ``cuda:N`` the service copies
            the tensors into an allocation of its own (see ``cuda_path``); on ``cpu`` they are copied into a memfd
            the service seals and keeps.
        timeout (`float`, *optional*, defaults to 60): seconds for the service's answer (it digests every byte).
        cuda_path (`str`, *optional*, defaults to ``"auto"``): on ``cuda:N``, how the service gets the bytes:
            ``"staging"``: a copy into a VMM allocation whose fd goes to the service, which copies it (two copies;
            the GPU needs room for the staging allocation and the service's copy beside the tensors);
            ``"ipc"``: CUDA IPC handles of the allocations the tensors live in (``cuIpcGetMemHandle``; the service
            copies straight from them: one copy, room for the service's copy only, but opening them costs the
            service about 3 ms per GB mapped, longer than a second copy at HBM speed; the
            tensors must stay alive and unchanged until this returns, which they do since this call waits);
            ``"auto"``: staging when the GPU has room for it (:func:`_room_to_stage`), else IPC, and staging
            again when IPC cannot export an allocation (torch's ``expandable_segments``) or the service refuses.
        home (`CudaWritableSlab`, *optional*): on ``cuda:N`` with ``cuda_path`` ``"auto"`` or ``"staging"``, the
            publisher's own VMM allocation its tensors were moved into before its checkpoint was read
            (:func:`allocate_home`, :func:`weightcache.integrations.params.move_storages`). When every planned
            copy finds its bytes already at their place there (the tensors' layout is what it was when moved),
            its fd goes to the service as the staging allocation: one copy (the service's) in all, tried before
            the paths above (which it needs no room for); otherwise those paths.

    Returns:
        `Published`.

    Raises:
        ValueError: ``cuda_path`` is not one of the three.
        DaemonUnavailable (`daemon_unavailable`): no service answers.
        AccessDenied (`access_denied`): this uid may not publish the model (docs/configuration.md, ``publishers``).
        PublicationInvalid (`publication_invalid`): the key lacks a field, or a tensor cannot be published
            (``cuda_path="ipc"``: an allocation IPC cannot export, ``details["reason"] = "ipc"``).
        InsufficientMemory (`insufficient_memory`): the service's memory budget has no room.
        ModelNotFound (`model_not_found`): the model is not configured on that GPU.

    Example:
        >>> p = publish("/srv/models/qwen3", key, dict(model.named_parameters()), 1, 0)
        >>> p.created, p.label
        (True, 'qwen3/tp1/rank0+pub:3f2a9c1d')
    """
    from .. import (
        identity,  # the engine key's check (not at module level: a plain attach never needs it)
    )
    from ..errors import PublicationInvalid

    sock_path = _socket_path(model, tp_size, tp_rank, device, socket_dir, gpu, timeout)
    identity.engine_key(key_fields, tp_size, tp_rank)  # refused here as the service would
    if cuda_path not in ("auto", "ipc", "staging"):
        raise ValueError(f"publish: cuda_path must be 'auto', 'ipc' or 'staging', got {cuda_path!r}")
    records, slab_bytes, copies = pack(tensors, attrs)
    manifest = Manifest(_wire_model(model), tp_size, tp_rank, {}, slab_bytes, records)
    data = pack_file(manifest)
    request = functools.partial(_send, sock_path, timeout, model, tp_size, tp_rank, key_fields, data)
    reply = None
    if home is not None and device.startswith("cuda") and cuda_path != "ipc":
        # first: the home in place costs the service's copy alone, and no room beside it (which the choice of
        # IPC below is about, and which the home itself takes)
        if _in_place(copies, slab_bytes, home):
            fd = home.export_fd()
            try:
                reply = request((home.size_bytes, [fd], {}))
            finally:
                os.close(fd)
            log.info("publish in place checkpoint=%s size_bytes=%d (the tensors were already at their slab offsets "
                     "in the publisher's own allocation)", model, home.size_bytes)
        else:
            log.info("publish checkpoint=%s: the tensors moved since they were placed in their home allocation; "
                     "the paths of cuda_path=%r instead", model, cuda_path)
    if reply is None and device.startswith("cuda") and (
            cuda_path == "ipc" or cuda_path == "auto" and not _room_to_stage(slab_bytes, device)):
        ipc = _ipc_request(copies, slab_bytes, device, cuda_path == "ipc")
        if ipc is not None:
            try:
                reply = request(ipc)
            except PublicationInvalid as e:  # a service that cannot open the handles: the staging copy
                if cuda_path != "auto" or e.details.get("reason") not in ("ipc", "backend"):
                    raise
                log.info("publish by CUDA IPC refused (%s); staging a copy instead", e)
    if reply is None:
        if device.startswith("cuda"):  # the service copies it into its own allocation and seals that
            staged = _fill_cuda(copies, slab_bytes, device)
            slab_fd, size, release = staged.fd, staged.size_bytes, staged.close
        else:  # the service seals this memfd: its pages become the slab
            slab_fd = _fill(copies, slab_bytes)
            size, release = os.fstat(slab_fd).st_size, functools.partial(os.close, slab_fd)
        try:
            reply = request((size, [slab_fd], {}))
        finally:
            release()  # CUDA: the staging allocation is freed here; the service holds its own copy
    if not isinstance(reply, protocol.PublishReply):
        raise RemoteProtocolError(f"publish: unexpected reply {reply.tag()!r}")
    log.info("published checkpoint=%s tp_size=%d tp_rank=%d slab=%s created=%s size_bytes=%d", model, tp_size,
             tp_rank, reply.label, reply.created, reply.size_bytes)
    return Published(reply.label, reply.created, reply.size_bytes, reply.engine_key_blake2b)


def attach_published(model: str, key_fields: dict[str, Any], tp_size: int = 1, tp_rank: int = 0, *,
                     device: str = "cpu", mode: AttachMode | str = DEFAULT_MODE, socket_dir: str | None = None,
                     gpu: int | None = None, timeout: float = 30.0) -> Attachment:
    """Attaches the publication of ``model``'s rank made under the engine key ``key_fields``, zero-copy.

    No disk fallback: on any error the engine loads the model itself (and may :func:`publish` it).

    Args:
        model (`str`): the checkpoint directory (recommended) or a model name of the service's configuration.
        key_fields (`dict`): the engine's key, as :func:`publish` took it.
        tp_size, tp_rank (`int`, *optional*): the rank.
        device, mode, socket_dir, gpu, timeout: as :func:`weightcache.attach`.

    Returns:
        `Attachment`: ``tensors`` are read-only views of the service's slab (tied names one tensor), valid until
        :meth:`Attachment.close`; ``layouts[name]["attrs"]`` the attributes given to :func:`publish`.

    Raises:
        ModelNotFound (`model_not_found`): no publication of that rank for this engine (``details["publication"]
            == "none"``), or the model is not configured.
        CacheKeyMismatch (`cache_key_mismatch`): the service holds it under another engine key, or its checkpoint
            identity or device differs from the checkpoint and device here; ``details["fields"]`` lists them.
        AccessDenied (`access_denied`), DaemonUnavailable (`daemon_unavailable`), PublicationInvalid
            (`publication_invalid`), ManifestInvalid (`manifest_invalid`), ManifestSlabMismatch
            (`manifest_slab_mismatch`).
    """
    mode = AttachMode(mode)
    sock_path = _socket_path(model, tp_size, tp_rank, device, socket_dir, gpu, timeout)
    session = Session(sock_path, timeout=timeout)
    try:
        reply = session.request(protocol.AttachPublished(_wire_model(model), tp_size, tp_rank, key_fields,
                                                         mode=mode), timeout)
        if not isinstance(reply, protocol.AttachReply):
            raise RemoteProtocolError(f"attach_published: unexpected reply {reply.tag()!r}")
        fd, manifest_fd = slab_and_manifest_fds(session)
        try:
            try:
                manifest = read_file(manifest_fd, reply.manifest_size_bytes).manifest
            finally:
                os.close(manifest_fd)
            backend = local_backend(device)
            _check_key(model, reply.checkpoint_path, key_fields, manifest, backend.device_info(), sock_path)
            slab = import_slab(backend, fd, reply, manifest, device)
        finally:
            os.close(fd)
        log.info("attached published checkpoint=%s tp_size=%d tp_rank=%d mode=%s", model, tp_size, tp_rank,
                 mode.value, extra=event("attached", model, tp_rank, tp_size=tp_size))
        return attachment_of(slab, manifest, reply, mode, session)
    except BaseException:
        session.close()
        raise


def _check_key(model: str, checkpoint_path: str, key_fields: dict[str, Any], manifest: Manifest,
               device: dict[str, Any], sock_path: str) -> None:
    """Raises CacheKeyMismatch (`cache_key_mismatch`) unless the slab's key is this engine's fields, the checkpoint
    as it is here (``stat()``) and this device."""
    from .. import identity

    key = manifest.key
    try:
        diff = identity.diff_keys(key_fields, {k: v for k, v in key.items() if k not in identity.RESERVED_KEY_FIELDS})
        diff += identity.diff_keys({"device": dict(device)}, {"device": key.get("device")})
        ck = Checkpoint(model if os.path.isdir(model) else checkpoint_path, validate=False)
        diff += ["checkpoint." + d for d in ck.identity_diff(key.get("checkpoint") or {})]
    except (KeyError, TypeError, AttributeError) as e:
        raise RemoteProtocolError(f"attach_reply from {sock_path} has a malformed cache key: {e!r}") from None
    if diff:
        raise CacheKeyMismatch(f"service at {sock_path} holds a different publication of {model!r}: differing key "
                               f"fields {', '.join(diff[:10])}", fields=diff, socket=sock_path)
