"""The disk fallback: the same pipeline as the service's, into the engine's private memory.

The only room of the client that imports the load pipeline (:mod:`weightcache.pipeline`,
:mod:`weightcache.quant`), and only when a fallback or a quantized slab's check needs it: an
engine that only attaches never imports it (tests/unit/test_lazy_imports.py).

Forbidden imports: weightcache.config, weightcache.daemon, weightcache.pipeline at module level,
weightcache.quant at module level, weightcache.sharding, numpy at module level, torch at module level.
"""

from __future__ import annotations

import logging
from typing import Any

from ..checkpoint import Checkpoint
from ..errors import WeightcacheError
from ..journal import event
from ..manifest import LayoutMap, Manifest, build_views
from ..spec import RankRequest
from ._attachment import Attachment
from ._device import device_info
from ._request import AttachRequest

log = logging.getLogger(__package__)  # the package's logger: a room is no logger name of its own


def detect_scheme(ck: Checkpoint, kernel: str | None) -> Any:
    """:func:`weightcache.quant.detect` of ``ck`` for ``kernel`` (``None``: no kernel check; imports
    :mod:`weightcache.quant`).

    Raises:
        UnsupportedQuantization, CheckpointCorrupt: as :func:`weightcache.quant.detect`.
    """
    from .. import quant

    return quant.detect(ck, kernel)


def check_files(ck: Checkpoint) -> None:
    """Reads ``ck``'s file list and safetensors headers (no tensor data).

    Raises:
        CheckpointNotFound (`checkpoint_not_found`): no safetensors file, or
            one the index lists is missing.
        CheckpointCorrupt (`checkpoint_corrupt`): an invalid index, a stray
            shard, or a file too short for its header.
    """
    ck.raw_headers  # noqa: B018 - lists the files and reads each header, raising on the first problem


def load_from_disk(rank: RankRequest, device: str) -> tuple[Manifest, Any]:
    """Runs the shared pipeline into private memory on ``device``.

    Args:
        rank (`RankRequest`): what to load, and the rank.
        device (`str`): ``cpu`` or ``cuda:N``.

    Returns:
        ``(manifest, slab)``: the slab is a private 1-D ``uint8`` tensor.

    Raises:
        The errors of :func:`weightcache.pipeline.plan` and :func:`weightcache.pipeline.execute`.
    """
    import torch

    from .. import pipeline  # the disk fallback's pipeline, imported when it runs

    pl = pipeline.plan(rank, device_info(device))
    slab = torch.empty(pl.slab_size_bytes, dtype=torch.uint8, device=device)
    manifest = pipeline.execute(pl, slab, with_digests=False)
    return manifest, slab


def fall_back(req: AttachRequest, local_ck: Checkpoint, unavailable: WeightcacheError) -> Attachment:
    """The attach's end when the service cannot serve: the checkpoint's own error, ``unavailable``, or a disk load.

    Args:
        req (`AttachRequest`): the attach.
        local_ck (`Checkpoint`): the checkpoint directory the engine named (opened without validation).
        unavailable (`WeightcacheError`): why the service cannot serve (the fallback's reason).

    Returns:
        `Attachment`: ``source="disk"``, ``fallback_reason`` ``"<code>: <message>"``, the tensors in
        private memory inside torch's own allocator.

    Raises:
        ``unavailable`` itself when ``req.fallback`` is off; CheckpointNotFound, CheckpointCorrupt: a broken
        checkpoint (whatever the service said); DeviceError (`device_error`): the engine's device fails.
    """
    model, tp_size, tp_rank, device = req.model, req.tp_size, req.tp_rank, req.device
    # The service cannot serve. A broken checkpoint is the engine's problem whatever the service
    # said (and no fallback could load it): its own error, not a cache miss.
    check_files(local_ck)
    if not req.fallback:
        raise unavailable
    reason = f"{unavailable.code}: {unavailable.message}"
    try:  # the fallback loads onto the engine's own device: a device that fails is not a disk load
        device_info(device)
    except WeightcacheError as e:
        log.warning("no fallback to disk, the device fails checkpoint=%s tp_size=%d tp_rank=%d device=%s code=%s "
                    "reason=%s", model, tp_size, tp_rank, device, e.code, reason)
        raise
    log.warning("fallback to disk checkpoint=%s tp_size=%d tp_rank=%d reason=%s", model, tp_size, tp_rank, reason,
                extra=event("fallback", model, tp_rank, tp_size=tp_size))
    manifest, slab = load_from_disk(req.rank_request(str(local_ck.path)), device)
    views = build_views(slab, manifest)
    return Attachment(views, LayoutMap(manifest), manifest, "disk", reason,
                      0, _slab=slab)  # private memory inside torch's own allocator
