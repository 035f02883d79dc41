"""The wire protocol, sans-I/O (in the manner of h11, split as Dynamo's memory service splits its own).

Rooms:

- :mod:`.messages`: one frozen, self-validating dataclass per request and
  per reply (:data:`REQUESTS`, :data:`REPLIES`); those an engine's attach
  exchanges there, ``release`` and its reply in :mod:`.lease`, the operator's
  in :mod:`.admin`, both imported on first use;
- :mod:`.records`: the typed records inside replies (slab and service
  status, verify results, metrics counters), imported on first use;
- :mod:`.codec`: :func:`encode`/:func:`decode` of one frame, the limits, and
  the connection's state table written out (:data:`TABLE`);
- :mod:`.connection`: :class:`Connection`, one side of a connection
  (buffering, fd matching by count, the state machine).

The values both ends share (slab states, attach modes, namings, request
defaults) live in :mod:`weightcache.wire` and are re-exported here.
``from weightcache import protocol; protocol.X`` keeps working for every name
the single module ``protocol.py`` had. See ``docs/protocol.md``.

No I/O: it never opens or closes an fd; the I/O code in :mod:`weightcache.daemon`
and :mod:`weightcache.client` owns them.

Forbidden imports: socket, selectors, asyncio, torch, weightcache.memory, weightcache.client,
weightcache.daemon, weightcache.pipeline.
"""

from ..wire import AttachMode, SlotState
from .codec import (CLIENT, CLOSED, IN, MAX_FDS_PER_FRAME, MAX_FRAME_BYTES, OUT, PROTOCOL_VERSION, READY,
                    REPLY_TYPES, REQUEST_TYPES, SERVER, START, TABLE, TRANSITIONS, Transition, decode, encode)
from .connection import NEED_DATA, Connection
from .messages import INT_MAX, INT_MIN, Attach, AttachReply, Error, Hello, HelloReply, Loading, Message

#: Names of :mod:`.admin` (the operator's messages), :mod:`.lease` and :mod:`.records`, imported on first use
#: (:func:`__getattr__`).
_LAZY = {
    "Release": "lease", "ReleaseReply": "lease",
    **dict.fromkeys(("REPLIES", "REQUESTS", "Evict", "EvictReply", "List", "ListReply", "Metrics", "MetricsReply",
                     "Preload", "PreloadReply", "Reload", "ReloadReply", "Status", "StatusReply", "Verify",
                     "VerifyReply"), "admin"),
    **dict.fromkeys(("HIDDEN_ID", "AttachCount", "AttachTimes", "DeviceInfo", "ErrorInfo", "KeySummary", "LeaseInfo",
                     "LoadCount", "ServiceCounters", "ServiceStatus", "SlabCounters", "SlabInfo", "VerifyResult",
                     "MAX_LEASE_HOLDERS_SHOWN", "MAX_LEASES_SHOWN", "LeaseHolder"), "records"),
}

__all__ = [
    "CLIENT", "CLOSED", "IN", "MAX_FDS_PER_FRAME", "MAX_FRAME_BYTES", "OUT", "PROTOCOL_VERSION", "READY",
    "REPLY_TYPES", "REQUEST_TYPES", "SERVER", "START", "TABLE", "TRANSITIONS", "Transition", "decode", "encode",
    "NEED_DATA", "Connection",
    "INT_MAX", "INT_MIN", "REPLIES", "REQUESTS", "Attach", "AttachReply", "Error", "Evict", "EvictReply", "Hello",
    "HelloReply", "List", "ListReply", "Loading", "Message", "Metrics", "MetricsReply", "Preload", "PreloadReply",
    "Release", "ReleaseReply", "Reload", "ReloadReply", "Status", "StatusReply", "Verify", "VerifyReply",
    "HIDDEN_ID", "AttachCount", "AttachTimes", "DeviceInfo", "ErrorInfo", "KeySummary", "LeaseInfo", "LoadCount",
    "ServiceCounters", "ServiceStatus", "SlabCounters", "SlabInfo", "VerifyResult",
    "MAX_LEASE_HOLDERS_SHOWN", "MAX_LEASES_SHOWN", "LeaseHolder",
    "AttachMode", "SlotState",
]


def __getattr__(name: str):
    """The operator's messages (:mod:`.admin`), ``release`` (:mod:`.lease`) and the records (:mod:`.records`),
    imported on first use: an engine's attach needs none of them (tests/unit/test_lazy_imports.py)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
