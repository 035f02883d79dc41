"""The TOML configuration: models, their TP layouts, their placement on GPUs, and the accounts it names.

The face of the package (schema: ``docs/configuration.md``, ``weightcache.toml(5)``). Its rooms:

- :mod:`._config`: :func:`load_config` and the records it returns;
- :mod:`._files`: bounded, non-blocking reads of the TOML files and drop-ins, and a key's line;
- :mod:`._accounts`: user and group names resolved to ids where the configuration is read.

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

from ._accounts import METRICS_USER, AccountNames
from ._config import (BACKENDS, BUDGET_RESERVE_FRACTION, BUDGET_RESERVE_MIN_BYTES, DEFAULT_CONFIG,
                      DEFAULT_METRICS_PORT, MAX_GPU_INDEX, PRELOADS, PRIORITY_RANGE, Config, Layout, MetricsConfig,
                      ModelConfig, Placement, ServiceConfig, account_names, config_path, default_budget_bytes,
                      load_config, load_metrics_config)
from ._files import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, resolve_paths

__all__ = ["AccountNames", "BACKENDS", "BUDGET_RESERVE_FRACTION", "BUDGET_RESERVE_MIN_BYTES", "Config",
           "DEFAULT_CONFIG", "DEFAULT_METRICS_PORT", "Layout", "MAX_CONFIG_BYTES", "MAX_CONFIG_DEPTH", "MAX_GPU_INDEX",
           "METRICS_USER", "MetricsConfig", "ModelConfig", "Placement", "PRELOADS", "PRIORITY_RANGE", "ServiceConfig",
           "account_names", "config_path", "default_budget_bytes", "load_config", "load_metrics_config",
           "resolve_paths"]
