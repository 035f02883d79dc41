"""``benchmarks/uring_rows.py``: the io_uring way ``bench_tp_reads.py --ways uring`` measures reads the right rows.

A benchmark that reads the wrong bytes fast would read as a win: the rows land where asked, batches longer than
the ring are split, and a file that ends early is a :class:`uring_rows.ShortRead` naming the first short row.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import uring_rows  # noqa: E402


def _ring(entries: int) -> uring_rows.Ring:
    try:
        return uring_rows.Ring(entries)
    except OSError as e:
        if e.errno in (errno.ENOSYS, errno.EPERM):
            pytest.skip(f"io_uring refused on this machine: {e}")
        raise


def test_strided_rows_land_where_asked_over_several_ring_batches(tmp_path):
    data = np.random.default_rng(3).integers(0, 256, 300 * 4096, dtype=np.uint8)
    path = tmp_path / "rows.bin"
    path.write_bytes(data.tobytes())
    ring = _ring(8)  # 300 rows: 38 batches of at most 8
    fd = os.open(path, os.O_RDONLY)
    try:
        out = np.zeros(300 * 2048, np.uint8)
        ring.read_rows(fd, 100, 4096, 1000, 300, out.ctypes.data, 2048)  # rows 1000 bytes, 2048 apart in out
        got = out.reshape(300, 2048)[:, :1000]
        want = np.stack([data[100 + i * 4096 : 1100 + i * 4096] for i in range(300)])
        assert (got == want).all()
        assert not out.reshape(300, 2048)[:, 1000:].any()  # nothing written between the rows
    finally:
        os.close(fd)
        ring.close()


def test_a_file_that_ends_early_is_a_short_read_naming_the_first_short_row(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(os.urandom(10 * 4096))
    ring = _ring(16)
    fd = os.open(path, os.O_RDONLY)
    try:
        out = np.zeros(20 * 512, np.uint8)
        with pytest.raises(uring_rows.ShortRead) as e:
            ring.read_rows(fd, 3800, 4096, 512, 20, out.ctypes.data, 512)
        assert e.value.offset == 3800 + 9 * 4096  # row 9 ends past the file's 40960 bytes
        ring.read_rows(fd, 0, 4096, 512, 4, out.ctypes.data, 512)  # the ring still works after the error
        assert bytes(out[:512]) == path.read_bytes()[:512]
    finally:
        os.close(fd)
        ring.close()
