"""The identity of a checkpoint (DESIGN §5) and the engine's check of it, from ``stat()`` and headers only.

The checkpoint *identity* (DESIGN §5) is computed from ``stat()`` and the
header bytes only, never from tensor data, so an engine can compute the cache
key in microseconds.

Owns :class:`CheckpointIdentity`, the part of
:class:`~weightcache.checkpoint.Checkpoint` that computes and compares it.

Forbidden imports: socket, torch, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import os
from typing import Any

from .checkpoint_files import INDEX_NAME
from .hashes import blake2b_hex


def _stat_identity(st: os.stat_result) -> dict[str, int]:
    """The ``stat()`` part of a file's identity (DESIGN §5): size, mtime_ns, ctime_ns, inode."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


class CheckpointIdentity:
    """The identity half of :class:`~weightcache.checkpoint.Checkpoint`. A base class, not used alone: it
    reads ``raw_headers``, ``files``, ``path``, ``config_bytes``, ``_extra``, ``_stats``, ``_dirfd`` and
    ``_index`` of the checkpoint.
    """

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
