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
path: see :mod:`weightcache.checkpoint._files`. Headers: :mod:`weightcache.checkpoint.header`, imported
on first use (an engine's attach checks a checkpoint's identity by ``stat()`` and reads no header).
Identity: :mod:`weightcache.checkpoint._identity`. :class:`Checkpoint` is one class; its parts are the
functions of those modules.

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
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointCorrupt, CheckpointNotFound
from ..hashes import blake2b_hex
from ._files import (_BLOB_LINK, INDEX_NAME, MAX_SIDE_FILE_BYTES, MemberPath, _check_plain, _may, _open_checked,
                     _open_dir, _roots, not_regular, open_file, resolve_dir, unreadable)
from ._identity import _stat_identity

if TYPE_CHECKING:
    from .header import TensorInfo


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
            from .header import _validate_with_safetensors

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
                    from .header import _read_header

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
            from .header import _read_raw_header

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
    def names(self) -> list[str]:
        """Every tensor name, with as little read as possible: from the headers when they are parsed already,
        else from the index's ``weight_map`` when the checkpoint has one (no header read: the check an engine
        makes before its start, :func:`weightcache.quant.quant_config.quantized_tensor`, stays one small file on
        network storage), else from the headers.

        Raises:
            CheckpointCorrupt (`checkpoint_corrupt`), CheckpointNotFound (`checkpoint_not_found`): as
                :attr:`files` and :attr:`tensors`.
        """
        self.files  # noqa: B018 - lists the files and reads the index's weight_map
        if self._tensors is None and self._weight_map is not None:
            return list(self._weight_map)
        return list(self.tensors)

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
        from .header import TensorInfo, _parse_header

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
        from .header import pread_exact

        path = self.file_path(info.file)
        fd = open_file(path)
        try:
            pread_exact(fd, memoryview(out).cast("B"), info.offset_bytes, info.size_bytes, str(path), info.name,
                        info.offset_bytes + info.size_bytes)
        finally:
            os.close(fd)

    # -- members, opened beneath the directory fd (containment: weightcache.checkpoint._files) --

    def close(self) -> None:
        """Closes the directory fds (also when the object is collected)."""
        for name in ("_dirfd", "_blobs_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)

    def __del__(self) -> None:
        self.close()

    def _exists(self, name: str) -> bool:
        """Whether ``name`` (a plain name) is in the directory (a symlink counts), looked up beneath its fd."""
        try:
            os.stat(name, dir_fd=self._dirfd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def read_side_file(self, name: str) -> bytes | None:
        """The bytes of side file ``name`` (``config.json``...), None when absent; opened beneath the directory fd.

        Raises:
            CheckpointCorrupt (`checkpoint_corrupt`): not a regular file, a link out of the
                checkpoint, or larger than :data:`MAX_SIDE_FILE_BYTES`.
            CheckpointUnreadable (`checkpoint_unreadable`): it may not be read.
        """
        if not self._exists(name):
            return None
        self.file_path(name)
        fd = self.open_member(name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size > MAX_SIDE_FILE_BYTES:
                raise CheckpointCorrupt(f"{self.path / name} is {size} bytes; side files of a checkpoint are at "
                                        f"most {MAX_SIDE_FILE_BYTES} bytes", file=name)
            chunks, got = [], 0
            while got <= size:
                b = os.read(fd, min(1 << 20, size + 1 - got))
                if not b:
                    break
                chunks.append(b)
                got += len(b)
            if got > size:  # it grew while read
                raise CheckpointCorrupt(f"{self.path / name} grew while it was read", file=name)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def file_path(self, fname: str) -> str:
        """The resolved path of checkpoint file ``fname``, checked to stay inside the checkpoint (module docstring).

        Checked once per name (at plan time), beneath the directory fd: a symlink is
        followed only to a plain name in the directory or, in a hub snapshot, to
        ``../../blobs/<name>``. The result is a :class:`MemberPath`: :func:`open_file`
        opens it beneath that directory's fd with ``O_NOFOLLOW`` (:meth:`open_member`).

        Raises:
            CheckpointCorrupt (`checkpoint_corrupt`): ``fname`` is not a plain
                file name, leads outside the checkpoint directory, or is not
                a regular file.
            CheckpointNotFound (`checkpoint_not_found`): it does not exist, or it is a link
                to a file that does not exist (``details["link_target"]``).
        """
        real = self._resolved.get(fname)
        if real is not None:
            return MemberPath(real, self, fname)
        _check_plain(fname, self._index)
        dfd, name, where = self._dirfd, fname, str(self.path)
        target = None
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(name, dir_fd=dfd)
                blob = _BLOB_LINK.fullmatch(target)
                if "/" not in target and target not in (".", ".."):
                    name = target
                elif blob is not None and len(self._roots) > 1:
                    dfd, name, where = self._blobs(), blob.group(1), self._roots[1]
                else:
                    real = os.path.realpath(self.path / fname)
                    raise CheckpointCorrupt(
                        f"checkpoint file {self.path / fname} resolves to {real}, outside the checkpoint directory "
                        f"{self.path}; the service reads only files inside it (a Hugging Face snapshot's links "
                        f"into its repository's blobs/ are allowed): copy the file into the checkpoint", file=fname,
                        path=str(self.path))
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            if target is not None:  # the link is there (ls lists it); what it names is not
                raise CheckpointNotFound(
                    f"checkpoint file {self.path / fname} is a symbolic link to {target}, which does not exist "
                    f"(an interrupted download or copy, or a file moved away): restore {os.path.join(where, name)} "
                    f"or download the checkpoint again", file=fname, link_target=target) from None
            raise CheckpointNotFound(f"checkpoint file {self.path / fname} does not exist", file=fname) from None
        except PermissionError:
            raise unreadable(self.path / fname) from None
        if stat.S_ISLNK(st.st_mode):
            raise CheckpointCorrupt(f"checkpoint file {self.path / fname} is a chain of symbolic links; the "
                                    f"service follows one link, to a file in the checkpoint", file=fname,
                                    path=str(self.path))
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(str(self.path / fname), st.st_mode)
        real = os.path.join(where, name)
        self._members[fname] = (dfd, name)
        self._resolved[fname] = real
        return MemberPath(real, self, fname)

    def _blobs(self) -> int:
        """The fd of a hub snapshot's ``<repo>/blobs`` directory (opened without following symlinks)."""
        if self._blobs_fd < 0:
            self._blobs_fd = _open_dir(self._roots[1], read=False)
        return self._blobs_fd

    def open_member(self, fname: str, flags: int = os.O_RDONLY | os.O_CLOEXEC) -> int:
        """Opens checked member ``fname`` (see :meth:`file_path`) beneath its directory fd.

        Opens with ``O_NOFOLLOW | O_NONBLOCK`` added, checks ``fstat`` says a regular
        file and, once its header was read, that it is that file: same ``st_dev``,
        ``st_ino``, ``st_size`` and ``st_mtime_ns``.

        Raises:
            CheckpointCorrupt (`checkpoint_corrupt`): a symlink or a non-regular
                file now, or another file than the one whose header was read.
            CheckpointNotFound, CheckpointUnreadable: gone, or not readable.
        """
        if fname not in self._members:
            self.file_path(fname)
        dfd, name = self._members[fname]
        shown = self._resolved[fname]
        fd = _open_checked(lambda: os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd),
                           shown, fname, "checked name")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise not_regular(shown, st.st_mode)
            was = self._stats.get(fname)
            if was is not None:
                changed = [k for k in ("st_dev", "st_ino", "st_size", "st_mtime_ns")
                           if getattr(st, k) != getattr(was, k)]
                if changed:
                    raise CheckpointCorrupt(
                        f"checkpoint file {shown} is not the file whose header was read ({', '.join(changed)} "
                        f"changed): it was replaced or rewritten during the load; the load is refused rather "
                        f"than serve bytes of another file", file=fname, changed=changed)
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- identity (DESIGN §5): stat() and headers only --

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
            if self._dirfd >= 0:
                return _stat_identity(os.stat(INDEX_NAME, dir_fd=self._dirfd))
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
