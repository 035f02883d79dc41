"""Checkpoint files by file descriptor: resolving the directory, opening members beneath it, side files.

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

Owns the module functions above; :class:`~weightcache.checkpoint.Checkpoint` opens its members with
them (:meth:`~weightcache.checkpoint.Checkpoint.file_path`, ``open_member``, ``read_side_file``).

Forbidden imports: socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import errno
import os
import pwd
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointCorrupt, CheckpointNotFound, CheckpointUnreadable

if TYPE_CHECKING:  # a type-only back edge: _checkpoint imports this room
    from ._checkpoint import Checkpoint

INDEX_NAME = "model.safetensors.index.json"
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

    def __reduce__(self) -> tuple:
        """A copy or pickle is the plain path (``copy.deepcopy`` in ``dataclasses.asdict`` of an error record
        whose details name the file; the checkpoint it is bound to is not copied)."""
        return str, (str(self),)


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
    fd = _open_checked(lambda: os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK), path, str(path),
                       "resolved path")
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


def _open_checked(open_fd, shown, file: str, by: str) -> int:
    """Runs ``open_fd()`` (an ``os.open`` with ``O_NOFOLLOW``) and maps its errors to checkpoint errors.

    Args:
        open_fd (`callable`): ``() -> int``, the open itself.
        shown: the file as error messages name it; file (`str`): ``details["file"]``.
        by (`str`): what the service opens files by ("resolved path", "checked name"), for the symlink error.

    Raises:
        CheckpointNotFound: ``ENOENT``. CheckpointUnreadable: ``EACCES``.
        CheckpointCorrupt: ``ELOOP`` (the file became a symbolic link after it was checked).
    """
    try:
        return open_fd()
    except FileNotFoundError:
        raise CheckpointNotFound(f"checkpoint file {shown} does not exist", file=file) from None
    except PermissionError:
        raise unreadable(shown) from None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise CheckpointCorrupt(f"checkpoint file {shown} became a symbolic link after it was checked; the service "
                                f"opens checkpoint files by their {by} only", file=file) from None
