"""Shared helpers for integration tests: a live service subprocess and its figures.

The service runs as a real subprocess (``python -m weightcache serve``) on a
Unix socket in ``tmp_path``; tests talk to it over real sockets and receive
real fds. Nothing here sleeps for a fixed time to "let things settle": every
wait polls an observable state (``status`` replies, ``/proc``) until a
deadline, and fails with the service's log if the deadline passes.

Fixtures:

- ``daemon``: a factory, ``daemon(models_or_config, backend="host", gpu=0)``
  -> :class:`ServiceProcess` (``.socket_dir``, ``.proc``, ``.pid``,
  ``.stop()``, ``.kill()``, ``.restart()``, ``.status()``,
  ``.snapshot()``...). Every service started through it is killed at the end
  of the test.
- ``module_daemon``: the same factory, module-scoped (one service shared by
  several tests of a module).

Plain functions: :func:`start_service`, :func:`poll_until` (the one deadline loop: every wait of the
tests goes through it), :func:`record_figures`, :func:`proc_fds`, :func:`proc_rss_bytes`,
:func:`blocked_torch_env`, :func:`torch_import_attempts`. Checkpoints are ``tests/checkpoints.py``'s
(:func:`write_checkpoint`, :func:`llama_checkpoint`, :func:`big_checkpoint`, :func:`read_checkpoint`,
:func:`compare_bytes`, :func:`minilm_path`); raw frames ``tests/wire_helpers.py``'s (:func:`raw_connect`,
:func:`frame`, :func:`read_reply`, :func:`doomed_client`).

Figures: each reliability scenario calls :func:`record_figures` once its
assertions passed; they are merged into ``.cache/reliability.json``, from
which ``scripts/reliability-report`` renders ``docs/reliability.md``.
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICE_DIR = ROOT / "service"
RELIABILITY_JSON = ROOT / ".cache" / "reliability.json"
START_TIMEOUT_S = 90.0


# --- TOML -------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def to_toml(config: dict[str, Any]) -> str:
    """Writes a two-level config dict (``service``, ``models.NAME``) as TOML."""
    out = []
    if config.get("service"):
        out.append("[service]")
        out += [f"{k} = {_toml_value(v)}" for k, v in config["service"].items()]
    for name, table in config.get("models", {}).items():
        out.append(f"\n[models.{json.dumps(name)}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(out) + "\n"


def make_config(models: dict[str, Any], backend: str = "host", gpu: int = 0, **service: Any) -> dict[str, Any]:
    """A config dict from ``{name: path}`` or ``{name: {path=..., ...}}`` (tp=1 on ``gpu`` by default)."""
    tables = {}
    for name, m in models.items():
        table = {"path": str(m)} if isinstance(m, (str, os.PathLike)) else {k: (str(v) if k == "path" else v)
                                                                           for k, v in m.items()}
        table.setdefault("layouts", [{"tp": 1, "gpus": [gpu]}])
        tables[name] = table
    return {"service": {"backend": backend, **service}, "models": tables}


# --- /proc ------------------------------------------------------------------


#: readlink("/proc/PID/fd/N") prefix -> kind, first match wins (anon_inode:[eventpoll] is "eventpoll").
_FD_KINDS = (("socket:", "socket"), ("pipe:", "pipe"), ("/memfd:", "memfd"), ("anon_inode:[eventpoll]", "eventpoll"),
             ("/dev/", "dev"), ("anon_inode:", "anon"), ("/", "file"))


def proc_fds(pid: int) -> collections.Counter:
    """Open fds of ``pid`` by kind: socket, pipe, memfd, eventpoll, file, dev, anon, other."""
    kinds: collections.Counter = collections.Counter()
    base = f"/proc/{pid}/fd"
    for name in os.listdir(base):
        try:
            target = os.readlink(f"{base}/{name}")
        except FileNotFoundError:
            continue  # closed while we looked (e.g. listdir's own fd)
        kinds[next((kind for prefix, kind in _FD_KINDS if target.startswith(prefix)), "other")] += 1
    return kinds


def proc_rss_bytes(pid: int) -> int:
    """``VmRSS`` of ``pid`` in bytes (``/proc/PID/status``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


# --- the service subprocess ----------------------------------------------------


def service_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a service or client subprocess: the source tree first, no systemd."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "JOURNAL_STREAM",
                        "WATCHDOG_USEC", "WEIGHTCACHE_SOCKET_DIR", "WEIGHTCACHE_CONFIG")}
    env["PYTHONPATH"] = os.pathsep.join([str(SERVICE_DIR)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.update(extra or {})
    return env


def poll_until(cond: Callable[[], Any], what: str, timeout: float = 60.0, period_s: float = 0.02,
               detail: Callable[[], str] | None = None) -> Any:
    """Calls ``cond`` until it returns something true (returned) or ``timeout`` seconds pass.

    The one deadline loop of the tests: ``cond`` may raise (an AssertionError when what it
    waits for can no longer happen, e.g. the service exited), which ends the wait at once.

    Args:
        cond (`callable`): ``() -> value``; a true value ends the wait.
        what (`str`): what is awaited, for the failure message.
        timeout (`float`): seconds.
        period_s (`float`): seconds between calls (0 when ``cond`` blocks by itself,
            e.g. a ``recv`` with a socket timeout).
        detail (`callable`, *optional*): ``() -> str`` appended to the failure message
            (the service's log).

    Raises:
        AssertionError: ``timed out waiting for <what> (<timeout> s)``.
    """
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} ({timeout} s)" + (f"\n{detail()}" if detail else ""))
        time.sleep(period_s)


class ServiceProcess:
    """One ``weightcache serve`` subprocess for one GPU index, listening in ``socket_dir``.

    Attributes:
        socket_dir (`str`): directory of ``<gpu>.sock`` (``workdir`` unless given).
        socket_path (`str`): the listening socket.
        config_path (`Path`): the TOML file it was started with.
        log_path (`Path`): its stderr (log lines).
        proc (`subprocess.Popen`), pid (`int`): the current process.
    """

    def __init__(self, workdir: Path, config: dict[str, Any] | Path, gpu: int = 0, backend: str | None = None,
                 env: dict[str, str] | None = None, nofile: int | None = None,
                 socket_dir: Path | None = None, run_as: int | None = None) -> None:
        """``config``: a config dict (written to ``workdir/weightcache.toml``) or the path of a TOML
        file used as it is. ``backend``: ``--backend`` (``None``: the config's, else ``host``; ``""``:
        no ``--backend`` flag, the service picks). ``env``: extra environment (``NOTIFY_SOCKET``...).
        ``run_as``: run the service as this uid (:func:`as_service_user`)."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.gpu = gpu
        if isinstance(config, dict):
            self.config_path = self.workdir / "weightcache.toml"
            self.config_path.write_text(to_toml(config))
            self.backend = config.get("service", {}).get("backend", "host") if backend is None else backend
        else:
            self.config_path = Path(config)
            self.backend = "host" if backend is None else backend
        self.socket_dir = str(socket_dir or self.workdir)  # several instances (one per GPU) may share one
        self.socket_path = os.path.join(self.socket_dir, f"{gpu}.sock")
        self.log_path = self.workdir / "service.log"
        self.extra_env = env or {}
        self.nofile = nofile
        #: uid (and gid) the service runs as, None: the test's own; see :func:`as_service_user`.
        self.run_as = run_as
        #: fds handed over as systemd's socket activation and fd store do (``FDNAME`` -> fd, placed at 3, 4,
        #: ... with ``LISTEN_FDS``/``LISTEN_FDNAMES``/``LISTEN_PID``); ``None``: none of those variables.
        self.listen_fds: dict[str, int] | None = None
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def write_config(self, config: dict[str, Any]) -> None:
        """Replaces the config file; takes effect at the next :meth:`start`."""
        self.config_path.write_text(to_toml(config))

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def launch(self) -> "ServiceProcess":
        """Starts ``python -m weightcache serve`` and returns at once (see :meth:`start`)."""
        backend = ["--backend", self.backend] if self.backend else []
        wrapper: list[str] = []
        if self.listen_fds is not None:
            wrapper = listen_fds_wrapper(self.listen_fds)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*as_service_user(self.run_as, self.socket_dir), *wrapper, sys.executable, "-m", "weightcache",
                 "serve", "--gpu", str(self.gpu), "--config", str(self.config_path), "--listen", self.socket_path,
                 *backend],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=service_env(self.extra_env), cwd=self.workdir,
                pass_fds=tuple((self.listen_fds or {}).values()),
                preexec_fn=None if self.nofile is None else self._limit_fds,
            )
        self.starts += 1
        return self

    def answers(self) -> bool:
        """Whether the service answers ``status`` now (AssertionError, with its log, if it exited)."""
        if self.proc.poll() is not None:
            raise AssertionError(f"service exited with {self.proc.returncode}\n{self.log()}")
        try:
            self.status()
        except Exception:  # noqa: BLE001 - not up yet
            return False
        return True

    def start(self, timeout: float = START_TIMEOUT_S) -> "ServiceProcess":
        """Starts the process and waits until it answers ``status``."""
        self.launch()
        poll_until(self.answers, "the service to answer status", timeout, 0.05, detail=self.log)
        return self

    def _limit_fds(self) -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def log(self) -> str:
        """The service's log so far (stderr)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def session(self, timeout: float = 30.0):
        """A connected :class:`weightcache.client.Session` (after ``hello``)."""
        from weightcache.session import Session

        return Session(self.socket_path, timeout=timeout, client="tests")

    def request(self, msg: Any, timeout: float = 30.0) -> Any:
        """One request on a fresh connection; returns the reply (raises typed errors)."""
        s = self.session(timeout)
        try:
            return s.request(msg)
        finally:
            s.close()

    def status(self) -> dict[str, Any]:
        """The ``status`` reply's dict."""
        from weightcache import protocol

        return self.request(protocol.Status(), timeout=10.0).status

    def slab(self, model: str, tp_rank: int = 0) -> dict[str, Any]:
        """The status entry of one slab."""
        for s in self.status()["slabs"]:
            if s["model"] == model and s["tp_rank"] == tp_rank:
                return s
        raise AssertionError(f"no slab {model} rank {tp_rank} in status")

    def wait_settled(self, timeout: float = 120.0) -> dict[str, Any]:
        """Polls ``status`` until no slab is pending or loading; returns that status."""
        def settled() -> dict[str, Any] | None:
            st = self.status()
            return st if all(s["state"] not in ("pending", "loading") for s in st["slabs"]) else None

        return poll_until(settled, "loads to settle", timeout, 0.05,
                          detail=lambda: f"{self.status()['status_line']}\n{self.log()}")

    def snapshot(self, others: int = 0, timeout: float = 30.0) -> dict[str, Any]:
        """fds by kind, RSS and status, taken while only ``others`` + our own connection are open.

        Waits (polling ``status``) until the service counts exactly ``others + 1``
        clients, i.e. it has processed every other connection's end, then reads /proc.
        """
        from weightcache import protocol

        s = self.session(timeout)
        try:
            def counted() -> dict[str, Any] | None:
                st = s.request(protocol.Status()).status
                return st if st["clients"] == others + 1 else None

            st = poll_until(counted, f"the service to count {others + 1} clients", timeout)
            return {"fds": proc_fds(self.pid), "rss_bytes": proc_rss_bytes(self.pid), "status": st,
                    "leases": sum(len(sl["leases"]) for sl in st["slabs"])}
        finally:
            s.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL and reap (no cleanup runs in the service)."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)

    def stop(self) -> int:
        """SIGTERM, wait, return the exit status (SIGKILL after 30 s)."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode if self.proc else 0

    def restart(self, timeout: float = START_TIMEOUT_S) -> "ServiceProcess":
        self.kill()
        return self.start(timeout)


#: Run before the service by :meth:`ServiceProcess.launch` when it has ``listen_fds``: moves the fds
#: (argv[1], comma-separated) to 3, 4, ... and sets ``LISTEN_FDS``/``LISTEN_FDNAMES`` (argv[2])/``LISTEN_PID``
#: to its own pid, then execs the rest of argv (the service keeps the pid, as under systemd). The fds as
#: ``pass_fds`` gave them (inheritable, at the test process's numbers) are closed before the exec, as systemd
#: passes nothing but 3, 4, ...: a copy left open at its old number was a second holder of each stored memfd
#: inside the service, so a slab the service let go of stayed counted as held elsewhere for good (issue 38,
#: P2; which stored fds leaked depended on the numbers the test process happened to give them).
_LISTEN_FDS_WRAPPER = (
    "import fcntl, os, sys\n"
    "fds = [int(x) for x in sys.argv[1].split(',') if x]\n"
    "high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in fds]  # out of the way of 3, 4, ...\n"
    "for i, fd in enumerate(high):\n"
    "    os.dup2(fd, 3 + i, inheritable=True)\n"
    "for fd in set(fds) - set(range(3, 3 + len(fds))):  # pass_fds' copies: systemd passes only 3, 4, ...\n"
    "    os.close(fd)\n"
    "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=str(len(fds)), LISTEN_FDNAMES=sys.argv[2])\n"
    "os.execv(sys.argv[3], sys.argv[3:])\n"
)


def listen_fds_wrapper(stored: dict[str, int]) -> list[str]:
    """The command that runs before a command given after it, as systemd starts a service with ``stored``
    (``FDNAME`` -> fd of this process, given to the child with ``pass_fds``): at 3, 4, ... in the order of
    their names, with ``LISTEN_FDS``/``LISTEN_FDNAMES``/``LISTEN_PID``, and no other copy of them."""
    names = sorted(stored)
    return [sys.executable, "-c", _LISTEN_FDS_WRAPPER, ",".join(str(stored[n]) for n in names), ":".join(names)]


def serve_with_stored_fds(cfg: Path, listen: Path, stored: dict[str, int], notify: str, log: Path,
                          gpu: int = 0, backend: str = "host", env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts ``serve --gpu N`` (a :class:`ServiceProcess`) as systemd would after a restart: the fd
    store's fds (``FDNAME`` -> fd) at 3, 4, ... with ``LISTEN_FDS``/``LISTEN_FDNAMES``/``LISTEN_PID``,
    and ``$NOTIFY_SOCKET`` set to ``notify``, ``$RUNTIME_DIRECTORY`` a directory beside it kept from one
    start to the next (``RuntimeDirectoryPreserve=restart``); its output appended to ``log``; ``backend``: its
    ``--backend``; ``env``: more environment. Returns at once."""
    runtime = Path(notify).parent / f"runtime-{gpu}"
    runtime.mkdir(exist_ok=True)
    svc = ServiceProcess(Path(listen).parent, Path(cfg), gpu, backend,
                         env={**(env or {}), "NOTIFY_SOCKET": notify, "RUNTIME_DIRECTORY": str(runtime)})
    svc.socket_path, svc.log_path, svc.listen_fds = str(listen), Path(log), dict(stored)
    return svc.launch().proc


class FdStoreStandIn:
    """systemd's fd store, stood in for by a test-owned ``$NOTIFY_SOCKET`` at ``path``.

    Keeps the fds a service sends with ``FDSTORE=1`` by ``FDNAME``
    (:meth:`collect`) and hands them to the next service it starts
    (:meth:`serve`), as systemd does after a restart. On exit it stops those
    services (SIGTERM) and closes the fds and the socket.
    """

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.fds: dict[str, int] = {}
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "FdStoreStandIn":
        return self

    def collect(self, count: int = 2, timeout: float = 90.0, log: Callable[[], str] = str) -> dict[str, int]:
        """Receives until ``count`` fds are stored (``slab-<id>`` and ``manifest-<id>`` per slab); returns them."""
        self.sock.settimeout(timeout)
        while len(self.fds) < count:
            try:
                msg, fds, _, _ = socket.recv_fds(self.sock, 65536, 4)
            except TimeoutError:
                raise AssertionError(f"the service sent no FDSTORE=1 fds to $NOTIFY_SOCKET\n{log()}") from None
            fields = dict(line.split("=", 1) for line in msg.decode().splitlines() if "=" in line)
            keep = fds[:1] if fields.get("FDSTORE") == "1" else []
            if keep:
                self.fds[fields["FDNAME"]] = keep[0]
            for fd in fds[len(keep):]:
                os.close(fd)
        return dict(self.fds)

    def drain(self) -> None:
        """Reads every datagram waiting, keeping ``FDSTORE=1`` fds as :meth:`collect` does: a service's
        notifications are dropped once the socket holds ``net.unix.max_dgram_qlen`` (10) unread datagrams, which
        a restart that drops and stores several entries reaches (systemd reads them at once)."""
        self.sock.setblocking(False)
        try:
            while True:
                try:
                    msg, fds, _, _ = socket.recv_fds(self.sock, 65536, 4)
                except BlockingIOError:
                    return
                fields = dict(line.split("=", 1) for line in msg.decode().splitlines() if "=" in line)
                if fields.get("FDSTOREREMOVE") == "1":  # as systemd does: the stored fd is closed at once
                    gone = self.fds.pop(fields.get("FDNAME", ""), None)
                    if gone is not None:
                        os.close(gone)
                keep = fds[:1] if fields.get("FDSTORE") == "1" else []
                if keep:
                    self.fds[fields["FDNAME"]] = keep[0]
                for fd in fds[len(keep):]:
                    os.close(fd)
        finally:
            self.sock.setblocking(True)

    def serve(self, cfg: Path, listen: Path, log: Path, gpu: int = 0, backend: str = "host",
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """Starts ``serve`` with the fds stored so far (:func:`serve_with_stored_fds`; ``env``: more environment)."""
        p = serve_with_stored_fds(cfg, listen, self.fds, self.path, log, gpu, backend, env)
        self.procs.append(p)
        return p

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=30)
        for fd in self.fds.values():
            os.close(fd)
        self.sock.close()


def as_service_user(uid: int | None, socket_dir: str) -> list[str]:
    """``setpriv`` arguments that run the service as ``uid`` (gid the same, no groups), as the unit's ``User=``.

    The service keeps one capability, ``CAP_DAC_READ_SEARCH``, only to read the
    test's interpreter and checkpoints under /root and pytest's 0700 temporary
    directories; it has neither ``CAP_SYS_ADMIN`` nor ``CAP_SYS_RESOURCE``, so the
    kernel's per-user limits (fds in flight, ``RLIMIT_NOFILE``) apply to it as
    to the packaged ``weightcache`` user. ``socket_dir`` is given to ``uid``. An
    empty list when ``uid`` is None.
    """
    if uid is None:
        return []
    os.chown(socket_dir, uid, uid)
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all,+dac_read_search",
            "--ambient-caps=+dac_read_search", "--bounding-set=-all,+dac_read_search", "--"]


def start_service(workdir: Path, models_or_config: dict[str, Any], backend: str = "host", gpu: int = 0,
                  env: dict[str, str] | None = None, nofile: int | None = None, run_as: int | None = None,
                  **service: Any) -> ServiceProcess:
    """Writes a config and starts a service; returns once it answers ``status``.

    Args:
        workdir (`Path`): socket, config and log directory (keep the path short:
            Unix socket paths are limited to 107 bytes).
        models_or_config (`dict`): a whole config (has a ``models`` key) or
            ``{name: path | {path=..., ...}}``.
        backend (`str`): ``host`` or ``cuda``.
        env (`dict`, *optional*): extra environment variables.
        nofile (`int`, *optional*): the service's ``RLIMIT_NOFILE`` (soft and hard).
        run_as (`int`, *optional*): run the service as this uid (:func:`as_service_user`).
        **service: more ``[service]`` keys.
    """
    cfg = (models_or_config if "models" in models_or_config
           else make_config(models_or_config, backend=backend, gpu=gpu, **service))
    return ServiceProcess(workdir, cfg, gpu, backend, env, nofile, run_as=run_as).start()


def _factory(base: Path) -> Iterator[Callable[..., ServiceProcess]]:
    started: list[ServiceProcess] = []
    n = [0]

    def make(models_or_config: dict[str, Any], backend: str = "host", gpu: int = 0, **kw: Any) -> ServiceProcess:
        n[0] += 1
        svc = start_service(base / f"s{n[0]}", models_or_config, backend=backend, gpu=gpu, **kw)
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.kill()


@pytest.fixture
def daemon(tmp_path: Path):
    """Factory: ``daemon(models_or_config, backend="host", gpu=0) -> ServiceProcess``; killed at teardown."""
    short = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))  # sockets need short paths
    yield from _factory(short)


@pytest.fixture(scope="module")
def module_daemon():
    """Module-scoped :func:`daemon`."""
    short = Path(tempfile.mkdtemp(prefix="wcm-", dir="/tmp"))
    yield from _factory(short)


# --- raw sockets ----------------------------------------------------------------


# --- figures ----------------------------------------------------------------------


_TEST_STARTED = [0.0]


@pytest.fixture(autouse=True)
def _figures_clock():
    """Notes when each test's body starts, for the ``duration_s`` of :func:`record_figures`."""
    _TEST_STARTED[0] = time.monotonic()
    yield


def record_figures(scenario: str, title: str, checks: str, backend: str = "host", **figures: Any) -> None:
    """Merges one scenario's figures into ``.cache/reliability.json`` (call after its assertions passed).

    Args:
        scenario (`str`): stable id, e.g. ``faults.client_killed_mid_attach``.
        title (`str`): one line for the report.
        checks (`str`): what the test asserts.
        **figures: ``clients``, ``duration_s``, ``frames_tried``, ``faults_injected``,
            ``bytes_compared`` and any other number worth reporting. ``duration_s``
            defaults to the time since the test's body started (fixture setup excluded).
    """
    if "duration_s" not in figures and _TEST_STARTED[0]:
        figures["duration_s"] = round(time.monotonic() - _TEST_STARTED[0], 2)
    RELIABILITY_JSON.parent.mkdir(parents=True, exist_ok=True)
    with open(RELIABILITY_JSON.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads(RELIABILITY_JSON.read_text())
        except (FileNotFoundError, ValueError):
            data = {"scenarios": {}}
        data["scenarios"][scenario] = {
            "title": title, "checks": checks, "backend": backend,
            "figures": figures, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        tmp = RELIABILITY_JSON.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        os.replace(tmp, RELIABILITY_JSON)


# --- a service without torch --------------------------------------------------------


_TORCH_BLOCKER = '''
import json, os, sys, threading, traceback

class _NoTorch:
    """Writes down and refuses every import of torch."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            with open(os.environ["WC_TEST_TORCH_LOG"], "a") as f:
                f.write(json.dumps({"thread": threading.current_thread().name,
                                    "stack": "".join(traceback.format_stack())}) + "\\n")
            raise ImportError("torch is blocked by the test's sitecustomize")
        return None

sys.meta_path.insert(0, _NoTorch())
'''


def blocked_torch_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """``env=`` for a service in which every ``import torch`` is written down (with its thread) and fails.

    Returns the environment (a ``sitecustomize`` first on ``PYTHONPATH``) and
    the JSON-lines file the attempts go to (:func:`torch_import_attempts`).
    """
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_TORCH_BLOCKER)
    log = tmp_path / "torch-imports.jsonl"
    return {"PYTHONPATH": os.pathsep.join([str(site), str(SERVICE_DIR)]), "WC_TEST_TORCH_LOG": str(log)}, log


def torch_import_attempts(log: Path) -> list[dict]:
    """The ``import torch`` attempts a :func:`blocked_torch_env` service made: ``{"thread", "stack"}`` each."""
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
