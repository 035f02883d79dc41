"""Hugging Face style checkpoints: the directory, its safetensors files and their identity.

The face of the package: :class:`Checkpoint` and the names other packages use. Its rooms:

- :mod:`._checkpoint`: :class:`Checkpoint`, one class (index, headers on first use, byte reads, identity);
- :mod:`._files`: containment by file descriptor (docs/reliability.md, "Threat model");
- :mod:`._identity`: the ``stat()`` part of the identity (DESIGN §5);
- :mod:`.header` (public, not re-exported here): safetensors header reads and parsing. It imports
  numpy and safetensors' validation on first use; an engine's attach, which checks a checkpoint's
  identity by ``stat()`` and reads no header, never imports it.

Forbidden imports: socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

from ._checkpoint import Checkpoint
from ._files import INDEX_NAME, MAX_SIDE_FILE_BYTES, MAX_SYMLINKS, MemberPath, not_regular, open_file, resolve_dir, \
    unreadable

__all__ = ["Checkpoint", "INDEX_NAME", "MAX_SIDE_FILE_BYTES", "MAX_SYMLINKS", "MemberPath", "not_regular",
           "open_file", "resolve_dir", "unreadable"]
