"""Frames, the tag table and the connection's state table: encode/decode of one frame, every message's wire type
and every allowed move, written out.

Frames on a Unix stream socket: a 4-byte big-endian length ``N`` followed by
``N`` bytes of one UTF-8 JSON object (no NaN, at most :data:`MAX_FRAME_BYTES`).
The object's ``type`` is the snake_case name of a message class; its optional
``fd_count`` says how many file descriptors travel as ``SCM_RIGHTS`` with the
frame (docs/protocol.md).

:data:`TAGS` is the tag table, a literal: each wire type, the room of this
package that defines its class, and the class name. :func:`message_class`
looks a type up there, importing the operator's rooms (:mod:`._admin`,
:mod:`._lease`) and publication's (:mod:`._publish`) the first time one of their types is looked up (an engine's
attach never does: their dataclasses and records cost about 14 ms to import);
:func:`requests` and :func:`replies` give every class.

:data:`TABLE` is the connection state machine as a literal table (as h11's
``_state.py``): for each role, state and direction, the message types allowed
and the state they lead to. :class:`~._connection.Connection`
looks moves up in :data:`TRANSITIONS`, the same table keyed by message type.

Within the package, imports go one way: _records <- _messages <- _admin, _lease, _publish <- _codec <- _connection.

Forbidden imports: socket, selectors, asyncio, torch, weightcache.memory, weightcache.client,
weightcache.daemon.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import LocalProtocolError, RemoteProtocolError
from . import _messages
from ._messages import Message, check_field, field_specs

#: 3: the manifest travels as a sealed memfd beside the slab (2: inside the frame; 1: JSON lists).
PROTOCOL_VERSION = 3
MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_FDS_PER_FRAME = 8
#: The length prefix of a frame: 4 bytes, big-endian.
LENGTH_PREFIX = struct.Struct(">I")

# --- the connection state table ------------------------------------------------------

#: Roles: which end of the connection this :class:`~._connection.Connection` is.
CLIENT, SERVER = "client", "server"
#: States: before ``hello``, after it, and after EOF or any protocol error.
START, READY, CLOSED = "start", "ready", "closed"
#: Directions: a message received (``in``) or sent (``out``).
IN, OUT = "in", "out"

#: Wire types of the requests after ``hello`` (a test checks them against :data:`TAGS`).
REQUEST_TYPES = ("list", "status", "attach", "release", "verify", "evict", "preload", "reload", "metrics", "publish",
                 "attach_published", "publish_cuda_ipc")
#: Wire types of the replies (a test checks them against :data:`TAGS`).
REPLY_TYPES = ("hello_reply", "list_reply", "status_reply", "attach_reply", "loading", "release_reply",
               "verify_reply", "evict_reply", "preload_reply", "reload_reply", "error", "metrics_reply", "publish_reply")

# --- the tag table ----------------------------------------------------------------------

#: Every message's wire type -> (the room of this package that defines its class, the class name): the requests,
#: ``hello`` first, in the order of :data:`REQUEST_TYPES`, then the replies in the order of :data:`REPLY_TYPES`.
#: A type is the snake_case of its class name (a test checks every row).
TAGS: dict[str, tuple[str, str]] = {
    "hello": ("_messages", "Hello"),
    "list": ("_admin", "List"),
    "status": ("_admin", "Status"),
    "attach": ("_messages", "Attach"),
    "release": ("_lease", "Release"),
    "verify": ("_admin", "Verify"),
    "evict": ("_admin", "Evict"),
    "preload": ("_admin", "Preload"),
    "reload": ("_admin", "Reload"),
    "metrics": ("_admin", "Metrics"),
    "publish": ("_publish", "Publish"),
    "attach_published": ("_publish", "AttachPublished"),
    "publish_cuda_ipc": ("_publish", "PublishCudaIpc"),
    "hello_reply": ("_messages", "HelloReply"),
    "list_reply": ("_admin", "ListReply"),
    "status_reply": ("_admin", "StatusReply"),
    "attach_reply": ("_messages", "AttachReply"),
    "loading": ("_messages", "Loading"),
    "release_reply": ("_lease", "ReleaseReply"),
    "verify_reply": ("_admin", "VerifyReply"),
    "evict_reply": ("_admin", "EvictReply"),
    "preload_reply": ("_admin", "PreloadReply"),
    "reload_reply": ("_admin", "ReloadReply"),
    "error": ("_messages", "Error"),
    "metrics_reply": ("_admin", "MetricsReply"),
    "publish_reply": ("_publish", "PublishReply"),
}

#: Wire type -> class, for the types :func:`message_class` has looked up (those of :mod:`._messages` from the start).
_CLASSES: dict[str, type[Message]] = {tag: getattr(_messages, name) for tag, (room, name) in TAGS.items()
                                      if room == "_messages"}


def message_class(tag: str) -> type[Message] | None:
    """The message class of wire type ``tag`` (None: no such type), from :data:`TAGS`.

    The first lookup of a type of the operator's rooms imports that room (:mod:`._admin` or :mod:`._lease`): an
    engine's attach never looks one up. Neither room imports this module, so this is no circle.
    """
    cls = _CLASSES.get(tag)
    if cls is None and tag in TAGS:
        room, name = TAGS[tag]
        if room == "_admin":
            from . import _admin as module
        elif room == "_lease":
            from . import _lease as module
        elif room == "_publish":
            from . import _publish as module
        else:
            module = _messages
        cls = _CLASSES[tag] = getattr(module, name)
    return cls


def requests() -> tuple[type[Message], ...]:
    """Every request class, ``hello`` first (imports the operator's rooms)."""
    return tuple(message_class(t) for t in ("hello",) + REQUEST_TYPES)


def replies() -> tuple[type[Message], ...]:
    """Every reply class (imports the operator's rooms)."""
    return tuple(message_class(t) for t in REPLY_TYPES)



@dataclass(frozen=True, slots=True)
class Transition:
    """One row of :data:`TABLE`: in ``state``, role ``role`` may move ``types`` in ``direction``, to ``target``."""

    role: str
    state: str
    direction: str
    types: tuple[str, ...]
    target: str


#: Every allowed move; anything absent is a protocol violation (local when sending, remote when receiving)
#: and moves the connection to CLOSED.
TABLE: tuple[Transition, ...] = (
    # the service: hello first, exactly once; a rejected hello is answered with an error
    Transition(SERVER, START, IN, ("hello",), READY),
    Transition(SERVER, START, OUT, ("error",), START),
    Transition(SERVER, READY, IN, REQUEST_TYPES, READY),
    Transition(SERVER, READY, OUT, REPLY_TYPES, READY),
    # the client: the mirror image
    Transition(CLIENT, START, OUT, ("hello",), READY),
    Transition(CLIENT, START, IN, ("error",), START),
    Transition(CLIENT, READY, OUT, REQUEST_TYPES, READY),
    Transition(CLIENT, READY, IN, REPLY_TYPES, READY),
)

#: (our role, state, direction, message type) -> next state: :data:`TABLE` keyed by message type.
TRANSITIONS: dict[tuple[str, str, str, str], str] = {
    (t.role, t.state, t.direction, typ): t.target for t in TABLE for typ in t.types}

# --- frames ---------------------------------------------------------------------------


def encode(msg: Message) -> bytes:
    """Serialises one message into a frame (length prefix + JSON).

    Raises:
        LocalProtocolError (`local_protocol_violation`): the frame exceeds
            :data:`MAX_FRAME_BYTES`.
    """
    body = json.dumps(msg.to_json(), allow_nan=False, separators=(",", ":"), ensure_ascii=False).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise LocalProtocolError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit",
                                 size_bytes=len(body))
    return LENGTH_PREFIX.pack(len(body)) + body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode(body: bytes, ignore_unknown: bool = False) -> tuple[Message, int]:
    """Parses one frame body into ``(message, fd_count)``.

    Args:
        body (`bytes`): the frame's JSON object.
        ignore_unknown (`bool`): drop fields the message does not know instead of refusing them: a client
            reading a reply (a newer service may add fields to a reply within a protocol version; docs/protocol.md,
            "Compatibility"). The service reads requests strictly (False).

    Raises:
        RemoteProtocolError (`protocol_violation`): invalid UTF-8/JSON (a NUL
            byte included), not an object, unknown ``type``, unknown or
            mistyped fields, or a value the message refuses (``attach``'s ``mode``).
    """
    try:
        obj = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
        # Lone surrogates ("\ud800") parse but cannot be encoded again (e.g. echoed in an error).
        # Valid UTF-8 cannot hold a surrogate, so one can only come from a \uD800-\uDFFF
        # escape; re-encode (as costly as the parse) only when the body has one.
        if _SURROGATE_ESCAPE.search(body):
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except (UnicodeError, ValueError) as e:
        raise RemoteProtocolError(f"frame is not valid UTF-8 JSON: {e}") from None
    except RecursionError:
        raise RemoteProtocolError("frame is not valid UTF-8 JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise RemoteProtocolError(f"frame must be a JSON object, got {type(obj).__name__}")
    tag = obj.pop("type", None)
    fd_count = obj.pop("fd_count", 0)
    if not isinstance(fd_count, int) or isinstance(fd_count, bool) or not 0 <= fd_count <= MAX_FDS_PER_FRAME:
        raise RemoteProtocolError(f"fd_count must be an integer 0..{MAX_FDS_PER_FRAME}, got {fd_count!r}")
    cls = message_class(tag) if isinstance(tag, str) else None
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {tag!r}", type=str(tag)[:64])
    specs = field_specs(cls)
    names = {name for name, _, _ in specs}
    unknown = set(obj) - names
    if unknown and ignore_unknown:
        for name in unknown:
            del obj[name]
    elif unknown:
        raise RemoteProtocolError(f"message {tag!r} has unknown field {sorted(unknown)[0]!r}", field=sorted(unknown)[0])
    for spec in specs:  # a mistyped field is named first, whatever else is wrong
        if spec[0] in obj:
            check_field(tag, spec, obj[spec[0]], RemoteProtocolError)
    if fd_count != cls.FD_COUNT:
        raise RemoteProtocolError(f"message {tag!r} must carry {cls.FD_COUNT} fds, frame declares {fd_count}")
    try:
        return cls(**obj), fd_count
    except TypeError as e:
        raise RemoteProtocolError(f"message {tag!r} is missing a field: {e}") from None
    except LocalProtocolError as e:  # the message's own check (e.g. attach's mode) refused the peer's value
        raise RemoteProtocolError(e.message, **e.details) from None
