"""What :func:`weightcache.attach` returns: an :class:`Attachment`, the weights of one (model, layout, rank).

Forbidden imports: weightcache.config, weightcache.daemon, weightcache.pipeline, numpy, torch at module level.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..manifest import Manifest

if TYPE_CHECKING:
    from ..session import Session


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


def copy_views(views: dict[str, Any]) -> dict[str, Any]:
    """Private copies of attached ``views`` (``mode="copy"``); tied names keep sharing one tensor."""
    out: dict[str, Any] = {}
    by_id: dict[int, Any] = {}
    for name, t in views.items():
        if id(t) not in by_id:
            by_id[id(t)] = t.clone()
        out[name] = by_id[id(t)]
    return out
