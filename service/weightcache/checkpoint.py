"""Hugging Face style checkpoints: safetensors headers, index, identity, byte reads.

A checkpoint is a directory with either one ``model.safetensors`` (or any
``*.safetensors`` files) or a sharded set listed by
``model.safetensors.index.json`` (``weight_map``: tensor name -> file name).
Headers are read with the safetensors library (``safe_open``, which validates
the header and the file's length against ``data_offsets``); the byte offsets of
every tensor come from the same header (format: 8-byte little-endian header
length N, N bytes of JSON, then the data; ``data_offsets`` are relative to the
end of the header). Source: https://github.com/huggingface/safetensors#format.

Containment (docs/reliability.md, "Threat model"), by file descriptor, not
by path: the service reads checkpoints with its own privileges, so a
checkpoint may only make it read files of that checkpoint.

- The configured directory is resolved once per :class:`Checkpoint` (once per
  load) by :func:`resolve_dir`: a symlink on the way is followed only when root
  or the service user owns it (``trusted_link_owners``; a link planted by a
  checkpoint's owner, e.g. ``snapshots/<rev>`` replaced by a link to another
  model, is refused). The service also passes ``root``, the path's resolution
  when the configuration was read (:attr:`~weightcache.daemon.state.Slot.realpath`):
  a load whose path now resolves elsewhere is refused until a reload.
- That directory is opened once into a directory fd, walking it component by
  component with ``O_NOFOLLOW | O_DIRECTORY`` (no symlink can be swapped in
  while it is opened), and every file is opened *beneath that fd*
  (``openat(dirfd, name, O_NOFOLLOW | O_NONBLOCK)``): file names are plain names
  (an index's ``weight_map`` value, a ``*.safetensors`` entry, ``config.json``).
  A file that is a symlink is followed only to a plain name in the same
  directory or, for a Hugging Face hub snapshot ``.../snapshots/<revision>/``,
  to ``../../blobs/<name>`` (opened beneath the repository's ``blobs/`` fd).
- Each file must be regular (``fstat``), and each data fd opened after the
  headers were read must be the file whose header was read: same
  ``st_dev``, ``st_ino``, size and ``st_mtime_ns`` as the header-time ``fstat``.
  A FIFO, a device, a directory, a symlink leading elsewhere or a file swapped
  after the plan is refused (``checkpoint_corrupt``) before any byte of it is
  read, and no error message quotes bytes of a file that fails these checks.
  Side files (``config.json``, the index) are read up to
  :data:`MAX_SIDE_FILE_BYTES`.

A client (the disk fallback) passes neither ``root`` nor ``trusted_link_owners``:
it reads with its own rights, and follows the symlinks of the path it was given.

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
#: Largest side file (``config.json``, the index, ``hf_quant_config.json``) read, bytes.
MAX_SIDE_FILE_BYTES = 64 * 1024 * 1024
#: Symlinks followed while resolving one checkpoint directory (the kernel's own limit is 40).
MAX_SYMLINKS = 40
#: A hub snapshot's file link: ``../../blobs/<name>``.
_BLOB_LINK = re.compile(r"\.\./\.\./blobs/([^/\0]+)")


class MemberPath(str):
    """The resolved path of a file of a :class:`Checkpoint` (a ``str``, for messages), which
    :func:`open_file` opens beneath the checkpoint's directory fd instead of by path."""

    __slots__ = ("checkpoint", "member")

    def __new__(cls, path: str, checkpoint: "Checkpoint", member: str) -> "MemberPath":
        self = super().__new__(cls, path)
        self.checkpoint, self.member = checkpoint, member
        return self


def resolve_dir(path: str | os.PathLike, trusted_link_owners: frozenset[int] | None = None) -> str:
    """The absolute resolution of ``path`` (``os.path.realpath`` semantics), refusing untrusted symlinks.

    Args:
        path (`str`): a checkpoint directory as configured.
        trusted_link_owners (`frozenset[int]`, *optional*): uids whose symlinks are
            followed (the service: root and its own uid); None follows every symlink.

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): a symlink on the way is owned by
            another uid; names it and its owner.
        CheckpointNotFound (`checkpoint_not_found`): more than :data:`MAX_SYMLINKS` links.
        OSError: from ``lstat``/``readlink`` (missing components are left to the caller's open).
    """
    parts = [c for c in os.fspath(os.path.abspath(path)).split("/") if c]
    parts.reverse()
    resolved, links = "/", 0
    while parts:
        c = parts.pop()
        if c == ".":
            continue
        if c == "..":
            resolved = os.path.dirname(resolved)
            continue
        nxt = os.path.join(resolved, c)
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            return os.path.join(nxt, *reversed(parts))
        if not stat.S_ISLNK(st.st_mode):
            resolved = nxt
            continue
        links += 1
        if links > MAX_SYMLINKS:
            raise CheckpointNotFound(f"checkpoint directory {path} cannot be opened: more than {MAX_SYMLINKS} "
                                     f"symbolic links on the way", path=str(path), errno=errno.ELOOP)
        if trusted_link_owners is not None and st.st_uid not in trusted_link_owners:
            raise CheckpointCorrupt(
                f"checkpoint directory {path}: {nxt} is a symbolic link owned by uid {st.st_uid}; the service "
                f"follows symlinks on the way to a checkpoint only when root or the service user owns them (a "
                f"link planted by a checkpoint's owner could point at another model): configure the real "
                f"directory, or have root create the link", file=nxt, path=str(path), owner_uid=st.st_uid)
        target = os.readlink(nxt)
        if target.startswith("/"):
            resolved = "/"
        parts.extend(reversed([x for x in target.split("/") if x]))
    return resolved


def _open_dir(path: str, read: bool = True) -> int:
    """Opens resolved directory ``path`` walking it with ``O_NOFOLLOW | O_DIRECTORY`` at every component.

    The last component is opened ``O_RDONLY`` (to list it) unless ``read`` is false; the
    ones before with ``O_PATH`` (search permission only).

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): a component is (now) a symlink or not a directory.
        CheckpointNotFound, CheckpointUnreadable: missing, or not searchable.
    """
    parts = [c for c in path.split("/") if c]
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    done = "/"
    try:
        for i, c in enumerate(parts):
            last = i == len(parts) - 1
            flags = (os.O_RDONLY if last and read else os.O_PATH) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            done = os.path.join(done, c)
            try:
                nfd = os.open(c, flags, dir_fd=fd)
            except FileNotFoundError:
                raise CheckpointNotFound(f"checkpoint directory {path} does not exist ({done} is missing)",
                                         path=path) from None
            except PermissionError:
                raise unreadable(done) from None
            except OSError as e:
                if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                raise CheckpointCorrupt(f"checkpoint directory {path}: {done} changed into a symbolic link or a "
                                        f"file while the service opened it; the service opens only the directory "
                                        f"the path resolved to", file=done, path=path) from None
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


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

    A :class:`MemberPath` is opened beneath its checkpoint's directory fd and
    checked against its header-time ``fstat`` (:meth:`Checkpoint.open_member`).

    Raises:
        CheckpointNotFound (`checkpoint_not_found`): it does not exist.
        CheckpointUnreadable (`checkpoint_unreadable`): ``EACCES``; names the
            file and the user.
        CheckpointCorrupt (`checkpoint_corrupt`): not a regular file, or a
            symlink where the resolved file was, or (a member) not the file
            whose header was read.
    """
    if isinstance(path, MemberPath):
        return path.checkpoint.open_member(path.member, flags)
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


def _validate_with_safetensors(path: Path | str) -> None:
    """Opens ``path`` with ``safetensors.safe_open`` to apply its own checks.

    A :class:`MemberPath` is opened beneath its directory fd first and handed to
    safetensors as ``/proc/self/fd/N`` (the file already checked, not the path again).
    """
    from safetensors import safe_open

    fd = open_file(path) if isinstance(path, MemberPath) else -1
    try:
        # framework="numpy": the same header checks without importing torch (fast restarts).
        with safe_open(f"/proc/self/fd/{fd}" if fd >= 0 else str(path), framework="numpy") as f:
            f.keys()
    except Exception as e:  # safetensors raises SafetensorError and friends
        raise CheckpointCorrupt(f"safetensors rejects {path}: {e}".replace(f"/proc/self/fd/{fd}", str(path)),
                                file=str(path)) from None
    finally:
        if fd >= 0:
            os.close(fd)


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

    def __init__(self, path: str | os.PathLike, validate: bool = True, root: str | None = None,
                 trusted_link_owners: frozenset[int] | None = None) -> None:
        self._dirfd = self._blobs_fd = -1
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
            self._parse()  # our errors name the tensor; then safetensors' own checks
            for fname in self.files:
                _validate_with_safetensors(self.file_path(fname))
        cfg = os.path.join(self.path, "config.json")
        self.config_bytes = self.read_side_file("config.json") or b""
        try:
            self.config: dict[str, Any] = json.loads(self.config_bytes) if self.config_bytes else {}
        except ValueError as e:
            raise CheckpointCorrupt(f"{cfg} is not valid JSON: {e}", file=cfg) from None
        self._extra: dict[str, bytes] = {}
        for extra in ("hf_quant_config.json",):
            raw = self.read_side_file(extra)
            if raw is not None:
                self._extra[extra] = raw

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
            try:
                weight_map = json.loads(self.read_side_file(INDEX_NAME) or b"")["weight_map"]
                files = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointCorrupt(f"index {index} is invalid: {e}", file=str(index)) from None
            for fname in files:
                _check_plain(fname, index)
            self._weight_map = weight_map
            for stray in sorted(self.path / n for n in names if n.endswith(".safetensors") and "-of-" in n):
                if stray.name not in files and re.fullmatch(r".+-\d+-of-\d+\.safetensors", stray.name):
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
            raise CheckpointNotFound(f"no *.safetensors files in checkpoint directory {self.path}", path=str(self.path))
        for fname in files:  # non-regular files and escapes are refused before any byte is read
            self.file_path(fname)
        return files

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
            CheckpointNotFound (`checkpoint_not_found`): it does not exist.
        """
        real = self._resolved.get(fname)
        if real is not None:
            return MemberPath(real, self, fname)
        _check_plain(fname, self._index)
        dfd, name, where = self._dirfd, fname, str(self.path)
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
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            raise CheckpointNotFound(f"checkpoint file {shown} does not exist", file=fname) from None
        except PermissionError:
            raise unreadable(shown) from None
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise CheckpointCorrupt(f"checkpoint file {shown} became a symbolic link after it was checked; the "
                                    f"service opens checkpoint files by their checked name only",
                                    file=fname) from None
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

    @property
    def raw_headers(self) -> dict[str, bytes]:
        """Raw safetensors header bytes per file (read on first use; no tensor data).

        Raises:
            CheckpointCorrupt (`checkpoint_corrupt`): a file too short for its header.
        """
        if self._raw_headers is None:
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
