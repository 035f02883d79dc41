#!/usr/bin/env python3
"""A TP rank's row-parallel rows copied out of plain memory: the copy's own cost, without a file.

``bench_tp_reads.py`` times a rank's rows out of the page cache; this one
copies the same shapes out of populated anonymous memory (no file, no page
cache, no page-table work during the copy), so that what the short rows cost
by themselves is seen apart from how they are reached. ``--threads`` threads
each copy their share of ``--gib`` GiB of rows of ``--pitches`` bytes, keeping
``pitch / TP`` bytes of each row, into their own buffer of packed rows, with
numpy ``copyto`` over three views of the same bytes:

- ``u1``: ``(rows, bytes)`` of ``uint8`` (what :func:`weightcache.reader._rows.copy_mapped_rows`
  does);
- ``u8``: ``(rows, bytes / 8)`` of ``uint64``;
- ``void``: ``(rows,)`` of one ``V<bytes>`` item per row.

Run it under ``GLIBC_TUNABLES`` (for example
``glibc.cpu.x86_non_temporal_threshold=0x4040``, the smallest glibc takes) to
see whether the copy's stores, not its loads, are the cost. Reports GB/s of
payload (the bytes kept), best of ``--reps``; checks that every row arrived.
Recorded in benchmarks/RESULTS.md (fifth 2026-12-02 session: on the H200 host
TP-8 rows copy at 0.3-0.5x the whole rows' rate on one thread, 0.6-0.74x on 16).

Usage: bench_row_copy.py [--gib G] [--threads 1,16] [--pitches 22016,8192] [--tps 1,2,8] [--views u1,u8,void]
       [--reps N]
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, versions  # noqa: E402


def view(buf: Any, offset: int, rows: int, length: int, pitch: int, how: str) -> Any:
    """``rows`` rows of ``length`` bytes, ``pitch`` apart from ``offset`` in ``buf``, as numpy view ``how``.

    Raises:
        ValueError: ``how`` is not ``u1``, ``u8`` or ``void``; ``u8`` with ``length`` or ``pitch`` not a multiple of 8.
    """
    import numpy as np

    if how == "u1":
        return np.ndarray((rows, length), np.uint8, buf, offset, (pitch, 1))
    if how == "u8":
        if length % 8 or pitch % 8:
            raise ValueError(f"u8 view needs multiples of 8 bytes: length {length}, pitch {pitch}")
        return np.ndarray((rows, length // 8), np.uint64, buf, offset, (pitch, 8))
    if how == "void":
        return np.ndarray((rows,), np.dtype(f"V{length}"), buf, offset, (pitch,))
    raise ValueError(f"unknown view {how!r}: u1, u8 or void")


def copy_rate(src: Any, threads: int, pitch: int, tp: int, how: str, reps: int) -> float:
    """GB/s of payload for ``threads`` threads copying TP ``tp``'s bytes of rows ``pitch`` apart out of ``src``.

    Raises:
        AssertionError: a row's bytes did not arrive where they belong (checked on the first and last row).
    """
    import numpy as np

    length = pitch // tp
    per = len(src) // pitch // threads
    dsts = [np.zeros(per * length, np.uint8) for _ in range(threads)]

    def work(i: int) -> None:
        np.copyto(view(dsts[i], 0, per, length, length, how), view(src, i * per * pitch, per, length, pitch, how))

    best = float("inf")
    for _ in range(reps):
        ths = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        best = min(best, time.perf_counter() - t0)
    for i, d in enumerate(dsts):
        for r in (0, per - 1):
            a = (i * per + r) * pitch
            assert bytes(d[r * length:(r + 1) * length]) == bytes(src[a:a + length]), (how, tp, i, r)
    return threads * per * length / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="anonymous memory to copy rows out of (default 1 GiB)")
    ap.add_argument("--threads", default="1,16")
    ap.add_argument("--pitches", default="22016,8192", help="row bytes (default: Llama-2-7B down_proj, o_proj bf16)")
    ap.add_argument("--tps", default="1,2,8")
    ap.add_argument("--views", default="u1,u8,void")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import numpy as np

    size = int(args.gib * (1 << 30))
    src = np.frombuffer(mmap.mmap(-1, size), np.uint8)
    block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    for off in range(0, size, len(block)):  # every page populated
        n = min(len(block), size - off)
        src[off:off + n] = block[:n]
    tps = [int(x) for x in args.tps.split(",")]
    rows, res = [], {"versions": versions(), "cpus": len(os.sched_getaffinity(0)), "gib": args.gib,
                     "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "rates": []}
    for pitch in (int(x) for x in args.pitches.split(",")):
        for threads in (int(x) for x in args.threads.split(",")):
            for how in args.views.split(","):
                rates = [copy_rate(src, threads, pitch, tp, how, args.reps) for tp in tps]
                res["rates"].append({"pitch": pitch, "threads": threads, "view": how, "gbps": dict(zip(tps, rates))})
                rows.append(f"| {pitch} | {threads} | {how} | " + " | ".join(
                    f"{r:.1f} ({r / rates[0]:.2f}x)" for r in rates) + " |")
    md = [f"### A rank's rows out of anonymous memory ({args.gib:g} GiB, {res['cpus']} CPUs, GLIBC_TUNABLES="
          f"{res['glibc_tunables'] or 'unset'}; GB/s of payload, best of {args.reps}, x the first TP's)", "",
          "| row pitch B | threads | view | " + " | ".join(f"TP {tp}" for tp in tps) + " |",
          "|---|---|---|" + "---|" * len(tps), *rows]
    emit("row_copy", res, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
