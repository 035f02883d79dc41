"""Logging: journald with structured fields under systemd, plain stderr outside.

Under systemd (``$JOURNAL_STREAM`` names our stderr) records go to journald
through ``systemd.journal.JournalHandler`` with the constant fields
``SYSLOG_IDENTIFIER=weightcache`` and ``WEIGHTCACHE_GPU``; per-event fields
(``WEIGHTCACHE_MODEL``, ``WEIGHTCACHE_RANK``, ``MESSAGE_ID``...) come from
``extra=`` (only UPPERCASE names survive). Each event kind has a fixed
``MESSAGE_ID`` (generated once with ``systemd-id128 new``), listed below and
in docs/operations.md.
"""

from __future__ import annotations

import logging
import os
import sys

#: Fixed MESSAGE_IDs, one per event kind.
MESSAGE_IDS = {
    "loaded": "5d1c8e0b3f2a4c7e9a6b1d2e3f405162",
    "load_failed": "a7e3c2b19f8d4e6a8b7c6d5e4f3a2b10",
    "attached": "0f9e8d7c6b5a49382716f5e4d3c2b1a0",
    "fallback": "3c4d5e6f708192a3b4c5d6e7f8091a2b",
    "rejected": "9b8a7c6d5e4f30211f2e3d4c5b6a7988",
    "evicted": "6e5d4c3b2a1948f7e6d5c4b3a2918f7e",
    "adopted": "1a2b3c4d5e6f47089a1b2c3d4e5f6a7b",
    "released": "c1d2e3f4a5b64c7d8e9f0a1b2c3d4e5f",
    "reloaded": "7a2112c2cf224a43bcec0e7cd261cd25",
    "config_rejected": "574150c4c549451792f1a95b09e14187",
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


def event(kind: str, model: str | None = None, rank: int | None = None, **more: str) -> dict:
    """``extra=`` fields of one event: MESSAGE_ID plus WEIGHTCACHE_MODEL/RANK."""
    d = {"MESSAGE_ID": MESSAGE_IDS[kind], "WEIGHTCACHE_EVENT": kind}
    if model is not None:
        d["WEIGHTCACHE_MODEL"] = model
    if rank is not None:
        d["WEIGHTCACHE_RANK"] = str(rank)
    d.update({k.upper(): str(v) for k, v in more.items()})
    return d
