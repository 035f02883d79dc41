"""Typed errors shared by the service, the client and the wire protocol.

This is a leaf module: it imports nothing from weightcache. Every error has a
permanent snake_case ``code`` (listed in ``docs/errors.md``) and a
``retryable`` flag. Error replies on the wire carry ``code``, ``message`` and
``details``; :func:`from_wire` rebuilds the same class on the other side, and an
unknown code becomes :class:`UnknownRemoteError`, which keeps the code.
"""

from __future__ import annotations

from typing import Any, ClassVar


class WeightcacheError(Exception):
    """Base class of every weightcache error. Not raised directly.

    Attributes:
        code (`str`): permanent, machine-readable error code.
        retryable (`bool`): whether the same request may succeed later.
        details (`dict`): JSON-serialisable fields naming the model, file,
            tensor or field at fault.
    """

    code: ClassVar[str] = ""
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **details: Any) -> None:
        if type(self) is WeightcacheError:
            raise TypeError("WeightcacheError is abstract; raise a subclass")
        super().__init__(message)
        self.message = message
        self.details = details

    def to_wire(self) -> dict[str, Any]:
        """Returns the ``error`` reply fields: ``code``, ``message``, ``details``."""
        return {"code": self.code, "message": self.message, "details": self.details}


class ConfigError(WeightcacheError):
    """The configuration file is malformed or inconsistent (names file and key)."""

    code = "config_invalid"


class CheckpointNotFound(WeightcacheError):
    """A checkpoint directory, file or index entry does not exist."""

    code = "checkpoint_not_found"


class CheckpointUnreadable(WeightcacheError):
    """A checkpoint directory or file exists but the reading user may not open it (``EACCES``).

    ``details``: ``file`` (the path refused), ``user`` and ``uid`` (who read).
    """

    code = "checkpoint_unreadable"


class CheckpointCorrupt(WeightcacheError):
    """A safetensors file is truncated or its header is invalid."""

    code = "checkpoint_corrupt"


class ShapeMismatch(WeightcacheError):
    """A tensor's shape disagrees with ``config.json`` or the sharding rule."""

    code = "shape_mismatch"


class UnsupportedQuantization(WeightcacheError):
    """A quantization scheme or kernel target that weightcache cannot process.

    Raised before any weight is read, whatever ``fallback`` says.
    """

    code = "unsupported_quantization"


class UnsupportedArchitecture(WeightcacheError):
    """No tensor-parallel rules exist for the model's architecture (TP > 1)."""

    code = "unsupported_architecture"


class CacheKeyMismatch(WeightcacheError):
    """The service holds a different key than the engine expects.

    ``details["fields"]`` lists the differing key fields.
    """

    code = "cache_key_mismatch"


class ModelNotFound(WeightcacheError):
    """The requested model or layout is not configured on this GPU."""

    code = "model_not_found"


class ModelLoadFailed(WeightcacheError):
    """The model failed to load; ``details["cause"]`` holds the original code."""

    code = "model_load_failed"


class ModelLoading(WeightcacheError):
    """The model is still loading and did not become ready within the wait."""

    code = "model_loading"
    retryable = True


class DaemonUnavailable(WeightcacheError):
    """No service answers on the socket (absent, refused or not ready in time)."""

    code = "daemon_unavailable"
    retryable = True


class AccessDenied(WeightcacheError):
    """The peer (``SO_PEERCRED``) is not on the model's allow list."""

    code = "access_denied"


class OutOfMemory(WeightcacheError):
    """The slab could not be allocated on the device or in host memory."""

    code = "out_of_memory"
    retryable = True


class InsufficientMemory(WeightcacheError):
    """The memory budget (``[service] memory_budget_bytes``) has no room for a slab, and none can be made:
    what holds the budget is leased, pinned or loading. Nothing resident was moved.

    ``details``: ``model``, ``need_bytes``, ``budget_bytes``, ``free_bytes``, ``resident`` (list of
    ``{"slab", "size_bytes", "leases", "pinned"}``) and ``leases`` (list of ``{"slab", "lease_id", "pid", "uid"}``).
    Retryable once an engine releases a lease.
    """

    code = "insufficient_memory"
    retryable = True


class DeviceError(WeightcacheError):
    """A CUDA driver call failed (names the call and the CUresult)."""

    code = "device_error"


class LeaseBusy(WeightcacheError):
    """An operation (e.g. evict) refused because clients hold leases."""

    code = "lease_busy"
    retryable = True


class ProtocolError(WeightcacheError):
    """A frame or message broke the wire protocol. Abstract: see subclasses."""

    code = "protocol_violation"

    def __init__(self, message: str, **details: Any) -> None:
        if type(self) is ProtocolError:
            raise TypeError("ProtocolError is abstract; raise Local- or RemoteProtocolError")
        super().__init__(message, **details)


class LocalProtocolError(ProtocolError):
    """This side tried to send something the protocol does not allow."""

    code = "local_protocol_violation"


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol does not allow."""

    code = "protocol_violation"


class ManifestInvalid(RemoteProtocolError, ValueError):
    """A packed manifest cannot be decoded or contradicts itself.

    ``details["section"]`` names the part at fault (``header``, ``names``,
    ``table``, ``dims``, ``digests``, ``layouts``, ``runs``, ``dtypes``).
    Seen by an engine in an ``attach_reply`` (a service bug or a foreign
    service), or by the service in a record of its fd store (dropped, loaded again).
    Also a ``ValueError``: the manifest's own decoding error.
    """

    code = "manifest_invalid"


class ManifestTooLarge(WeightcacheError):
    """A slab's manifest file would exceed the limit engines read (raised at load, never at attach)."""

    code = "manifest_too_large"


class ManifestSlabMismatch(RemoteProtocolError):
    """A manifest's views do not fit the slab received with it (a view past the mapping's end)."""

    code = "manifest_slab_mismatch"


class PublicationInvalid(WeightcacheError):
    """A ``publish`` (or an attach by engine key) the service cannot take: its engine key lacks a field or has one
    of the wrong type, its manifest does not fit the memfd sent with it, the fd is no memfd that can be sealed,
    or the backend takes no publication. ``details["field"]`` or ``details["reason"]`` names what."""

    code = "publication_invalid"


class SlabStillMapped(WeightcacheError):
    """A ``publish`` whose memfd could not be sealed against writes: the publisher (or a process it shared the fd
    with) still holds a writable mapping of it (the kernel refuses ``F_SEAL_WRITE`` then, ``EBUSY``). Unmap every
    writable mapping before sending; nothing was kept."""

    code = "slab_still_mapped"


class InternalError(WeightcacheError):
    """The service failed to handle one request for a reason that is its own bug
    or an unexpected library error; it logged the details and keeps serving."""

    code = "internal_error"


class UnknownRemoteError(WeightcacheError):
    """An error reply whose code this version does not know; keeps the code."""

    code = "unknown"

    def __init__(self, message: str, remote_code: str = "unknown", **details: Any) -> None:
        super().__init__(message, **details)
        self.remote_code = remote_code


class ResourceExhausted(WeightcacheError):
    """A per-client cap of the service was reached (docs/reliability.md, "Limits").

    ``details``: ``limit`` (the ``[service]`` key, e.g. ``max_unread_replies``),
    ``value`` (its value) and ``actual`` (what the client was at). Retryable
    once the client reads its replies or closes other connections.
    """

    code = "resource_exhausted"
    retryable = True


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


ERRORS_BY_CODE: dict[str, type[WeightcacheError]] = {
    c.code: c
    for c in _all_subclasses(WeightcacheError)
    if c.code and c not in (ProtocolError, UnknownRemoteError, LocalProtocolError)
}


#: Error codes of a load the service cannot lay out itself but a vLLM engine can: a model configured with
#: ``naming = "vllm"`` whose load fails with one of these waits for its engine's publication
#: (``waiting_for_engine``) instead of failing; ``check-config`` reports it so, not as an error.
ENGINE_LAYOUT_CODES: frozenset[str] = frozenset({"unsupported_architecture", "unsupported_quantization"})


def from_wire(code: str, message: str, details: dict[str, Any] | None = None) -> WeightcacheError:
    """Rebuilds the error class named by ``code`` from an ``error`` reply.

    Args:
        code (`str`): the reply's ``code``.
        message (`str`): the reply's ``message``.
        details (`dict`, *optional*): the reply's ``details``.

    Returns:
        The matching :class:`WeightcacheError` subclass instance, or
        :class:`UnknownRemoteError` (keeping ``code``) for codes this version
        does not know.
    """
    details = dict(details or {})
    cls = ERRORS_BY_CODE.get(code)
    if cls is None:
        return UnknownRemoteError(message, remote_code=code, **details)
    return cls(message, **details)
