"""``weightcache metrics`` against live services: promtool accepts it, and it says what ``status --json`` says.

test_cli.py's node: two ``weightcache serve`` subprocesses (GPU 0 and 1, host backend) hold the
real all-MiniLM-L6-v2 checkpoint (GPU 0), a tiny Llama at tp = 2 (GPUs 0 and
1) and a model whose checkpoint does not exist (fails on GPU 0). An engine
holds a lease on minilm; another attach of the failed model is refused; an
operator verifies minilm. Then the exposition is checked by Debian's
``promtool check metrics`` and compared, value by value, with ``weightcache
status --json`` and with what the test itself did.

This host has no systemd as PID 1, so every socket is asked (a hand-run
``weightcache serve``); the choice under systemd is tested in
tests/system/test_metrics_systemd.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from weightcache import attach
from weightcache.errors import ModelLoadFailed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cli import Services, llama_path, minilm_path, services  # noqa: E402,F401 - fixtures

pytestmark = pytest.mark.timeout(180)

PROMTOOL = shutil.which("promtool")


def run_cli(svc: Services, *argv: str) -> subprocess.CompletedProcess:
    """``python -m weightcache ARGV`` as an operator runs it (a process of its own)."""
    env = {k: v for k, v in os.environ.items() if k not in ("WEIGHTCACHE_CONFIG",)}
    env["WEIGHTCACHE_SOCKET_DIR"] = str(svc.socket_dir)
    return subprocess.run([sys.executable, "-m", "weightcache", *argv], capture_output=True, text=True, timeout=60,
                          env=env)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """``(sample name, labels) -> value`` of an exposition, parsed by prometheus_client's own parser."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(smp: dict, name: str, **labels) -> float:
    """The sample ``name{labels}``; ``gpu_uuid`` is matched only when given (test_gpu_uuid_on_what_instances_report
    checks it on every sample)."""
    want = frozenset((k, str(v)) for k, v in labels.items())
    keys = [k for k in smp if k[0] == name and (k[1] == want or ("gpu_uuid" not in labels and k[1] - want
                                                                 and {x[0] for x in k[1] - want} == {"gpu_uuid"}))]
    assert len(keys) == 1, f"{name}{labels} not exposed once; have {sorted(k for k in smp if k[0] == name)}"
    return smp[keys[0]]


@pytest.fixture(scope="module")
def node(services):
    """test_cli's node (its own instances for this module), after an attach held, one refused and a verify."""
    if os.path.isdir("/run/systemd/system"):
        pytest.skip("this host runs systemd: metrics asks only running weightcache@N units (see the system test)")
    svc = services
    held = attach("minilm", socket_dir=str(svc.socket_dir), gpu=0, fallback=False, timeout=30)
    try:
        with pytest.raises(ModelLoadFailed):
            attach("broken", socket_dir=str(svc.socket_dir), gpu=0, fallback=False, timeout=30)
        assert run_cli(svc, "verify", "minilm", "--gpu", "0").returncode == 0
        yield svc, held
    finally:
        held.close()


def test_promtool_accepts_the_exposition(node):
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (Debian package prometheus, in the Makefile's APT_PKGS)")
    svc, _ = node
    r = run_cli(svc, "metrics")
    assert r.returncode == 0, r.stderr
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=r.stdout, capture_output=True, text=True,
                           timeout=60)
    assert (check.returncode, check.stdout, check.stderr) == (0, "", ""), (check.stdout, check.stderr)


def test_values_equal_status_json(node):
    svc, held = node
    status = json.loads(run_cli(svc, "status", "--json").stdout)
    r = run_cli(svc, "metrics")
    assert r.returncode == 0, r.stderr
    smp = samples(r.stdout)
    assert len(status["gpus"]) == 2 and not status["unreachable"]
    for st in status["gpus"]:
        g = st["gpu"]
        assert value(smp, "weightcache_instance_up", gpu=g) == 1
        assert value(smp, "weightcache_socket_listening", gpu=g) == 1
        assert value(smp, "weightcache_memory_total_bytes", gpu=g) == st["memory"]["total_bytes"]
        # Free host RAM moves between the two commands; the slabs' share does not.
        assert value(smp, "weightcache_memory_free_bytes", gpu=g) == pytest.approx(st["memory"]["free_bytes"], rel=0.05)
        assert value(smp, "weightcache_memory_slab_bytes", gpu=g) == sum(sl["resident_bytes"] for sl in st["slabs"])
        for sl in st["slabs"]:
            lab = dict(gpu=g, model=sl["model"], tp_size=sl["tp_size"], tp_rank=sl["tp_rank"])
            assert value(smp, "weightcache_slab_resident_bytes", **lab) == sl["resident_bytes"]
            assert value(smp, "weightcache_slab_tensors", **lab) == sl["tensors"]
            assert value(smp, "weightcache_slab_leases", **lab) == len(sl["leases"])
            assert value(smp, "weightcache_slab_adopted", **lab) == int(sl["adopted"])
            for state in ("pending", "loading", "ready", "failed", "evicted"):
                assert value(smp, "weightcache_slab_state", state=state, **lab) == int(sl["state"] == state)
    # What the test did: two models resident, one failed, one lease, a refused attach, one verify.
    minilm = dict(gpu=0, model="minilm", tp_size=1, tp_rank=0)
    broken = dict(gpu=0, model="broken", tp_size=1, tp_rank=0)
    assert value(smp, "weightcache_slab_state", state="ready", **minilm) == 1
    assert value(smp, "weightcache_slab_resident_bytes", **minilm) == held.resident_bytes
    assert value(smp, "weightcache_slab_state", state="ready", gpu=1, model="llama", tp_size=2, tp_rank=1) == 1
    assert value(smp, "weightcache_slab_state", state="failed", **broken) == 1
    assert value(smp, "weightcache_slab_leases", **minilm) == 1
    failed_code = next(sl for sl in status["gpus"][0]["slabs"] if sl["model"] == "broken")["error"]["code"]
    assert value(smp, "weightcache_loads_total", outcome="failed", code=failed_code, source="checkpoint", **broken) == 1
    assert value(smp, "weightcache_loads_total", outcome="loaded", code="", source="checkpoint", **minilm) == 1
    total = next(sl for sl in status["gpus"][0]["slabs"] if sl["model"] == "minilm")["total_bytes"]
    assert value(smp, "weightcache_slab_last_load_bytes", **minilm) == total
    assert value(smp, "weightcache_slab_last_load_duration_seconds", **minilm) > 0
    assert value(smp, "weightcache_attaches_total", gpu=0, model="minilm", outcome="daemon", code="") == 1
    assert value(smp, "weightcache_attaches_total", gpu=0, model="broken", outcome="refused",
                 code="model_load_failed") == 1
    assert value(smp, "weightcache_attach_duration_seconds_count", gpu=0, model="minilm") == 1
    assert value(smp, "weightcache_attach_duration_seconds_bucket", gpu=0, model="minilm", le="+Inf") == 1
    assert value(smp, "weightcache_verify_runs_total", **minilm) == 1
    assert value(smp, "weightcache_verify_failures_total", **minilm) == 0
    infos = [dict(labels) for (name, labels) in smp if name == "weightcache_build_info"]
    assert {(i["gpu"], i["backend"]) for i in infos} == {("0", "host"), ("1", "host")}, infos


def test_gpu_uuid_on_what_instances_report(node):
    """Every sample an instance reports carries gpu_uuid, its device's (as status --json says; empty on the host
    backend); the four series the endpoint writes from outside the instance carry gpu only."""
    from weightcache import metrics

    svc, _ = node
    status = json.loads(run_cli(svc, "status", "--json").stdout)
    uuids = {str(st["gpu"]): st["device"]["gpu_uuid"] for st in status["gpus"]}
    r = run_cli(svc, "metrics")
    assert r.returncode == 0, r.stderr
    seen = set()
    for fam in text_string_to_metric_families(r.stdout):
        base = fam.name.removesuffix("_info") if fam.name.endswith("_build_info") else fam.name
        for s in fam.samples:
            if fam.name in metrics.OUTSIDE:
                assert "gpu_uuid" not in s.labels, s
            else:
                assert s.labels["gpu_uuid"] == uuids[s.labels["gpu"]], s
                seen.add(base)
    # Every family but the outside ones, and those with a sample only once it happened: publications, dropped
    # sd_notify datagrams, peer seeding (this node published nothing, its notify socket was read, it has no peers).
    happened_only = {"weightcache_publishes", "weightcache_publications_dropped", "weightcache_notify_dropped", "weightcache_peer_seeds",
                     "weightcache_peer_seed_bytes", "weightcache_peer_seed_seconds", "weightcache_peer_served",
                     "weightcache_peer_served_bytes"}
    assert seen == set(metrics.FAMILIES) - set(metrics.OUTSIDE) - happened_only, sorted(seen)


def test_textfile_output_is_written_whole(node, tmp_path):
    svc, _ = node
    out = tmp_path / "weightcache.prom"
    r = run_cli(svc, "metrics", "--output", str(out))
    assert r.returncode == 0 and r.stdout == "", r.stderr
    smp = samples(out.read_text())
    assert value(smp, "weightcache_slab_leases", gpu=0, model="minilm", tp_size=1, tp_rank=0) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["weightcache.prom"]  # no temporary file left


def test_an_idle_node_answers_with_what_it_knows(tmp_path):
    """No instance: the configured GPU is reported with its socket down, and nothing else."""
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(f'[models.m]\npath = "{minilm_path()}"\nlayouts = [ {{ tp = 1, gpus = [3] }} ]\n')
    env = {**os.environ, "WEIGHTCACHE_SOCKET_DIR": str(tmp_path / "run"), "WEIGHTCACHE_CONFIG": str(cfg)}
    r = subprocess.run([sys.executable, "-m", "weightcache", "metrics"], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 0, r.stderr
    smp = samples(r.stdout)
    assert value(smp, "weightcache_socket_listening", gpu=3) == 0
    assert value(smp, "weightcache_instance_up", gpu=3) == 0
    assert value(smp, "weightcache_configured_slabs", gpu=3) == 1  # WeightcacheConfiguredGpuNotServing's input
    assert not [k for k in smp if k[0].startswith("weightcache_slab_")]


def test_a_disabled_gpu_counts_no_configured_slabs(tmp_path):
    """Issue 39: [service] disabled_gpus takes a GPU out on purpose: weightcache_configured_slabs 0, so the
    configured-GPU alert stays silent for it; the other GPU counts its ranks."""
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(f'[service]\ndisabled_gpus = [3]\n\n[models.m]\npath = "{minilm_path()}"\n'
                   f'layouts = [ {{ tp = 1, gpus = [3] }}, {{ tp = 2, gpus = [4, 5] }}, {{ tp = 1, gpus = [4] }} ]\n')
    env = {**os.environ, "WEIGHTCACHE_SOCKET_DIR": str(tmp_path / "run"), "WEIGHTCACHE_CONFIG": str(cfg)}
    r = subprocess.run([sys.executable, "-m", "weightcache", "metrics"], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 0, r.stderr
    smp = samples(r.stdout)
    assert value(smp, "weightcache_configured_slabs", gpu=3) == 0
    assert value(smp, "weightcache_configured_slabs", gpu=4) == 2
    assert value(smp, "weightcache_configured_slabs", gpu=5) == 1
