"""Hugging Face style checkpoints: safetensors headers, index, identity, byte reads.

A checkpoint is a directory with either one ``model.safetensors`` (or any
``*.safetensors`` files) or a sharded set listed by
``model.safetensors.index.json`` (``weight_map``: tensor name -> file name).
Headers are read with the safetensors library (``safe_open``, which validates
the header and the file's length against ``data_offsets``); the byte offsets of
every tensor come from the same header (format: 8-byte little-endian header
length N, N bytes of JSON, then the data; ``data_offsets`` are relative to the
end of the header). Source: https://github.com/huggingface/safetensors#format.

Containment (docs/reliability.md, "Threat model"): the service reads
checkpoints with its own privileges, so a checkpoint may only make it read
files of that checkpoint. The configured directory is resolved once (it may
itself be a symlink: the operator chose it); every file name (an index's
``weight_map`` value, a ``*.safetensors`` entry) must be a plain name in that
directory, must resolve inside it (or, for a Hugging Face hub snapshot
``.../snapshots/<revision>/``, inside the same repository's ``blobs/``), and
must be a regular file; it is then opened by its resolved path with
``O_NOFOLLOW | O_NONBLOCK`` and checked again with ``fstat``. A FIFO, a device,
a directory or a symlink leading elsewhere is refused before any byte is read,
and no error message quotes bytes of a file that fails these checks.

The checkpoint *identity* (DESIGN §5) is computed from ``stat()`` and the
header bytes only, never from tensor data, so an engine can compute the cache
key in microseconds.

Forbidden imports: socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import re
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CheckpointCorrupt, CheckpointNotFound, CheckpointUnreadable
from .hashes import blake2b_hex

INDEX_NAME = "model.safetensors.index.json"
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


def unreadable(path: str | os.PathLike) -> CheckpointUnreadable:
    """The error for ``EACCES`` on ``path``: names the path, the first directory
    on the way that this user may not enter (if any), the user, and the fix."""
    uid = os.geteuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    path = os.path.abspath(path)
    blocked = next((d for d in _ancestors(path) if not _may(d, os.X_OK)), None)
    where = f" (directory {blocked} is not searchable by it)" if blocked else ""
    return CheckpointUnreadable(
        f"permission denied: user {user} (uid {uid}) cannot read {path}{where}; this process reads the "
        f"checkpoint as {user} (the service as its user, an engine's disk fallback as the engine's user): make "
        f"the checkpoint readable by {user} (e.g. chmod -R o+rX the checkpoint directory and o+x its parents, "
        f"or give it to {user}'s group)", file=path, user=user, uid=uid)


def _may(path: str | os.PathLike, mode: int) -> bool:
    """``access(2)`` for the effective ids, the ones ``open`` uses."""
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def _ancestors(path: str) -> list[str]:
    """``/a/b/c`` -> ``["/", "/a", "/a/b"]``."""
    parts, out = path.rstrip("/").split("/")[:-1], []
    for i in range(len(parts)):
        out.append("/".join(parts[: i + 1]) or "/")
    return out


def open_file(path: str | os.PathLike, flags: int = os.O_RDONLY | os.O_CLOEXEC) -> int:
    """``os.open`` of a checkpoint file (a resolved path: see :meth:`Checkpoint.file_path`), regular files only.

    Opens with ``O_NOFOLLOW | O_NONBLOCK`` added (a symlink or a FIFO swapped
    in after the checks neither redirects nor blocks the read) and checks
    ``fstat`` says a regular file.

    Raises:
        CheckpointNotFound (`checkpoint_not_found`): it does not exist.
        CheckpointUnreadable (`checkpoint_unreadable`): ``EACCES``; names the
            file and the user.
        CheckpointCorrupt (`checkpoint_corrupt`): not a regular file, or a
            symlink where the resolved file was.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointNotFound(f"checkpoint file {path} does not exist", file=str(path)) from None
    except PermissionError:
        raise unreadable(path) from None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise CheckpointCorrupt(f"checkpoint file {path} became a symbolic link after it was checked; the service "
                                f"opens checkpoint files by their resolved path only", file=str(path)) from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise not_regular(str(path), mode)
    return fd


def not_regular(path: str, mode: int) -> CheckpointCorrupt:
    """The error for a checkpoint file that is a FIFO, a device, a socket or a directory."""
    kind = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
            stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}.get(stat.S_IFMT(mode), "not a regular file")
    return CheckpointCorrupt(f"checkpoint file {path} is {kind}; safetensors files must be regular files (a read "
                             f"from anything else may block the loader or never end)", file=path)


def _read_small(path: str) -> bytes | None:
    """The bytes of a small side file (``config.json``...), ``None`` if it does not exist.

    Raises:
        CheckpointUnreadable (`checkpoint_unreadable`): it exists but may not be read.
    """
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except PermissionError:
        raise unreadable(path) from None


def _stat_identity(st: os.stat_result) -> dict[str, int]:
    """The ``stat()`` part of a file's identity (DESIGN §5): size, mtime_ns, ctime_ns, inode."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


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
            raise CheckpointCorrupt(f"safetensors file {path} is truncated: tensor {tensor!r} ends at byte {end}",
                                    file=path, tensor=tensor)
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


def _roots(directory: Path) -> tuple[str, ...]:
    """Where the files of checkpoint ``directory`` (resolved) may resolve to: itself and, for a Hugging Face
    hub snapshot (``<repo>/snapshots/<revision>``), ``<repo>/blobs``."""
    d = str(directory)
    if directory.parent.name == "snapshots":
        return d, str(directory.parent.parent / "blobs")
    return (d,)


def _check_plain(fname: Any, index: Path) -> None:
    """Refuses a checkpoint file name that is not a plain name in the directory (``../x``, ``/etc/x``, ``a/b``).

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): names the index and the entry.
    """
    if isinstance(fname, str) and fname not in ("", ".", "..") and "/" not in fname and "\0" not in fname:
        return
    raise CheckpointCorrupt(
        f"index {index} maps tensors to {str(fname)[:200]!r}, which is not a plain file name in the checkpoint "
        f"directory; weight_map values must be names like 'model-00001-of-00002.safetensors'",
        file=str(fname)[:200], index=str(index))


def warm_validation() -> threading.Thread:
    """Imports what the header check needs (numpy, for ``safe_open``) on a background thread; returns it started.

    ``safe_open(framework="numpy")`` imports numpy on first use (0.1-0.2 s);
    a service calls this as it starts, so that the import overlaps reading the
    configuration and the CUDA driver's init (whose calls release the GIL)
    instead of delaying the first plan. A failed import is left for the check
    itself to report.
    """
    def run() -> None:
        try:
            import numpy  # noqa: F401
        except ImportError:  # pragma: no cover - numpy is a dependency; the check reports it
            pass

    th = threading.Thread(target=run, name="weightcache-warm-numpy", daemon=True)
    th.start()
    return th


def _validate_with_safetensors(path: Path) -> None:
    """Opens ``path`` with ``safetensors.safe_open`` to apply its own checks."""
    from safetensors import safe_open

    try:
        # framework="numpy": the same header checks without importing torch (fast restarts).
        with safe_open(str(path), framework="numpy") as f:
            f.keys()
    except Exception as e:  # safetensors raises SafetensorError and friends
        raise CheckpointCorrupt(f"safetensors rejects {path}: {e}", file=str(path)) from None


class Checkpoint:
    """A checkpoint directory, opened from its headers (no tensor data read).

    Args:
        path (`str | os.PathLike`): directory holding ``*.safetensors`` files
            (and ``model.safetensors.index.json`` when sharded).
        validate (`bool`, *optional*, defaults to `True`): open each file with
            ``safetensors.safe_open`` and parse every header now. ``False``
            reads only ``config.json`` (and ``hf_quant_config.json``) now; the
            index, the raw header bytes (for :meth:`identity`) and the parsed
            headers (:attr:`tensors`) on first use, raising then.

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
            or an index that is not valid JSON.

    Example:
        >>> ck = Checkpoint("/srv/models/all-MiniLM-L6-v2")
        >>> ck.tensors["embeddings.word_embeddings.weight"].shape
        (30522, 384)
    """

    def __init__(self, path: str | os.PathLike, validate: bool = True) -> None:
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
        self.path = Path(os.path.realpath(path))
        self._roots = _roots(self.path)
        self._resolved: dict[str, str] = {}
        self._index = self.path / INDEX_NAME
        self._files: list[str] | None = None
        self._weight_map: dict[str, str] | None = None
        self._raw_headers: dict[str, bytes] | None = None
        self._layout: dict[str, tuple[int, int]] = {}
        self._stats: dict[str, os.stat_result] = {}  # each file as its header was read (identity)
        self._tensors: dict[str, TensorInfo] | None = None
        self._metadata: dict[str, dict] = {}
        if validate:
            self._parse()  # our errors name the tensor; then safetensors' own checks
            for fname in self.files:
                _validate_with_safetensors(Path(self.file_path(fname)))
        cfg = os.path.join(self.path, "config.json")
        self.config_bytes = _read_small(cfg) or b""
        try:
            self.config: dict[str, Any] = json.loads(self.config_bytes) if self.config_bytes else {}
        except ValueError as e:
            raise CheckpointCorrupt(f"{cfg} is not valid JSON: {e}", file=cfg) from None
        self._extra: dict[str, bytes] = {}
        for extra in ("hf_quant_config.json",):
            raw = _read_small(os.path.join(self.path, extra))
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
        if index.exists():
            try:
                weight_map = json.loads(_read_small(str(index)) or b"")["weight_map"]
                files = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointCorrupt(f"index {index} is invalid: {e}", file=str(index)) from None
            for fname in files:
                _check_plain(fname, index)
            self._weight_map = weight_map
            for stray in sorted(self.path.glob("*-of-*.safetensors")):
                if stray.name not in files and re.fullmatch(r".+-\d+-of-\d+\.safetensors", stray.name):
                    _, stray_header, _ = _read_header(Path(self.file_path(stray.name)))
                    names = sorted(k for k in stray_header if k != "__metadata__")
                    raise CheckpointCorrupt(
                        f"shard {stray} is in the checkpoint directory but {index} does not list it, so its "
                        f"{len(names)} tensors (e.g. {names[0] if names else '-'!r}) would be missing; regenerate "
                        f"the index or remove the stray shard",
                        file=stray.name, tensor=names[0] if names else None, index=str(index),
                    )
        else:
            files = sorted(f.name for f in self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointNotFound(f"no *.safetensors files in checkpoint directory {self.path}", path=str(self.path))
        for fname in files:  # non-regular files and escapes are refused before any byte is read
            self.file_path(fname)
        return files

    def file_path(self, fname: str) -> str:
        """The resolved path of checkpoint file ``fname``, checked to stay inside the checkpoint (module docstring).

        Resolved once per name (at plan time); later opens use this path with ``O_NOFOLLOW``.

        Raises:
            CheckpointCorrupt (`checkpoint_corrupt`): ``fname`` is not a plain
                file name, resolves outside the checkpoint directory, or is not
                a regular file.
            CheckpointNotFound (`checkpoint_not_found`): it does not exist.
        """
        real = self._resolved.get(fname)
        if real is not None:
            return real
        _check_plain(fname, self._index)
        real = os.path.realpath(self.path / fname)
        if not any(os.path.dirname(real) == root for root in self._roots):
            raise CheckpointCorrupt(
                f"checkpoint file {self.path / fname} resolves to {real}, outside the checkpoint directory "
                f"{self.path}; the service reads only files inside it (a Hugging Face snapshot's links into its "
                f"repository's blobs/ are allowed): copy the file into the checkpoint", file=fname,
                path=str(self.path))
        try:
            st = os.stat(real)
        except FileNotFoundError:
            raise CheckpointNotFound(f"checkpoint file {self.path / fname} does not exist", file=fname) from None
        except PermissionError:
            raise unreadable(real) from None
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(str(self.path / fname), st.st_mode)
        self._resolved[fname] = real
        return real

    @property
    def raw_headers(self) -> dict[str, bytes]:
        """Raw safetensors header bytes per file (read on first use; no tensor data).

        Raises:
            CheckpointCorrupt (`checkpoint_corrupt`): a file too short for its header.
        """
        if self._raw_headers is None:
            raw_headers = {}
            for fname in self.files:
                raw, data_start, st = _read_raw_header(Path(self.file_path(fname)))
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
        tensors: dict[str, TensorInfo] = {}
        raw_headers = self.raw_headers
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
        return json.loads(raw) if raw is not None else None

    def identity(self) -> dict[str, Any]:
        """Checkpoint identity of DESIGN §5, from ``stat()`` and headers only.

        Returns:
            `dict`: ``files``: per file ``{size, mtime_ns, ctime_ns, inode,
            header_blake2b}``; ``index``: ``{size, mtime_ns, ctime_ns, inode}``
            of ``model.safetensors.index.json``, or ``None`` without one;
            ``config_json_blake2b``; ``quant_config_blake2b``.
        """
        raw_headers = self.raw_headers
        files = {}
        for fname in self.files:
            # The fstat taken before the header was read: a rewrite after it moves ctime, so a later
            # identity_diff sees it (a stat taken after the read could pair a new stat with an old header).
            files[fname] = {**_stat_identity(self._stats[fname]),
                            "header_blake2b": blake2b_hex(raw_headers[fname])}
        return {
            "files": files,
            "index": self._index_identity(),
            **self._side_file_hashes(),
        }

    def _side_file_hashes(self) -> dict[str, str]:
        """blake2b-128 of ``config.json`` and ``hf_quant_config.json`` (empty bytes when absent)."""
        return {
            "config_json_blake2b": blake2b_hex(self.config_bytes),
            "quant_config_blake2b": blake2b_hex(self._extra.get("hf_quant_config.json", b"")),
        }

    def _index_identity(self) -> dict[str, int] | None:
        try:
            return _stat_identity(os.stat(self._index))
        except FileNotFoundError:
            return None

    def identity_diff(self, identity: dict[str, Any]) -> list[str]:
        """Fields in which this checkpoint, as it is now, differs from ``identity`` (an :meth:`identity`).

        The engine's check of a service's slab, from ``stat()`` alone (plus the
        small JSON files): no index is parsed and no header read. A ``write()``
        moves ``ctime`` and no syscall sets it back, so equal ``inode, size,
        mtime_ns, ctime_ns`` mean the file was not rewritten and
        ``header_blake2b`` is not recomputed; an unchanged index implies the
        same file list. Like the whole key (which never hashes tensor bytes),
        this misses writes that move no timestamp: through a shared ``mmap``
        to an already dirty page, until writeback (docs/protocol.md).

        Returns:
            `list[str]`: dotted field names (``files.model.safetensors.mtime_ns``,
            ``index``...); empty when the identity holds.
        """
        if identity.get("index", "absent") != self._index_identity():
            return ["index"]  # the file list may have changed: nothing else is comparable cheaply
        want = identity.get("files") or {}
        names = sorted(want) if identity["index"] is not None else self.files
        if sorted(want) != names:
            return ["files"]
        diff = []
        root = str(self.path)
        for fname in names:
            try:
                now = _stat_identity(os.stat(os.path.join(root, fname)))
            except FileNotFoundError:
                diff.append(f"files.{fname}")
                continue
            diff += [f"files.{fname}.{k}" for k, v in now.items() if want[fname].get(k) != v]
        diff += [key for key, h in self._side_file_hashes().items() if identity.get(key) != h]
        return diff

    def read_into(self, info: TensorInfo, out) -> None:
        """Reads the bytes of one tensor into ``out`` with ``os.preadv``.

        Args:
            info (`TensorInfo`): the tensor.
            out: a writable buffer of exactly ``info.size_bytes`` bytes (a
                ``memoryview``, or a contiguous CPU ``uint8`` tensor's numpy view).

        Raises:
            CheckpointCorrupt (`checkpoint_corrupt`): the file ended early.
        """
        path = self.file_path(info.file)
        fd = open_file(path)
        try:
            pread_exact(fd, memoryview(out).cast("B"), info.offset_bytes, info.size_bytes, str(path), info.name,
                        info.offset_bytes + info.size_bytes)
        finally:
            os.close(fd)
