"""The CUDA staging pool's bookkeeping (weightcache.memory.cuda_staging.StagingPool), with the pinned sets faked.

The pool's real allocations (``cuMemAllocHost``, streams, events) and a fill
through pooled sets are exercised on the GPU (tests/gpu/test_torch_free_load_gpu.py);
here: what is kept, reused, waited for and freed.
"""

from __future__ import annotations

import threading

import pytest

cuda_staging = pytest.importorskip("weightcache.memory.cuda_staging")


class _FakeSet:
    made: list["_FakeSet"] = []
    gate: threading.Event | None = None
    gated: int | None = None  # the buffer size the gate holds back (None: every size)
    fail_after: int | None = None

    def __init__(self, device, buffer_bytes: int) -> None:
        if _FakeSet.gate is not None and _FakeSet.gated in (None, buffer_bytes):
            assert _FakeSet.gate.wait(10)
        if _FakeSet.fail_after is not None and len(_FakeSet.made) >= _FakeSet.fail_after:
            raise RuntimeError("cuMemAllocHost failed (fake)")
        self.device, self.buffer_bytes, self.freed = device, buffer_bytes, False
        _FakeSet.made.append(self)

    def free(self) -> None:
        assert not self.freed, "set freed twice"
        self.freed = True


@pytest.fixture
def pool(monkeypatch):
    _FakeSet.made, _FakeSet.gate, _FakeSet.gated, _FakeSet.fail_after = [], None, None, None
    monkeypatch.setattr(cuda_staging, "_StagingSet", _FakeSet)
    return cuda_staging.StagingPool(object())


def test_warmed_sets_are_taken_and_kept_for_the_next_fill(pool):
    th = pool.warm(4, 1000)
    th.join(10)
    assert len(_FakeSet.made) == 4
    taken = [pool.take(1000) for _ in range(4)]
    assert sorted(map(id, taken)) == sorted(map(id, _FakeSet.made))  # no allocation on the fill's path
    extra = pool.take(1000)  # more readers than warmed sets: one more is allocated
    assert len(_FakeSet.made) == 5 and extra is _FakeSet.made[-1]
    for s in taken + [extra]:
        pool.give(s)
    assert pool.warm(4, 1000) is None  # enough kept: nothing to allocate
    again = [pool.take(1000) for _ in range(5)]
    assert len(_FakeSet.made) == 5 and not any(s.freed for s in again)


def test_a_taker_waits_for_the_warm_up_instead_of_allocating_beside_it(pool):
    _FakeSet.gate = threading.Event()
    pool.warm(2, 64)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.take(64)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got  # waiting on the warm-up, not allocating its own
    _FakeSet.gate.set()
    t.join(10)
    assert got and len(_FakeSet.made) == 2


def test_a_new_buffer_size_frees_the_old_sets(pool):
    pool.warm(2, 100).join(10)
    old = list(_FakeSet.made)
    s = pool.take(100)
    fresh = pool.take(200)  # staging_bytes or read_threads changed by a reload
    assert fresh.buffer_bytes == 200 and all(o.freed for o in old if o is not s)
    pool.give(s)  # came back at the old size: freed, not kept
    assert s.freed
    pool.give(fresh)
    assert pool.take(200) is fresh


def test_a_failed_warm_up_leaves_the_error_to_the_taker(pool):
    _FakeSet.fail_after = 1
    pool.warm(3, 10).join(10)
    first = pool.take(10)
    assert first is _FakeSet.made[0]
    with pytest.raises(RuntimeError, match="cuMemAllocHost failed"):
        pool.take(10)


def test_close_frees_the_kept_sets_and_sets_given_back_later(pool):
    pool.warm(2, 10).join(10)
    busy = pool.take(10)
    pool.close()
    assert [s.freed for s in _FakeSet.made if s is not busy] == [True]
    pool.give(busy)
    assert busy.freed


def test_a_reload_s_new_size_is_warmed_without_waiting_for_the_old_warm_up(pool):
    """A reload changes the buffer size while the warm-up of the old size still allocates: the new size is warmed
    (not counted as being warmed by the old thread) and taken; the old thread frees the set it was making and stops."""
    _FakeSet.gate, _FakeSet.gated = threading.Event(), 100
    old = pool.warm(3, 100)  # held in its first allocation
    new = pool.warm(2, 200)
    assert new is not None
    new.join(10)
    got = [pool.take(200) for _ in range(2)]
    assert [s.buffer_bytes for s in got] == [200, 200] and all(s in _FakeSet.made for s in got)
    _FakeSet.gate.set()
    old.join(10)
    stale = [s for s in _FakeSet.made if s.buffer_bytes == 100]
    assert len(stale) == 1 and stale[0].freed  # the one in flight, freed; the other two never made



def test_fewer_read_threads_at_the_same_buffer_size_keep_fewer_sets(pool):
    """read_threads 4 -> 2 with staging_bytes halved (the buffer size unchanged): the next load's warm-up frees the
    two kept sets beyond its count (the pool holds what staging_bytes says), and takes the other two."""
    pool.warm(4, 100).join(10)
    first = [pool.take(100) for _ in range(4)]
    for s in first:
        pool.give(s)
    assert pool.warm(2, 100) is None
    assert sum(s.freed for s in _FakeSet.made) == 2
    again = [pool.take(100) for _ in range(2)]
    assert len(_FakeSet.made) == 4 and not any(s.freed for s in again)


class _Cond(threading.Condition):
    """The pool's condition, saying when a taker waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout=None):
        self.waiting.set()
        return super().wait(timeout)


def test_a_taker_waiting_for_its_size_never_gets_a_set_of_another_size(pool):
    """A reader waits for the warm-up of its size while another fill's warm-up (another size, after a reload) puts
    its sets in the pool: the reader gets a set of its own size, never the other's (whose buffers are shorter than
    the chunks it reads: its reads failed as a truncated file)."""
    pool._cond = _Cond()
    _FakeSet.gate, _FakeSet.gated = threading.Event(), 100
    old = pool.warm(1, 100)  # held in its allocation
    got = []
    taker = threading.Thread(target=lambda: got.append(pool.take(100)))
    taker.start()
    assert pool._cond.waiting.wait(10)
    pool.warm(1, 50).join(10)  # the other fill's set, put in the pool while the taker waits
    _FakeSet.gate.set()
    old.join(10)
    taker.join(10)
    assert [s.buffer_bytes for s in got] == [100]


def test_a_warm_up_thread_that_cannot_start_leaves_the_takers_to_allocate(pool, monkeypatch):
    """No thread to be had (a thread limit): nothing is counted as being warmed, so a reader allocates its own set
    instead of waiting for ever for a warm-up that never ran."""
    def refused(self):
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", refused)
        assert pool.warm(2, 100) is None
    got = []
    taker = threading.Thread(target=lambda: got.append(pool.take(100)), daemon=True)
    taker.start()
    taker.join(10)
    assert not taker.is_alive() and [s.buffer_bytes for s in got] == [100]
