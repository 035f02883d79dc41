"""The vLLM names the weightcache plugin imports or calls, checked against a vLLM wheel's source (issue 35).

vLLM's CPU build stops at 0.32, so the engine tests run the plugin on 0.32
only; users are on 0.33 and 0.34. This check reads each wheel's Python source
with :mod:`ast` (no install, no import: the wheel is a zip) and verifies, for
every entry of :data:`SURFACE`:

- ``import``: every ``from vllm... import NAME`` in the plugin's modules
  (:data:`PLUGIN_MODULES`, found by walking their syntax trees, function
  bodies included) resolves in the wheel: defined at the top level of the
  module (also inside a top-level ``if``/``try``), imported into it (``from
  .x import NAME``, ``from .x import *``, followed), a submodule, or served by
  the module's ``__getattr__`` (``vllm.platforms.current_platform``). An
  import the plugin makes inside ``try: ... except ImportError`` may be
  missing where :data:`OPTIONAL` says so, and must resolve everywhere else;
- ``call``: a function or method the plugin calls accepts the call as the
  plugin writes it (:class:`Call`: the number of positional arguments and the
  keyword names), methods looked up through the class's bases;
- ``override``: a method of the plugin's loader that vLLM calls exists on
  vLLM's ``BaseModelLoader`` with the same parameter names (vLLM may call it
  by keyword), and every abstract method of the wheel's ``BaseModelLoader``
  is defined by the plugin's loader;
- ``field``: a config attribute the plugin reads (a dataclass field, a class
  attribute or a property), looked up through the bases.

Any import of a vLLM name that :data:`SURFACE` does not list is itself a
failure: a new use must be added here (and so checked) before it ships.

Run: ``python tests/vllm_surface.py WHEEL...`` (exit 1 and one line per
problem), or :func:`check` from tests/unit/test_vllm_surface.py (``make test``),
which fetches the wheels of :data:`VERSIONS` into ``.cache/vllm-wheels``.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
import zipfile
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "service" / "weightcache" / "integrations"
#: The plugin's modules that import vLLM.
PLUGIN_MODULES = ("vllm.py", "vllm_zero_copy.py", "vllm_fallback.py", "vllm_publish.py")
#: The plugin's loader class and its module (for ``override``).
LOADER = ("vllm.py", "WeightcacheModelLoader")
#: Where the wheels are cached, and the versions ``make test`` checks (``VLLM_CHECKED`` in mk/vllm.mk).
WHEELS = REPO / ".cache" / "vllm-wheels"


def versions() -> list[str]:
    """``VLLM_CHECKED`` of mk/vllm.mk: the vLLM versions whose wheels the check reads."""
    text = (REPO / "mk" / "vllm.mk").read_text()
    return re.search(r"^VLLM_CHECKED\s*:=\s*(.+)$", text, re.M).group(1).split()


@dataclasses.dataclass(frozen=True)
class Call:
    """A call as the plugin writes it: ``positional`` arguments, then ``keywords`` (names)."""

    positional: int = 0
    keywords: tuple[str, ...] = ()


#: What the plugin uses: (kind, dotted target, detail). ``call``: detail is the :class:`Call`;
#: ``override``: detail is the plugin loader's method name; ``field``/``import``: None.
SURFACE: tuple[tuple[str, str, object], ...] = (
    # imports (also found from the plugin's source: a new one must be listed here)
    ("import", "vllm.__version__", None),  # the publication's engine key
    ("import", "vllm.config.ModelConfig", None),
    ("import", "vllm.config.VllmConfig", None),
    ("import", "vllm.config.load.LoadConfig", None),
    ("import", "vllm.distributed.get_tensor_model_parallel_rank", None),
    ("import", "vllm.distributed.get_tensor_model_parallel_world_size", None),
    ("import", "vllm.distributed.get_pp_group", None),
    ("import", "vllm.logger.init_logger", None),
    ("import", "vllm.model_executor.model_loader.register_model_loader", None),
    ("import", "vllm.model_executor.model_loader.base_loader.BaseModelLoader", None),
    ("import", "vllm.model_executor.model_loader.default_loader.DefaultModelLoader", None),
    ("import", "vllm.platforms.current_platform", None),
    ("import", "vllm.utils.torch_utils.set_default_torch_dtype", None),
    ("import", "vllm.model_executor.layers.quantization.base_config.QuantizeMethodBase", None),
    ("import", "vllm.model_executor.model_loader.reload.meta.materialize_meta_tensor", None),
    ("import", "vllm.model_executor.model_loader.utils.initialize_model", None),
    ("import", "vllm.model_executor.model_loader.utils.process_weights_after_loading", None),
    ("import", "vllm.model_executor.utils.weights_already_processed", None),
    ("import", "vllm.model_executor.model_loader.weight_cache.utils.record_external_weight_charge", None),
    ("import", "vllm.model_executor.model_loader.weight_cache.utils.record_external_weight_fallback", None),
    # calls
    ("call", "vllm.logger.init_logger", Call(1)),
    ("call", "vllm.model_executor.model_loader.register_model_loader", Call(1)),
    ("call", "vllm.distributed.get_tensor_model_parallel_rank", Call(0)),
    ("call", "vllm.distributed.get_tensor_model_parallel_world_size", Call(0)),
    ("call", "vllm.distributed.get_pp_group", Call(0)),
    ("call", "vllm.utils.torch_utils.set_default_torch_dtype", Call(1)),
    ("call", "vllm.platforms.interface.Platform.is_cpu", Call(0)),
    ("call", "vllm.model_executor.model_loader.base_loader.BaseModelLoader.__init__", Call(1)),
    ("call", "vllm.model_executor.model_loader.base_loader.BaseModelLoader.load_model", Call(3)),
    ("call", "vllm.model_executor.model_loader.default_loader.DefaultModelLoader.__init__", Call(1)),
    ("call", "vllm.model_executor.model_loader.default_loader.DefaultModelLoader.load_model", Call(3)),
    ("call", "vllm.model_executor.model_loader.default_loader.DefaultModelLoader.track_weights_loading",
     Call(2, ("quantized",))),
    ("call", "vllm.model_executor.model_loader.default_loader.DefaultModelLoader.get_all_weights", Call(2)),
    ("call", "vllm.model_executor.layers.quantization.base_config.QuantizeMethodBase.process_weights_after_loading",
     Call(1)),
    ("call", "vllm.model_executor.model_loader.reload.meta.materialize_meta_tensor", Call(1)),
    ("call", "vllm.model_executor.model_loader.utils.initialize_model",
     Call(0, ("vllm_config", "model_config", "prefix"))),
    ("call", "vllm.model_executor.model_loader.utils.process_weights_after_loading", Call(3)),
    ("call", "vllm.model_executor.utils.weights_already_processed", Call(0)),
    ("call", "vllm.model_executor.model_loader.weight_cache.utils.record_external_weight_charge", Call(3)),
    ("call", "vllm.model_executor.model_loader.weight_cache.utils.record_external_weight_fallback", Call(2)),
    # methods of the plugin's loader that vLLM calls
    ("override", "vllm.model_executor.model_loader.base_loader.BaseModelLoader.download_model", "download_model"),
    ("override", "vllm.model_executor.model_loader.base_loader.BaseModelLoader.load_weights", "load_weights"),
    ("override", "vllm.model_executor.model_loader.base_loader.BaseModelLoader.load_model", "load_model"),
    ("override", "vllm.model_executor.model_loader.base_loader.BaseModelLoader.get_external_weight_memory",
     "get_external_weight_memory"),
    ("override", "vllm.model_executor.model_loader.base_loader.BaseModelLoader.get_all_weights", "get_all_weights"),
    # config attributes read
    ("field", "vllm.config.VllmConfig.model_config", None),
    ("field", "vllm.config.VllmConfig.load_config", None),
    ("field", "vllm.config.VllmConfig.device_config", None),
    ("field", "vllm.config.VllmConfig.compilation_config", None),
    ("field", "vllm.config.VllmConfig.lora_config", None),
    ("field", "vllm.config.VllmConfig.weight_transfer_config", None),
    ("field", "vllm.config.ModelConfig.model", None),
    ("field", "vllm.config.ModelConfig.model_weights", None),
    ("field", "vllm.config.ModelConfig.dtype", None),
    ("field", "vllm.config.ModelConfig.quantization", None),
    ("field", "vllm.config.ModelConfig.enable_sleep_mode", None),
    ("field", "vllm.config.load.LoadConfig.device", None),
    ("field", "vllm.config.load.LoadConfig.load_format", None),
    ("field", "vllm.config.load.LoadConfig.model_loader_extra_config", None),
    ("field", "vllm.config.device.DeviceConfig.device", None),
    ("field", "vllm.config.compilation.CompilationConfig.static_forward_context", None),
    ("field", "vllm.config.compilation.CompilationConfig.static_all_moe_layers", None),
    ("field", "vllm.model_executor.layers.quantization.base_config.QuantizeMethodBase.supports_pre_processed_weights",
     None),
)

#: Targets that exist only in some versions, with the versions where they must exist; the plugin uses
#: them behind ``try: ... except ImportError`` (checked) or, for an override, as an extra method.
OPTIONAL: dict[str, str] = {
    "vllm.model_executor.model_loader.weight_cache.utils.record_external_weight_charge": ">=0.34",
    "vllm.model_executor.model_loader.weight_cache.utils.record_external_weight_fallback": ">=0.34",
    "vllm.model_executor.model_loader.base_loader.BaseModelLoader.get_all_weights": ">=0.34",
}


class Wheel:
    """A vLLM wheel's Python source, parsed on demand (``zipfile``, no extraction)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.zip = zipfile.ZipFile(self.path)
        self.members = set(self.zip.namelist())
        self._trees: dict[str, ast.Module | None] = {}
        m = re.match(r"vllm-([^-]+)-", self.path.name)
        self.version = Version(m.group(1)) if m else None

    def _file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for f in (base + ".py", base + "/__init__.py"):
            if f in self.members:
                return f
        return None

    def is_package(self, module: str) -> bool:
        return (self._file(module) or "").endswith("/__init__.py")

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            f = self._file(module)
            self._trees[module] = ast.parse(self.zip.read(f).decode(), f) if f else None
        return self._trees[module]

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = module.split(".") if self.is_package(module) else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """Where ``module.name`` is defined: ``(defining module, node)``; a submodule's node is its tree."""
        tree = self.tree(module)
        if tree is None or depth > 12:
            return None
        star: list[str] = []
        for node in _top_level(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return module, node
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return module, node
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name \
                    and node.value is not None:
                return module, node
            if isinstance(node, ast.ImportFrom):
                src = self._absolute(module, node)
                for alias in node.names:
                    if alias.name == "*":
                        star.append(src)
                    elif (alias.asname or alias.name) == name:
                        found = self.resolve(src, alias.name, depth + 1)
                        if found is None and self.tree(f"{src}.{alias.name}") is not None:
                            return f"{src}.{alias.name}", self.tree(f"{src}.{alias.name}")
                        return found
        if self.tree(f"{module}.{name}") is not None:
            return f"{module}.{name}", self.tree(f"{module}.{name}")
        for src in star:
            found = self.resolve(src, name, depth + 1)
            if found is not None:
                return found
        for node in _top_level(tree.body):  # a module __getattr__ that serves the name (lazy attributes)
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and any(
                    isinstance(c, ast.Constant) and c.value == name for c in ast.walk(node)):
                return module, node
        return None

    def resolve_dotted(self, dotted: str) -> tuple[str, ast.AST, list[str]] | None:
        """``a.b.C.meth`` → (module of C, ClassDef C or the function, remaining attribute path ``[meth]``)."""
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:cut])
            if self.tree(module) is None:
                continue
            found = self.resolve(module, parts[cut])
            if found is not None:
                return found[0], found[1], parts[cut + 1:]
        return None

    def member(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """``name`` in ``cls``'s body or its bases' (resolved in vLLM's source; others are not followed)."""
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return module, node
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return module, node
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return module, node
        if depth > 12:
            return None
        for base in cls.bases:
            if isinstance(base, ast.Name):
                found = self.resolve(module, base.id)
                if found is not None and isinstance(found[1], ast.ClassDef):
                    hit = self.member(found[0], found[1], name, depth + 1)
                    if hit is not None:
                        return hit
        return None

    def target(self, dotted: str) -> tuple[str, ast.AST] | None:
        """The node ``dotted`` names: a module-level definition, or a class member (through bases)."""
        found = self.resolve_dotted(dotted)
        if found is None:
            return None
        module, node, rest = found
        for attr in rest:
            if not isinstance(node, ast.ClassDef):
                return None
            hit = self.member(module, node, attr)
            if hit is None:
                return None
            module, node = hit
        return module, node

    def abstract_methods(self, dotted_class: str) -> set[str]:
        found = self.target(dotted_class)
        if found is None or not isinstance(found[1], ast.ClassDef):
            return set()
        return {n.name for n in found[1].body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and any(_name(d) == "abstractmethod" for d in n.decorator_list)}


def _top_level(body: list[ast.stmt]):
    """Statements at a module's top level, inside top-level ``if``/``try`` blocks too."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                yield from _top_level(block)
        else:
            yield node


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _name(node.func)
    return ""


def accepts(fn: ast.FunctionDef, call: Call, method: bool) -> str | None:
    """Why ``fn`` cannot take ``call``, or ``None`` (``method``: its first parameter is ``self``/``cls``)."""
    a = fn.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    if method and not any(_name(d) == "staticmethod" for d in fn.decorator_list):
        positional = positional[1:]
    n_pos_defaults = len(a.defaults)
    required = positional[: len(positional) - n_pos_defaults]
    if call.positional > len(positional) and a.vararg is None:
        return f"takes {len(positional)} positional arguments, the plugin passes {call.positional}"
    named = set(positional[call.positional:]) - {p.arg for p in a.posonlyargs} | {p.arg for p in a.kwonlyargs}
    for kw in call.keywords:
        if kw not in named and a.kwarg is None:
            return f"has no parameter {kw!r} (parameters: {positional + [p.arg for p in a.kwonlyargs]})"
    missing = [p for p in required[call.positional:] if p not in call.keywords]
    missing += [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None and p.arg not in call.keywords]
    if missing:
        return f"requires {missing}, which the plugin does not pass"
    return None


def plugin_imports() -> list[tuple[str, str, bool]]:
    """Every ``from vllm... import NAME`` of :data:`PLUGIN_MODULES`: ``(file, dotted name, guarded)``;
    ``guarded``: inside a ``try`` whose handlers catch ``ImportError``."""
    out = []
    for fname in PLUGIN_MODULES:
        tree = ast.parse((PLUGIN / fname).read_text(), fname)
        guarded_nodes = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
                for inner in node.body:
                    guarded_nodes.update(id(n) for n in ast.walk(inner))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm":
                out += [(fname, f"{node.module}.{a.name}", id(node) in guarded_nodes) for a in node.names]
            elif isinstance(node, ast.Import):
                out += [(fname, a.name, id(node) in guarded_nodes) for a in node.names if a.name.split(".")[0] == "vllm"]
    return out


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(_name(t) in ("ImportError", "ModuleNotFoundError") for t in types if t is not None)


def _loader_method(name: str) -> ast.FunctionDef | None:
    """The plugin loader's method ``name`` (a ``def``, or ``name = module.function``: that function)."""
    tree = ast.parse((PLUGIN / LOADER[0]).read_text(), LOADER[0])
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == LOADER[1])
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets) \
                and isinstance(node.value, ast.Attribute):
            other = ast.parse((PLUGIN / "vllm_fallback.py").read_text())
            return next((n for n in other.body if isinstance(n, ast.FunctionDef) and n.name == node.value.attr), None)
    return None


def _params(fn: ast.FunctionDef) -> list[str]:
    return [p.arg for p in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs][1:]


def check(wheel_path: str | Path, surface=SURFACE, optional=OPTIONAL) -> list[str]:
    """Every problem of the plugin's vLLM surface in one wheel (empty: compatible).

    Args:
        wheel_path: a ``vllm-X.Y.Z-*.whl``.
        surface, optional: :data:`SURFACE` and :data:`OPTIONAL` (a test passes altered copies).

    Returns:
        `list[str]`: one line per problem, ``vllm X.Y.Z: kind target: what``.
    """
    w = Wheel(wheel_path)
    tag = f"vllm {w.version}"
    problems: list[str] = []

    def required(target: str) -> bool:
        spec = optional.get(target)
        return spec is None or w.version is None or SpecifierSet(spec).contains(w.version)

    listed = {t for kind, t, _ in surface if kind == "import"}
    for fname, dotted, guarded in plugin_imports():
        if dotted not in listed:
            problems.append(f"{tag}: import {dotted} ({fname}) is not in tests/vllm_surface.py SURFACE: list it")
        elif dotted in optional and not guarded:
            problems.append(f"{tag}: import {dotted} ({fname}) exists only in vllm{optional[dotted]} but is not "
                            f"inside try/except ImportError")
    for kind, dotted, detail in surface:
        found = w.target(dotted)
        if found is None:
            if required(dotted):
                problems.append(f"{tag}: {kind} {dotted}: not found")
            continue
        module, node = found
        if kind == "call":
            fn = node
            if isinstance(node, ast.ClassDef):  # calling a class: its __init__
                hit = w.member(module, node, "__init__")
                fn = hit[1] if hit else None
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                why = accepts(fn, detail, method=_is_method(w, dotted))
                if why:
                    problems.append(f"{tag}: call {dotted} ({module}): {why}")
            elif fn is not None and not isinstance(fn, (ast.Assign, ast.AnnAssign)):
                problems.append(f"{tag}: call {dotted}: not a function ({type(fn).__name__})")
        elif kind == "override":
            ours = _loader_method(detail)
            if ours is None:
                problems.append(f"{tag}: override {dotted}: the plugin's loader has no {detail}")
            elif isinstance(node, ast.FunctionDef) and _params(node) != _params(ours):
                problems.append(f"{tag}: override {dotted}: vLLM's parameters {_params(node)}, the plugin's "
                                f"{_params(ours)}")
    base = "vllm.model_executor.model_loader.base_loader.BaseModelLoader"
    for name in sorted(w.abstract_methods(base)):
        if _loader_method(name) is None:
            problems.append(f"{tag}: abstract method {base}.{name} is not defined by the plugin's loader")
    return problems


def _is_method(w: Wheel, dotted: str) -> bool:
    parent = w.target(dotted.rsplit(".", 1)[0])
    return parent is not None and isinstance(parent[1], ast.ClassDef)


def main(argv: list[str]) -> int:
    problems = [p for wheel in argv[1:] for p in check(wheel)]
    for p in problems:
        print(p)
    print(f"{len(problems)} problems in {len(argv) - 1} wheels", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
