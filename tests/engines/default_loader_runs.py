"""The engine tests' memo of vLLM's default-loader runs, shared by every test module of a session.

Several tests compare against vLLM's default loader (``--load-format auto``) on a checkpoint that another module
also writes, byte for byte (the same builder and seed: tests/engine_checkpoints.py, tests/fp8_fixtures.py). The
default loader's greedy tokens are a function of the checkpoint's bytes and the engine's settings, so one run per
(bytes, settings) serves them all: :func:`key` names a run by the digest of the checkpoint's files and the
settings, and ``RUNS`` keeps its ``(result, output)`` for the rest of the session. Runs of the weightcache loaders
are never kept (each of those is what a test asserts on).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: ``key(...) -> (result, output)`` of a successful default-loader run (``result`` has ``tokens``).
RUNS: dict[tuple, tuple[dict, str]] = {}


def checkpoint_digest(path: Path) -> str:
    """BLAKE2b of every file under ``path`` (relative name and bytes, in name order).

    Raises:
        FileNotFoundError: ``path`` is not a directory with files.
    """
    h = hashlib.blake2b(digest_size=20)
    files = sorted(p for p in Path(path).rglob("*") if p.is_file())
    if not files:
        raise FileNotFoundError(f"{path}: no checkpoint files")
    for p in files:
        h.update(str(p.relative_to(path)).encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def key(model: Path, **settings) -> tuple:
    """The memo key of a default-loader run of ``model`` with the engine ``settings`` (dtype, tp, prompts...)."""
    return (checkpoint_digest(model), tuple(sorted((k, repr(v)) for k, v in settings.items())))
