"""The metrics endpoint over TLS with basic authentication (``[metrics] web_config``, Prometheus' web config file).

``weightcache serve-metrics`` runs as a process of its own with a config whose ``[metrics] web_config`` names a
web config file (``tls_server_config`` with a certificate made here by ``openssl``, ``basic_auth_users`` with a
bcrypt hash in htpasswd's ``$2y$`` form). Debian's Prometheus server (package ``prometheus``, in the Makefile's
apt list) scrapes it four ways: over TLS with the right credentials (up, the series arrive), without
credentials and with a wrong password (down, HTTP 401), and in plain HTTP (down). The endpoint is also asked
directly: 401 and ``WWW-Authenticate`` without credentials, the exposition with them, and a web config it does
not fully understand stops it before it listens, naming the file and the key.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from weightcache.errors import ConfigError

bcrypt = pytest.importorskip("bcrypt", reason="bcrypt is in the test extra (pip install -e '.[test]')")

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
OPENSSL = shutil.which("openssl")
PASSWORD = "scrape-s3cret"
#: Seconds the test's Prometheus may run (``timeout`` kills it whatever happens).
PROM_LIFETIME_S = 180

pytestmark = pytest.mark.timeout(240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _self_signed(tmp_path: Path, name: str) -> None:
    """``<name>.crt`` and ``<name>.key`` in ``tmp_path``: a self-signed P-256 certificate for 127.0.0.1."""
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(tmp_path / f"{name}.key"), "-out", str(tmp_path / f"{name}.crt"),
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-days", "2"],
                   check=True, capture_output=True)


@pytest.fixture
def tls_endpoint(tmp_path):
    """A serve-metrics process with TLS and basic auth; yields (port, CA file, tmp_path)."""
    yield from _endpoint(tmp_path)


def _endpoint(tmp_path: Path, more_tls: str = ""):
    """Starts serve-metrics with TLS (``more_tls``: further ``tls_server_config`` lines) and basic auth; yields
    (port, CA file, tmp_path); kills it after."""
    if OPENSSL is None:
        pytest.skip("openssl is not installed (Debian package openssl, in the Makefile's APT_PKGS)")
    _self_signed(tmp_path, "metrics")
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
    hashed = "$2y$" + hashed[4:]  # as `htpasswd -nBC 10` writes it
    # Relative file names: to the web config file's directory, as exporter-toolkit reads them.
    (tmp_path / "web-config.yml").write_text("tls_server_config:\n  cert_file: metrics.crt\n  key_file: metrics.key\n"
                                             f"{more_tls}basic_auth_users:\n  prometheus: '{hashed}'\n")
    (tmp_path / "weightcache.toml").write_text(f'[metrics]\nweb_config = "{tmp_path}/web-config.yml"\n\n'
                                               '[models.m]\npath = "/srv/models/m"\nlayouts = [{ tp = 1, gpus = [0] }]\n')
    (tmp_path / "sock").mkdir()
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "weightcache", "serve-metrics", "--config",
                             str(tmp_path / "weightcache.toml"), "--socket-dir", str(tmp_path / "sock"),
                             "--listen", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "serve-metrics did not listen within 60 s"
                time.sleep(0.1)
        yield port, tmp_path / "metrics.crt", tmp_path
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def _get(port: int, ca: Path, auth: tuple[str, str] | None, ctx: ssl.SSLContext | None = None) -> tuple[int, dict, str]:
    req = urllib.request.Request(f"https://127.0.0.1:{port}/metrics")
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    ctx = ctx or ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def test_credentials_are_required_over_tls(tls_endpoint):
    port, ca, _ = tls_endpoint
    code, headers, body = _get(port, ca, None)
    assert code == 401 and headers["WWW-Authenticate"].startswith('Basic realm="weightcache metrics"'), (code, headers)
    assert "weightcache_" not in body
    assert _get(port, ca, ("prometheus", "wrong"))[0] == 401
    assert _get(port, ca, ("nobody", PASSWORD))[0] == 401
    code, _, body = _get(port, ca, ("prometheus", PASSWORD))
    assert code == 200 and 'weightcache_configured_slabs{gpu="0"} 1.0' in body, body
    # Plain HTTP to the TLS port gets no HTTP answer, and the endpoint keeps serving.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert not s.recv(4096).startswith(b"HTTP/")
    assert _get(port, ca, ("prometheus", PASSWORD))[0] == 200


def test_an_unknown_user_or_a_wrong_password_after_a_good_one_is_refused(tls_endpoint):
    """An unknown user is refused whatever its password, the empty one included (its bcrypt check runs against a
    hash of the empty password only to take the time a known user's does); a good password's cached check does
    not let a wrong password of the same user in."""
    port, ca, _ = tls_endpoint
    for auth in (("nobody", ""), ("", ""), ("nobody", PASSWORD)):
        code, _, body = _get(port, ca, auth)
        assert code == 401 and "weightcache_" not in body, (auth, code)
    assert _get(port, ca, ("prometheus", PASSWORD))[0] == 200
    for wrong in ("", "wrong", PASSWORD + "x"):
        assert _get(port, ca, ("prometheus", wrong))[0] == 401, wrong
    assert _get(port, ca, ("prometheus", PASSWORD))[0] == 200


def test_a_refused_request_gets_the_401_alone_on_its_connection(tls_endpoint):
    """Everything the endpoint writes on a connection whose request has no valid credentials is the 401: no
    exposition follows it (read raw until the endpoint closes, beyond the 401's Content-Length)."""
    port, ca, _ = tls_endpoint
    ctx = ssl.create_default_context(cafile=str(ca))
    for auth in ("", "Authorization: Basic " + base64.b64encode(b"prometheus:wrong").decode() + "\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(f"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n{auth}\r\n".encode())
            got = b""
            while chunk := s.recv(65536):
                got += chunk
        assert got.startswith(b"HTTP/1.0 401 ") and got.count(b"HTTP/1.") == 1, got[:300]
        assert b"weightcache_" not in got, got[-300:]


def test_client_certificates_and_the_minimum_tls_version_are_enforced(tmp_path):
    """``client_auth_type: RequireAndVerifyClientCert`` with ``client_ca_file`` and ``min_version: TLS13``: a client
    without a certificate, or one that speaks at most TLS 1.2, gets no answer; one with the certificate over TLS
    1.3 and the password gets the exposition."""
    if OPENSSL is None:
        pytest.skip("openssl is not installed (Debian package openssl, in the Makefile's APT_PKGS)")
    _self_signed(tmp_path, "client")
    more = "  min_version: TLS13\n  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: client.crt\n"
    gen = _endpoint(tmp_path, more)
    port, ca, _ = next(gen)
    try:
        def client(cert: bool, max_version: ssl.TLSVersion = ssl.TLSVersion.MAXIMUM_SUPPORTED) -> ssl.SSLContext:
            ctx = ssl.create_default_context(cafile=str(ca))
            ctx.maximum_version = max_version
            if cert:
                ctx.load_cert_chain(str(tmp_path / "client.crt"), str(tmp_path / "client.key"))
            return ctx

        code, _, body = _get(port, ca, ("prometheus", PASSWORD), client(True))
        assert code == 200 and "weightcache_" in body, code
        for ctx in (client(False), client(True, ssl.TLSVersion.TLSv1_2)):
            with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
                _get(port, ca, ("prometheus", PASSWORD), ctx)
        assert _get(port, ca, ("prometheus", PASSWORD), client(True))[0] == 200  # still serving
    finally:
        gen.close()


def test_prometheus_scrapes_over_tls_with_basic_auth(tls_endpoint):
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian package prometheus, in the Makefile's APT_PKGS)")
    port, ca, tmp = tls_endpoint
    prom_port = _free_port()
    jobs = {"weightcache": f"    scheme: https\n    tls_config:\n      ca_file: {ca}\n"
                           f"    basic_auth:\n      username: prometheus\n      password: {PASSWORD}\n",
            "no-credentials": f"    scheme: https\n    tls_config:\n      ca_file: {ca}\n",
            "wrong-password": f"    scheme: https\n    tls_config:\n      ca_file: {ca}\n"
                              "    basic_auth:\n      username: prometheus\n      password: guessed\n",
            "plain-http": "    scheme: http\n"}
    (tmp / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
        + "".join(f"  - job_name: {job}\n{conf}    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
                  for job, conf in jobs.items()))
    prom = subprocess.Popen(["timeout", "-k", "5", str(PROM_LIFETIME_S), PROMETHEUS,
                             f"--config.file={tmp}/prometheus.yml", f"--storage.tsdb.path={tmp}/prom-data",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def api(path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/{path}", timeout=30) as r:
            return json.loads(r.read())["data"]

    try:
        deadline, targets = time.monotonic() + 120, {}
        while time.monotonic() < deadline:
            assert prom.poll() is None, prom.stderr.read()[-3000:]
            try:
                targets = {t["labels"]["job"]: t for t in api("targets")["activeTargets"]}
            except OSError:
                targets = {}
            if len(targets) == 4 and all(t["health"] != "unknown" for t in targets.values()):
                break
            time.sleep(0.5)
        assert len(targets) == 4, targets
        assert targets["weightcache"]["health"] == "up", targets["weightcache"]
        for job in ("no-credentials", "wrong-password"):
            assert targets[job]["health"] == "down" and "401" in targets[job]["lastError"], targets[job]
        assert targets["plain-http"]["health"] == "down", targets["plain-http"]
        query = urllib.parse.quote('weightcache_configured_slabs{gpu="0"}')
        deadline, result = time.monotonic() + 60, []
        while time.monotonic() < deadline and not result:
            result = api(f"query?query={query}")["result"]
            time.sleep(0.2)
        assert [r["metric"]["job"] for r in result] == ["weightcache"], result  # only the job with credentials
        assert float(result[0]["value"][1]) == 1.0
    finally:
        os.killpg(prom.pid, 9)
        prom.wait()


def test_an_unsupported_key_stops_the_endpoint_before_it_listens(tmp_path):
    (tmp_path / "web-config.yml").write_text("tls_server_config:\n  cert_file: c.crt\n  key_file: c.key\n"
                                             "  cipher_suites: [TLS_AES_128_GCM_SHA256]\n")
    (tmp_path / "weightcache.toml").write_text(f'[metrics]\nweb_config = "{tmp_path}/web-config.yml"\n')
    r = subprocess.run([sys.executable, "-m", "weightcache", "serve-metrics", "--config",
                        str(tmp_path / "weightcache.toml"), "--listen", f"127.0.0.1:{_free_port()}"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode != 0
    assert f"{tmp_path}/web-config.yml: tls_server_config.cipher_suites: not supported" in r.stderr, r.stderr


def test_web_config_errors_name_file_and_key(tmp_path):
    from weightcache.metrics_web import load_web_config

    web = tmp_path / "web.yml"
    web.write_text("basic_auth_users:\n  prometheus: plaintext-password\n")
    with pytest.raises(ConfigError, match=r"web.yml: basic_auth_users.prometheus: not a bcrypt hash"):
        load_web_config(str(web))
    web.write_text("tls_server_config:\n  cert_file: missing.crt\n  key_file: missing.key\n")
    with pytest.raises(ConfigError, match=r"tls_server_config.cert_file: cannot load the certificate "
                                          + str(tmp_path) + "/missing.crt"):
        load_web_config(str(web))
    web.write_text("http_server_config:\n  http2: false\n")
    with pytest.raises(ConfigError, match=r"web.yml: http_server_config: not supported"):
        load_web_config(str(web))


def test_a_changed_password_applies_without_a_restart(tmp_path):
    import base64

    from weightcache.metrics_web import WebConfigFile

    def header(pw: str) -> str:
        return "Basic " + base64.b64encode(f"prometheus:{pw}".encode()).decode()

    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: '{bcrypt.hashpw(b'one', bcrypt.gensalt(4)).decode()}'\n")
    wf = WebConfigFile(str(web))
    assert wf.current().authorized(header("one")) and not wf.current().authorized(header("two"))
    web.write_text(f"basic_auth_users:\n  prometheus: '{bcrypt.hashpw(b'two', bcrypt.gensalt(4)).decode()}'\n"
                   "# changed\n")
    wf._checked = float("-inf")  # the next connection looks at the files (at most once a second otherwise)
    assert wf.current().authorized(header("two")) and not wf.current().authorized(header("one"))
    web.write_text("basic_auth_users: [not, a, mapping]\n# broken\n")
    wf._checked = float("-inf")
    assert wf.current().authorized(header("two"))  # a file that does not load keeps the last good one


def test_check_config_reports_the_web_config(tls_endpoint):
    _, _, tmp = tls_endpoint
    r = subprocess.run([sys.executable, "-m", "weightcache", "check-config", "--config", str(tmp / "weightcache.toml"),
                        "--as-user", "root"], capture_output=True, text=True, timeout=120, check=False)
    assert f"metrics endpoint: web_config={tmp}/web-config.yml: TLS, basic_auth_users=1" in r.stdout, r.stdout
    (tmp / "web-config.yml").write_text("basic_auth_users:\n  prometheus: clear-text\n")
    r = subprocess.run([sys.executable, "-m", "weightcache", "check-config", "--config", str(tmp / "weightcache.toml"),
                        "--as-user", "root"], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0
    assert (f"error: [metrics] web_config: {tmp}/web-config.yml: basic_auth_users.prometheus: not a bcrypt hash"
            in r.stderr), r.stderr


def test_connections_that_never_shake_hands_do_not_refuse_the_scrape(tls_endpoint, tmp_path):
    """Slots over TLS: connections that never start the TLS handshake (any user can open them) hold slots as
    connections that never send a request do; the scrape takes the slot of the one waiting longest."""
    import threading

    from weightcache import metrics, metrics_http
    from weightcache.metrics_web import WebConfigFile

    _, ca, tmp = tls_endpoint
    listener = metrics_http.bind("127.0.0.1:0")
    server = metrics_http.MetricsServer(listener, metrics.registry(str(tmp_path), lambda: [0], 5.0),
                                        max_connections=2, budget_s=30.0,
                                        web=WebConfigFile(str(tmp / "web-config.yml")))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = listener.getsockname()[1]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(2)]
    try:
        code, _, body = _get(port, ca, ("prometheus", PASSWORD))
        assert code == 200 and 'weightcache_socket_listening{gpu="0"} 0.0' in body
        assert idle[0].recv(100) == b""  # cut: its slot went to the scrape
    finally:
        for s in idle:
            s.close()
        server.shutdown()
        listener.close()
