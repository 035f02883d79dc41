"""A throw-away systemd (PID 1) in a ``systemd-nspawn`` container, for system tests.

By default the host's own OS is booted with ``--volatile=yes``: the host's
``/usr`` read-only, ``/`` a tmpfs whose ``/etc`` and ``/var`` start empty, so
nothing the tests do reaches the host (docs/systemd-notes.md, "Running a real
systemd in tests"). The repository (with its ``.venv``) is bind-mounted
read-only at the same path, and so is the venv's base interpreter when it does
not live under ``/usr``, so ``ExecStart=`` can run the daemon from the tree.
``directory=`` boots another root instead (e.g. a debootstrap rootfs, where
``dpkg -i`` works) without ``--volatile``.

Commands run inside through ``nsenter -t <init pid> -a``; files are written
through ``/proc/<init pid>/root``. The container runs inside ``timeout`` (so a
leaked one dies on its own) and is stopped by PID, never by name.

Example::

    with Container("wc-test", binds_ro=[repo]) as c:
        c.run(["systemctl", "start", "weightcache@0.socket"])
        c.show("weightcache@0.socket", "ActiveState")   # {"ActiveState": "active"}
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "units"

# A clean environment for commands in the container (the host's PATH may name pyenv shims).
ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "SYSTEMD_PAGER": "",
    "SYSTEMD_COLORS": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
}

BOOT_TIMEOUT_S = 60.0
#: The container kills itself after this long even if the test process dies.
LIFETIME_S = 1800


def unavailable_reason() -> str | None:
    """Why system tests cannot run here (``None`` when they can)."""
    if os.geteuid() != 0:
        return "system tests need root (systemd-nspawn boots a container)"
    for tool in ("systemd-nspawn", "nsenter", "timeout"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install systemd-container util-linux coreutils)"
    return None


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):  # the process is gone
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    return out


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def python_binds(python: Path) -> list[Path]:
    """Directories a venv interpreter needs besides ``/usr`` and the venv itself.

    A venv's ``bin/python`` is a symlink to its base interpreter; when that is
    not under ``/usr`` (pyenv, a python.org build in ``/opt``), its prefix has
    to be visible in the container too.
    """
    real = Path(os.path.realpath(python))
    prefix = real.parent.parent  # <prefix>/bin/python3.X
    if str(prefix).startswith(("/usr/", "/bin/", "/lib")) or str(prefix) in ("/usr", "/"):
        return []
    return [prefix]


def _bind(p) -> tuple[Path, Path]:
    """``path`` (same path inside) or ``(host path, container path)``."""
    if isinstance(p, tuple):
        return Path(p[0]), Path(p[1])
    return Path(p), Path(p)


class Container:
    """One booted container. Use as a context manager, or call ``start()``/``stop()``.

    Args:
        name (`str`): machine name (``-M``); also the name of its cgroup.
        binds_ro (`list`): host paths bind-mounted read-only at the same path, or
            ``(host path, container path)`` pairs (files or directories).
        binds_rw (`list`): the same, read-write.
        directory (`str`, *optional*, defaults to ``"/"``): the root to boot;
            ``"/"`` is booted ``--volatile=yes``.
        private_network (`bool`, *optional*, defaults to ``True``): no network;
            ``False`` shares the host's (scripts/newcomer-check downloads).
        lifetime_s (`int`, *optional*, defaults to :data:`LIFETIME_S`): when it kills itself.
    """

    def __init__(self, name: str, binds_ro=(), binds_rw=(), directory: str = "/", private_network: bool = True,
                 lifetime_s: int = LIFETIME_S) -> None:
        self.name = name
        self.private_network = private_network
        self.lifetime_s = lifetime_s
        self.binds_ro = [_bind(p) for p in binds_ro]
        self.binds_rw = [_bind(p) for p in binds_rw]
        self.directory = directory
        self.proc: subprocess.Popen | None = None
        self.leader: int | None = None
        self.log_path = Path(f"/tmp/{name}.nspawn.log")
        self._cgroups: list[Path] = []

    # -- life cycle -------------------------------------------------------------------

    def _cgroup_dirs(self) -> list[Path]:
        base = Path("/sys/fs/cgroup")
        if (base / "unified").is_dir() and (base / "systemd").is_dir():  # hybrid (v1 + v2)
            return [base / "systemd" / self.name, base / "unified" / self.name]
        if (base / "cgroup.procs").exists():  # pure v2
            return [base / self.name]
        return []

    def _enter_cgroup(self) -> None:  # runs in the child between fork and exec
        for d in self._cgroups:
            with contextlib.suppress(OSError):  # tidiness only; nspawn works without it
                with open(d / "cgroup.procs", "w") as f:
                    f.write("0")

    def start(self) -> "Container":
        cmd = [
            "timeout", "-k", "10", str(self.lifetime_s),
            "systemd-nspawn", "-D", self.directory,
            *(["--private-network"] if self.private_network else []),
            "--register=no", "--keep-unit", "--console=passive",
            "-M", self.name,
        ]
        if self.directory == "/":
            cmd.append("--volatile=yes")
        cmd += [f"--bind-ro={src}:{dst}" for src, dst in self.binds_ro]
        cmd += [f"--bind={src}:{dst}" for src, dst in self.binds_rw]
        # Without systemd.firstboot=off a fresh /etc waits forever in systemd-firstboot.
        cmd += ["-b", "--", "systemd.firstboot=off"]
        self._cgroups = self._cgroup_dirs()
        for d in self._cgroups:
            d.mkdir(exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=self._enter_cgroup,
        )
        log.close()
        try:
            self._wait_booted()
        except BaseException:
            self.stop()
            raise
        return self

    def _find_leader(self) -> int | None:
        # timeout -> systemd-nspawn -> systemd (PID 1 inside)
        for nspawn in _children(self.proc.pid):
            for child in _children(nspawn):
                if _comm(child) == "systemd":
                    return child
        return None

    def _wait_booted(self) -> None:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        state = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"container {self.name} exited with {self.proc.returncode}: {self.log_tail()}")
            if self.leader is None:
                self.leader = self._find_leader()
            if self.leader is not None:
                r = self.run(["systemctl", "is-system-running"], check=False, timeout=10)
                state = r.stdout.strip()
                if state in ("running", "degraded"):
                    return
            time.sleep(0.1)
        raise RuntimeError(f"container {self.name} not booted after {BOOT_TIMEOUT_S} s (state {state!r}): {self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """Powers the container off (SIGTERM to nspawn via ``timeout``), then SIGKILL if it hangs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # timeout forwards it to nspawn: orderly shutdown
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                for nspawn in _children(self.proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(nspawn, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        self.leader = None
        # The container's cgroups (payload/, supervisor/, ...) are empty now: remove them, deepest first.
        for d in self._cgroups:
            for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [d]:
                with contextlib.suppress(OSError):
                    sub.rmdir()

    def __enter__(self) -> "Container":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- inside ------------------------------------------------------------------------

    def _argv(self, cmd, env: dict | None) -> list[str]:
        if isinstance(cmd, str):
            cmd = ["sh", "-c", cmd]
        return ["nsenter", "-t", str(self.leader), "-a", "--", "env", "-i",
                *[f"{k}={v}" for k, v in {**ENV, **(env or {})}.items()], *cmd]

    def run(self, cmd, check: bool = True, timeout: float = 60, input: str | None = None,
            env: dict | None = None) -> subprocess.CompletedProcess:
        """Runs ``cmd`` (a list, or a string for ``sh -c``) in all of the container's namespaces."""
        r = subprocess.run(self._argv(cmd, env), capture_output=True, text=True, timeout=timeout, input=input)
        if check and r.returncode != 0:
            shown = cmd if isinstance(cmd, str) else shlex.join(cmd)
            raise AssertionError(
                f"in container: {shown} exited {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
                f"{self._journal_of(cmd)}"
            )
        return r

    def _journal_of(self, cmd) -> str:
        """For a failed ``systemctl VERB UNIT...``: the last lines of those units' journals ("control
        process exited with error code" alone says nothing of why)."""
        if isinstance(cmd, str) or len(cmd) < 3 or cmd[0] != "systemctl":
            return ""
        units = [a for a in cmd[2:] if not a.startswith("-")]
        argv = ["journalctl", "--no-pager", "-n", "60", "-o", "short-monotonic"]
        for u in units:
            argv += ["-u", u]
        try:
            j = subprocess.run(self._argv(argv, None), capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return "\njournal: journalctl timed out"
        return f"\njournal of {' '.join(units)}:\n{j.stdout}{j.stderr}"

    def popen(self, cmd, env: dict | None = None) -> subprocess.Popen:
        """Starts ``cmd`` inside without waiting; text pipes on stdin and stdout. The caller ends it."""
        return subprocess.Popen(self._argv(cmd, env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def path(self, p: str | os.PathLike) -> Path:
        """The host path of the container's ``p`` (through ``/proc/<pid>/root``)."""
        return Path(f"/proc/{self.leader}/root") / str(p).lstrip("/")

    def write(self, p: str, text: str, mode: int = 0o644) -> None:
        host = self.path(p)
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_text(text)
        host.chmod(mode)

    def copy(self, src: str | os.PathLike, dst: str, mode: int | None = None) -> None:
        host = self.path(dst)
        host.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, host)
        host.chmod(mode if mode is not None else os.stat(src).st_mode & 0o7777)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """``systemctl show -p ...`` as a dict."""
        r = self.run(["systemctl", "show", unit, *[f"-p{p}" for p in props]])
        return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)

    def wait_for(self, unit: str, until, values=None, timeout: float = 60) -> dict[str, str]:
        """Polls ``systemctl show`` until a condition holds; returns the properties last read.

        Either ``wait_for(unit, "ActiveState", "active")`` (a property and one
        value or a set of values) or ``wait_for(unit, predicate)``, where
        ``predicate(props)`` sees ActiveState, SubState, Result, MainPID,
        NRestarts, StatusText, NFileDescriptorStore and WatchdogTimestampMonotonic. Readiness comes from
        systemd, never from the logs.
        """
        props = ["ActiveState", "SubState", "Result", "MainPID", "NRestarts", "StatusText", "NFileDescriptorStore",
                 "WatchdogTimestampMonotonic"]
        if isinstance(until, str):
            prop, want = until, {values} if isinstance(values, str) else set(values)
            props.append(prop)
            until = lambda s: s.get(prop) in want  # noqa: E731
        deadline = time.monotonic() + timeout
        while True:
            s = self.show(unit, *props)
            if until(s):
                return s
            if time.monotonic() > deadline:
                log = self.run(["journalctl", "-u", unit, "-n", "40", "--no-pager"], check=False).stdout
                raise AssertionError(f"{unit}: condition not met within {timeout} s: {s}\n{log}")
            time.sleep(0.1)


#: Appended to the tests' unit drop-ins. A checkout (and pytest's tmp_path
#: checkpoints) may live under /tmp, which the unit's PrivateTmp=yes hides from
#: the service: the test services see the real /tmp. Production keeps PrivateTmp.
TEST_DROPIN = ("# The source tree, its venv and the test checkpoints may be under /tmp (CI checkouts):\n"
               "PrivateTmp=no\n"
               "# ... which leaves the service no writable temporary directory (ProtectSystem=strict), and\n"
               "# import torch -> cuda.bindings -> cuda.pathfinder runs ctypes.util.find_library, which\n"
               "# needs one when the volatile container has no /etc/ld.so.cache. Production has PrivateTmp.\n"
               "Environment=TMPDIR=%t/weightcache/%i\n")


def install_weightcache(c: Container, python: Path | None = None) -> None:
    """Installs the tree's units, generator, sysusers file and launcher into a volatile container.

    ``/usr`` is the host's and read-only there, so the units go to
    ``/etc/systemd/system`` and the generator to ``/etc/systemd/system-generators``
    (both searched by systemd), and a drop-in points ``ExecStart=`` at the
    tree's launcher. ``/etc/default/weightcache`` names the tree's venv.
    """
    python = python or REPO / ".venv" / "bin" / "python"
    for f in ("weightcache@.socket", "weightcache@.service", "weightcache.target", "weightcache.service",
              "weightcache-metrics.socket",
              "weightcache-metrics.service"):
        c.copy(UNITS / f, f"/etc/systemd/system/{f}", 0o644)
    c.copy(UNITS / "weightcache-generator", "/etc/systemd/system-generators/weightcache-generator", 0o755)
    c.copy(UNITS / "weightcache.sysusers", "/etc/sysusers.d/weightcache.conf", 0o644)
    c.write(
        "/etc/systemd/system/weightcache@.service.d/50-source-tree.conf",
        "# tests/system/nspawn.py: run the tree's launcher (/usr is the host's, read-only).\n"
        f"[Service]\nExecStart=\nExecStart={UNITS / 'weightcache-launch'} %i\n"
        f"ExecReload=\nExecReload={REPO / 'packaging' / 'weightcache.sh'} reload --gpu %i --socket-dir /run/weightcache\n"
        + TEST_DROPIN,
    )
    c.write(
        "/etc/systemd/system/weightcache.service.d/50-source-tree.conf",
        "# tests/system/nspawn.py: the tree's command line (/usr/bin/weightcache is not installed here).\n"
        f"[Service]\nExecReload=\nExecReload={REPO / 'packaging' / 'weightcache.sh'} reload --running "
        "--socket-dir /run/weightcache\n# The source tree and its venv may be under /tmp (CI checkouts).\nPrivateTmp=no\n",
    )
    c.write(
        "/etc/systemd/system/weightcache-metrics.service.d/50-source-tree.conf",
        "# tests/system/nspawn.py: the tree's command line (/usr/bin/weightcache is not installed here).\n"
        f"[Service]\nExecStart=\nExecStart={python} -m weightcache serve-metrics\n"
        "# The source tree and its venv may be under /tmp (CI checkouts).\nPrivateTmp=no\n",
    )
    c.write("/etc/default/weightcache", f"WEIGHTCACHE_PYTHON={python}\n")
    c.run(["systemd-sysusers"])
    # The volatile /root is 0700; a checkout (a root user's clone lands in /root), its venv or a pyenv
    # interpreter bind-mounted below it must be reachable by the weightcache user and the test users. Only
    # the container's own directories above the mount points change (the host's /root stays 0700).
    for p in default_binds(python):
        for parent in p.parents:
            if parent == Path("/"):
                break
            c.run(["chmod", "o+x", str(parent)])
    c.run(["systemctl", "daemon-reload"])


def default_binds(python: Path | None = None) -> list[Path]:
    """The tree, the venv's own directory where it lies outside the tree (``.venv`` a symlink), and
    :func:`python_binds`."""
    python = python or REPO / ".venv" / "bin" / "python"
    venv = Path(os.path.realpath(python.parent.parent))
    outside = [] if venv == REPO or REPO in venv.parents else [venv]
    return [REPO, *outside, *python_binds(python)]


def unreadable_reason(paths=None) -> str | None:
    """Why the service user and the test users could not read the tree or its venv (``None`` when they can).

    In the container the directories above a bind mount are opened up (:func:`install_weightcache`), but the
    bound directories keep the host's modes: a tree that others may not read and search (``git clone`` under
    ``umask 077``) fails every unit with "control process exited with error code".
    """
    for p in paths or default_binds():
        mode = os.stat(p).st_mode
        if mode & 0o005 != 0o005:
            return (f"{p} is mode {mode & 0o777:04o}: the service user and the test users in the container cannot "
                    f"read it; chmod o+rX it (or clone the repository with umask 022)")
    return None


if __name__ == "__main__":  # manual use: python tests/system/nspawn.py  (a shell inside)
    with Container("weightcache-manual", binds_ro=default_binds()) as box:
        install_weightcache(box)
        print(f"booted; leader PID {box.leader}; exit the shell to stop it", file=sys.stderr)
        subprocess.run(["nsenter", "-t", str(box.leader), "-a", "bash"])
