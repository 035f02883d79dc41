"""The metrics endpoint's web configuration: TLS and basic authentication, in Prometheus' own file format.

``[metrics] web_config = "/etc/weightcache/web-config.yml"`` names a file in the format of the Prometheus
exporters' ``--web.config.file`` (exporter-toolkit; node_exporter, Prometheus itself), which an operator of
a fleet already writes::

    tls_server_config:
      cert_file: /etc/weightcache/metrics.crt       # PEM; relative paths: to this file's directory
      key_file: /etc/weightcache/metrics.key
      client_auth_type: RequireAndVerifyClientCert  # optional, with client_ca_file (mutual TLS)
      client_ca_file: /etc/weightcache/scrapers-ca.crt
      min_version: TLS12                            # TLS10 .. TLS13 (default TLS12)
    basic_auth_users:                               # user: bcrypt hash (htpasswd -nBC 10 "" | tr -d ':\\n')
      prometheus: $2y$10$...

Read here: ``tls_server_config`` (``cert_file``, ``key_file``, ``client_auth_type``, ``client_ca_file``,
``min_version``, ``max_version``) and ``basic_auth_users``. Any other key (``cipher_suites``,
``curve_preferences`` and ``http_server_config``, whose Go names do not map onto Python's :mod:`ssl`,
or a misspelling) is refused naming the key: a file meant for a stricter server must not be served
more loosely. Parsed with PyYAML; bcrypt hashes checked with ``bcrypt`` (Debian: python3-yaml,
python3-bcrypt), imported only when a web config is set.

:class:`WebConfigFile` re-reads the file, and the certificate and key it names, when one of them changes
(checked at most once a second, at a connection), as exporter-toolkit does, so a renewed certificate or a
changed password applies without a restart; a changed file that does not load keeps the last good one
(logged). A successful password check is cached (its SHA-256 with the user and the hash), since bcrypt
costs tens of milliseconds a check and Prometheus scrapes every few seconds.

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client, weightcache.pipeline.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import re
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

log = logging.getLogger(__name__)

#: exporter-toolkit's ``client_auth_type`` values -> Python's ``verify_mode`` (None: refused here).
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
#: ``min_version`` / ``max_version`` names -> :class:`ssl.TLSVersion`.
TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1, "TLS12": ssl.TLSVersion.TLSv1_2,
                "TLS13": ssl.TLSVersion.TLSv1_3}
TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version")
TOP_KEYS = ("tls_server_config", "basic_auth_users")
#: A bcrypt hash as htpasswd -B, Go's bcrypt and Python's bcrypt write it.
BCRYPT_RE = re.compile(r"^\$2[aby]?\$\d\d\$[./A-Za-z0-9]{53}$")
#: Seconds between two looks at the files' modification times.
RECHECK_S = 1.0
#: Successful checks remembered (oldest forgotten first).
AUTH_CACHE_SIZE = 256
REALM = "weightcache metrics"


def _bcrypt():
    try:
        import bcrypt
    except ImportError:
        raise ConfigError("basic_auth_users needs the bcrypt module (Debian: apt install python3-bcrypt; "
                          "pip: bcrypt)", key="basic_auth_users") from None
    return bcrypt


@dataclass
class WebConfig:
    """One loaded web configuration file.

    Attributes:
        path (`str`): the file.
        ssl_context (`ssl.SSLContext | None`): a server context with the certificate loaded; None: plain HTTP.
        users (`dict[str, bytes]`): user -> bcrypt hash (ASCII bytes); empty: no authentication.
        files (`tuple[str, ...]`): the file and those it names (certificate, key, client CA), absolute.
    """

    path: str
    ssl_context: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    _ok: dict[bytes, None] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _dummy: bytes = field(default=b"", repr=False)

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header value passes ``basic_auth_users`` (always, when none is set).

        An unknown user costs a bcrypt check too (against a hash of no user), so the time taken does not
        tell which users exist.
        """
        if not self.users:
            return True
        if not header or header[:6].lower() != "basic ":
            return False
        try:
            user, sep, password = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        if not sep:
            return False
        hashed = self.users.get(user)
        key = hashlib.sha256(b"\0".join([user.encode(), hashed or b"", password.encode()])).digest()
        with self._lock:
            if hashed is not None and key in self._ok:
                return True
        bcrypt = _bcrypt()
        if hashed is None:
            if not self._dummy:
                self._dummy = bcrypt.hashpw(b"", bcrypt.gensalt(10))
            bcrypt.checkpw(password.encode(), self._dummy)
            return False
        if not bcrypt.checkpw(password.encode(), hashed):
            return False
        with self._lock:
            self._ok[key] = None
            while len(self._ok) > AUTH_CACHE_SIZE:
                self._ok.pop(next(iter(self._ok)))
        return True


def _err(path: str, key: str, msg: str) -> ConfigError:
    return ConfigError(f"{path}: {key}: {msg}", file=path, key=key)


def _file(path: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _err(path, key, f"expected a file name, got {value!r}")
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), value))


def _tls(path: str, table: Any) -> tuple[ssl.SSLContext, list[str]]:
    if not isinstance(table, dict):
        raise _err(path, "tls_server_config", "must be a mapping (cert_file, key_file, ...)")
    for key in table:
        if key not in TLS_KEYS:
            raise _err(path, f"tls_server_config.{key}", f"not supported by weightcache's endpoint (read: "
                                                         f"{', '.join(TLS_KEYS)}); remove it, or the endpoint "
                                                         "would serve with less than the file asks")
    for key in ("cert_file", "key_file"):
        if key not in table:
            raise _err(path, f"tls_server_config.{key}", "missing: TLS needs both cert_file and key_file")
    cert = _file(path, "tls_server_config.cert_file", table["cert_file"])
    key = _file(path, "tls_server_config.key_file", table["key_file"])
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    files = [cert, key]
    for name, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        v = table.get(name, default)
        if v not in TLS_VERSIONS:
            raise _err(path, f"tls_server_config.{name}", f"{v!r} is not one of {', '.join(TLS_VERSIONS)}")
        setattr(ctx, "minimum_version" if name == "min_version" else "maximum_version", TLS_VERSIONS[v])
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise _err(path, "tls_server_config.cert_file", f"cannot load the certificate {cert} with the key {key}: "
                                                        f"{e} (the endpoint's user, weightcache-metrics, must be "
                                                        "able to read both)") from None
    auth = table.get("client_auth_type", "NoClientCert")
    if auth not in CLIENT_AUTH:
        raise _err(path, "tls_server_config.client_auth_type",
                   f"{auth!r} is not one of {', '.join(CLIENT_AUTH)}")
    ctx.verify_mode = CLIENT_AUTH[auth]
    if "client_ca_file" in table:
        ca = _file(path, "tls_server_config.client_ca_file", table["client_ca_file"])
        try:
            ctx.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as e:
            raise _err(path, "tls_server_config.client_ca_file", f"cannot load {ca}: {e}") from None
        files.append(ca)
    elif auth != "NoClientCert":
        raise _err(path, "tls_server_config.client_ca_file", f"missing: client_auth_type {auth} verifies "
                                                             "client certificates against client_ca_file")
    return ctx, files


def load_web_config(path: str) -> WebConfig:
    """Reads and checks a web configuration file (see the module docstring for the keys).

    Args:
        path (`str`): the file (``[metrics] web_config``).

    Returns:
        `WebConfig`: its TLS context (certificate and key loaded) and its users.

    Raises:
        ConfigError (`config_invalid`): the file is missing, unreadable or not YAML; an unknown key; a
            certificate or key that does not load; a ``basic_auth_users`` entry that is not a bcrypt hash;
            PyYAML or bcrypt not installed. The message names the file and the key.
    """
    try:
        import yaml
    except ImportError:
        raise _err(path, "metrics.web_config", "reading a web config file needs PyYAML (Debian: apt install "
                                               "python3-yaml; pip: PyYAML)") from None
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise _err(path, "metrics.web_config", f"cannot read it: {e.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise _err(path, "metrics.web_config", f"not valid YAML: {e}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise _err(path, "metrics.web_config", "must be a mapping (tls_server_config, basic_auth_users)")
    for key in data:
        if key not in TOP_KEYS:
            raise _err(path, str(key), f"not supported by weightcache's endpoint (read: {', '.join(TOP_KEYS)}); "
                                       "remove it, or the endpoint would serve with less than the file asks")
    cfg = WebConfig(path=path, files=(os.path.abspath(path),))
    if data.get("tls_server_config") is not None:
        cfg.ssl_context, named = _tls(path, data["tls_server_config"])
        cfg.files += tuple(named)
    users = data.get("basic_auth_users") or {}
    if not isinstance(users, dict):
        raise _err(path, "basic_auth_users", "must be a mapping of user: bcrypt hash")
    for user, hashed in users.items():
        if not isinstance(user, str) or not user or ":" in user:
            raise _err(path, f"basic_auth_users.{user}", "a user name is a non-empty string without ':'")
        if not isinstance(hashed, str) or not BCRYPT_RE.match(hashed):
            raise _err(path, f"basic_auth_users.{user}", "not a bcrypt hash ($2y$10$..., 60 characters: "
                                                         "htpasswd -nBC 10 USER, the part after ':')")
        cfg.users[user] = hashed.encode("ascii")
    if cfg.users:
        _bcrypt()
        if cfg.ssl_context is None:
            log.warning("metrics web config %s: basic_auth_users without tls_server_config: passwords cross the "
                        "network in clear text", path)
    return cfg


class WebConfigFile:
    """The web configuration in force, re-read when its files change (see the module docstring).

    Args:
        path (`str`): the file; loaded at once.

    Raises:
        ConfigError: as :func:`load_web_config`, for the first load only.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._cfg = load_web_config(path)
        self._stamp = self._stamps(self._cfg.files)
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    @staticmethod
    def _stamps(files: tuple[str, ...]) -> tuple:
        out = []
        for f in files:
            try:
                st = os.stat(f)
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def current(self) -> WebConfig:
        """The configuration to use for a new connection: reloaded first if a file changed."""
        now = time.monotonic()
        with self._lock:
            if now - self._checked < RECHECK_S:
                return self._cfg
            self._checked = now
            stamp = self._stamps(self._cfg.files)
            if stamp == self._stamp:
                return self._cfg
            self._stamp = stamp
            try:
                cfg = load_web_config(self.path)
            except ConfigError as e:
                log.error("metrics web config not reloaded, the last good one stays in force: %s", e.message)
                return self._cfg
            self._cfg, self._stamp = cfg, self._stamps(cfg.files)
            log.info("metrics web config reloaded path=%s tls=%s users=%d", self.path,
                     cfg.ssl_context is not None, len(cfg.users))
            return cfg


__all__ = ["CLIENT_AUTH", "REALM", "TLS_VERSIONS", "WebConfig", "WebConfigFile", "load_web_config"]
