"""Publication: an engine hands the service the weights it processed itself, and attaches them by its engine key.

``publish`` carries two fds: a memfd holding the slab's bytes (the publisher has unmapped it; the service seals
it) and a memfd holding the publisher's manifest file (:func:`weightcache.manifest.pack_file`: names, dtypes,
shapes, strides, offsets and each tensor's layout metadata, the engine's Python-side attributes and aliases
included). ``attach_published`` asks for such a slab by the engine's key and is answered like ``attach``
(``attach_reply`` with the slab's and the service's manifest file's fds, or ``error``). docs/protocol.md,
"Publication", is the reference.

Neither is part of an engine's plain attach, so this room is imported on first use, as :mod:`._admin` is.

Forbidden imports: socket, selectors, asyncio, torch, weightcache.memory, weightcache.client,
weightcache.daemon.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..wire import DEFAULT_MODE, AttachMode
from ._messages import Message, _parse


@dataclass(frozen=True, slots=True)
class Publish(Message):
    """Hands the service one rank's processed weights; two fds travel with it: the slab memfd, then the
    publisher's manifest file (a memfd).

    Attributes:
        model: a model name from the config, or its checkpoint path (as ``attach``).
        tp_size, tp_rank: the layout and rank; equal to ``engine_key.parallel``'s.
        engine_key: the engine's key fields (docs/protocol.md, "The engine key"), a JSON object.
        size_bytes: bytes of the slab memfd (its ``fstat`` size; the manifest's ``slab_size_bytes`` fits in it).
        manifest_size_bytes: bytes of the manifest file.
    """

    FD_COUNT: ClassVar[int] = 2
    model: str
    tp_size: int
    tp_rank: int
    engine_key: dict
    size_bytes: int
    manifest_size_bytes: int


@dataclass(frozen=True, slots=True)
class PublishCudaIpc(Publish):
    """``publish`` on the cuda backend without a staging copy: the publisher's allocations by CUDA IPC handle. Two
    fds travel with it: the IPC table (a memfd of ``table_size_bytes`` bytes of UTF-8 JSON, ``{"segments": [hex of
    each 64-byte cuIpcGetMemHandle handle], "copies": [[segment, src_offset, dst_offset, size], ...]}``), then the
    publisher's manifest file. The service copies the bytes into its own slab before it answers; the publisher
    keeps its allocations alive, unchanged, until the reply.

    Attributes (those of :class:`Publish`, whose fields come first, and):
        size_bytes: the slab's size in bytes (a multiple of the GPU's VMM granularity).
        table_size_bytes: bytes of the IPC table.
    """

    table_size_bytes: int


@dataclass(frozen=True, slots=True)
class PublishReply(Message):
    """Answer to ``publish``: the slab's label, whether this publication made it (``created``; false: an identical
    publication was already held, and this one's memfd was closed unused), its size in bytes and the blake2b of
    the engine key it is held under."""

    label: str
    created: bool
    size_bytes: int
    engine_key_blake2b: str


@dataclass(frozen=True, slots=True)
class AttachPublished(Message):
    """Asks for a published slab by the engine's key; answered as ``attach`` (``attach_reply`` + 2 fds).

    Attributes:
        model: a model name from the config, or its checkpoint path.
        tp_size, tp_rank: the layout and rank.
        engine_key: the engine's key fields, compared with each publication's; a difference is
            ``cache_key_mismatch`` naming the fields.
        mode (`AttachMode`): ``zero_copy`` or ``copy``.

    Raises:
        LocalProtocolError (`local_protocol_violation`): ``mode`` is not an :class:`~weightcache.wire.AttachMode`.
    """

    model: str
    tp_size: int
    tp_rank: int
    engine_key: dict
    mode: str = DEFAULT_MODE

    def __post_init__(self) -> None:
        Message.__post_init__(self)
        _parse(self, "mode", AttachMode)
