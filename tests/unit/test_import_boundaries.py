"""Module boundaries: every module's "Forbidden imports:" docstring line holds (STYLE.md).

Reads the line from each module's docstring, parses the module with ``ast``
and fails on any import of a forbidden name; "X at module level" forbids X
only in top-level statements. Short names (``daemon``) mean ``weightcache.daemon``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "service" / "weightcache"
LOCAL = {p.stem for p in PKG.glob("*.py")} | {p.name for p in PKG.iterdir() if p.is_dir()}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        m = re.search(r"Forbidden imports:(.*?)(?:\n\n|$)", doc, re.S)
        if m:
            yield pytest.param(path, m.group(1), id=str(path.relative_to(PKG)))


def _rules(text: str) -> list[tuple[str, bool]]:
    rules = []
    for part in re.split(r"[,;]", text.split("(")[0]):
        part = " ".join(part.split()).rstrip(".")
        if not part:
            continue
        top_only = part.endswith("at module level")
        name = part.removesuffix("at module level").strip()
        if name in LOCAL:
            name = f"weightcache.{name}"
        rules.append((name, top_only))
    return rules


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(absolute module name, is top-level) of every import in the file."""
    tree = ast.parse(path.read_text())
    pkg_parts = ["weightcache", *path.relative_to(PKG).parent.parts]
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [f"{mod}.{a.name}" for a in node.names] if not node.module else [mod]
            else:
                names = [node.module]
            out += [(n, id(node) in top) for n in names]
    return out


def test_some_modules_declare_boundaries():
    assert len(list(_modules())) >= 10


@pytest.mark.parametrize("path,text", list(_modules()))
def test_forbidden_imports_absent(path, text):
    rules = _rules(text)
    assert rules, text
    for mod, is_top in _imports(path):
        for name, top_only in rules:
            if (mod == name or mod.startswith(name + ".")) and (is_top or not top_only):
                raise AssertionError(f"{path.name} imports {mod}, which its docstring forbids ({text.strip()})")


def test_rule_parsing_and_detection(tmp_path):
    assert _rules(" torch at module level, socket, daemon, weightcache.client.") == [
        ("torch", True), ("socket", False), ("weightcache.daemon", False), ("weightcache.client", False)]
    bad = PKG / "protocol" / "codec.py"
    imports = dict(_imports(bad))
    assert "weightcache.errors" in imports and "socket" not in imports


#: The service's rooms (DESIGN.md section 3) and what each must at least refuse to import.
DAEMON_ROOMS = {
    "state.py": {"socket", "selectors", "threading", "torch", "weightcache.memory", "weightcache.daemon.transport",
                 "weightcache.daemon.handlers", "weightcache.daemon.loads"},
    "handlers.py": {"socket", "selectors", "threading", "weightcache.daemon.transport", "weightcache.daemon.loads",
                    "weightcache.daemon.fdstore"},
    "loads.py": {"socket", "selectors", "weightcache.protocol", "weightcache.daemon.transport",
                 "weightcache.daemon.handlers"},
    "fdstore.py": {"socket", "selectors", "weightcache.protocol", "weightcache.daemon.transport",
                   "weightcache.daemon.handlers"},
    "access.py": {"socket", "selectors", "torch", "weightcache.daemon.transport", "weightcache.daemon.handlers"},
    "transport.py": {"threading", "torch", "weightcache.pipeline", "weightcache.daemon.handlers",
                     "weightcache.daemon.loads"},
    "ticker.py": {"socket", "selectors", "torch", "weightcache.daemon.transport", "weightcache.daemon.handlers"},
    "limits.py": {"socket", "selectors", "threading", "torch", "weightcache.daemon.transport",
                  "weightcache.daemon.handlers"},
    "reload.py": {"socket", "selectors", "threading", "torch", "weightcache.memory", "weightcache.daemon.transport",
                  "weightcache.daemon.handlers", "weightcache.daemon.loads", "weightcache.daemon.fdstore"},
    "metrics.py": {"socket", "selectors", "threading", "torch", "prometheus_client", "weightcache.daemon.transport",
                   "weightcache.daemon.loop"},
    "lograte.py": {"socket", "selectors", "threading", "torch", "weightcache.daemon.transport",
                   "weightcache.daemon.handlers"},
    "loop.py": {"torch"},
    "__init__.py": {"torch"},
    "budget.py": {"socket", "threading", "torch", "weightcache.memory", "weightcache.protocol",
                  "weightcache.daemon.state", "weightcache.daemon.handlers"},
    "tiers.py": {"socket", "selectors", "threading", "torch", "weightcache.memory", "weightcache.daemon.transport",
                 "weightcache.daemon.handlers", "weightcache.daemon.loads", "weightcache.daemon.fdstore"},
    "bootstrap.py": {"torch", "weightcache.cli", "weightcache.client"},
}


def test_every_daemon_room_declares_its_boundaries():
    """Each file of service/weightcache/daemon/ is a known room whose docstring says what it owns and
    forbids at least the imports above (the parametrized test then enforces the line)."""
    rooms = {p.name for p in (PKG / "daemon").glob("*.py")}
    assert rooms == set(DAEMON_ROOMS), "a new file in daemon/ needs its entry (and its docstring rules) here"
    for name, must in DAEMON_ROOMS.items():
        doc = ast.get_docstring(ast.parse((PKG / "daemon" / name).read_text())) or ""
        m = re.search(r"Forbidden imports:(.*?)(?:\n\n|$)", doc, re.S)
        assert m, f"daemon/{name}: no 'Forbidden imports:' line"
        declared = {n for n, _ in _rules(m.group(1))}
        assert must <= declared, f"daemon/{name} must forbid {sorted(must - declared)}"
        assert len(doc.split("\n\n")[0]) > 20, f"daemon/{name}: the first paragraph says what it owns"
