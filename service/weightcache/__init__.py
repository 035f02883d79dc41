"""weightcache: LLM weights resident in GPU memory, attached by engines in milliseconds.

Engines call :func:`attach`; operators run ``weightcache serve`` under systemd
(one instance per GPU). See README.md and docs/.

The package loads lazily (PEP 562): ``import weightcache`` imports nothing
else, ``weightcache.attach`` imports :mod:`weightcache.client` and what
attaching needs, never the load pipeline (``pipeline``, ``quant``,
``sharding``, ``loader``), which the disk fallback imports when it runs.
Without torch the import still works; :func:`attach` then raises
``ModuleNotFoundError`` naming the runtime to use.

Forbidden imports: torch, numpy, weightcache.client at module level, weightcache.pipeline, weightcache.daemon.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the submodule that defines it, imported on first access.
_LAZY = {"attach": "client", "Attachment": "client", "AttachOptions": "client", "Retry": "client",
         "WeightcacheError": "errors"}

__all__ = ["attach", "Attachment", "AttachOptions", "Retry", "WeightcacheError"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .client import AttachOptions, Attachment, Retry, attach
    from .errors import WeightcacheError


def __getattr__(name: str) -> Any:
    """Imports the submodule defining public ``name`` on first access (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # __import__, not importlib.import_module: the same import statement path (and `-X importtime` sees it)
    return getattr(__import__(f"{__name__}.{module}", fromlist=[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
