"""The build and the setup a fresh machine runs (issue 39).

- ``pyproject.toml``: setuptools is capped to the range it was built with, Debian 12's 66 included, and
  ``project.license`` is in no form that one end of the range rejects (the TOML table stops working after
  2027-02-18; the SPDX string needs setuptools >= 77). The .deb build under Debian's setuptools is
  ``tests/system/test_packages.py``.
- The Makefile installs the CPU build of torch (PyPI's ``torch==2.13.0`` is the CUDA build, 4.7 GB), from
  a wheel directory pip is configured with where it holds the wheel, else from PyTorch's CPU index.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
#: Debian 12's python3-setuptools (the .deb build).
BOOKWORM_SETUPTOOLS = "66.1.1"


def test_setuptools_is_capped_to_a_tested_range_that_holds_bookworms():
    (req,) = [Requirement(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]]
    assert req.name == "setuptools"
    assert req.specifier.contains(BOOKWORM_SETUPTOOLS), str(req.specifier)
    assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), f"no upper bound: {req}"
    assert not req.specifier.contains("999"), str(req.specifier)


def test_no_license_form_that_one_end_of_the_range_rejects():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "license" not in project, project.get("license")
    assert "license-files" not in project  # PEP 639 key, unknown to setuptools 66
    assert "Apache License" in (REPO / "LICENSE").read_text()[:200]


def _make_n(target: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    r = subprocess.run(["make", "-n", "-B", "-C", str(REPO), target], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("target", ["setup", "setup-vllm"])
def test_setup_installs_the_cpu_torch_and_honours_a_configured_wheel_directory(target):
    out = _make_n(target)
    torch_lines = [line for line in out.splitlines() if "pip install" in line and "torch==" in line]
    assert torch_lines, out
    for line in torch_lines:
        # Only the +cpu build, never PyPI's CUDA torch; the local wheels are tried first (--no-index), and the
        # CPU index is added only when they do not hold it.
        assert re.findall(r"'torch==([^']+)'", line) and set(re.findall(r"'torch==([^']+)'", line)) == {"2.13.0+cpu"}, line
        assert "--dry-run --no-index --no-deps 'torch==2.13.0+cpu'" in line, line
        assert "--extra-index-url https://download.pytorch.org/whl/cpu" in line, line
        assert "--index-url" not in line.replace("--extra-index-url", ""), line  # pip.conf's indexes stay


def test_vllm_stamp_imports_the_cpu_extension_and_apt_has_libnuma():
    out = _make_n("setup-vllm")
    assert re.search(r'-c "import vllm, vllm\._C\b', out), out
    makefile = (REPO / "Makefile").read_text()
    pkgs = re.search(r"^APT_PKGS\s*:=((?:.*\\\n)*.*)$", makefile, re.M).group(1).split()
    assert "libnuma1" in pkgs and "prometheus" in pkgs, pkgs


def test_the_newcomer_check_finds_the_readmes_commands():
    """scripts/newcomer-check runs what the README says, read from it: the prerequisites block of a fresh
    Debian 12 (apt-get, then the clone with its placeholder) and the make targets of its first block."""
    import runpy

    script = runpy.run_path(str(REPO / "scripts" / "newcomer-check"), run_name="newcomer_check")
    prereq, targets = script["readme_steps"]((REPO / "README.md").read_text())
    assert targets == ["demo", "test"]
    assert prereq[0].startswith("apt-get update && apt-get install -y ") and {"git", "make", "python3"} <= set(
        prereq[0].split()), prereq
    assert script["CLONE_PLACEHOLDER"] in prereq[1] and prereq[1].endswith("&& cd weightcache"), prereq
    assert script["ORIGIN"].endswith("/weightcache")  # git clone file://.../weightcache makes weightcache/
