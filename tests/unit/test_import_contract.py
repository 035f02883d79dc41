"""The package's import contract (issue 34, docs/design.md §3): layers, no cycle, private rooms stay private.

Three contracts of ``.importlinter`` at the repository root, checked by import-linter (``lint-imports``, a
maintained tool over grimp's import graph, imports inside functions included):

- **layers**: each package or module imports only those below it (errors <- wire <- ... <- cli);
- **acyclic_siblings**: no import cycle between the children of any package, at any depth;
- **private_modules**: a ``_room`` module is imported only from inside its own package.

A fourth rule import-linter has no contract for is checked here with ``ast``: no ``from X import _name`` of a
private *name* from a module of another package. Each contract is also run against a small package with one
deliberate violation, so that a contract that cannot fail is seen to fail.

The module-size signal (a module over :data:`MODULE_LINES_SIGNAL` lines) is a warning, not a failure.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "service" / "weightcache"
LINT = Path(sys.executable).with_name("lint-imports")
#: A module longer than this is worth a look (a signal, not a wall: a cohesive class may be long).
MODULE_LINES_SIGNAL = 600


def _lint(cwd: Path, pythonpath: Path, config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), str(config), "--no-cache"], cwd=cwd, capture_output=True,
                          text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(pythonpath)})


def test_the_package_keeps_its_import_contract():
    r = _lint(ROOT, ROOT / "service", ROOT / ".importlinter")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "3 kept, 0 broken" in r.stdout, r.stdout[-3000:]


def _private_name_imports(pkg_dir: Path, root_name: str) -> list[str]:
    """``file: from X import _name`` for every private name imported from a module of another package."""
    out = []
    for path in sorted(pkg_dir.rglob("*.py")):
        rel = path.relative_to(pkg_dir.parent)
        parts = list(rel.with_suffix("").parts)
        package = parts[:-1]  # the package this module lives in
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            if not target or target[0] != root_name:
                continue
            for alias in node.names:
                name = alias.name
                if not name.startswith("_") or name.startswith("__"):
                    continue
                # The package of the module imported from: the target itself when it is a package.
                target_path = pkg_dir.parent.joinpath(*target)
                target_package = target if target_path.is_dir() else target[:-1]
                if target_package != package:
                    out.append(f"{rel}: from {'.'.join(target)} import {name}")
    return out


def test_no_private_name_is_imported_across_packages():
    assert _private_name_imports(PKG, "weightcache") == []


def test_module_size_is_a_signal_not_a_wall():
    long = [f"{p.relative_to(PKG)} ({n} lines)" for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MODULE_LINES_SIGNAL]
    if long:
        warnings.warn(f"modules over {MODULE_LINES_SIGNAL} lines (a look, not a rule): {', '.join(long)}",
                      stacklevel=1)


# ---- the contracts fail where they should: a toy package with one planted violation each ----

_TOY_CONFIG = """\
[importlinter]
root_package = toy

[importlinter:contract:layers]
name = layers
type = layers
containers =
    toy
layers =
    high
    low

[importlinter:contract:acyclic]
name = acyclic
type = acyclic_siblings
ancestors =
    toy

[importlinter:contract:private]
name = private
type = private_modules
"""


def _toy(tmp_path: Path, files: dict[str, str]) -> Path:
    base = {"toy/__init__.py": "", "toy/low/__init__.py": "from ._room import VALUE\n",
            "toy/low/_room.py": "VALUE = 1\n_SECRET = 2\n", "toy/high/__init__.py": "from toy.low import VALUE\n"}
    for name, text in {**base, **files}.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    (tmp_path / ".importlinter").write_text(_TOY_CONFIG)
    return tmp_path


def test_the_toy_package_keeps_the_contract(tmp_path):
    root = _toy(tmp_path, {})
    r = _lint(root, root, root / ".importlinter")
    assert r.returncode == 0 and "3 kept, 0 broken" in r.stdout, r.stdout[-3000:]
    assert _private_name_imports(root / "toy", "toy") == []


@pytest.mark.parametrize("planted,broken", [
    # an upward import, inside a function (a lazy import counts)
    ({"toy/low/up.py": "def f():\n    from toy import high\n"}, "layers BROKEN"),
    # a cycle between two modules of one package
    ({"toy/low/a.py": "from toy.low import b\n", "toy/low/b.py": "def f():\n    from toy.low import a\n"},
     "acyclic BROKEN"),
    # another package imports a private room
    ({"toy/high/use.py": "from toy.low import _room\n"}, "private BROKEN"),
], ids=["upward", "cycle", "private-room"])
def test_a_planted_violation_breaks_its_contract(tmp_path, planted, broken):
    root = _toy(tmp_path, planted)
    r = _lint(root, root, root / ".importlinter")
    assert r.returncode != 0 and broken in r.stdout, r.stdout[-3000:]


def test_a_private_name_imported_across_packages_is_found(tmp_path):
    root = _toy(tmp_path, {"toy/high/use.py": "from toy.low._room import VALUE\nfrom ..low._room import _SECRET\n"})
    assert _private_name_imports(root / "toy", "toy") == ["toy/high/use.py: from toy.low._room import _SECRET"]
