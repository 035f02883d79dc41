"""Safetensors headers of checkpoint files: reading, parsing and checking them, and byte reads.

Format: 8-byte little-endian header length N, N bytes of JSON, then the
data; ``data_offsets`` are relative to the end of the header. Source:
https://github.com/huggingface/safetensors#format. Owns :class:`TensorInfo`,
the raw and parsed header reads (every entry checked against the file's
size, errors naming the file and tensor but never quoting its bytes),
safetensors' own validation (``safe_open``) and :func:`pread_exact`.

Forbidden imports: socket, torch, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt
from ._files import MemberPath, open_file

#: Same cap as the safetensors Rust core (100 MB header).
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, from its file's safetensors header.

    Attributes:
        name (`str`): header key.
        file (`str`): file name inside the checkpoint directory.
        dtype (`str`): safetensors dtype code (``BF16``, ``F8_E4M3``...).
        shape (`tuple[int]`): shape as stored.
        offset_bytes (`int`): absolute byte offset of the data in ``file``.
        size_bytes (`int`): data length in bytes.
    """

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int
    size_bytes: int


def truncated(path: str, tensor: str, end: int) -> CheckpointCorrupt:
    """The ``checkpoint_corrupt`` of safetensors file ``path`` that ends before byte ``end``, where ``tensor``'s data ends."""
    return CheckpointCorrupt(f"safetensors file {path} is truncated: tensor {tensor!r} ends at byte {end}",
                             file=str(path), tensor=tensor)


def pread_exact(fd: int, buf: memoryview, offset: int, need: int, path: str, tensor: str, end: int) -> None:
    """Fills the first ``need`` bytes of ``buf`` from ``fd`` at ``offset`` (``os.preadv``, retried on short reads).

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): the file ended first; names
            ``path`` and ``tensor``, whose data ends at byte ``end``.
    """
    done = 0
    while done < need:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise truncated(path, tensor, end)
        done += n


def _read_raw_header(path: Path) -> tuple[bytes, int, os.stat_result]:
    """Returns (raw header bytes, data start offset, ``fstat`` before the read) of one file, without parsing.

    Raises:
        CheckpointNotFound (`checkpoint_not_found`): the file does not exist.
        CheckpointCorrupt (`checkpoint_corrupt`): shorter than its header says.
    """
    fd = open_file(path)
    try:
        st = os.fstat(fd)
        size = st.st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise CheckpointCorrupt(
                f"safetensors file {path} is truncated: {size} bytes, shorter than the 8-byte header length",
                file=str(path),
            )
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            # The length field's value is not quoted: it is the file's first 8 bytes.
            raise CheckpointCorrupt(
                f"safetensors file {path} is truncated or not a safetensors file: its 8-byte header length "
                f"field points past the end of the file (or past the {MAX_HEADER_BYTES}-byte cap)",
                file=str(path),
            )
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    return raw, 8 + n, st


def _parse_header(path: Path, raw: bytes, data_start: int, size: int) -> dict[str, Any]:
    """Parses a raw header and checks every entry against the file's size.

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): invalid JSON or entry, or
            data offsets beyond the end of the file (names the tensor).
    """
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except UnicodeDecodeError as e:  # its message would quote the byte: name the position only
        raise CheckpointCorrupt(f"safetensors header of {path} is not UTF-8 (byte {e.start} of the header)",
                                file=str(path)) from None
    except ValueError as e:
        raise CheckpointCorrupt(f"safetensors header of {path} is not valid JSON: {e}", file=str(path)) from None
    except RecursionError:  # the file's writer nested it 200,000 deep (issue 38, P8)
        raise CheckpointCorrupt(f"safetensors header of {path} is nested too deeply to parse", file=str(path),
                                cause="too_deep") from None
    except MemoryError:
        raise CheckpointCorrupt(f"safetensors header of {path} is too large to parse", file=str(path),
                                cause="too_large") from None
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            dtype, shape = entry["dtype"], tuple(int(s) for s in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointCorrupt(
                f"safetensors header of {path} has an invalid entry for tensor {name!r}",
                file=str(path),
                tensor=name,
            ) from None
        if data_start + end > size:
            raise CheckpointCorrupt(
                f"safetensors file {path} is truncated: tensor {name!r} ends at byte "
                f"{data_start + end}, file has {size} bytes",
                file=str(path),
                tensor=name,
            )
        del begin, dtype, shape
    return header


def _read_header(path: Path) -> tuple[bytes, dict[str, Any], int]:
    """Returns (raw header bytes, parsed header, data start offset) of one file.

    Raises:
        CheckpointNotFound (`checkpoint_not_found`): the file does not exist.
        CheckpointCorrupt (`checkpoint_corrupt`): truncated or invalid header,
            or data offsets beyond the end of the file.
    """
    raw, data_start, st = _read_raw_header(path)
    return raw, _parse_header(path, raw, data_start, st.st_size), data_start


def import_validation_modules() -> None:
    """Imports the modules the header check loads lazily (safetensors, and numpy for ``safe_open``).

    ``weightcache check-config`` calls it before it drops to the service user, so that the child
    checks what that user may read of the checkpoints, not of the interpreter's own installation
    (a source tree's Python under ``/root`` is unreadable to ``nobody``).

    Raises:
        ImportError: safetensors or numpy is not importable (a broken runtime, not a checkpoint fault).
    """
    import numpy  # noqa: F401
    import safetensors  # noqa: F401


def warm_validation() -> threading.Thread:
    """Imports what the header check needs (numpy, for ``safe_open``) on a background thread; returns it started.

    ``safe_open(framework="numpy")`` imports numpy on first use (0.1-0.3 s);
    a service calls this once its own modules are imported, so that the import
    overlaps the CUDA driver's start-up (whose calls release the GIL) and the
    daemon's set-up instead of delaying the first plan. A failed import is left
    for the check itself to report.
    """
    def run() -> None:
        try:
            import_validation_modules()
        except ImportError:  # pragma: no cover - numpy is a dependency; the check reports it
            pass

    th = threading.Thread(target=run, name="weightcache-warm-numpy", daemon=True)
    th.start()
    return th


def _validate_with_safetensors(path: Path | str) -> None:
    """Opens ``path`` with ``safetensors.safe_open`` to apply its own checks.

    A :class:`MemberPath` is opened beneath its directory fd first and handed to
    safetensors as ``/proc/self/fd/N`` (the file already checked, not the path again).

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): safetensors rejects the file.
        ImportError: numpy, which ``safe_open`` imports on first use, cannot be imported (the runtime's
            fault, not the checkpoint's).
    """
    from safetensors import safe_open

    fd = open_file(path) if isinstance(path, MemberPath) else -1
    try:
        # framework="numpy": the same header checks without importing torch (fast restarts).
        with safe_open(f"/proc/self/fd/{fd}" if fd >= 0 else str(path), framework="numpy") as f:
            f.keys()
    except ImportError:  # numpy (safe_open imports it on first use) is missing: the runtime's fault, not the file's
        raise
    except Exception as e:  # safetensors raises SafetensorError and friends
        raise CheckpointCorrupt(f"safetensors rejects {path}: {e}".replace(f"/proc/self/fd/{fd}", str(path)),
                                file=str(path)) from None
    finally:
        if fd >= 0:
            os.close(fd)

