"""Reading files as another user, for the permission tests (issue 15).

Root bypasses file modes (``CAP_DAC_OVERRIDE``); a test that must see
``EACCES`` the way the service user ``weightcache`` does drops its effective
uid and gid to ``nobody`` for a block, which also clears its effective
capabilities, and takes them back after (the real uid stays 0).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import pytest

NOBODY = 65534


@contextlib.contextmanager
def as_nobody() -> Iterator[None]:
    """Runs the block with effective uid/gid ``nobody``; skips the test when not root."""
    if os.geteuid() != 0:
        pytest.skip("needs root to read as another user")
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
