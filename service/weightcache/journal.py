"""Logging: journald with structured fields under systemd, plain stderr outside.

Under systemd (``$JOURNAL_STREAM`` names our stderr) records go to journald
through ``systemd.journal.JournalHandler`` with the constant fields
``SYSLOG_IDENTIFIER=weightcache`` and ``WEIGHTCACHE_GPU``; per-event fields
(``WEIGHTCACHE_MODEL``, ``WEIGHTCACHE_RANK``, ``MESSAGE_ID``, and numbers as
fields of their own: ``WEIGHTCACHE_BYTES``, ``WEIGHTCACHE_DURATION_MS``,
``WEIGHTCACHE_ERROR_CODE``...) come from ``extra=`` built by :func:`event`
(only UPPERCASE names survive). Each event kind has a fixed random
``MESSAGE_ID``, listed below, in weightcache.systemd(7), docs/operations.md
and the journal message catalog.
"""

from __future__ import annotations

import logging
import os
import sys

#: One random 128-bit MESSAGE_ID per event kind, generated once
#: (``python3 -c 'import uuid; print(uuid.uuid4().hex)'``) and never changed:
#: operators search by them and the message catalog
#: (units/weightcache.catalog, installed as
#: /usr/lib/systemd/catalog/weightcache.catalog) explains each. The list is
#: also in weightcache.systemd(7) and docs/operations.md (a test keeps all three equal).
MESSAGE_IDS = {
    "serving": "c399c6e3cb7a4d0fae0534a290bffab6",
    "ready": "a53d9ed7248b4e379818a36e367b81d4",
    "config_rejected": "da569fd55db74952a73f20c2858941b8",
    "loaded": "6ad38071b6cb4658bd5919c57e4aaac6",
    "load_failed": "6ec80d77f7684d67a638ac64427674bb",
    "attached": "7648ddf34cc84145b40ae515cea198f3",
    "released": "cb5449baccf940bcb4dd97270ca1f671",
    "evicted": "beb355af0f964bfdb1e578323c2502b2",
    "adopted": "f3fc5d86cced450b90db137a1ee94d81",
    "verify": "8155f7ddb1d54d5d9e079155da4d441e",
    "fallback": "4b523c7d13ff4c70b6900ef60d96c209",
    "attach_retry": "c85f453bae144486ad95db78efacb6f9",
    "rejected": "d62fa5f1c03d4c50b2b8645956695356",
    "reloaded": "7a2112c2cf224a43bcec0e7cd261cd25",
    "demoted": "4cefb35f14ad4756bb021c774a9ab0f3",
    "promoted": "2a41ba0667bd4a3fa0d127c5a7ffb003",
    "shelved": "9b93fa1d3b644b4cbf0b4b8438d3534b",
    "backend": "b8d4268cc41644dcbebfd2edd4c254b6",
    "published": "6aea506d539c4cc0b81bd2def38dc7ae",
    "image_written": "706ee30dcfa7447581fb36f12a92793a",
    "image_read": "4ef037d4cb7b4db8a12a1f062f0100d8",
    "image_rejected": "0a157b223a074af3bae12382624f7158",
    "seeded": "76682bdd68b44dd499c3927f0c907211",
    "seed_fallback": "08daa9304d7d4b29adb0844825a8e55b",
    "seed_served": "325e587bdbc64862bd2da3ec358720c3",
    "seed_rejected": "603decf3704042009c22e886d2ed20d8",
    "waiting_for_engine": "414833f1fa444f9499d89f99cdbc1380",
    "publication_dropped": "f13a3d98715848c18490898ffa0d1b67",
}


def _under_journal() -> bool:
    js = os.environ.get("JOURNAL_STREAM")
    if not js:
        return False
    try:
        dev, ino = (int(x) for x in js.split(":"))
        st = os.fstat(2)
    except (ValueError, OSError):
        return False
    return st.st_dev == dev and st.st_ino == ino


class _KVFormatter(logging.Formatter):
    """stderr format: time level logger message [MODEL=.. RANK=..]."""

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = [f"{k.removeprefix('WEIGHTCACHE_').lower()}={v}" for k, v in vars(record).items()
                  if k.startswith("WEIGHTCACHE_")]
        return base + (" [" + " ".join(extras) + "]" if extras else "")


def setup_logging(gpu: int | None = None, level: int = logging.INFO) -> str:
    """Configures the root logger; returns ``"journal"`` or ``"stderr"``."""
    root = logging.getLogger()
    root.setLevel(level)
    for h in list(root.handlers):
        root.removeHandler(h)
    if _under_journal():
        try:
            from systemd.journal import JournalHandler

            fields = {"SYSLOG_IDENTIFIER": "weightcache"}
            if gpu is not None:
                fields["WEIGHTCACHE_GPU"] = str(gpu)
            root.addHandler(JournalHandler(**fields))
            return "journal"
        except ImportError:
            pass
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(_KVFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(h)
    return "stderr"


def event(kind: str, model: str | None = None, rank: int | None = None, *, size_bytes: int | None = None,
          duration_ms: float | None = None, error_code: str | None = None, **more: object) -> dict:
    """``extra=`` fields of one event: its MESSAGE_ID, the model and rank, and its numbers as fields of their own.

    Args:
        kind (`str`): a key of :data:`MESSAGE_IDS` (also ``WEIGHTCACHE_EVENT=``).
        model (`str`, *optional*): ``WEIGHTCACHE_MODEL=``.
        rank (`int`, *optional*): ``WEIGHTCACHE_RANK=`` (the tp_rank).
        size_bytes (`int`, *optional*): ``WEIGHTCACHE_BYTES=``, bytes.
        duration_ms (`float`, *optional*): ``WEIGHTCACHE_DURATION_MS=``, milliseconds, written as an integer.
        error_code (`str`, *optional*): ``WEIGHTCACHE_ERROR_CODE=`` (docs/errors.md).
        **more: further fields, written as ``WEIGHTCACHE_<NAME>=`` (``peer_pid=3`` -> ``WEIGHTCACHE_PEER_PID=3``).

    Raises:
        KeyError: ``kind`` has no MESSAGE_ID (a bug: every event kind must have one).

    Example:
        >>> event("loaded", "qwen", 0, size_bytes=4096, duration_ms=12.4)["WEIGHTCACHE_DURATION_MS"]
        '12'
    """
    d = {"MESSAGE_ID": MESSAGE_IDS[kind], "WEIGHTCACHE_EVENT": kind}
    if model is not None:
        d["WEIGHTCACHE_MODEL"] = model
    if rank is not None:
        d["WEIGHTCACHE_RANK"] = str(rank)
    if size_bytes is not None:
        d["WEIGHTCACHE_BYTES"] = str(int(size_bytes))
    if duration_ms is not None:
        d["WEIGHTCACHE_DURATION_MS"] = str(round(duration_ms))
    if error_code is not None:
        d["WEIGHTCACHE_ERROR_CODE"] = error_code
    d.update({f"WEIGHTCACHE_{k.upper()}": str(v) for k, v in more.items()})
    return d
