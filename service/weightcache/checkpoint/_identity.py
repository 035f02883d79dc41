"""The identity of a checkpoint (DESIGN §5) and the engine's check of it, from ``stat()`` and headers only.

The checkpoint *identity* (DESIGN §5) is computed from ``stat()`` and the
header bytes only, never from tensor data, so an engine can compute the cache
key in microseconds.

Owns the ``stat()`` part of a file's identity; :meth:`Checkpoint.identity` and
:meth:`Checkpoint.identity_diff` build and compare the whole.

Forbidden imports: socket, torch, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import os


def _stat_identity(st: os.stat_result) -> dict[str, int]:
    """The ``stat()`` part of a file's identity (DESIGN §5): size, mtime_ns, ctime_ns, inode."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}
