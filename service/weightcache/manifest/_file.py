"""The manifest file: what travels beside a slab (a sealed memfd) and into systemd's fd store.

One UTF-8 JSON object ``{"format": FILE_FORMAT, <publisher's fields>,
"manifest": <packed header>}``, one NUL byte, then the packed payload
(:meth:`weightcache.manifest.Manifest.to_wire`). The service writes the
fields ``backend``, ``size_bytes``, ``checkpoint_path``, ``placement`` (the
operator's rank request plus its GPU, :meth:`weightcache.config.Placement.to_json`)
and ``dtypes_served`` (the dtype names the slab serves,
:attr:`weightcache.pipeline.Plan.dtypes_served`). A reader ignores fields it
does not know and finds ``None`` for those an older service did not write, so
the format stays ``weightcache-manifest-1``.

:func:`read_file` is the one reader (client attach, fd-store adoption, a
service serving what it kept): it checks the size, reads and parses.

Forbidden imports: torch, socket, selectors, weightcache.config, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from typing import Any

from ..errors import ManifestInvalid, ManifestTooLarge
from ..spec import DTYPE_NAMES, RankRequest
from ._manifest import Manifest

#: ``format`` of a manifest file (:func:`pack_file`).
FILE_FORMAT = "weightcache-manifest-1"
#: The largest manifest file a service publishes and a client reads: 32 MiB (a rank of
#: ``service.max_tensors_per_checkpoint`` = 150,000 tensors with names of Llama's length is about 20 MB). A client
#: parses it after the reply is in, so this bounds how long an attach can run past its timeout (17 MB/s
#: measured: 200 MiB took 11.7 s; issue 38, P10).
MAX_MANIFEST_BYTES = 32 * 1024 * 1024


def pack_file(manifest: Manifest, **fields: Any) -> bytes:
    """The manifest file that travels beside a slab (a sealed memfd) and into systemd's fd store.

    Layout: one UTF-8 JSON object ``{"format": FILE_FORMAT, **fields,
    "manifest": <packed header>}``, one NUL byte, then the packed payload
    (:meth:`Manifest.to_wire`). ``fields`` are the publisher's own (see the module docstring).

    Raises:
        ManifestTooLarge (`manifest_too_large`): the file would exceed
            :data:`MAX_MANIFEST_BYTES`.
    """
    header, payload = manifest.to_wire()
    head = json.dumps({"format": FILE_FORMAT, **fields, "manifest": header}, allow_nan=False,
                      separators=(",", ":"), ensure_ascii=False).encode()
    size = len(head) + 1 + len(payload)
    if size > MAX_MANIFEST_BYTES:
        raise ManifestTooLarge(
            f"manifest of model {manifest.model!r} rank {manifest.tp_rank} is {size} bytes "
            f"({len(manifest.tensors)} tensors), over the {MAX_MANIFEST_BYTES}-byte limit of a manifest file; "
            f"split the model over more ranks", model=manifest.model, size_bytes=size,
            limit_bytes=MAX_MANIFEST_BYTES, tensors=len(manifest.tensors))
    return b"".join((head, b"\x00", payload))


def unpack_file(raw: bytes) -> tuple[dict[str, Any], Manifest]:
    """Parses :func:`pack_file` output into ``(fields, manifest)`` (``fields`` without ``manifest``).

    Raises:
        ManifestInvalid (`manifest_invalid`): another format, no NUL separator,
            invalid JSON, or an invalid packed manifest.
    """
    nul = raw.find(b"\x00")
    if nul < 0:
        raise ManifestInvalid(f"manifest file of {len(raw)} bytes has no NUL after its JSON", section="file")
    try:
        obj = json.loads(raw[:nul].decode("utf-8"))
    except (RecursionError, MemoryError) as e:
        raise ManifestInvalid(f"manifest file's JSON cannot be parsed: {type(e).__name__}", section="file") from None
    except ValueError as e:
        raise ManifestInvalid(f"manifest file's JSON is invalid: {e}", section="file") from None
    if not isinstance(obj, dict) or obj.get("format") != FILE_FORMAT:
        got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise ManifestInvalid(f"manifest file has format {got!r}, expected {FILE_FORMAT!r}", section="file")
    header = obj.pop("manifest", None)
    return obj, Manifest.from_wire(header, memoryview(raw)[nul + 1:])


@dataclass(frozen=True)
class ManifestFile:
    """A parsed manifest file.

    Attributes:
        manifest (`Manifest`): the slab's manifest.
        fields (`dict`): every field of the file's JSON but ``manifest`` (``format`` included).
        size_bytes (`int`): the file's size in bytes.
    """

    manifest: Manifest
    fields: dict[str, Any]
    size_bytes: int

    @property
    def backend(self) -> str | None:
        """``backend`` of the service that wrote it (``host``, ``cuda``)."""
        return self.fields.get("backend")

    @property
    def allocation_bytes(self) -> int | None:
        """The file's ``size_bytes`` field: the slab allocation's size in bytes (backend-rounded, at least
        ``manifest.slab_size_bytes``), or ``None`` when absent."""
        v = self.fields.get("size_bytes")
        return v if type(v) is int else None

    @property
    def placement(self) -> dict[str, Any] | None:
        """``placement`` as JSON (:meth:`weightcache.config.Placement.from_json` reads it), or ``None``."""
        v = self.fields.get("placement")
        return v if isinstance(v, dict) else None

    @property
    def request(self) -> RankRequest | None:
        """The operator's rank request the slab was loaded for (from ``placement``); ``None`` when the file
        has none (an older service) or it is damaged."""
        p = self.placement
        if p is None:
            return None
        try:
            return RankRequest.from_json(p)
        except ValueError:
            return None

    @property
    def dtypes_served(self) -> frozenset[str] | None:
        """The dtype names the slab serves, or ``None`` when the file does not say (an older service)."""
        v = self.fields.get("dtypes_served")
        if not isinstance(v, list) or not all(isinstance(x, str) and x in DTYPE_NAMES for x in v):
            return None
        return frozenset(v)


def read_file(fd: int, size_bytes: int | None = None) -> ManifestFile:
    """Reads and parses the manifest file ``fd`` (from byte 0; the fd's offset is not used).

    Args:
        fd (`int`): the manifest file (a sealed memfd); not closed.
        size_bytes (`int`, *optional*): the size announced with it (an
            ``attach_reply``'s ``manifest_size_bytes``); checked when given.

    Returns:
        `ManifestFile`.

    Raises:
        ManifestInvalid (`manifest_invalid`): the size differs from
            ``size_bytes`` or exceeds :data:`MAX_MANIFEST_BYTES`
            (``details["section"] == "file"``), or the content is invalid.
        OSError: ``fstat`` or ``pread`` failed.
    """
    st = os.fstat(fd)
    size = st.st_size
    if not stat.S_ISREG(st.st_mode):
        raise ManifestInvalid(f"manifest fd is not a regular file (mode 0o{stat.S_IFMT(st.st_mode):o})",
                              section="file", size_bytes=size)
    if (size_bytes is not None and size != size_bytes) or size > MAX_MANIFEST_BYTES:
        announced = f", {size_bytes} announced" if size_bytes is not None else ""
        raise ManifestInvalid(f"manifest file holds {size} bytes{announced} (limit {MAX_MANIFEST_BYTES})",
                              section="file", size_bytes=size)
    try:
        raw = os.pread(fd, size, 0)
    except OSError as e:
        raise ManifestInvalid(f"manifest file cannot be read: {e}", section="file", size_bytes=size) from None
    if len(raw) != size:
        raise ManifestInvalid(f"manifest file gave {len(raw)} of its {size} bytes", section="file", size_bytes=size)
    fields, manifest = unpack_file(raw)
    return ManifestFile(manifest, fields, size)
