"""The image file: one safetensors file holding a slab's bytes, its manifest, its cache key and its digest.

Layout (the safetensors format, so ``safetensors.safe_open`` reads it as any other file)::

    u64 little-endian N | N bytes of JSON header, padded with spaces | the slab's bytes

The header has one tensor, :data:`TENSOR_NAME` (``U8``, ``[slab_size_bytes]``), and a
``__metadata__`` of strings:

- ``format``: :data:`FORMAT`;
- ``manifest``: the slab's manifest, packed (:meth:`weightcache.manifest.Manifest.to_wire`): the header
  as JSON under ``header`` and the payload (names, dtypes, shapes, strides, offsets, digests, layouts,
  aliases) base64 under ``payload``;
- ``key``: the full cache key (DESIGN §5) as JSON, the checkpoint's identity included;
- ``placement``: the operator's rank request it was made for (:meth:`weightcache.config.Placement.to_json`);
- ``backend``: ``host`` or ``cuda`` (the digests' family);
- ``digest``: ``blake2b:<hex>`` of the packed manifest (header JSON and payload), whose records carry the
  digest of every tensor's bytes: the bytes read are checked against those, the manifest against this;
- ``written_at``: Unix seconds;
- ``publication`` (a published slab only): the engine key, the publisher's uid and the scope, as JSON.

The data starts at a multiple of :data:`DATA_ALIGN` (4 KiB) so that ``O_DIRECT`` reads and mappings
of it are aligned.

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import base64
import json
import os
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import ManifestInvalid
from ..hashes import blake2b_hex
from ..manifest import Manifest

#: ``__metadata__.format`` of an image file.
FORMAT = "weightcache-image-1"
#: The one tensor of an image file: the slab's bytes as ``U8``.
TENSOR_NAME = "weightcache.slab"
#: File offset alignment of the slab's bytes.
DATA_ALIGN = 4096
#: The largest JSON header read (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100 * 1000 * 1000
#: File name suffix of an image; a rejected one gets :data:`REJECTED_SUFFIX` appended.
SUFFIX = ".safetensors"
REJECTED_SUFFIX = ".rejected"


class ImageFormatError(Exception):
    """An image file that is not one: ``reason`` ``format`` (truncated, bad JSON, fields missing) or
    ``digest`` (the manifest differs from its recorded digest)."""

    def __init__(self, message: str, reason: str = "format") -> None:
        super().__init__(message)
        self.reason = reason


def manifest_digest(header: dict[str, Any], payload: bytes) -> str:
    """``blake2b:<hex>`` of a packed manifest (:meth:`Manifest.to_wire`): what ``__metadata__.digest`` holds."""
    head = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return "blake2b:" + blake2b_hex(head + b"\0" + payload)


def build_header(manifest: Manifest, key: dict[str, Any], placement: dict[str, Any], backend: str,
                 written_at: float, publication: dict[str, Any] | None = None) -> bytes:
    """The file's first bytes: the u64 length and the JSON header, padded so the data starts at
    a multiple of :data:`DATA_ALIGN`.

    Args:
        manifest (`Manifest`): the slab's, digests included; its ``slab_size_bytes`` is the data length.
        key (`dict`): the slab's full cache key.
        placement (`dict`): the rank request (``Placement.to_json()``).
        backend (`str`): ``host`` or ``cuda``.
        written_at (`float`): Unix seconds.
        publication (`dict`, *optional*): a published slab's publication (engine key, publisher, scope).

    Returns:
        `bytes`: ``8 + N`` bytes, a multiple of :data:`DATA_ALIGN`.
    """
    mh, payload = manifest.to_wire()
    meta = {"format": FORMAT,
            "manifest": json.dumps({"header": mh, "payload": base64.b64encode(payload).decode()},
                                   separators=(",", ":"), allow_nan=False),
            "key": json.dumps(key, sort_keys=True, separators=(",", ":")),
            "placement": json.dumps(placement, sort_keys=True, separators=(",", ":")),
            "backend": backend, "digest": manifest_digest(mh, payload), "written_at": f"{written_at:.3f}"}
    if publication is not None:
        meta["publication"] = json.dumps(publication, sort_keys=True, separators=(",", ":"))
    n = manifest.slab_size_bytes
    head = json.dumps({"__metadata__": meta, TENSOR_NAME: {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}},
                      separators=(",", ":")).encode()
    total = 8 + len(head)
    pad = -total % DATA_ALIGN
    head += b" " * pad
    return struct.pack("<Q", len(head)) + head


@dataclass(frozen=True)
class ImageHeader:
    """What an image file says about itself (no tensor byte read).

    Attributes:
        manifest (`Manifest`): the slab's manifest as written (the key inside is the writer's).
        key (`dict`): the full cache key it was made with.
        placement (`dict`): the rank request it was made for.
        backend (`str`): ``host`` or ``cuda``.
        digest (`str`): ``blake2b:<hex>`` of the packed manifest.
        data_offset (`int`): file offset of the slab's first byte.
        data_bytes (`int`): the slab's length (``manifest.slab_size_bytes``).
        written_at (`float`): Unix seconds.
        publication (`dict | None`): a published slab's publication record; None for a slab the service made.
    """

    manifest: Manifest
    key: dict[str, Any]
    placement: dict[str, Any]
    backend: str
    digest: str
    data_offset: int
    data_bytes: int
    written_at: float
    publication: dict[str, Any] | None = None


def read_header(fd: int, file_size: int) -> ImageHeader:
    """Reads and checks the header of the image open on ``fd`` (``file_size`` bytes long).

    Raises:
        ImageFormatError: truncated, not JSON, not :data:`FORMAT`, fields missing, the data not
            ``slab_size_bytes`` long, or the manifest's digest not the one recorded.
    """
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        raise ImageFormatError(f"{file_size} bytes: shorter than a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise ImageFormatError(f"header of {n} bytes does not fit the {file_size}-byte file")
    head = os.pread(fd, n, 8)
    if len(head) != n:
        raise ImageFormatError("the header ends early")
    try:
        obj = json.loads(head)
        meta = obj["__metadata__"]
        if meta.get("format") != FORMAT:
            raise ImageFormatError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        t = obj[TENSOR_NAME]
        lo, hi = (int(x) for x in t["data_offsets"])
        packed = json.loads(meta["manifest"])
        payload = base64.b64decode(packed["payload"], validate=True)
        manifest = Manifest.from_wire(packed["header"], payload)
        key, placement = json.loads(meta["key"]), json.loads(meta["placement"])
        digest, backend, written_at = str(meta["digest"]), str(meta["backend"]), float(meta["written_at"])
        publication = json.loads(meta["publication"]) if "publication" in meta else None
        if publication is not None and not isinstance(publication, dict):
            raise TypeError("publication is not an object")
    except ImageFormatError:
        raise
    except (ValueError, KeyError, TypeError, ManifestInvalid) as e:
        raise ImageFormatError(f"header is damaged: {type(e).__name__}: {e}") from None
    if t.get("dtype") != "U8" or lo != 0 or hi != manifest.slab_size_bytes:
        raise ImageFormatError(f"tensor {TENSOR_NAME} is not U8 [0, {manifest.slab_size_bytes}) bytes")
    if 8 + n + hi != file_size:
        raise ImageFormatError(f"{file_size} bytes, expected {8 + n + hi} (a write that did not finish?)")
    if manifest_digest(packed["header"], payload) != digest:
        raise ImageFormatError("the manifest's digest differs from the one recorded", "digest")
    return ImageHeader(manifest, key, placement, backend, digest, 8 + n, hi, written_at, publication)
