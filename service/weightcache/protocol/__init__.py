"""The wire protocol, sans-I/O (in the manner of h11, split as Dynamo's memory service splits its own).

This face is the one import path of every public name; the rooms behind it are private:

- :mod:`._messages`: the message base and what an engine's attach exchanges
  (``hello``, ``attach``, their replies, ``loading``, ``error``), frozen
  self-validating dataclasses; :mod:`._lease`: ``release`` and its reply;
  :mod:`._admin`: the operator's messages; :mod:`._publish`: ``publish``, its reply and ``attach_published``
  (an engine hands the service the weights it processed, and attaches them by its engine key);
- :mod:`._records`: the typed records inside replies (slab and service
  status, verify results, metrics counters);
- :mod:`._codec`: :func:`encode`/:func:`decode` of one frame, the limits,
  the tag table (:data:`TAGS`, :func:`message_class`, :func:`requests`,
  :func:`replies`) and the connection's state table written out (:data:`TABLE`);
- :mod:`._connection`: :class:`Connection`, one side of a connection
  (buffering, fd matching by count, the state machine).

The names of :mod:`._admin`, :mod:`._lease`, :mod:`._publish` and :mod:`._records` are imported
on first use (:func:`__getattr__`): an engine's attach exchanges none of them,
and their dataclasses cost about 14 ms to build at import
(tests/unit/test_lazy_imports.py). Every other name is imported here.

The values both ends share (slab states, attach modes, namings, request
defaults) live in :mod:`weightcache.wire` and are imported from there. See
``docs/protocol.md``.

No I/O: it never opens or closes an fd; the I/O code in :mod:`weightcache.daemon`
and :mod:`weightcache.client` owns them.

Forbidden imports: socket, selectors, asyncio, torch, weightcache.memory, weightcache.client,
weightcache.daemon, weightcache.pipeline.
"""

from ._codec import (CLIENT, CLOSED, IN, MAX_FDS_PER_FRAME, MAX_FRAME_BYTES, OUT, PROTOCOL_VERSION, READY,
                     REPLY_TYPES, REQUEST_TYPES, SERVER, START, TABLE, TAGS, TRANSITIONS, Transition, decode, encode,
                     message_class, replies, requests)
from ._connection import NEED_DATA, Connection
from ._messages import (ATTACH_EXCHANGE, INT_MAX, INT_MIN, Attach, AttachReply, Error, Hello, HelloReply, Loading,
                        Message, prepare)

#: The records of :mod:`._records`, imported on first use.
_RECORDS = ("HIDDEN_ID", "MAX_LEASE_HOLDERS_SHOWN", "MAX_LEASES_SHOWN", "AttachCount", "AttachTimes", "DeviceInfo",
            "ErrorInfo", "KeySummary", "LeaseHolder", "LeaseInfo", "LoadCount", "PublicationDropCount", "PublishCount",
            "SeedCount", "ServiceCounters", "ServiceStatus",
            "SlabCounters", "SlabInfo", "VerifyResult")
#: Name -> its room, for the names imported on first use: the message classes of :mod:`._admin`, :mod:`._lease`
#: and :mod:`._publish` (from the tag table) and the records.
_LATER = {**{name: room for room, name in TAGS.values() if room != "_messages"}, **dict.fromkeys(_RECORDS, "_records")}

__all__ = [
    "CLIENT", "CLOSED", "IN", "MAX_FDS_PER_FRAME", "MAX_FRAME_BYTES", "OUT", "PROTOCOL_VERSION", "READY",
    "REPLY_TYPES", "REQUEST_TYPES", "SERVER", "START", "TABLE", "TAGS", "TRANSITIONS", "Transition", "decode",
    "encode", "message_class", "replies", "requests",
    "NEED_DATA", "Connection",
    "ATTACH_EXCHANGE", "INT_MAX", "INT_MIN", "Attach", "AttachReply", "Error", "Hello", "HelloReply", "Loading",
    "Message", "prepare",
    *_LATER,
]


def __getattr__(name: str):
    """A name of :mod:`._admin`, :mod:`._lease`, :mod:`._publish` or :mod:`._records` (:data:`_LATER`), its room imported on first
    use (PEP 562); any other name missing here is an AttributeError."""
    room = _LATER.get(name)
    if room is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{room}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LATER))
