"""Hugging Face style checkpoints: safetensors headers, index, identity, byte reads.

A checkpoint is a directory with either one ``model.safetensors`` (or any
``*.safetensors`` files) or a sharded set listed by
``model.safetensors.index.json`` (``weight_map``: tensor name -> file name).
Headers are read with the safetensors library (``safe_open``, which validates
the header and the file's length against ``data_offsets``); the byte offsets of
every tensor come from the same header (format: 8-byte little-endian header
length N, N bytes of JSON, then the data; ``data_offsets`` are relative to the
end of the header). Source: https://github.com/huggingface/safetensors#format.

Containment (docs/reliability.md, "Threat model") is by file descriptor, not by
path: see :mod:`weightcache.checkpoint_files`. Headers: :mod:`weightcache.checkpoint_header`.
Identity: :mod:`weightcache.checkpoint_identity`. This module keeps :class:`Checkpoint` and
re-exports the public names of those three.

A client (the disk fallback) passes neither ``root`` nor ``trusted_link_owners``:
it reads with its own rights, and follows the symlinks of the path it was given.

Forbidden imports: socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

# Re-exported: the rest of the package, tests and benchmarks import these from here.
from .checkpoint_files import (  # noqa: F401
    INDEX_NAME, MAX_SIDE_FILE_BYTES, MAX_SYMLINKS, CheckpointFiles, MemberPath, _check_plain, _may, _open_dir,
    _read_small, _roots, not_regular, open_file, resolve_dir, unreadable)
from .checkpoint_identity import CheckpointIdentity, _stat_identity  # noqa: F401
from .errors import CheckpointCorrupt, CheckpointNotFound

#: Re-exported from :mod:`weightcache.checkpoint_header` on first use (PEP 562): an engine's attach checks
#: a checkpoint's identity by ``stat()`` and reads no header, so it does not import the header module.
_HEADER_NAMES = ("MAX_HEADER_BYTES", "TensorInfo", "_parse_header", "_read_header", "_read_raw_header",
                 "_validate_with_safetensors", "pread_exact", "warm_validation")


def __getattr__(name: str) -> Any:
    """The names of :mod:`weightcache.checkpoint_header` re-exported here, imported on first use."""
    if name in _HEADER_NAMES:
        from . import checkpoint_header

        return getattr(checkpoint_header, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Weight files of other formats, which weightcache never reads (pickle in particular).
_OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")


def parse_json(raw: bytes, path: str, what: str) -> Any:
    """``json.loads(raw)`` of a checkpoint's JSON file ``path`` (``what`` names it in the message).

    A checkpoint's writer decides these bytes: JSON nested 200,000 deep
    raises ``RecursionError`` in the decoder, a huge one ``MemoryError``; both
    are that file's fault, reported like invalid JSON (issue 38, P8).

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): invalid JSON, too deeply nested
            (``details.cause`` ``too_deep``) or too large to decode (``too_large``);
            ``details.file`` names the file.
    """
    try:
        return json.loads(raw)
    except RecursionError:
        raise CheckpointCorrupt(f"{what} {path} is nested too deeply to parse; the checkpoint's writer must fix "
                                f"the file", file=path, cause="too_deep") from None
    except MemoryError:
        raise CheckpointCorrupt(f"{what} {path} ({len(raw)} bytes) is too large to parse; the checkpoint's writer "
                                f"must fix the file", file=path, cause="too_large") from None
    except ValueError as e:
        raise CheckpointCorrupt(f"{what} {path} is invalid: not valid JSON: {e}", file=path) from None


def _no_safetensors_hint(names: list[str]) -> tuple[str, list[str]]:
    """What a directory without safetensors files holds instead, for the ``checkpoint_not_found`` message.

    Args:
        names (`list[str]`): the directory's entries.

    Returns:
        The text to append to the message (starting with ``": "``, or empty), and the entries it
        names (``details["found"]``): weight files of other formats, or a Hugging Face cache
        repository's ``snapshots``.
    """
    other = sorted(n for n in names if n.endswith(_OTHER_WEIGHT_SUFFIXES) and not n.startswith("."))
    if other:
        shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
        return (f": it holds {shown}, weights in another format; weightcache reads safetensors only (it never "
                f"unpickles): convert the checkpoint to safetensors, or download the repository's *.safetensors "
                f"files"), other
    if "snapshots" in names and "blobs" in names:
        return (": it is a Hugging Face cache repository (blobs/, snapshots/); give the snapshot directory, "
                "<this directory>/snapshots/<revision>"), ["snapshots"]
    if not [n for n in names if not n.startswith(".")]:
        return ": the directory is empty", []
    return "", []


class Checkpoint(CheckpointFiles, CheckpointIdentity):
    """A checkpoint directory, opened from its headers (no tensor data read).

    Args:
        path (`str | os.PathLike`): directory holding ``*.safetensors`` files
            (and ``model.safetensors.index.json`` when sharded).
        validate (`bool`, *optional*, defaults to `True`): open each file with
            ``safetensors.safe_open`` and parse every header now. ``False``
            reads only ``config.json`` (and ``hf_quant_config.json``) now; the
            index, the raw header bytes (for :meth:`identity`) and the parsed
            headers (:attr:`tensors`) on first use, raising then.
        max_tensors (`int`, *optional*): the most tensors the headers may list, all files together
            (``service.max_tensors_per_checkpoint``); counted in the raw header bytes before they are parsed.
            None: no cap (an engine's disk fallback).

    Attributes:
        path (`Path`): resolved directory.
        files (`list[str]`): safetensors file names, sorted.
        tensors (`dict[str, TensorInfo]`): every tensor by name.
        config (`dict`): parsed ``config.json`` or ``{}``.
        raw_headers (`dict[str, bytes]`): raw header bytes per file.
        metadata (`dict[str, dict]`): ``__metadata__`` per file.

    Raises:
        CheckpointNotFound (`checkpoint_not_found`): missing directory, file,
            or a tensor of the index absent from its file; a path that cannot
            name a directory (too long, a symlink loop, a NUL character).
        CheckpointUnreadable (`checkpoint_unreadable`): the directory or a
            file exists but this user may not read it (names both).
        CheckpointCorrupt (`checkpoint_corrupt`): a truncated or invalid file,
            or an index that is not valid JSON; more tensors than ``max_tensors``
            (``details.cause`` ``too_many_tensors``).

    Example:
        >>> ck = Checkpoint("/srv/models/all-MiniLM-L6-v2")
        >>> ck.tensors["embeddings.word_embeddings.weight"].shape
        (30522, 384)
    """

    def __init__(self, path: str | os.PathLike, validate: bool = True, root: str | None = None,
                 trusted_link_owners: frozenset[int] | None = None, max_tensors: int | None = None) -> None:
        self._dirfd = self._blobs_fd = -1
        self._max_tensors = max_tensors
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFound(f"checkpoint directory {path} does not exist", path=str(path)) from None
        except PermissionError:
            raise unreadable(path) from None
        except OSError as e:  # ENAMETOOLONG, ELOOP, EIO...: no directory to read at that path
            raise CheckpointNotFound(f"checkpoint directory {str(path)[:200]!r} cannot be opened: {e.strerror}; "
                                     f"give the directory that holds config.json and the *.safetensors files",
                                     path=str(path)[:4096], errno=e.errno) from None
        except ValueError:  # os.stat: "embedded null byte"
            raise CheckpointNotFound(f"checkpoint path {str(path)[:200]!r} contains a NUL character; no file can "
                                     f"have that name", path=str(path)[:4096]) from None
        if not stat.S_ISDIR(st.st_mode):
            raise CheckpointNotFound(f"checkpoint path {path} is not a directory; give the directory that holds "
                                     f"config.json and the *.safetensors files", path=str(path))
        if not _may(path, os.R_OK | os.X_OK):
            raise unreadable(path)
        resolved = resolve_dir(path, trusted_link_owners)
        if root is not None and resolved != root:
            raise CheckpointCorrupt(
                f"checkpoint directory {path} now resolves to {resolved}, not to {root} as when the configuration "
                f"was read: a symlink on the way changed; the service loads the directory it was configured with "
                f"(run `systemctl reload` to follow the new target)", path=str(path), file=str(path))
        self._dirfd = _open_dir(resolved)
        try:
            self._init(resolved, validate)
        except BaseException:
            self.close()  # a failed open leaves no fd behind (the error may be kept long after)
            raise

    def _init(self, resolved: str, validate: bool) -> None:
        self.path = Path(resolved)
        self._roots = _roots(self.path)
        self._resolved: dict[str, str] = {}
        #: file name -> (directory fd, name beneath it) of each checked member.
        self._members: dict[str, tuple[int, str]] = {}
        self._index = self.path / INDEX_NAME
        self._files: list[str] | None = None
        self._weight_map: dict[str, str] | None = None
        self._raw_headers: dict[str, bytes] | None = None
        self._layout: dict[str, tuple[int, int]] = {}
        self._stats: dict[str, os.stat_result] = {}  # each file as its header was read (identity)
        self._tensors: dict[str, TensorInfo] | None = None
        self._metadata: dict[str, dict] = {}
        if validate:
            from .checkpoint_header import _validate_with_safetensors

            self._parse()  # our errors name the tensor; then safetensors' own checks
            for fname in self.files:
                _validate_with_safetensors(self.file_path(fname))
        cfg = os.path.join(self.path, "config.json")
        self.config_bytes = self.read_side_file("config.json") or b""
        self.config: dict[str, Any] = parse_json(self.config_bytes, cfg, "config file") if self.config_bytes else {}
        self._extra: dict[str, bytes] = {}
        for extra in ("hf_quant_config.json",):
            raw = self.read_side_file(extra)
            if raw is not None:
                self._extra[extra] = raw

    @property
    def files(self) -> list[str]:
        """Safetensors file names, sorted: those the index lists, else every ``*.safetensors``.

        Raises:
            CheckpointCorrupt (`checkpoint_corrupt`): an invalid index, or a
                ``*-NNNNN-of-NNNNN.safetensors`` shard the index does not list.
            CheckpointNotFound (`checkpoint_not_found`): no safetensors file.
        """
        if self._files is None:
            self._files = self._list_files()
        return self._files

    def _list_files(self) -> list[str]:
        index = self._index
        names = os.listdir(self._dirfd)
        if INDEX_NAME in names:
            weight_map = parse_json(self.read_side_file(INDEX_NAME) or b"", str(index), "index")
            try:
                weight_map = weight_map["weight_map"]
                files = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointCorrupt(f"index {index} is invalid: {e}", file=str(index)) from None
            for fname in files:
                _check_plain(fname, index)
            self._weight_map = weight_map
            for stray in sorted(self.path / n for n in names if n.endswith(".safetensors") and "-of-" in n):
                if stray.name not in files and re.fullmatch(r".+-\d+-of-\d+\.safetensors", stray.name):
                    from .checkpoint_header import _read_header

                    _, stray_header, _ = _read_header(self.file_path(stray.name))
                    names = sorted(k for k in stray_header if k != "__metadata__")
                    raise CheckpointCorrupt(
                        f"shard {stray} is in the checkpoint directory but {index} does not list it, so its "
                        f"{len(names)} tensors (e.g. {names[0] if names else '-'!r}) would be missing; regenerate "
                        f"the index or remove the stray shard",
                        file=stray.name, tensor=names[0] if names else None, index=str(index),
                    )
        else:
            files = sorted(n for n in names if n.endswith(".safetensors") and not n.startswith("."))
        if not files:
            hint, found = _no_safetensors_hint(names)
            raise CheckpointNotFound(f"no *.safetensors files in checkpoint directory {self.path}{hint}",
                                     path=str(self.path), found=found)
        for fname in files:  # non-regular files and escapes are refused before any byte is read
            self.file_path(fname)
        return files

    @property
    def raw_headers(self) -> dict[str, bytes]:
        """Raw safetensors header bytes per file (read on first use; no tensor data).

        Raises:
            CheckpointCorrupt (`checkpoint_corrupt`): a file too short for its header.
        """
        if self._raw_headers is None:
            from .checkpoint_header import _read_raw_header

            raw_headers = {}
            for fname in self.files:
                raw, data_start, st = _read_raw_header(self.file_path(fname))
                raw_headers[fname] = raw
                self._layout[fname] = (data_start, st.st_size)
                self._stats[fname] = st
            self._raw_headers = raw_headers
        return self._raw_headers

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor by name, parsed from the headers on first use (see :meth:`_parse`)."""
        if self._tensors is None:
            self._parse()
        return self._tensors

    @property
    def metadata(self) -> dict[str, dict]:
        """``__metadata__`` of each file."""
        if self._tensors is None:
            self._parse()
        return self._metadata

    def _parse(self) -> None:
        """Parses the raw headers into :class:`TensorInfo` records and checks the index.

        Raises:
            CheckpointCorrupt (`checkpoint_corrupt`): invalid header or entry,
                or a tensor past the end of its file.
            CheckpointNotFound (`checkpoint_not_found`): a tensor of the index
                missing from its file.
        """
        from .checkpoint_header import TensorInfo, _parse_header

        tensors: dict[str, TensorInfo] = {}
        raw_headers = self.raw_headers
        if self._max_tensors is not None:  # counted in the raw bytes: refused before a 50 MB header is parsed
            listed = sum(raw.count(b'"data_offsets"') for raw in raw_headers.values())
            if listed > self._max_tensors:
                raise CheckpointCorrupt(
                    f"checkpoint {self.path} lists {listed} tensors in its headers, over "
                    f"service.max_tensors_per_checkpoint = {self._max_tensors}; raise it if the checkpoint is real "
                    f"(the largest known have about 100,000 per rank)", file=str(self.path), cause="too_many_tensors",
                    limit="max_tensors_per_checkpoint", value=self._max_tensors, actual=listed)
        for fname in self.files:
            data_start, size = self._layout[fname]
            header = _parse_header(self.path / fname, raw_headers[fname], data_start, size)
            self._metadata[fname] = header.get("__metadata__") or {}
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                begin, end = entry["data_offsets"]
                tensors[name] = TensorInfo(
                    name=name,
                    file=fname,
                    dtype=entry["dtype"],
                    shape=tuple(int(s) for s in entry["shape"]),
                    offset_bytes=data_start + int(begin),
                    size_bytes=int(end) - int(begin),
                )
        if self._weight_map is not None:
            for name, fname in self._weight_map.items():
                if name not in tensors:
                    raise CheckpointNotFound(
                        f"tensor {name!r} listed in {self._index} for {fname} is missing from that file",
                        file=fname,
                        tensor=name,
                    )
        self._tensors = tensors

    def extra_json(self, name: str) -> dict[str, Any] | None:
        """Parsed side file such as ``hf_quant_config.json``, or ``None``."""
        raw = self._extra.get(name)
        return parse_json(raw, str(self.path / name), "side file") if raw is not None else None

    def read_into(self, info: TensorInfo, out) -> None:
        """Reads the bytes of one tensor into ``out`` with ``os.preadv``.

        Args:
            info (`TensorInfo`): the tensor.
            out: a writable buffer of exactly ``info.size_bytes`` bytes (a
                ``memoryview``, or a contiguous CPU ``uint8`` tensor's numpy view).

        Raises:
            CheckpointCorrupt (`checkpoint_corrupt`): the file ended early.
        """
        from .checkpoint_header import pread_exact

        path = self.file_path(info.file)
        fd = open_file(path)
        try:
            pread_exact(fd, memoryview(out).cast("B"), info.offset_bytes, info.size_bytes, str(path), info.name,
                        info.offset_bytes + info.size_bytes)
        finally:
            os.close(fd)
