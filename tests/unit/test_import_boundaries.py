"""Module boundaries: every module's "Forbidden imports:" docstring line holds (STYLE.md).

Reads the line from each module's docstring, parses the module with ``ast``
and fails on any import of a forbidden name; "X at module level" forbids X
only in top-level statements. Short names (``daemon``) mean ``weightcache.daemon``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
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
    """(module, only at module level) per rule; ``X directly`` is X for the source check (see _direct)."""
    rules = []
    for part in re.split(r"[,;]", re.sub(r"\([^)]*\)", "", text)):  # "(why)" remarks are not rules
        part = " ".join(part.split()).rstrip(".").strip()
        if not part:
            continue
        top_only = part.endswith("at module level")
        name = part.removesuffix("at module level").strip().removesuffix(" directly")
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
    bad = PKG / "protocol" / "_codec.py"
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
    "effects.py": {"socket", "selectors", "threading", "weightcache.daemon.transport", "weightcache.daemon.loads",
                   "weightcache.daemon.fdstore", "weightcache.daemon.handlers"},
    "load_results.py": {"socket", "selectors", "weightcache.protocol", "weightcache.daemon.transport",
                        "weightcache.daemon.handlers", "weightcache.daemon.loads"},
    "fdstore.py": {"socket", "selectors", "weightcache.protocol", "weightcache.daemon.transport",
                   "weightcache.daemon.handlers"},
    "access.py": {"socket", "selectors", "torch", "weightcache.daemon.transport", "weightcache.daemon.handlers"},
    "transport.py": {"threading", "torch", "weightcache.pipeline", "weightcache.daemon.handlers",
                     "weightcache.daemon.loads"},
    "outbox.py": {"threading", "torch", "weightcache.pipeline", "weightcache.daemon.handlers",
                  "weightcache.daemon.loads", "weightcache.daemon.transport"},
    "clients.py": {"threading", "torch", "weightcache.pipeline", "weightcache.daemon.handlers",
                   "weightcache.daemon.loads", "weightcache.daemon.transport", "weightcache.daemon.outbox"},
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
    "offloop.py": {"torch", "weightcache.daemon.loop"},
    "__init__.py": {"torch"},
    "budget.py": {"socket", "threading", "torch", "weightcache.memory", "weightcache.protocol",
                  "weightcache.daemon.state", "weightcache.daemon.handlers"},
    "tiers.py": {"socket", "selectors", "threading", "torch", "weightcache.memory", "weightcache.daemon.transport",
                 "weightcache.daemon.handlers", "weightcache.daemon.loads", "weightcache.daemon.fdstore"},
    "bootstrap.py": {"torch", "weightcache.cli", "weightcache.client"},
    "imaging.py": {"socket", "selectors", "torch", "weightcache.daemon.transport", "weightcache.daemon.loop"},
    "publish.py": {"socket", "selectors", "threading", "torch", "weightcache.daemon.transport",
                   "weightcache.daemon.handlers", "weightcache.daemon.loads", "weightcache.daemon.fdstore"},
    "peers.py": {"torch", "weightcache.daemon.transport", "weightcache.daemon.handlers", "weightcache.daemon.loop"},
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


# -- at run time: what importing a module really loads ----------------------------------------

#: Run in one fresh interpreter (no weightcache module loaded, nothing but os and sys imported
#: by the probe itself): for each module named on the command line, fork, import it, print
#: ``module<TAB>OK<TAB>every name in sys.modules`` (or ``module<TAB>ERR<TAB>type: message``):
#: what ``python -c "import weightcache.x"`` loads.
_PROBE = r"""
import os, sys
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(name)
            line = "OK\t" + " ".join(sorted(sys.modules))
        except BaseException as e:
            line = "ERR\t" + type(e).__name__ + ": " + " ".join(str(e).split())
        os.write(w, (name + "\t" + line + "\n").encode())
        os._exit(0)
    os.close(w)
    while True:
        b = os.read(r, 1 << 20)
        if not b:
            break
        os.write(1, b)
    os.close(r)
    os.waitpid(pid, 0)
"""

#: Modules whose import breaks their docstring's line today -> who is fixing it. Emptied by the lead.
RUNTIME_OFFENDERS: dict[str, str] = {}

#: Third-party packages a module may need that the test environment may lack (the module is then skipped).
OPTIONAL = ("vllm",)


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _probe(names: list[str], cwd: Path | None = None) -> dict[str, tuple[str, set[str]]]:
    """module -> ("OK", names in sys.modules after importing it fresh) or ("ERR", {message})."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    if cwd is not None:
        env["PYTHONPATH"] = str(cwd)
    out = subprocess.run([sys.executable, "-c", _PROBE, *names], capture_output=True, text=True, env=env,
                         cwd=cwd, timeout=600, check=True).stdout
    res = {}
    for line in out.splitlines():
        name, status, rest = (line.split("\t") + [""])[:3]
        res[name] = (status, set(rest.split()) if status == "OK" else {rest})
    return res


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@pytest.fixture(scope="module")
def loaded() -> dict[str, tuple[str, set[str]]]:
    """One probe run over every module with a Forbidden line and every package above one."""
    names = [_module_name(p.values[0]) for p in _modules()]
    return _probe(sorted(set(names) | {pkg for n in names for pkg in _parents(n)}))


def _direct(text: str) -> set[str]:
    """Rules written ``X directly``: the module must not import X itself, but what it imports may
    (a wiring room such as ``daemon.loop`` loads the rooms that run the pipeline)."""
    out = set()
    for part in re.split(r"[,;]", re.sub(r"\([^)]*\)", "", text)):
        part = " ".join(part.split()).rstrip(".").strip()
        if part.endswith(" directly"):
            name = part.removesuffix(" directly").strip()
            out.add(f"weightcache.{name}" if name in LOCAL else name)
    return out


def _violations(text: str, modules: set[str], name: str) -> list[str]:
    """What a rule of ``text`` forbids among the ``modules`` that importing ``name`` loaded.

    A forbidden project module or third-party package (torch, numpy, prometheus_client...)
    counts when it is loaded at all, through any chain. A standard-library module is the
    source check's only: the standard library loads ``threading`` for ``logging`` and
    ``socket`` for ``subprocess``, and a room forbidding ``threading`` means that it starts
    no thread, not that nothing below it holds a lock. ``X directly`` rules (:func:`_direct`)
    are the source check's only too. ``name`` and its packages do not count (what they
    load does: in mode ``fresh``, a package ``__init__`` importing a forbidden module fails).
    """
    modules = modules - {name, *_parents(name)}  # what they load still counts
    direct = _direct(text)
    bad = []
    for rule, _ in _rules(text):  # "X at module level" too: a run-time import is module level by definition
        if rule.split(".")[0] in sys.stdlib_module_names or rule in direct:
            continue
        bad += sorted(m for m in modules if m == rule or m.startswith(rule + "."))
    return bad


@pytest.mark.parametrize("path,text", list(_modules()))
def test_forbidden_imports_hold_at_run_time(loaded, path, text):
    """Importing the module in a fresh interpreter loads none of its "Forbidden imports"
    (through any chain: its own imports, its parent packages' ``__init__``)."""
    name = _module_name(path)
    status, fresh = loaded[name]
    if status == "ERR":
        (msg,) = fresh
        if msg.startswith("ModuleNotFoundError") and any(f"'{o}" in msg for o in OPTIONAL):
            pytest.skip(f"{name}: {msg}")
        raise AssertionError(f"importing {name} failed: {msg}")
    bad = _violations(text, fresh, name)
    if bad and name in RUNTIME_OFFENDERS:
        pytest.xfail(f"{name} loads {bad[:5]} (owner: {RUNTIME_OFFENDERS[name]})")
    parent = _parents(name)[-1] if "." in name else None
    by_parent = set(_violations(text, loaded[parent][1], name)) if parent and loaded[parent][0] == "OK" else set()
    assert not bad, (f"`import {name}` loads {bad[:8]}, which its docstring forbids ({text.strip()})"
                     + (f"; {sorted(by_parent)[:5]} already through the package {parent}" if by_parent else ""))


def test_run_time_probe_sees_a_violation(tmp_path):
    """The probe and the rule matching catch a real import (a test that cannot fail is a defect)."""
    pkg = tmp_path / "wc_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import heavy\n")
    (pkg / "heavy.py").write_text("import socket\n")
    (pkg / "leaf.py").write_text('"""Forbidden imports: wc_probe_pkg.heavy, socket."""\n')
    found = _probe(["wc_probe_pkg.leaf", "wc_probe_pkg.heavy"], cwd=tmp_path)
    status, fresh = found["wc_probe_pkg.leaf"]
    rules = " wc_probe_pkg.heavy, socket."
    assert status == "OK" and _violations(rules, fresh, "wc_probe_pkg.leaf") == ["wc_probe_pkg.heavy"]
    assert "socket" in fresh  # loaded, but a standard-library rule is the source check's
    assert _violations(" wc_probe_pkg.heavy directly.", fresh, "wc_probe_pkg.leaf") == []
    assert _violations(rules, found["wc_probe_pkg.heavy"][1], "wc_probe_pkg.heavy") == []  # itself does not count
    assert _rules(" wc_probe_pkg.heavy directly, torch at module level (why).") == [("wc_probe_pkg.heavy", False),
                                                                                   ("torch", True)]
