""":class:`weightcache.daemon.tiers.HeldElsewhere`: a memfd the service closed is counted while anything still maps
it, and reported free once the last mapping goes (inotify ``IN_IGNORED`` on its inode; issue 38, P2)."""

from __future__ import annotations

import mmap
import os
import select

from weightcache.daemon.tiers import HeldElsewhere


def _memfd(size: int) -> int:
    fd = os.memfd_create("slab", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


def test_counted_while_mapped_freed_when_unmapped():
    h = HeldElsewhere()
    try:
        fd = _memfd(1 << 20)
        m = mmap.mmap(fd, 1 << 20, prot=mmap.PROT_READ)  # an engine's mapping (same process here)
        h.watch(fd, "a/tp1/rank0", 1 << 20)
        os.close(fd)
        assert h.read() == [] and h.bytes == 1 << 20 and h.labels() == ["a/tp1/rank0"]
        m.close()
        assert select.select([h.fd], [], [], 5)[0]
        assert h.read() == [("a/tp1/rank0", 1 << 20)] and h.bytes == 0
    finally:
        h.close()


def test_nothing_else_holding_it_frees_it_at_once():
    h = HeldElsewhere()
    try:
        fd = _memfd(4096)
        h.watch(fd, "b", 4096)
        os.close(fd)
        assert select.select([h.fd], [], [], 5)[0]
        assert h.read() == [("b", 4096)] and h.bytes == 0
    finally:
        h.close()
