"""The unit files, generator and launcher, checked without booting anything.

- ``systemd-analyze verify`` on instantiated copies: exit 0 and no warning at
  all (systemd 252 exits 0 on unknown keys, so warnings must fail too);
- ``systemd-analyze security --offline``: the service's exposure stays low;
- the generator: GPUs from a config (with a conf.d drop-in) and from a fake
  PCI sysfs tree;
- the launcher: a missing or incomplete runtime gives exit status 78 and a
  status text (received on a test-owned ``$NOTIFY_SOCKET``) that names the fix;
  with a socket from systemd it holds the socket instead (weightcache-hold) and
  execs the daemon under the same PID once the runtime is there.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "units"
INSTALLED_LAUNCHER = "/usr/libexec/weightcache/weightcache-launch"
INSTALLED_COMMAND = "/usr/bin/weightcache"

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def _instantiate(tmp_path: Path) -> list[str]:
    """Copies the units into ``tmp_path`` with ``@0`` instances, as the before-stop hook does.

    Where the package is not installed, ``ExecStart=`` is pointed at the tree's
    launcher (verify checks that the command is executable); nothing else changes.
    """
    names = []
    for f in UNITS.iterdir():
        if f.suffix in (".socket", ".service", ".target"):
            text = f.read_text()
            if not os.access(INSTALLED_LAUNCHER, os.X_OK):
                text = text.replace(f"ExecStart={INSTALLED_LAUNCHER}", f"ExecStart={UNITS / 'weightcache-launch'}")
            if not os.access(INSTALLED_COMMAND, os.X_OK):
                for key in ("ExecStart", "ExecReload"):
                    text = text.replace(f"{key}={INSTALLED_COMMAND}", f"{key}={REPO / 'packaging' / 'weightcache.sh'}")
            (tmp_path / f.name).write_text(text)
            if "@." in f.name:
                inst = f.name.replace("@.", "@0.")
                (tmp_path / inst).write_text(text)
                names.append(inst)
    return sorted(names)


@needs_analyze
def test_verify_has_no_warnings(tmp_path):
    names = _instantiate(tmp_path)
    assert names == ["weightcache@0.service", "weightcache@0.socket"]
    r = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *[f"./{n}" for n in names], "./weightcache.target",
         "./weightcache.service",
         "./weightcache-metrics.socket", "./weightcache-metrics.service"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    # Any output at all is a warning (unknown key, bad value, missing dependency...).
    assert (r.stdout + r.stderr).strip() == ""


@needs_analyze
@pytest.mark.parametrize("unit", ["weightcache@0.service", "weightcache-metrics.service", "weightcache.service"])
def test_security_exposure_is_low(tmp_path, unit):
    _instantiate(tmp_path)
    r = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--man=no", "--no-pager", f"./{unit}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    m = re.search(rf"Overall exposure level for {re.escape(unit)}: ([0-9.]+)", r.stdout)
    assert m, r.stdout
    # 10 is fully exposed; GPU access (no PrivateDevices=, no PrivateUsers=) keeps the daemon above 0.
    assert float(m.group(1)) <= 2.0, r.stdout


def test_socket_and_service_keys():
    """The keys issue 10 and STYLE.md name, with their values."""
    sock = (UNITS / "weightcache@.socket").read_text()
    svc = (UNITS / "weightcache@.service").read_text()
    for text in (sock, svc):
        assert text.startswith("# SPDX-License-Identifier: Apache-2.0\n")
        assert "Documentation=man:weightcache.systemd(7)" in text
    for line in ("Service=weightcache@%i.service", "ListenStream=/run/weightcache/%i.sock", "Accept=no",
                 "FileDescriptorName=listen", "SocketGroup=weightcache-clients", "SocketMode=0660",
                 "WantedBy=weightcache.target"):
        assert re.search(rf"^{re.escape(line)}$", sock, re.M), line
    for line in ("Type=notify", "Requires=weightcache@%i.socket", "After=weightcache@%i.socket",
                 "PartOf=weightcache.target weightcache.service",
                 "After=weightcache.target weightcache.service", "RuntimeDirectory=weightcache/%i", "Restart=on-failure",
                 "Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID", "DevicePolicy=closed", "User=weightcache",
                 "IPAddressDeny=any",
                 # issue 26: no start limit (systemd 252 counts "systemctl restart", and a unit that hits the
                 # limit drops its fd store); crashes are paced instead.
                 "StartLimitIntervalSec=0s", "RestartSec=2s"):
        assert re.search(rf"^{re.escape(line)}$", svc, re.M), line
    assert re.search(r"^ExecStart=\S+ %i$", svc, re.M)
    assert re.search(r"^ExecReload=/usr/bin/weightcache reload --gpu %i --socket-dir /run/weightcache$", svc, re.M)
    assert not re.search(r"^PrivateDevices=", svc, re.M)
    # The umbrella reloads the running instances itself and waits for them (propagated reload jobs ran after
    # its own, and "systemctl reload weightcache" returned before any instance had reloaded).
    assert not re.search(r"^ReloadPropagatedFrom=", svc, re.M)
    umbrella = (UNITS / "weightcache.service").read_text()
    assert re.search(r"^ExecReload=/usr/bin/weightcache reload --running --socket-dir /run/weightcache$", umbrella,
                     re.M)
    # Issue 39: the umbrella ran its reload as root (9.6 UNSAFE); it needs only the instances' sockets.
    for line in ("User=weightcache", "Group=weightcache", "ProtectSystem=strict", "PrivateNetwork=yes"):
        assert re.search(rf"^{re.escape(line)}$", umbrella, re.M), line
    # Booleans are only yes/no (STYLE.md).
    for text in (sock, svc):
        assert not re.search(r"^\w+=(true|false|on|off|1|0)$", text, re.M | re.I)
    man = (REPO / "man" / "weightcache.systemd.7").read_text()
    # An optional first line names the tbl preprocessor (the journal events table).
    assert re.match(r"(?:'\\\" t\n)?\.\\\" SPDX-License-Identifier", man) and ".TH WEIGHTCACHE.SYSTEMD 7" in man


# -- generator ------------------------------------------------------------------------------


def _generate(tmp_path: Path, config: Path, sysfs: Path, socket_dir: Path | None = None) -> list[str]:
    out = tmp_path / "normal"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "WEIGHTCACHE_CONFIG": str(config),
           "WEIGHTCACHE_SYSFS": str(sysfs), "WEIGHTCACHE_SOCKET_DIR": str(socket_dir or tmp_path / "no-run")}
    r = subprocess.run(["/usr/bin/python3", UNITS / "weightcache-generator", out, tmp_path / "early", tmp_path / "late"],
                       env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    wants = out / "weightcache.target.wants"
    if not wants.exists():
        return []
    for link in wants.iterdir():
        assert link.is_symlink() and os.readlink(link).endswith("/weightcache@.socket"), link
    return sorted(p.name for p in wants.iterdir())


def _fake_pci(root: Path, devices: dict[str, tuple[str, str]]) -> Path:
    for addr, (vendor, cls) in devices.items():
        d = root / "bus" / "pci" / "devices" / addr
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
    return root


def test_generator_reads_gpus_from_config_and_dropins(tmp_path):
    etc = tmp_path / "etc"
    (etc / "conf.d").mkdir(parents=True)
    main = etc / "weightcache.toml"
    main.write_text(
        '[service]\nbackend = "host"\n'
        '[models.a]\npath = "/srv/a"\nlayouts = [{ tp = 1, gpus = [0] }]\n'
        '[models.b]\npath = "/srv/b"\nlayouts = [{ tp = 1, gpus = [5] }]\n'
    )
    # The drop-in replaces model b entirely: GPU 5 is no longer used, GPU 2 is.
    (etc / "conf.d" / "10-b.toml").write_text('[models.b]\npath = "/srv/b"\nlayouts = [{ tp = 2, gpus = [2, 0] }]\n')
    # A PCI tree with one GPU must not matter when the config names GPUs.
    sysfs = _fake_pci(tmp_path / "sys", {"0000:17:00.0": ("0x10de", "0x030200")})
    assert _generate(tmp_path, main, sysfs) == ["weightcache@0.socket", "weightcache@2.socket"]


def test_generator_skips_disabled_gpus_and_requires_the_checkpoint_mounts(tmp_path):
    """Issue 26: [service] disabled_gpus is the per-instance off switch; RequiresMountsFor= names each
    GPU's checkpoint directories (network storage is mounted first, unmounted last)."""
    main = tmp_path / "etc" / "weightcache.toml"
    main.parent.mkdir()
    main.write_text(
        '[service]\ndisabled_gpus = [1]\n'
        '[models.a]\npath = "/mnt/nfs/a 100%"\nlayouts = [{ tp = 2, gpus = [0, 1] }]\n'
        '[models.b]\npath = "/srv/b"\nlayouts = [{ tp = 1, gpus = [0] }, { tp = 1, gpus = [2] }]\n'
    )
    assert _generate(tmp_path, main, tmp_path / "no-sys") == ["weightcache@0.socket", "weightcache@2.socket"]
    normal = tmp_path / "normal"
    mounts = {g: (normal / f"weightcache@{g}.service.d" / "50-checkpoints.conf").read_text().splitlines()[-1]
              for g in (0, 2)}
    assert mounts == {0: 'RequiresMountsFor="/mnt/nfs/a 100%%" "/srv/b"', 2: 'RequiresMountsFor="/srv/b"'}
    assert not (normal / "weightcache@1.service.d").exists()
    # systemd reads the quoted, %-escaped paths back as they are in the config.
    if shutil.which("systemd-analyze"):
        unit = tmp_path / "weightcache@0.service"
        unit.write_text("[Service]\nExecStart=/bin/true\n")
        dropin = tmp_path / "weightcache@0.service.d"
        dropin.mkdir()
        (dropin / "50-checkpoints.conf").write_text((normal / "weightcache@0.service.d" / "50-checkpoints.conf")
                                                   .read_text())
        r = subprocess.run(["systemd-analyze", "verify", "--man=no", f"./{unit.name}"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and (r.stdout + r.stderr).strip() == "", r.stdout + r.stderr


def test_generator_falls_back_to_pci_sysfs(tmp_path):
    sysfs = _fake_pci(tmp_path / "sys", {
        "0000:00:02.0": ("0x8086", "0x030000"),  # Intel VGA: not ours
        "0000:17:00.0": ("0x10de", "0x030200"),  # NVIDIA 3D controller (H100/H200)
        "0000:3a:00.0": ("0x10de", "0x030000"),  # NVIDIA VGA controller
        "0000:3a:00.1": ("0x10de", "0x040300"),  # NVIDIA HD audio function: not a GPU
        "0000:5d:00.0": ("0x10de", "0x068000"),  # NVSwitch bridge: not a GPU
    })
    assert _generate(tmp_path, tmp_path / "missing.toml", sysfs) == ["weightcache@0.socket", "weightcache@1.socket"]


@pytest.mark.parametrize("text,encoding", [("[models.a\npath = ", "utf-8"),
                                           ('[models.a]\npath = "/m"\n', "utf-16")])
def test_generator_survives_a_broken_config(tmp_path, text, encoding):
    main = tmp_path / "weightcache.toml"
    main.write_text(text, encoding=encoding)
    sysfs = _fake_pci(tmp_path / "sys", {"0000:17:00.0": ("0x10de", "0x030200")})
    assert _generate(tmp_path, main, sysfs) == ["weightcache@0.socket"]


def test_generator_keeps_the_listening_instances_when_the_config_does_not_load(tmp_path):
    """A typo, then ``systemctl daemon-reload`` (a package upgrade runs one): the generator wired the GPUs of PCI
    sysfs instead, none on a host-backend node, so the running instances dropped out of weightcache.target
    (the next stop and start of the target, or a reboot, left them off) and, on a GPU node, every GPU came in,
    disabled ones included. It keeps the instances whose socket listens now; with none (at boot), sysfs."""
    main = tmp_path / "weightcache.toml"
    main.write_text('[models.a]\npath = "/srv/a"\nlayouts = [{ tp = 2, gpus = [0, 2] }]\noops = [\n')
    run = tmp_path / "run"
    run.mkdir()
    for name in ("0.sock", "2.sock"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(run / name))
        s.close()
    (run / "5.sock").write_text("")  # not a socket
    (run / "0").mkdir()  # RuntimeDirectory= of weightcache@0
    sysfs = _fake_pci(tmp_path / "sys", {"0000:17:00.0": ("0x10de", "0x030200"), "0000:18:00.0": ("0x10de", "0x030200")})
    assert _generate(tmp_path / "reload", main, sysfs, run) == ["weightcache@0.socket", "weightcache@2.socket"]
    # Nothing listens (boot): PCI sysfs, as before.
    assert _generate(tmp_path / "boot", main, sysfs, tmp_path / "empty-run") == ["weightcache@0.socket",
                                                                                 "weightcache@1.socket"]
    # No config at all (fresh install): sysfs, whatever listens.
    assert _generate(tmp_path / "fresh", tmp_path / "missing.toml", sysfs, run) == ["weightcache@0.socket",
                                                                                    "weightcache@1.socket"]


def test_generator_skips_gpu_indices_outside_the_configs_range(tmp_path):
    """An index check-config rejects (above MAX_GPU_INDEX, negative) makes no unit; the valid ones still do,
    the highest valid index included."""
    from weightcache.config import MAX_GPU_INDEX

    main = tmp_path / "weightcache.toml"
    main.write_text(f'[models.a]\npath = "/srv/a"\nlayouts = [{{ tp = 3, gpus = [1, 99999999999999, -1] }}]\n'
                    f'[models.b]\npath = "/srv/b"\nlayouts = [{{ tp = 1, gpus = [{MAX_GPU_INDEX}] }}]\n')
    sysfs = _fake_pci(tmp_path / "sys", {"0000:17:00.0": ("0x10de", "0x030200")})
    assert _generate(tmp_path, main, sysfs) == ["weightcache@1.socket", f"weightcache@{MAX_GPU_INDEX}.socket"]


def test_generator_without_gpus_links_nothing(tmp_path):
    assert _generate(tmp_path, tmp_path / "missing.toml", tmp_path / "nosys") == []


@pytest.mark.parametrize("table,listen", [
    ('[metrics]\nport = 19661\n', "127.0.0.1:19661"),
    ('[metrics]\naddress = "::1"\n', "[::1]:9661"),
    ('[metrics]\nport = 70000\n', None),  # out of range: warned, the unit's default stays
    ('', None),  # no [metrics]: no drop-in
])
def test_generator_moves_the_metrics_socket_to_the_configured_address(tmp_path, table, listen):
    main = tmp_path / "weightcache.toml"
    main.write_text(table + '[models.a]\npath = "/srv/a"\n')
    assert _generate(tmp_path, main, tmp_path / "nosys") == ["weightcache@0.socket"]
    dropin = tmp_path / "normal" / "weightcache-metrics.socket.d" / "50-config.conf"
    if listen is None:
        assert not dropin.exists()
    else:
        assert re.findall(r"^ListenStream=(.*)$", dropin.read_text(), re.M) == ["", listen]
    default = re.search(r"^ListenStream=(.*)$", (UNITS / "weightcache-metrics.socket").read_text(), re.M).group(1)
    from weightcache.config import MetricsConfig

    assert default == MetricsConfig().listen  # the unit's default is the config's default


# -- launcher -------------------------------------------------------------------------------


def _launch(tmp_path: Path, python: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Runs the launcher for GPU 0 with ``WEIGHTCACHE_PYTHON=python`` and a test notify socket."""
    addr = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(addr)
        s.settimeout(0)
        env = {"PATH": "/usr/bin:/bin", "NOTIFY_SOCKET": addr, "WEIGHTCACHE_PYTHON": python}
        r = subprocess.run([UNITS / "weightcache-launch", "0"], env=env, capture_output=True, text=True, timeout=60)
        messages = []
        while True:
            try:
                messages.append(s.recv(4096).decode())
            except BlockingIOError:
                break
    return r, messages


def test_launcher_reports_missing_runtime(tmp_path):
    r, messages = _launch(tmp_path, str(tmp_path / "no-venv" / "bin" / "python"))
    assert r.returncode == 78
    assert len(messages) == 1 and messages[0].startswith("STATUS=runtime missing: ")
    assert "weightcache-setup-runtime" in messages[0] and str(tmp_path / "no-venv") in messages[0]
    assert "weightcache-setup-runtime" in r.stderr


def test_launcher_reports_incomplete_runtime(tmp_path):
    # A real interpreter without torch or weightcache (the system's python3, isolated).
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.base_prefix}/bin/python3 -I -S \"$@\"\n")
    fake.chmod(0o755)
    r, messages = _launch(tmp_path, str(fake))
    assert r.returncode == 78
    assert messages == [f"STATUS=runtime incomplete: {fake} cannot import torch weightcache; run weightcache-setup-runtime, "
                        "or set WEIGHTCACHE_PYTHON in /etc/default/weightcache to a Python that has torch and weightcache"]


def test_launcher_rejects_a_bad_instance_name(tmp_path):
    r = subprocess.run([UNITS / "weightcache-launch", "gpu0"], env={"PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 78
    assert "bad instance name 'gpu0'" in r.stderr


def test_launcher_without_a_runtime_holds_the_socket_until_it_is_installed(tmp_path):
    """Under the unit (a socket from systemd), a missing runtime does not fail the unit: weightcache-hold
    reports ready with the reason, answers engines daemon_unavailable, keeps the fds and, once the runtime
    is there, execs the launcher (and so the daemon) under the same PID with the same socket."""
    import json
    import struct

    runtime, served = tmp_path / "venv" / "bin" / "python", tmp_path / "served"
    addr = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        notify.bind(addr)
        listener.bind(str(tmp_path / "0.sock"))
        listener.listen(8)
        env = {"PATH": "/usr/bin:/bin", "NOTIFY_SOCKET": addr, "WEIGHTCACHE_PYTHON": str(runtime),
               "LISTEN_FDS": "1", "LISTEN_FDNAMES": "listen"}
        # sd_listen_fds(3): the fd at 3 and LISTEN_PID naming the process itself.
        proc = subprocess.Popen(["/bin/sh", "-c", 'LISTEN_PID=$$ exec "$0" "$@"', UNITS / "weightcache-launch", "0"],
                                env=env, pass_fds=(3,), stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: os.dup2(listener.fileno(), 3))
        try:
            notify.settimeout(30)
            first = notify.recv(4096).decode()
            assert first.startswith("READY=1\nSTATUS=runtime missing: "), first
            assert str(runtime) in first and "weightcache-setup-runtime" in first, first

            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as engine:
                engine.settimeout(30)
                engine.connect(str(tmp_path / "0.sock"))
                hello = json.dumps({"type": "hello", "protocol_version": 3, "client": "test"}).encode()
                engine.sendall(struct.pack(">I", len(hello)) + hello)
                (n,) = struct.unpack(">I", engine.recv(4, socket.MSG_WAITALL))
                reply = json.loads(engine.recv(n, socket.MSG_WAITALL))
            assert reply["type"] == "error" and reply["code"] == "daemon_unavailable", reply
            assert reply["message"].startswith("weightcache@0: runtime missing: "), reply

            # The runtime appears: a stand-in that finds torch and weightcache and, as the daemon, records
            # its PID and what it inherited.
            runtime.parent.mkdir(parents=True)
            runtime.write_text('#!/bin/sh\n[ "$1" = -c ] && exit 0\n'
                               f'echo "$$ $LISTEN_PID $LISTEN_FDS $(readlink /proc/$$/fd/3) $*" > {served}\n')
            runtime.chmod(0o755)
            assert proc.wait(timeout=60) == 0, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        inode = os.fstat(listener.fileno()).st_ino
    pid, listen_pid, listen_fds, fd3, *argv = served.read_text().split()
    assert (pid, listen_pid, listen_fds) == (str(proc.pid),) * 2 + ("1",)
    assert fd3 == f"socket:[{inode}]" and argv == ["-m", "weightcache", "serve", "--gpu", "0"]


def test_hold_answers_engines_and_pings_the_watchdog_while_a_client_trickles(tmp_path):
    """weightcache-hold serves its connections side by side: a client of the socket group that sends its hello
    one byte a second (or nothing at all) holds neither the answer to a well-behaved engine nor the watchdog
    ping. It read each connection to the end on its one thread (2 s per recv), so such a client kept every
    engine in the backlog and, past WatchdogSec=, had systemd abort the unit."""
    import json
    import struct
    import threading
    import time

    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        notify.bind(str(tmp_path / "notify.sock"))
        listener.bind(str(tmp_path / "0.sock"))
        listener.listen(8)
        env = {"PATH": "/usr/bin:/bin", "NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
               "WEIGHTCACHE_PYTHON": str(tmp_path / "no-venv" / "bin" / "python"),
               "LISTEN_FDS": "1", "LISTEN_FDNAMES": "listen", "WATCHDOG_USEC": "1000000"}
        proc = subprocess.Popen(["/bin/sh", "-c", 'LISTEN_PID=$$ WATCHDOG_PID=$$ exec "$0" "$@"',
                                 UNITS / "weightcache-launch", "0"],
                                env=env, pass_fds=(3,), stderr=subprocess.DEVNULL,
                                preexec_fn=lambda: os.dup2(listener.fileno(), 3))
        stop = threading.Event()
        clients = []
        try:
            notify.settimeout(30)
            assert notify.recv(4096).decode().startswith("READY=1\nSTATUS=runtime missing: ")
            # Accepted first (the backlog is FIFO): one connection that never sends, one that trickles a
            # 64 KiB hello a byte a second, within the 2 s each recv waited.
            for _ in range(2):
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(str(tmp_path / "0.sock"))
                clients.append(c)
            clients[1].sendall(struct.pack(">I", 65536))

            def trickle():
                while not stop.wait(1.0):
                    try:
                        clients[1].send(b" ")
                    except OSError:
                        return
            threading.Thread(target=trickle, daemon=True).start()
            while notify.recv(4096) != b"WATCHDOG=1":  # drain the pings sent before the trickle began
                pass

            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as engine:
                engine.settimeout(20)  # the trickle runs for all of it: without the fix no answer comes
                engine.connect(str(tmp_path / "0.sock"))
                hello = json.dumps({"type": "hello", "protocol_version": 3, "client": "test"}).encode()
                engine.sendall(struct.pack(">I", len(hello)) + hello)
                (n,) = struct.unpack(">I", engine.recv(4, socket.MSG_WAITALL))
                reply = json.loads(engine.recv(n, socket.MSG_WAITALL))
            assert reply["code"] == "daemon_unavailable" and reply["details"] == {"reason": "runtime_missing"}, reply
            # The watchdog is pinged while the trickle goes on.
            assert not stop.is_set()
            pings = 0
            while pings < 3:
                assert notify.recv(4096) == b"WATCHDOG=1"
                pings += 1
            assert proc.poll() is None
        finally:
            stop.set()
            for c in clients:
                c.close()
            proc.kill()
            proc.wait()


# -- the container helper (tests/system/nspawn.py), without booting ----------------------------


def test_a_checkout_others_cannot_read_is_refused_with_the_reason(tmp_path):
    """Issue 39: a checkout the service and test users cannot read (a clone under umask 077) failed every
    systemd test with "control process exited with error code"; the session now fails at once, saying why.
    (A checkout under /root is fine: the container's directories above the mount points are opened.)"""
    import nspawn

    ok, closed = tmp_path / "ok", tmp_path / "closed"
    ok.mkdir(mode=0o755)
    closed.mkdir(mode=0o700)
    assert nspawn.unreadable_reason([ok]) is None
    why = nspawn.unreadable_reason([ok, closed])
    assert why.startswith(f"{closed} is mode 0700") and "chmod o+rX" in why, why


def test_a_failed_systemctl_shows_the_journal_of_its_units(monkeypatch):
    """Issue 39: a unit that failed to start showed only systemctl's "control process exited with error code";
    the assertion now carries the last journal lines of the units the command named."""
    import nspawn

    box = nspawn.Container("not-started")
    box.leader = 1
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        if "journalctl" in argv:
            return subprocess.CompletedProcess(argv, 0, "weightcache-launch: runtime missing\n", "")
        return subprocess.CompletedProcess(argv, 1, "", "Job for weightcache@0.service failed")

    monkeypatch.setattr(nspawn.subprocess, "run", run)
    with pytest.raises(AssertionError) as e:
        box.run(["systemctl", "start", "--no-block", "weightcache@0.socket", "weightcache@0.service"])
    text = str(e.value)
    assert "journal of weightcache@0.socket weightcache@0.service:" in text and "runtime missing" in text, text
    journal = calls[-1]
    assert journal[journal.index("journalctl"):][-4:] == ["-u", "weightcache@0.socket", "-u", "weightcache@0.service"]
    calls.clear()
    with pytest.raises(AssertionError):
        box.run(["test", "-e", "/x"])  # not systemctl: no journal asked
    assert not any("journalctl" in c for c in calls)
