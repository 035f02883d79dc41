"""The benchmark scripts that scripts/gpu-check and benchmarks/run call still run (CPU, host backend, tiny sizes).

Their figures are not checked here (speed is for benchmarks with recorded
results); what is checked is that a refactor of the client or the service
did not leave a script calling what no longer exists, as happened to
``bench_attach_stages.py`` when the client started importing ``identity``
on first use: the GPU run of ``benchmarks/run --quick`` was the first to see it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, tmp_path: Path) -> str:
    env = {**os.environ, "BENCH_DATA_DIR": str(tmp_path / "data"), "BENCH_JSON_DIR": str(tmp_path / "json"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{script} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def test_bench_attach_stages_runs_and_times_every_stage(tmp_path):
    out = _run("bench_attach_stages.py", "--device", "cpu", "--iters", "3", "--warmup", "1",
               "--dir", str(tmp_path / "data"), tmp_path=tmp_path)
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    for stage in ("connect", "recvmsg: waiting for the service + reading the reply",
                  "key check: fields + stat() of the files", "**attach() end to end**"):
        assert stage in rows, (stage, out[-3000:])
    # every patched stage was reached: a timer on a function the client no longer calls reads 0
    recv = rows["recvmsg: waiting for the service + reading the reply"].split("|")[2].strip()
    assert int(recv) > 0, rows


def test_bench_first_start_splits_the_cold_attaches_into_stages(tmp_path):
    """``--cold-attach``: fresh engine processes attach; the client-first attaches come back split into the client's
    stages (first and second), every stage an attach by name passes through reached."""
    import json

    out = _run("bench_first_start.py", "--device", "cpu", "--size-gb", "0.05", "--reps", "1", "--naming", "vllm",
               "--cold-attach", "1", "--dir", str(tmp_path / "data"), "--remove", tmp_path=tmp_path)
    res = json.loads((tmp_path / "json" / "first_start_cpu_vllm.json").read_text())
    stages = res["namings"]["vllm"]["cold_attach"]["source"]["stages_us"]
    for stage in ("connect", "send hello + attach", "waiting for the reply (recvmsg) + decode",
                  "manifest file: pread + JSON + packed columns", "key check: fields + stat() of the files",
                  "views: build_views", "other (outside the stages)"):
        assert stage in stages and stages[stage]["second"] > 0, (stage, sorted(stages))
    assert "| stage of `attach()` (client first) | first, µs | second, µs | first − second |" in out


def test_bench_first_start_instances_load_one_rank_each(tmp_path):
    """``--tp 2 --instances``: two services started at once, each loading only its own rank (the other on a GPU
    index no instance serves), against one service loading the whole checkpoint; each instance loads one rank,
    less than the whole, and the two together at least the whole (norms are in both ranks)."""
    import json

    _run("bench_first_start.py", "--device", "cpu", "--size-gb", "0.05", "--reps", "1", "--naming", "vllm",
         "--tp", "2", "--instances", "--dir", str(tmp_path / "data"), "--remove", tmp_path=tmp_path)
    res = json.loads((tmp_path / "json" / "first_start_cpu_instances_tp2_vllm.json").read_text())
    tp = res["namings"]["vllm"]["tp"]
    assert set(tp) == {"1", "2"}, tp
    whole = tp["1"]["payload_bytes"]
    assert tp["1"]["instances"] == [{"ranks": 1, "payload_bytes": whole}], tp["1"]
    ranks = tp["2"]["instances"]
    assert [x["ranks"] for x in ranks] == [1, 1], ranks
    assert all(0 < x["payload_bytes"] < whole for x in ranks) and tp["2"]["payload_bytes"] >= whole, (ranks, whole)
    assert tp["1"]["torch_free"] and tp["2"]["torch_free"]
    assert tp["2"]["load_gbps"]["median"] > 0 and res["namings"]["vllm"]["rate_vs_tp1"] > 0


def test_bench_tp_reads_runs_every_way_and_removes_its_file(tmp_path):
    f = tmp_path / "bench-dir" / "tp.bin"  # gpu-check's $BENCH_DATA_DIR may not exist yet
    out = _run("bench_tp_reads.py", "--file", str(f), "--layers", "1", "--threads", "2", "--reps", "1",
               "--ways", "span,iov,mmap,row,vmread,uring,mmap+fd", tmp_path=tmp_path)
    rows = {tuple(c.strip() for c in line.split("|")[1:3]) for line in out.splitlines() if line.startswith("| ")}
    assert {("1", "whole rows"), ("1", "whole rows+fd")} <= rows, out[-3000:]
    ways = ("span", "iov", "mmap", "row", "vmread", "uring", "mmap+fd")
    assert {(tp, way) for tp in ("2", "8") for way in ways} <= rows, out[-3000:]
    assert not f.exists()


def test_bench_concurrency_runs_and_times_every_stage(tmp_path):
    """One engine, three attaches: each client stage the script wraps is one the client still calls (a timer on a
    name the client no longer uses reads 0; one on an attribute it lacks, ``client.identity``, broke the script)."""
    out = _run("bench_concurrency.py", "--device", "cpu", "--ns", "1", "--samples", "3", "--warmup", "1",
               tmp_path=tmp_path)
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("| N | connect |"))
    header, row = lines[at], lines[at + 2]  # the header, |---|, N = 1
    cells = dict(zip([c.strip() for c in header.split("|")[2:-1]], [c.strip() for c in row.split("|")[2:-1]]))
    for stage in ("connect", "reply wait", "manifest file", "key check", "import + map", "views"):
        assert float(cells[stage].split("/")[0]) > 0, (stage, cells)


def test_bench_row_copy_copies_every_view_and_checks_the_rows(tmp_path):
    import json

    _run("bench_row_copy.py", "--gib", "0.03", "--threads", "1,2", "--reps", "1", tmp_path=tmp_path)
    res = json.loads((tmp_path / "json" / "row_copy.json").read_text())
    got = {(r["pitch"], r["threads"], r["view"]) for r in res["rates"]}
    assert got == {(p, t, v) for p in (22016, 8192) for t in (1, 2) for v in ("u1", "u8", "void")}, got
    assert all(set(r["gbps"]) == {"1", "2", "8"} and min(r["gbps"].values()) > 0 for r in res["rates"])


def test_bench_gpu_gather_says_it_needs_a_gpu_and_measures_nothing_without_one(tmp_path):
    """CI has no GPU: the script imports, says why it measured nothing, writes no file and no results."""
    from weightcache.memory import cuda_driver

    if cuda_driver.load_driver() is not None:
        import pytest

        pytest.skip("a CUDA driver is present: the GPU check runs this benchmark")
    out = _run("bench_gpu_gather.py", "--dir", str(tmp_path / "gather"), tmp_path=tmp_path)
    assert "needs a CUDA GPU (the driver reports none here): nothing measured" in out
    assert not (tmp_path / "gather").exists() and not (tmp_path / "json").exists()


def test_bench_seed_seeds_and_reads_in_the_same_run(tmp_path):
    """Issue 37: the peer-seeding benchmark runs both receivers and times the source's attaches."""
    pytest.importorskip("nixl_cu12", reason="NIXL (weightcache[seeding]) is not installed")
    out = _run("bench_seed.py", "--size-gb", "0.02", "--reps", "1", "--dir", str(tmp_path / "seed"), "--remove",
               tmp_path=tmp_path)
    assert "| seeded by the peer (NIXL READ) |" in out and "peer / checkpoint, whole load:" in out
    assert "while it serves the peer p50" in out


def test_bench_image_write_p99_measures_both_phases_and_the_write(tmp_path):
    """Issue 36: an attach loop while no image is written, then while one is; the write's own figures from the
    service's ``image written`` line."""
    import json

    _run("bench_image_write_p99.py", "--write-gb", "0.05", "--idle-s", "0.2", "--reps", "1",
         "--dir", str(tmp_path / "data"), tmp_path=tmp_path)
    res = json.loads((tmp_path / "json" / "image_write_p99_host.json").read_text())
    tree = res["trees"]["this tree"]
    assert tree["idle_ms"]["n"] >= 100 and tree["write_ms"]["n"] >= 1, tree
    (rep,) = tree["reps"]
    assert rep["size"] > 0 and rep["write_s"] >= 0 and rep["write_gbps"] > 0, rep


def test_bench_seeding_gpu_says_it_needs_a_gpu_and_measures_nothing_without_one(tmp_path):
    """Issue 37's GPU probe (NIXL READ of a GPU slab) imports on CI and says why it measured nothing."""
    from weightcache.memory import cuda_driver

    if cuda_driver.load_driver() is not None:
        import pytest

        pytest.skip("a CUDA driver is present: the GPU check runs this benchmark")
    out = _run("bench_seeding_gpu.py", "--size-gb", "0.01", tmp_path=tmp_path)
    assert "bench_seeding_gpu needs a CUDA GPU (the driver reports none here): nothing measured" in out
