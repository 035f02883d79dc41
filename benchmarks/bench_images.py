#!/usr/bin/env python3
"""Processed images (issue 36): image -> READY against checkpoint -> READY, same checkpoint, same run.

A BF16 Llama checkpoint of ``--size-gb`` (Llama-2-7B widths, layers to size; random bytes on disk) is
loaded once by a service with ``image = true`` and an uncapped write rate, which writes its image
(the write's time is reported from the service's ``image written`` line). Then, ``--reps`` times and
alternating, a fresh ``weightcache serve`` (no fd store) is started:

- ``checkpoint``: the model with ``image = false``: the pipeline reads the checkpoint;
- ``image``: the model with ``image = true``: the service reads the image (``status`` must say
  ``source = image``).

Both read from the page cache (every file is read once before each start), their pages put there the same
way: after the first run both are dropped from the page cache, then read back by the same threads. Reported per run: the
service's own load time (its ``loaded ... duration_ms``: plan, allocate, read, digests, seal) and its
read rate, and spawn -> every slab ready (``status`` polled every 10 ms); and the load's stages from the same
line (plan, allocate, read, digest, seal: :data:`STAGES`), medians per source and their differences, so that a
gap between the two shows in the stage it comes from. The issue's targets: image
load at least 0.9x the checkpoint's rate (CPU) and image -> READY at most 1.1x checkpoint -> READY (GPU).

Usage: bench_images.py [--device cpu|cuda] [--size-gb 1] [--reps 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    GB,
    LLAMA2_7B,
    emit,
    layers_for,
    service_env,
    spread,
    stats,
    versions,
    wait_ready,
    warm_page_cache,
    write_checkpoint,
    write_config,
)

_LOADED = re.compile(r"loaded model=\S+ .*?duration_ms=(\d+) read_ms=(\d+) read_gbps=([\d.]+) plan_ms=(\d+) "
                     r"allocate_ms=(\d+) digest_ms=(\d+) seal_ms=(\d+) .*?source=(\w+)")
#: The stages of the service's ``loaded`` line (daemon/load_results.py), in order: ``plan`` (checkpoint headers,
#: the plan; for ``image`` also the image's header read and checked), ``allocate``, ``read`` (the parallel
#: reader; the checkpoint's zero fills, scales and byte maps too), ``digest`` (every tensor's digest after the
#: read), ``seal`` (the manifest file, the slab sealed), ``other`` (the load's duration less those: room, posts).
STAGES = ("plan", "allocate", "read", "digest", "seal", "other")
_WRITTEN = re.compile(r"image written .*?size_bytes=(\d+) duration_ms=(\d+) write_gbps=([\d.]+)")


def _run(work: Path, ck: Path, images: Path, device: str, image: bool, rate: int, tag: str) -> dict:
    """Starts a service on ``ck``, waits for READY, stops it; returns its figures."""
    cfg = write_config(work / f"{tag}.toml", {"m": {"path": ck, "image": image}}, device,
                       image_dir=str(images), image_write_bytes_per_s=rate)
    sock, log = str(work / f"{tag}.sock"), work / f"{tag}.log"
    t0 = time.perf_counter()
    with open(log, "w") as lf:
        proc = subprocess.Popen([sys.executable, "-m", "weightcache", "serve", "--gpu", "0", "--config", str(cfg),
                                 "--listen", sock, "--backend", device], stdout=lf, stderr=lf, env=service_env(),
                                cwd=work)
    try:
        st = wait_ready(sock, proc, 600.0, log, poll_s=0.01)  # READY timed to 10 ms
        ready_s = time.perf_counter() - t0
        out = {"ready_s": ready_s, "source": st["slabs"][0].get("source")}
        if image and out["source"] == "checkpoint":  # the first run: wait for the write
            deadline = time.monotonic() + 600
            while not _WRITTEN.search(log.read_text()):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"no image written\n{log.read_text()[-4000:]}")
                time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    text = log.read_text()
    m = _LOADED.search(text)
    if m is None:
        raise RuntimeError(f"no loaded line\n{text[-4000:]}")
    out.update(load_s=int(m.group(1)) / 1e3, read_s=int(m.group(2)) / 1e3, read_gbps=float(m.group(3)))
    ms = dict(zip(("plan", "allocate", "digest", "seal"), (int(m.group(i)) for i in (4, 5, 6, 7))))
    ms["read"] = int(m.group(2))
    ms["other"] = int(m.group(1)) - sum(ms.values())
    out["stages_ms"] = ms
    out["outside_load_ms"] = out["ready_s"] * 1e3 - int(m.group(1))  # spawn, imports, start-up, the 10 ms poll
    w = _WRITTEN.search(text)
    if w is not None:
        out.update(write_s=int(w.group(2)) / 1e3, write_gbps=float(w.group(3)), image_bytes=int(w.group(1)))
    return out


def _numa() -> str:
    """``N NUMA nodes, GPU 0 on node K`` (best effort: sysfs and nvidia-smi), for the results."""
    nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    gpu = "?"
    try:
        bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.strip().lower()
        dom, rest = bus.split(":", 1)
        gpu = Path(f"/sys/bus/pci/devices/{dom[-4:]}:{rest}/numa_node").read_text().strip()
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return f"{len(nodes)} NUMA node(s), GPU 0 on node {gpu}"


def _drop_from_page_cache(path: Path) -> int:
    """Writes back and drops every ``*.safetensors`` file of ``path`` from the page cache
    (``POSIX_FADV_DONTNEED``; no root needed); returns the bytes dropped."""
    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def _reader_alone(ck: Path, img: Path, backend_name: str, reps: int) -> dict[str, list[float]]:
    """The service's parallel reader in this process, without the service: every tensor of the checkpoint's
    shards (one task per tensor, 256-byte aligned in the slab, as the plan of a BF16 HF checkpoint places them)
    against the image's one contiguous task, into a fresh slab of the backend each time, alternating, after one
    warm-up each (the pinned staging made). GB/s of each read (``read_direct``, digests left out)."""
    import json as _json
    import struct

    from weightcache.images import read_header
    from weightcache.memory import get_backend
    from weightcache.reader import LoaderOptions, ReadTask, read_direct

    tasks_ck, at = [], 0
    for f in sorted(ck.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            head = _json.loads(fh.read(n))
        for name, t in sorted(((k, v) for k, v in head.items() if k != "__metadata__"),
                              key=lambda kv: kv[1]["data_offsets"][0]):
            lo, hi = t["data_offsets"]
            tasks_ck.append(ReadTask(str(f), 8 + n + lo, hi - lo, at, name))
            at = -(-(at + hi - lo) // 256) * 256
    fd = os.open(img, os.O_RDONLY)
    try:
        h = read_header(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    tasks_img = [ReadTask(str(img), h.data_offset, h.data_bytes, 0, "weightcache.slab")]
    backend = get_backend(backend_name, 0)
    opts = LoaderOptions()
    prepare = getattr(backend, "prepare_fill", None)
    if prepare is not None:
        prepare(opts.threads, opts.buffer_bytes)
    out: dict[str, list[float]] = {"checkpoint": [], "image": []}
    for i in range(reps + 1):
        for kind, tasks in (("checkpoint", tasks_ck), ("image", tasks_img)):
            size = sum(t.length for t in tasks)
            slab = backend.allocate(max(at, h.data_bytes), "bench-reader")
            try:
                t0 = time.perf_counter()
                read_direct(tasks, slab, opts, with_digests=False)
                dt = time.perf_counter() - t0
            finally:
                slab.abort()
            if i:
                out[kind].append(size / dt / 1e9)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--reader-reps", type=int, default=3,
                    help="reads of each by the reader alone, in this process (0: none)")
    ap.add_argument("--dir", default=os.environ.get("BENCH_DATA_DIR") or tempfile.gettempdir())
    args = ap.parse_args()
    backend = "host" if args.device == "cpu" else "cuda"
    shape = layers_for(int(args.size_gb * GB), LLAMA2_7B)
    base = Path(args.dir) / "bench-images"
    ck = write_checkpoint(base / f"ck-{shape.layers}l", shape, "random")
    images = base / "images"
    shutil.rmtree(images, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix="wcbi-", dir="/tmp"))
    try:
        first = _run(work, ck, images, backend, True, 0, "first")
        assert first["source"] == "checkpoint", first
        img = next(images.glob("*.safetensors"))
        # Both files' pages made the same way: out of the page cache, then read back by warm_page_cache's
        # threads (readahead), where the checkpoint's came from write() and the image's from the service's
        # sendfile, on other CPUs (and NUMA nodes) and in other folio sizes.
        dropped = _drop_from_page_cache(ck) + _drop_from_page_cache(images)
        runs: dict[str, list[dict]] = {"checkpoint": [], "image": []}
        for i in range(args.reps):
            for kind in ("checkpoint", "image"):
                warm_page_cache(ck)
                warm_page_cache(images)
                r = _run(work, ck, images, backend, kind == "image", 0, f"{kind}{i}")
                assert r["source"] == kind, (kind, r)
                runs[kind].append(r)
        alone = _reader_alone(ck, img, backend, args.reader_reps) if args.reader_reps else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s = {k: {f: stats([r[f] for r in v]) for f in ("load_s", "read_gbps", "ready_s")} for k, v in runs.items()}
    ratio_load = s["image"]["load_s"]["median"] / s["checkpoint"]["load_s"]["median"]
    ratio_ready = s["image"]["ready_s"]["median"] / s["checkpoint"]["ready_s"]["median"]
    rate_ratio = s["image"]["read_gbps"]["median"] / s["checkpoint"]["read_gbps"]["median"]
    size = first.get("image_bytes", img.stat().st_size)
    title = (f"Processed images: {size / GB:.2f} GB slab ({shape.layers} Llama-2-7B layers, BF16), backend {backend}, "
             f"{args.reps} reps each, from the page cache; medians (min-max)")
    md = [title, "", "| source | service load (s) | read rate (GB/s) | spawn -> READY (s) |", "|---|---|---|---|"]
    for k in ("checkpoint", "image"):
        row = [f"{s[k][f]['median']:.3f} ({s[k][f]['min']:.3f}-{s[k][f]['max']:.3f})" for f in
               ("load_s", "read_gbps", "ready_s")]
        md.append(f"| {k} | " + " | ".join(row) + " |")
    ratios = (f"image / checkpoint: load {ratio_load:.2f}x, spawn -> READY {ratio_ready:.2f}x; read rate "
              f"{rate_ratio:.2f}x (issue target >= 0.9x the rate; <= 1.1x to READY on the GPU)")
    write = (f"image write (first run, uncapped): {first.get('write_s', float('nan')):.3f} s, "
             f"{first.get('write_gbps', float('nan')):.2f} GB/s")
    md += ["", ratios, write, "", ("Where the time goes: the stages of the service's `loaded` line (ms, medians; "
                                   "`outside` = spawn -> READY less the load: interpreter, imports, start-up, status "
                                   "poll)"), "",
           "| source | " + " | ".join(STAGES) + " | load | outside |", "|---|" + "---|" * (len(STAGES) + 2)]
    stage_med = {}
    for k in ("checkpoint", "image"):
        med = {st: statistics.median(r["stages_ms"][st] for r in runs[k]) for st in STAGES}
        med["load"] = statistics.median(r["load_s"] * 1e3 for r in runs[k])
        med["outside"] = statistics.median(r["outside_load_ms"] for r in runs[k])
        stage_med[k] = med
        md.append(f"| {k} | " + " | ".join(f"{med[st]:.0f}" for st in (*STAGES, "load", "outside")) + " |")
    md.append("| image - checkpoint | " + " | ".join(f"{stage_med['image'][st] - stage_med['checkpoint'][st]:+.0f}"
                                                  for st in (*STAGES, "load", "outside")) + " |")
    if alone is not None:
        a_ck, a_img = stats(alone["checkpoint"]), stats(alone["image"])
        md += ["", (f"The reader alone, in this process ({args.reader_reps} reads each, alternating, fresh slab each, "
                    f"digests left out): checkpoint shards (one task per tensor) {spread(a_ck)} GB/s, image (one "
                    f"task) {spread(a_img)} GB/s: {a_img['median'] / a_ck['median']:.2f}x")]
    numa = _numa()
    md += ["", (f"Host: {numa}; the image's pages come from the warm-up's threads (the writer drops what it wrote "
                "from the page cache as it goes).")]
    emit("bench_images", {"reader_alone": alone, "numa": numa, "device": args.device, "size_bytes": size,
                          "runs": runs, "stats": s, "first": first, "ratio_load": ratio_load,
                          "stages_ms_median": stage_med, "dropped_bytes": dropped, "ratio_ready": ratio_ready,
                          "rate_ratio": rate_ratio, "versions": versions()}, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
