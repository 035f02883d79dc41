"""The wire messages: one frozen, slotted dataclass per request and per reply, each validating itself.

A message's wire ``type`` is the snake_case name of its class (``AttachReply``
-> ``attach_reply``); its fields are JSON values whose types the annotations
give (``int`` fields hold signed 64-bit integers). A message checks its field
types when built, and a field with a closed set of values (``Attach.mode``)
is parsed into its :mod:`weightcache.wire` enum there, once: built here, a bad
value raises :class:`~weightcache.errors.LocalProtocolError`; decoded from a
peer's frame (:mod:`._codec`), the same check raises
:class:`~weightcache.errors.RemoteProtocolError`. Replies that carry records
(:mod:`._records`) give them typed through ``typed()``.

This room holds what an engine's attach exchanges (``hello``, ``attach``,
their replies, ``loading``, ``error``); ``release`` and its reply (a lease
ended before its connection, which weightcache's client never does: it closes
the connection) live in :mod:`._lease`, and the operator's messages (``list``,
``status``, ``verify``, ``evict``, ``preload``, ``reload``, ``metrics`` and
their replies) in :mod:`._admin`. Neither is imported here: the tag table of
:mod:`._codec` says which room defines each wire type and imports the
operator's rooms on first use, so that ``weightcache.attach`` does not build
(nor import the records of) messages it never sends: each frozen slotted
dataclass costs about a millisecond of code generation at import
(tests/unit/test_lazy_imports.py).

Forbidden imports: socket, selectors, asyncio, torch, weightcache.memory, weightcache.client,
weightcache.daemon.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import LocalProtocolError, WeightcacheError
from ..wire import DEFAULT_MODE, AttachMode, SlotState

#: Integers on the wire are signed 64-bit, so that any client language can hold them.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1


def snake_case(name: str) -> str:
    """``re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()`` without compiling a pattern (an engine's first attach
    tags its messages; a pattern's compilation was a tenth of a millisecond of it)."""
    return "".join("_" + c if i and "A" <= c <= "Z" else c for i, c in enumerate(name)).lower()


_JSON_TYPES = {"int": int, "str": str, "bool": bool, "dict": dict, "list": list, "float": (int, float)}


@dataclass(frozen=True, slots=True)
class Message:
    """Base of every message. Subclasses are frozen, slotted dataclasses.

    ``fd_count`` is a class-level constant for messages that carry fds.
    """

    FD_COUNT: ClassVar[int] = 0

    @classmethod
    def tag(cls) -> str:
        """The wire ``type``: the class name in snake_case (``AttachReply`` -> ``attach_reply``)."""
        tag = _TAGS.get(cls)
        if tag is None:
            tag = _TAGS[cls] = snake_case(cls.__name__)
        return tag

    def to_json(self) -> dict[str, Any]:
        """The message's JSON fields, with ``type`` (and ``fd_count``)."""
        d = {name: getattr(self, name) for name, _, _ in field_specs(type(self))}
        d["type"] = self.tag()
        if self.FD_COUNT:
            d["fd_count"] = self.FD_COUNT
        return d

    def __post_init__(self) -> None:
        tag = type(self).tag()
        for spec in field_specs(type(self)):
            check_field(tag, spec, getattr(self, spec[0]), LocalProtocolError)


_SPECS: dict[type, tuple[tuple[str, str, bool], ...]] = {}
_TAGS: dict[type, str] = {}


def field_specs(cls: type) -> tuple[tuple[str, str, bool], ...]:
    """``(field name, JSON base type, optional)`` of each field of message class ``cls``, computed once."""
    specs = _SPECS.get(cls)
    if specs is None:
        out = []
        for f in dataclasses.fields(cls):
            spec = str(f.type).replace(" ", "")
            out.append((f.name, spec.removesuffix("|None").split("[")[0], spec.endswith("|None")))
        specs = _SPECS[cls] = tuple(out)
    return specs


def check_field(tag: str, spec: tuple[str, str, bool], value: Any, exc: type) -> None:
    """Raises ``exc`` (LocalProtocolError or RemoteProtocolError) unless ``value`` fits field ``spec`` (of
    :func:`field_specs`) of a message of wire type ``tag``."""
    name, base, optional = spec
    if value is None and optional:
        return
    want = _JSON_TYPES[base]
    if isinstance(value, bool) and base != "bool":
        raise exc(f"message {tag!r}: field {name!r} must be {base}, got a boolean", field=name)
    if not isinstance(value, want):
        raise exc(f"message {tag!r}: field {name!r} must be {base}, got {type(value).__name__}", field=name)
    if isinstance(value, int) and not isinstance(value, bool) and not INT_MIN <= value <= INT_MAX:
        raise exc(f"message {tag!r}: field {name!r} is outside the signed 64-bit range", field=name)


def _parse(msg: Message, name: str, enum: type) -> None:
    """Replaces field ``name`` of frozen message ``msg`` (a string, type-checked) by its member of StrEnum ``enum``.

    Raises:
        LocalProtocolError (`local_protocol_violation`): the value is not one of the enum's
            (:func:`._codec.decode` turns it into RemoteProtocolError).
    """
    value = getattr(msg, name)
    if isinstance(value, enum):
        return
    try:
        object.__setattr__(msg, name, enum(value))
    except ValueError:
        raise LocalProtocolError(f"message {msg.tag()!r}: {name} must be one of "
                                 f"{', '.join(m.value for m in enum)}, got {value!r}", field=name) from None


# --- requests (client -> service) -------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """First frame of a connection. ``client`` is a free-form identity string."""

    protocol_version: int
    client: str = ""


@dataclass(frozen=True, slots=True)
class Attach(Message):
    """Asks for one slab.

    Attributes:
        model: a model name from the config, or a checkpoint path.
        tp_size, tp_rank: the layout and rank.
        wait_ms: how long the service may hold the request while the model loads
            (0: answer ``loading`` at once).
        dtype, naming: when attaching by path, select among configured models.
        mode (`AttachMode`): ``zero_copy`` or ``copy`` (recorded with the lease); a string is
            parsed into the member.

    Raises:
        LocalProtocolError (`local_protocol_violation`): ``mode`` is not an
            :class:`~weightcache.wire.AttachMode` (decoded from a frame:
            RemoteProtocolError, `protocol_violation`).
    """

    model: str
    tp_size: int = 1
    tp_rank: int = 0
    wait_ms: int = 0
    dtype: str | None = None
    naming: str | None = None
    mode: str = DEFAULT_MODE

    def __post_init__(self) -> None:
        Message.__post_init__(self)
        _parse(self, "mode", AttachMode)


@dataclass(frozen=True, slots=True)
class HelloReply(Message):
    """Answer to ``hello``: the service's protocol version, GPU index and UUID, backend (``host`` | ``cuda``) and capabilities."""

    protocol_version: int
    gpu: int
    gpu_uuid: str
    backend: str
    capabilities: list = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class AttachReply(Message):
    """A lease on one slab; two fds travel with this frame: the slab, then its manifest file.

    The manifest file is a sealed memfd holding the slab's packed manifest
    (:func:`weightcache.manifest.pack_file`, docs/protocol.md), the same for
    every attach of the slab; it travels beside the frame so that a manifest
    of any tensor count fits (at most ``MAX_MANIFEST_BYTES`` of
    :mod:`weightcache.manifest`, checked when the slab is loaded).

    Attributes:
        lease_id: ends with :class:`Release` or the connection.
        checkpoint_path: the checkpoint directory the slab was loaded from.
        backend: ``host`` or ``cuda``.
        manifest_size_bytes: the manifest file's size in bytes.
    """

    FD_COUNT: ClassVar[int] = 2
    lease_id: int
    checkpoint_path: str
    backend: str
    manifest_size_bytes: int


@dataclass(frozen=True, slots=True)
class Loading(Message):
    """The model is still loading; progress in bytes; ``state`` (`SlotState`): ``pending`` or ``loading``."""

    model: str
    done_bytes: int
    total_bytes: int
    state: str = SlotState.LOADING

    def __post_init__(self) -> None:
        Message.__post_init__(self)
        _parse(self, "state", SlotState)


@dataclass(frozen=True, slots=True)
class Error(Message):
    """A typed error: ``code`` (see docs/errors.md), ``message``, ``details``."""

    code: str
    message: str
    details: dict = field(default_factory=dict)

    @classmethod
    def from_exc(cls, e: WeightcacheError) -> "Error":
        return cls(**e.to_wire())


#: The messages of an engine's attach: what it sends (``hello``, ``attach``) and what the service may answer.
ATTACH_EXCHANGE = (Hello, Attach, HelloReply, AttachReply, Loading, Error)


def prepare(classes: tuple[type[Message], ...] = ATTACH_EXCHANGE) -> None:
    """Works out the wire tag and the field specs of each of ``classes`` now, not when its first message is built
    or decoded (``dataclasses.fields`` and the annotations' text: about 10 µs a class). The import ahead of an
    engine's attach path (:mod:`weightcache.client._imports`) prepares :data:`ATTACH_EXCHANGE` on its thread."""
    for cls in classes:
        cls.tag()
        field_specs(cls)
