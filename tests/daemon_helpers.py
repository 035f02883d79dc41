"""Helpers the in-process daemon tests share (tests/unit/test_daemon_*.py): a settable clock and the
teardown that closes what loads left in a service state."""

from __future__ import annotations

from typing import Any


class Clock:
    """A clock that stands still until a test moves ``t`` (seconds); pass it where a service reads
    ``time.monotonic``."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def close_slabs(state: Any) -> None:
    """Closes the sealed slab and manifest file of every slot of ``state`` (a ServiceState) that holds one."""
    for s in state.slots:
        if s.sealed is not None:
            s.sealed.close()
            s.manifest_file.close()
