"""Issue 38, P2 on CUDA: a slab the service freed counts until every process its fd was sent to has exited.

The driver tells the exporter of a VMM allocation nothing when the last imported handle goes
(tests/gpu/test_trust_gpu.py), so ``tiers.HeldByReceivers`` waits on a pidfd per receiver. Real child
processes here; the serving loop's part (the attach records the receiver, the evict counts the slab in
``held_elsewhere_bytes``) is tests/gpu/test_trust_gpu.py's service test.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from types import SimpleNamespace

from service_harness import poll_until
from weightcache.daemon import tiers


def _child() -> subprocess.Popen:
    """A process that runs until its stdin closes."""
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)


def _end(p: subprocess.Popen) -> None:
    p.stdin.close()
    p.wait(timeout=60)


def test_a_freed_slab_counts_until_its_last_receiver_exits():
    a, b, gone = _child(), _child(), _child()
    _end(gone)  # exited (and reaped) before the slab is freed: not waited for
    watch = tiers.HeldByReceivers()
    try:
        watch.watch_freed(SimpleNamespace(receivers={a.pid, b.pid, gone.pid}, size_bytes=100), "m/tp1/rank0")
        watch.watch_freed(SimpleNamespace(receivers={gone.pid}, size_bytes=7), "only-gone/tp1/rank0")
        watch.watch_freed(SimpleNamespace(receivers=set(), size_bytes=5), "never-attached/tp1/rank0")
        watch.watch_freed(SimpleNamespace(fd=3, size_bytes=9), "a-manifest-file")  # no receivers: not counted
        assert (watch.bytes, watch.labels()) == (100, ["m/tp1/rank0"])
        assert watch.read() == [] and select.select([watch.fd], [], [], 0)[0] == []
        _end(a)
        poll_until(lambda: select.select([watch.fd], [], [], 0)[0], "the epoll fd to say a receiver exited")
        assert watch.read() == [] and watch.bytes == 100  # b still runs
        _end(b)
        freed: list = []
        poll_until(lambda: freed.extend(watch.read()) or freed, "the last receiver's exit")
        assert freed == [("m/tp1/rank0", 100)] and watch.bytes == 0 and watch.labels() == []
    finally:
        for p in (a, b):
            if p.poll() is None:
                _end(p)
        watch.close()


def test_close_releases_the_pidfds_of_receivers_still_running():
    a = _child()
    watch = tiers.HeldByReceivers()
    before = len(os.listdir("/proc/self/fd"))
    try:
        watch.watch_freed(SimpleNamespace(receivers={a.pid}, size_bytes=1), "m/tp1/rank0")
        assert len(os.listdir("/proc/self/fd")) == before + 1  # one pidfd
        watch.close()
        assert len(os.listdir("/proc/self/fd")) == before - 1  # and the epoll fd
    finally:
        _end(a)


def test_a_slab_attached_by_many_processes_keeps_only_those_that_run():
    a = _child()
    ended = []
    for _ in range(3):
        p = _child()
        _end(p)
        ended.append(p.pid)
    try:
        slab = SimpleNamespace(receivers=set())
        for pid in (a.pid, *ended):
            tiers.note_receiver(slab, pid)
        assert slab.receivers == {a.pid, *ended}  # below the mark: kept as given
        # At the mark the exited ones go (pids above the kernel's pid_max, 2**22 at most, never run)
        slab.receivers |= set(range(10**7, 10**7 + tiers.RECEIVERS_PRUNE_AT))
        tiers.note_receiver(slab, 1)  # init: it runs
        assert slab.receivers == {a.pid, 1}
        tiers.note_receiver(SimpleNamespace(), 5)  # a slab without receivers (host): nothing
    finally:
        _end(a)
