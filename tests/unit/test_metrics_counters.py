"""The service's counters (daemon/metrics.py), the exposition's names (metrics.py) and the journal's fields.

In-process: counters fed with real protocol messages, the exposition of
hand-made :class:`~weightcache.metrics.Instance` records parsed back with
prometheus_client's parser, and the example dashboard and alert rules checked
against the names the exposition has.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from weightcache import metrics, protocol
from weightcache.config import Layout, ModelConfig, Placement
from weightcache.daemon.metrics import ATTACH_BUCKETS_S, OTHER_MODEL, Counters
from weightcache.journal import MESSAGE_IDS, event

REPO = Path(__file__).resolve().parents[2]


def _placement(name: str, rank: int = 0, tp: int = 1) -> Placement:
    return Placement(ModelConfig(name=name, path=f"/srv/{name}", layouts=(Layout(tp, tuple(range(tp))),)), tp, rank,
                     rank)


class _Reply:
    def __init__(self, msg: protocol.Message) -> None:
        self.msg = msg


def test_attaches_are_counted_by_model_outcome_and_code():
    c = Counters([_placement("qwen")], started_at=1700000000.0)
    c.answered(protocol.Attach("qwen"), [_Reply(protocol.AttachReply(1, "/srv/qwen", "host", 4096))], 0.0007)
    c.answered(protocol.Attach("/srv/qwen/"), [_Reply(protocol.Loading("qwen", 1, 2))], 0.002)  # by path
    c.answered(protocol.Attach("nope"), [_Reply(protocol.Error("model_not_found", "m"))], 0.0001)
    c.answered(protocol.Attach("qwen"), [], 0.0)  # parked: counted when answered
    rec = protocol.ServiceCounters.from_json(c.record().to_json())  # as the wire carries it
    assert {(a.model, a.outcome, a.code): a.count for a in rec.attaches} == {
        ("qwen", "daemon", ""): 1, ("qwen", "loading", ""): 1, (OTHER_MODEL, "refused", "model_not_found"): 1}
    times = {t.model: t for t in rec.attach_times}
    assert times["qwen"].bounds_s == list(ATTACH_BUCKETS_S)
    # 0.7 ms lands in the (0.5 ms, 1 ms] bucket, 2 ms in (1 ms, 2.5 ms].
    assert times["qwen"].counts[:3] == [0, 1, 1] and sum(times["qwen"].counts) == 2
    assert times["qwen"].sum_s == pytest.approx(0.0027)
    assert rec.started_at == 1700000000.0 and rec.version


def test_a_parked_attach_counts_from_when_it_was_parked():
    c = Counters([_placement("qwen")], started_at=0.0)
    a, b = protocol.Attach("qwen", wait_ms=5000), protocol.Attach("qwen", wait_ms=1000)
    wa, wb = (a, None, 100.0 + 5.0), (b, None, 103.0 + 1.0)  # parked at t=100 and t=103
    c.waited([wa, wb], [wa], [_Reply(protocol.Error("model_load_failed", "x"))], now=103.5)
    (t,) = c.record().attach_times
    assert t.sum_s == pytest.approx(0.5)  # only b was answered, 0.5 s after it was parked
    assert [(x.outcome, x.code) for x in c.record().attaches] == [("refused", "model_load_failed")]


def test_loads_and_verifies():
    p = _placement("qwen")
    c = Counters([p], started_at=0.0)
    c.load_settled(p, "checkpoint_not_found")
    c.load_settled(p, None, 1.5, 4096)
    c.answered(protocol.Verify("qwen"), [_Reply(protocol.VerifyReply([
        protocol.VerifyResult("qwen", 1, 0, "ready", ["w"], 3).to_json()]))], 0.1)
    rec = c.record()
    assert {(x.outcome, x.code): x.count for x in rec.loads} == {("failed", "checkpoint_not_found"): 1,
                                                                 ("loaded", ""): 1}
    (s,) = rec.slabs
    assert (s.last_load_s, s.last_load_bytes, s.verify_runs, s.verify_failures) == (1.5, 4096, 1, 1)


def _status(slabs) -> protocol.ServiceStatus:
    return protocol.ServiceStatus(0, 42, "host", protocol.DeviceInfo("host"), 1000, 4000, tuple(slabs), 1, "ready")


def _slab(model: str, state: str, resident: int, leases: int = 0) -> protocol.SlabInfo:
    return protocol.SlabInfo(model, f"/srv/{model}", 1, 0, state, resident, resident, 0, resident, False, "auto",
                             "hf", 7 if resident else 0,
                             leases=tuple(protocol.LeaseInfo(i, 1, 2, 3, 0.0, "zero_copy") for i in range(leases)))


def _exposition(instances) -> dict:
    class _Fixed:
        def collect(self):
            fam = metrics._Families()
            for inst in instances:
                metrics._add_instance(fam, inst)
            yield from (m for m in fam.f.values() if m.samples)

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Fixed())
    return {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}


def test_exposition_names_types_and_values(monkeypatch):
    from weightcache import notify

    monkeypatch.setattr(notify, "dropped", notify.dropped.__class__({"STATUS": 3, "FDSTORE": 1}))
    c = Counters([_placement("qwen")], started_at=123.0)
    c.answered(protocol.Attach("qwen"), [_Reply(protocol.AttachReply(1, "/srv/qwen", "host", 4096))], 0.003)
    c.load_settled(_placement("qwen"), None, 2.0, 2048)
    c.answered(protocol.Publish("qwen", 1, 0, {}, 4096, 10), [_Reply(protocol.PublishReply("x", True, 4096, "k"))], 0.1)
    c.publication_dropped(_placement("qwen"), "digest_mismatch")
    c.publication_dropped(_placement("qwen", rank=1, tp=2), "budget")  # a rank of a TP 2 publication
    from weightcache.seeding import SeedStats

    c.seeding = SeedStats()  # peer seeding (issue 37): one seeded, one fallback, one served
    c.seeding.count("received", ("qwen", 1, 0, "seeded", ""))
    c.seeding.count("received", ("qwen", 1, 0, "fallback", "digest_mismatch"))
    c.seeding.count("received_bytes", "qwen", 4096)
    c.seeding.count("received_seconds", "qwen", 0.25)
    c.seeding.count("served", ("qwen", "served", ""))
    c.seeding.count("served_bytes", "qwen", 8192)
    st = _status([_slab("qwen", "ready", 2048, leases=2), _slab("bad", "failed", 0)])
    fams = _exposition([metrics.Instance(0, True, "active", st, c.record(), configured_slabs=2),
                        metrics.Instance(1, True, "inactive"),
                        metrics.Instance(2, False, "inactive", configured_slabs=0)])
    for name, fam in fams.items():
        assert re.fullmatch(r"weightcache_[a-z0-9_]+", name), name
        kind = metrics.FAMILIES[name.removesuffix("_info") if name.endswith("_info") else name][0]
        # The text format (0.0.4) has no info type: an info family is a gauge named *_info.
        assert fam.type == ("gauge" if kind == "info" else kind), (name, fam.type)
        for s in fam.samples:
            if kind == "counter":
                assert s.name == name + "_total", s.name
    assert len(fams) == len(metrics.FAMILIES)  # every family has a sample with one instance up

    def val(name, **labels):
        fam_name = max((n for n in fams if name.startswith(n)), key=len)  # peer_served_bytes, not peer_served
        (v,) = [s.value for s in fams[fam_name].samples
                if s.name == name and all(s.labels.get(k) == str(x) for k, x in labels.items())]
        return v

    assert val("weightcache_slab_resident_bytes", gpu=0, model="qwen") == 2048
    assert val("weightcache_publishes_total", gpu=0, model="qwen", tp_size=1, tp_rank=0, outcome="published") == 1
    assert val("weightcache_publications_dropped_total", gpu=0, model="qwen", tp_size=1, tp_rank=0,
               reason="digest_mismatch") == 1
    assert val("weightcache_publications_dropped_total", gpu=0, model="qwen", tp_size=2, tp_rank=1,
               reason="budget") == 1
    assert val("weightcache_slab_leases", gpu=0, model="qwen") == 2
    assert val("weightcache_notify_dropped_total", gpu=0, key="FDSTORE") == 1  # the datagrams of a full socket
    assert val("weightcache_notify_dropped_total", gpu=0, key="STATUS") == 3
    assert val("weightcache_slab_state", gpu=0, model="bad", state="failed") == 1
    assert val("weightcache_slab_state", gpu=0, model="bad", state="ready") == 0
    assert val("weightcache_memory_slab_bytes", gpu=0) == 2048
    assert val("weightcache_instance_up", gpu=1) == 0 and val("weightcache_instance_up", gpu=0) == 1
    assert val("weightcache_service_state", gpu=1, state="inactive") == 1
    assert val("weightcache_attaches_total", gpu=0, model="qwen", outcome="daemon") == 1
    assert val("weightcache_attach_duration_seconds_bucket", gpu=0, model="qwen", le="0.0025") == 0
    assert val("weightcache_attach_duration_seconds_bucket", gpu=0, model="qwen", le="0.005") == 1
    assert val("weightcache_start_time_seconds", gpu=0) == 123.0
    assert val("weightcache_peer_seeds_total", gpu=0, model="qwen", outcome="fallback", reason="digest_mismatch") == 1
    assert val("weightcache_peer_seed_bytes_total", gpu=0, model="qwen") == 4096
    assert val("weightcache_peer_seed_seconds_total", gpu=0, model="qwen") == 0.25
    assert val("weightcache_peer_served_bytes_total", gpu=0, model="qwen") == 8192
    # From the configuration: GPU 0 places 2 slabs, GPU 2 is in disabled_gpus (0); GPU 1's was not read.
    assert val("weightcache_configured_slabs", gpu=0) == 2 and val("weightcache_configured_slabs", gpu=2) == 0
    assert {s.labels["gpu"] for s in fams["weightcache_configured_slabs"].samples} == {"0", "2"}
    # The idle instance has no slab, build or memory series at all.
    assert {s.labels["gpu"] for s in fams["weightcache_slab_resident_bytes"].samples} == {"0"}


def _names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bweightcache_[a-z0-9_]+", expr))


def _exposed(name: str) -> bool:
    for fam, (kind, _, _) in metrics.FAMILIES.items():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}.get(
            kind, ("",))
        if name in {fam + s for s in suffixes}:
            return True
    return False


def test_alert_rules_and_dashboard_use_exposed_names():
    rules = (REPO / "examples" / "prometheus" / "weightcache-alerts.yml").read_text()
    exprs = re.findall(r"expr: \|?\n?((?:.+\n)+?)\s+(?:for|labels):", rules)
    assert len(exprs) == 8, exprs
    dashboard = json.loads((REPO / "examples" / "grafana" / "weightcache-dashboard.json").read_text())
    targets = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(targets) >= 6
    for expr in exprs + targets:
        names = _names_in(expr)
        if expr.startswith('up{job="weightcache"}'):  # WeightcacheMetricsEndpointDown: Prometheus' own series
            continue
        assert names, expr
        assert all(_exposed(n) for n in names), (expr, [n for n in names if not _exposed(n)])


def test_every_event_has_a_random_id_and_a_catalog_entry():
    catalog = (REPO / "units" / "weightcache.catalog").read_text()
    assert set(MESSAGE_IDS) == {"serving", "ready", "config_rejected", "loaded", "load_failed", "attached",
                                "released", "evicted", "adopted", "verify", "fallback", "attach_retry", "rejected", "reloaded",
                                "demoted", "promoted", "shelved", "backend", "published", "image_written",
                                "image_read", "image_rejected", "seeded", "seed_fallback", "seed_served",
                                "seed_rejected", "waiting_for_engine", "publication_dropped"}
    assert len(set(MESSAGE_IDS.values())) == len(MESSAGE_IDS)
    for kind, mid in MESSAGE_IDS.items():
        assert re.fullmatch(r"[0-9a-f]{32}", mid) and mid[12] == "4" and mid[16] in "89ab", kind  # a uuid4
        assert re.search(rf"^-- {mid}\nSubject: .+\nDefined-By: weightcache\n", catalog, re.M), kind
    assert len(re.findall(r"^-- [0-9a-f]{32}$", catalog, re.M)) == len(MESSAGE_IDS)


def test_event_fields_hold_numbers_of_their_own():
    fields = event("loaded", "qwen", 1, size_bytes=4096, duration_ms=12.6, tensors=7)
    assert fields == {"MESSAGE_ID": MESSAGE_IDS["loaded"], "WEIGHTCACHE_EVENT": "loaded", "WEIGHTCACHE_MODEL": "qwen",
                      "WEIGHTCACHE_RANK": "1", "WEIGHTCACHE_BYTES": "4096", "WEIGHTCACHE_DURATION_MS": "13",
                      "WEIGHTCACHE_TENSORS": "7"}
    assert event("load_failed", error_code="checkpoint_not_found")["WEIGHTCACHE_ERROR_CODE"] == "checkpoint_not_found"


def test_operations_md_lists_every_event_and_metric():
    ops = (REPO / "docs" / "operations.md").read_text()
    for kind, mid in MESSAGE_IDS.items():
        assert f"| `{kind}` | `{mid}` |" in ops, kind
    for name, (kind, _, _) in metrics.FAMILIES.items():
        shown = name + {"counter": "_total", "info": "_info"}.get(kind, "")
        assert f"| `{shown}` | {kind} |" in ops, shown


def test_promtool_accepts_the_alert_rules():
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus, in the Makefile's APT_PKGS)")
    r = subprocess.run([promtool, "check", "rules", str(REPO / "examples" / "prometheus" / "weightcache-alerts.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS: 8 rules found" in r.stdout, r.stdout + r.stderr


def test_promtool_unit_tests_of_every_alert_rule():
    """examples/prometheus/weightcache-alerts.test.yml: every packaged rule fires in a case of its own; the
    configured-GPU rule fires for a stopped socket and for a missing socket series and is silent for a GPU of
    disabled_gpus (weightcache_configured_slabs 0); the endpoint rule fires for up == 0 and for no target."""
    import shutil
    import subprocess

    import yaml

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus, in the Makefile's APT_PKGS)")
    where = REPO / "examples" / "prometheus"
    rules = yaml.safe_load((where / "weightcache-alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    cases = yaml.safe_load((where / "weightcache-alerts.test.yml").read_text())
    fired = {t["alertname"] for c in cases["tests"] for t in c["alert_rule_test"] if t.get("exp_alerts")}
    assert fired == alerts, (sorted(alerts - fired), sorted(fired - alerts))
    (nots,) = [c for c in cases["tests"] if c["name"] == "configured GPU not serving"]
    gpus = {a["exp_labels"]["gpu"] for t in nots["alert_rule_test"] if t["alertname"].endswith("NotServing")
            for a in t.get("exp_alerts", ())}
    assert gpus == {"1", "3"}  # not 0 (serving) nor 2 (disabled_gpus)
    r = subprocess.run([promtool, "test", "rules", "weightcache-alerts.test.yml"], cwd=where, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_promtool_dcgm_join_rules():
    """examples/prometheus/weightcache-dcgm.yml: the GPU UUID lands on weightcache's per-GPU series, and a query
    joins them with a dcgm-exporter series on (UUID) alone (issue 39: the join needed group_left on build_info)."""
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus, in the Makefile's APT_PKGS)")
    where = REPO / "examples" / "prometheus"
    r = subprocess.run([promtool, "test", "rules", "weightcache-dcgm.test.yml"], cwd=where, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    rules = (where / "weightcache-dcgm.yml").read_text()
    assert all(_exposed(n) for n in _names_in(rules)), _names_in(rules)


def test_gpu_uuid_labels_what_the_instance_reports_and_not_the_outside_series():
    """A CUDA instance's device UUID is a label of every series it reports (so they join dcgm-exporter's UUID
    one-to-one); socket, unit state, answered and configured slabs carry gpu only, the same series whether the
    instance is up (its UUID known) or down (unknown)."""
    c = Counters([_placement("qwen")], started_at=5.0)
    c.answered(protocol.Attach("qwen"), [_Reply(protocol.AttachReply(1, "/srv/qwen", "cuda", 4096))], 0.003)
    st = protocol.ServiceStatus(0, 42, "cuda", protocol.DeviceInfo("cuda", "GPU-5e0c", "9.0"), 1000, 4000,
                                (_slab("qwen", "ready", 2048),), 1, "ready")
    up = _exposition([metrics.Instance(0, True, "active", st, c.record(), configured_slabs=1)])
    down = _exposition([metrics.Instance(0, True, "failed", configured_slabs=1)])
    for name, fam in up.items():
        for s in fam.samples:
            if name in metrics.OUTSIDE:
                assert "gpu_uuid" not in s.labels, s
            else:
                assert s.labels["gpu_uuid"] == "GPU-5e0c", s
    assert set(down) == set(metrics.OUTSIDE)
    assert ({(s.name, tuple(sorted(s.labels.items()))) for n in metrics.OUTSIDE for s in down[n].samples}
            == {(s.name, tuple(sorted(s.labels.items()))) for n in metrics.OUTSIDE for s in up[n].samples})
