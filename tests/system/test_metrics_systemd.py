"""Metrics and the journal under a real systemd 252 (PID 1 of a systemd-nspawn container).

- ``weightcache-metrics.socket`` (TCP 127.0.0.1:9661) activates
  ``weightcache-metrics.service`` on the first scrape; before any instance
  runs it answers with what it knows (sockets listening, services inactive, no
  slabs) and starts none of them.
- Debian's Prometheus server, started here inside the container on a
  loopback port (and killed by ``timeout`` whatever happens), scrapes the
  endpoint; a query through its HTTP API returns the resident bytes of the
  loaded model, equal to ``weightcache status --json``; the alert rules of
  ``examples/prometheus/weightcache-alerts.yml`` load; instances that were
  never started stay inactive through every scrape.
- ``journalctl -u weightcache@0 -o json`` holds each event's MESSAGE_ID with
  its numbers as fields of their own (serving, ready, loaded, load_failed,
  attached, released, verify, adopted, evicted, config_rejected, rejected).

The real all-MiniLM-L6-v2 checkpoint on "GPU" 0 (host backend) and a model
whose checkpoint does not exist (fails). The catalog (``journalctl -x``) needs
the package installed: tests/system/test_packages.py.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.parse

import pytest

from nspawn import REPO
from test_systemd import PYTHON, SYSUSERS_TEST, _as_user, _checkpoint, client

pytestmark = pytest.mark.system

METRICS_URL = "http://127.0.0.1:9661/metrics"
PROM_PORT = 19090
RULES = REPO / "examples" / "prometheus" / "weightcache-alerts.yml"
#: Seconds the test's Prometheus may live (``timeout`` kills it after that whatever happens).
PROM_LIFETIME_S = 240

# urllib inside the container (no curl there): prints the body, or exits 1 with the error.
FETCH = ("import sys, urllib.request\n"
         "try:\n    sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())\n"
         "except Exception as e:\n    sys.exit(f'{type(e).__name__}: {e}')\n")


def _config(ckpt) -> str:
    return ('[service]\nbackend = "host"\n\n'
            f'[models.minilm]\npath = "{ckpt}"\nlayouts = [{{ tp = 1, gpus = [0] }}, {{ tp = 1, gpus = [1] }}]\n\n'
            '[models.broken]\npath = "/srv/no-such-checkpoint"\nlayouts = [{ tp = 1, gpus = [0] }]\n')


def fetch(c, url: str) -> str:
    r = c.run([str(PYTHON), "-c", FETCH, url], check=False, timeout=60)
    assert r.returncode == 0, (url, r.stderr)
    return r.stdout


def sample(text: str, name: str, **labels) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    want = {k: str(v) for k, v in labels.items()}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in want.items()):
                return s.value
    return None


@pytest.fixture(scope="module")
def box(container):
    from weightcache.journal import MESSAGE_IDS

    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed (Debian package prometheus, in the Makefile's APT_PKGS)")
    c = container
    c.ckpt = _checkpoint()
    c.message_ids = MESSAGE_IDS
    c.write("/etc/weightcache/weightcache.toml", _config(c.ckpt))
    c.write("/etc/sysusers.d/weightcache-test.conf", SYSUSERS_TEST)
    c.run(["systemd-sysusers"])
    c.run(["systemctl", "daemon-reload"])
    yield c
    c.run("systemctl stop weightcache-metrics.socket weightcache-metrics.service 'weightcache@*.service' "
          "'weightcache@*.socket'; systemctl reset-failed 'weightcache*'", check=False)


def test_an_idle_node_answers_and_no_instance_is_started(box):
    c = box
    c.run(["systemctl", "start", "weightcache-metrics.socket", "weightcache@0.socket", "weightcache@1.socket"])
    assert c.show("weightcache-metrics.service", "ActiveState") == {"ActiveState": "inactive"}
    text = fetch(c, METRICS_URL)
    assert c.show("weightcache-metrics.service", "ActiveState") == {"ActiveState": "active"}  # socket-activated
    for gpu in (0, 1):
        assert sample(text, "weightcache_socket_listening", gpu=gpu) == 1
        assert sample(text, "weightcache_service_state", gpu=gpu, state="inactive") == 1
        assert sample(text, "weightcache_instance_up", gpu=gpu) == 0
        # Asking for metrics connected to no instance socket: nothing was activated.
        assert c.show(f"weightcache@{gpu}.service", "ActiveState") == {"ActiveState": "inactive"}
    assert sample(text, "weightcache_slab_resident_bytes") is None
    assert c.show("weightcache-metrics.service", "User") == {"User": "weightcache-metrics"}


def test_prometheus_scrapes_the_endpoint(box, tmp_path):
    c = box
    c.run(["systemctl", "start", "weightcache-metrics.socket", "weightcache@0.socket", "weightcache@1.socket"])
    c.run(["systemctl", "start", "weightcache@0.service"])  # GPU 1 stays idle: only its socket listens
    attached = client(c, "alice", 0)
    assert attached["ok"] and attached["source"] == "daemon", attached
    r = c.run([str(PYTHON), "-m", "weightcache", "status", "--json", "--gpu", "0"], check=False, timeout=60)
    (st,) = json.loads(r.stdout)["gpus"]
    resident = next(sl["resident_bytes"] for sl in st["slabs"] if sl["model"] == "minilm")
    assert resident > 0

    c.write("/var/tmp/prom/prometheus.yml",
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {RULES}\n"
            "scrape_configs:\n  - job_name: weightcache\n    static_configs:\n"
            "      - targets: ['127.0.0.1:9661']\n")
    prom = c.popen(["timeout", "-k", "5", str(PROM_LIFETIME_S), "prometheus",
                    "--config.file=/var/tmp/prom/prometheus.yml", "--storage.tsdb.path=/var/tmp/prom/data",
                    f"--web.listen-address=127.0.0.1:{PROM_PORT}"])
    try:
        query = urllib.parse.quote('weightcache_slab_resident_bytes{gpu="0",model="minilm"}')
        deadline, result = time.monotonic() + 90, []
        while time.monotonic() < deadline:
            r = c.run([str(PYTHON), "-c", FETCH, f"http://127.0.0.1:{PROM_PORT}/api/v1/query?query={query}"],
                      check=False, timeout=60)
            if r.returncode == 0:
                result = json.loads(r.stdout)["data"]["result"]
                if result:
                    break
            assert prom.poll() is None, prom.stderr.read()[-3000:]
            time.sleep(0.5)
        assert len(result) == 1, result
        assert result[0]["metric"]["job"] == "weightcache" and result[0]["metric"]["tp_rank"] == "0", result
        assert float(result[0]["value"][1]) == resident

        rules = json.loads(fetch(c, f"http://127.0.0.1:{PROM_PORT}/api/v1/rules"))["data"]["groups"]
        loaded = {rule["name"]: rule["health"] for g in rules for rule in g["rules"]}
        # Every rule of the file is loaded (issue 26 added WeightcacheConfigRejected and WeightcacheRestarting).
        in_file = re.findall(r"^\s*- alert: (\w+)$", RULES.read_text(), re.M)
        assert {"WeightcacheConfigRejected", "WeightcacheRestarting", "WeightcacheSlabFailed"} <= set(in_file)
        assert set(loaded) == set(in_file), loaded
        # The failed model is what the first rule is about: its expression matches now.
        failed = json.loads(fetch(c, f"http://127.0.0.1:{PROM_PORT}/api/v1/query?query="
                                     + urllib.parse.quote('weightcache_slab_state{state="failed"} == 1')))
        assert [m["metric"]["model"] for m in failed["data"]["result"]] == ["broken"], failed
    finally:
        prom.terminate()
        prom.wait(timeout=30)
    # Every scrape asked only the running instance: GPU 1 was never started.
    assert c.show("weightcache@1.service", "ActiveState") == {"ActiveState": "inactive"}


def _entries(c, kind: str, pid: str | None = None, want: int = 1, timeout: float = 10) -> list[dict]:
    match = [f"MESSAGE_ID={c.message_ids[kind]}"] + ([f"_PID={pid}"] if pid else [])
    deadline = time.monotonic() + timeout
    while True:
        r = c.run(["journalctl", "-u", "weightcache@0", "-o", "json", "--no-pager", *match], check=False)
        entries = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
        if len(entries) >= want or time.monotonic() > deadline:
            return entries
        time.sleep(0.2)


def _numbers(entry: dict, *fields: str) -> dict[str, int]:
    """The fields as integers; int() fails on anything but a plain number."""
    return {f: int(entry[f]) for f in fields}


def test_journal_events_carry_message_ids_and_numbers(box):
    c, unit = box, "weightcache@0.service"
    c.run(["systemctl", "start", "weightcache@0.socket", unit])
    pid = c.show(unit, "MainPID")["MainPID"]
    assert good_attach(client(c, "alice", 0))  # attached, then released when the client exits
    c.run([str(PYTHON), "-m", "weightcache", "verify", "minilm", "--gpu", "0"], timeout=60)
    # A frame that is not JSON: the service refuses it (protocol_violation) and goes on.
    c.run(_as_user("alice", str(PYTHON), "-c",
                   "import socket, struct\ns = socket.socket(socket.AF_UNIX)\ns.connect('/run/weightcache/0.sock')\n"
                   "s.sendall(struct.pack('>I', 3) + b'{{{')\ns.recv(4096)\n"), timeout=60)

    loaded = _entries(c, "loaded", pid)[0]
    assert _numbers(loaded, "WEIGHTCACHE_BYTES", "WEIGHTCACHE_DURATION_MS", "WEIGHTCACHE_TENSORS")[
        "WEIGHTCACHE_TENSORS"] == 104
    failed = _entries(c, "load_failed", pid)[0]
    assert failed["WEIGHTCACHE_MODEL"] == "broken" and failed["WEIGHTCACHE_ERROR_CODE"] == "checkpoint_not_found"
    assert _numbers(_entries(c, "serving", pid)[0], "WEIGHTCACHE_SLABS") == {"WEIGHTCACHE_SLABS": 2}
    ready = _entries(c, "ready", pid)[0]
    assert _numbers(ready, "WEIGHTCACHE_SLABS", "WEIGHTCACHE_FAILED") == {"WEIGHTCACHE_SLABS": 1,
                                                                         "WEIGHTCACHE_FAILED": 1}
    assert int(ready["WEIGHTCACHE_BYTES"]) == int(_entries(c, "attached", pid)[0]["WEIGHTCACHE_BYTES"]) > 0
    _numbers(_entries(c, "attached", pid)[0], "WEIGHTCACHE_LEASE", "WEIGHTCACHE_PEER_PID")
    _numbers(_entries(c, "released", pid)[0], "WEIGHTCACHE_DURATION_MS", "WEIGHTCACHE_LEASE")
    verify = _entries(c, "verify", pid)[0]
    assert _numbers(verify, "WEIGHTCACHE_TENSORS", "WEIGHTCACHE_MISMATCHED", "WEIGHTCACHE_DURATION_MS")[
        "WEIGHTCACHE_MISMATCHED"] == 0
    assert _entries(c, "rejected", pid)[0]["WEIGHTCACHE_ERROR_CODE"] == "protocol_violation"

    c.run(["systemctl", "restart", unit])  # the slab comes back from the fd store
    pid = c.show(unit, "MainPID")["MainPID"]
    adopted = _entries(c, "adopted", pid)[0]
    assert int(adopted["WEIGHTCACHE_BYTES"]) == int(ready["WEIGHTCACHE_BYTES"])
    # Adopted after a restart: its leases are unknown, so evict needs --force (issue 26).
    c.run([str(PYTHON), "-m", "weightcache", "evict", "--force", "minilm", "--gpu", "0"], timeout=60)
    assert int(_entries(c, "evicted", pid)[0]["WEIGHTCACHE_BYTES"]) == int(ready["WEIGHTCACHE_BYTES"])

    c.write("/etc/weightcache/weightcache.toml", _config(c.ckpt).replace("[service]\n", "[service]\nbakend = 1\n"))
    try:
        c.run(["systemctl", "restart", unit])  # a typo does not fail the unit: it serves on and says why
        rejected = _entries(c, "config_rejected")
        assert rejected and rejected[-1]["WEIGHTCACHE_ERROR_CODE"] == "config_invalid", rejected
        assert rejected[-1]["WEIGHTCACHE_CONFIG_KEY"] == "service.bakend", rejected
    finally:
        c.write("/etc/weightcache/weightcache.toml", _config(c.ckpt))


def good_attach(answer: dict) -> bool:
    return answer.get("ok") is True and answer.get("source") == "daemon" and answer.get("equal") is True


# HTTPS inside the container: prints the status and the body (or the error), never raises.
FETCH_TLS = ("import base64, ssl, sys, urllib.error, urllib.request\n"
             "req = urllib.request.Request(sys.argv[1])\n"
             "if len(sys.argv) > 3:\n"
             "    req.add_header('Authorization', 'Basic ' + base64.b64encode(sys.argv[3].encode()).decode())\n"
             "ctx = ssl.create_default_context(cafile=sys.argv[2])\n"
             "try:\n    r = urllib.request.urlopen(req, timeout=30, context=ctx)\n"
             "    print(r.status); sys.stdout.write(r.read().decode())\n"
             "except urllib.error.HTTPError as e:\n    print(e.code); sys.stdout.write(e.read().decode())\n")


def test_the_sandboxed_endpoint_serves_tls_with_basic_auth(box, tmp_path):
    """``[metrics] web_config`` under the packaged unit: weightcache-metrics (its own user, no device, no
    network namespace of its own to create sockets in) reads the key through its group, answers 401 without
    credentials and the exposition with them, over TLS on the socket systemd passes."""
    bcrypt = pytest.importorskip("bcrypt", reason="bcrypt is in the test extra")
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (Debian package openssl, in the Makefile's APT_PKGS)")
    import subprocess

    c = box
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(tmp_path / "k"), "-out", str(tmp_path / "c"), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-days", "2"], check=True, capture_output=True)
    c.write("/etc/weightcache/metrics.crt", (tmp_path / "c").read_text())
    c.write("/etc/weightcache/metrics.key", (tmp_path / "k").read_text(), 0o640)
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()
    c.write("/etc/weightcache/web-config.yml", "tls_server_config:\n  cert_file: metrics.crt\n  key_file: metrics.key\n"
                                               f"basic_auth_users:\n  prometheus: '{hashed}'\n", 0o640)
    c.run(["chown", "root:weightcache-metrics", "/etc/weightcache/metrics.key", "/etc/weightcache/web-config.yml"])
    c.write("/etc/weightcache/weightcache.toml",
            _config(c.ckpt) + '\n[metrics]\nweb_config = "/etc/weightcache/web-config.yml"\n')
    url, ca = "https://127.0.0.1:9661/metrics", "/etc/weightcache/metrics.crt"
    try:
        c.run("systemctl stop weightcache-metrics.service; systemctl restart weightcache-metrics.socket")
        r = c.run([str(PYTHON), "-c", FETCH_TLS, url, ca], check=False, timeout=60)
        assert r.stdout.startswith("401\n") and "weightcache_" not in r.stdout, (r.stdout, r.stderr)
        r = c.run([str(PYTHON), "-c", FETCH_TLS, url, ca, "prometheus:s3cret"], check=False, timeout=60)
        assert r.stdout.startswith("200\n") and "weightcache_socket_listening{" in r.stdout, (r.stdout, r.stderr)
        assert c.show("weightcache-metrics.service", "ActiveState") == {"ActiveState": "active"}
    finally:
        c.write("/etc/weightcache/weightcache.toml", _config(c.ckpt))
        c.run("systemctl stop weightcache-metrics.service; systemctl restart weightcache-metrics.socket", check=False)
