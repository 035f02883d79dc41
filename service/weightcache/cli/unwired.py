"""Models placed on GPUs that have no instance yet (no ``N.sock``): ``status`` and ``reload`` say so.

The generator wires ``weightcache@N.socket`` for the GPUs of the config at
``systemctl daemon-reload``; a layout naming a new GPU does nothing until then,
and the instances that do run cannot see it (issue 26: ``reload`` and
``status`` used to ignore it without a word).
"""

from __future__ import annotations

import os

from ..config import load_config
from ..errors import ConfigError


def gpus_without_instance(listening: list[int], config: str | None = None) -> dict[int, list[str]]:
    """GPU index -> names of the models the configuration places there, for GPUs not in ``listening``.

    Args:
        listening (`list[int]`): GPU indices whose socket exists.
        config (`str`, *optional*): the main config file (default: :func:`weightcache.config.config_path`).

    Returns:
        `dict[int, list[str]]`: empty when every configured GPU listens or the configuration does not load
        (that error is reported elsewhere); GPUs of ``[service] disabled_gpus`` are left out.
    """
    try:
        cfg = load_config(config)
    except ConfigError:
        return {}
    out: dict[int, list[str]] = {}
    for p in cfg.placements():
        if p.gpu in cfg.service.disabled_gpus:  # switched off on purpose
            continue
        if p.gpu not in listening and p.model.name not in out.setdefault(p.gpu, []):
            out[p.gpu].append(p.model.name)
    return dict(sorted(out.items()))


def disabled_gpus(config: str | None = None) -> dict[int, list[str]]:
    """GPU index -> names of the models placed there, for each GPU of ``[service] disabled_gpus`` (empty when
    the configuration does not load): ``status`` and ``check-config`` show them (issue 39: invisible there)."""
    try:
        cfg = load_config(config)
    except ConfigError:
        return {}
    out: dict[int, list[str]] = {g: [] for g in sorted(cfg.service.disabled_gpus)}
    for p in cfg.placements():
        if p.gpu in out and p.model.name not in out[p.gpu]:
            out[p.gpu].append(p.model.name)
    return out


def disabled_lines(off: dict[int, list[str]]) -> list[str]:
    """One line per GPU of :func:`disabled_gpus`, naming its models and how to start it anyway."""
    return [f"GPU {gpu}: disabled ([service] disabled_gpus): weightcache.target does not start its instance"
            f"{'; ' + ('models ' if len(names) > 1 else 'model ') + ', '.join(names) + ' placed here' if names else ''}"
            f" (by hand: systemctl start weightcache@{gpu}.socket)" for gpu, names in off.items()]


def warnings(where: str, listening: list[int], config: str | None = None) -> list[str]:
    """One line per GPU of :func:`gpus_without_instance`, naming its models, the missing socket and the fix."""
    return [f"GPU {gpu}: {'models' if len(names) > 1 else 'model'} {', '.join(names)} placed here, but no instance "
            f"listens ({os.path.join(where, f'{gpu}.sock')} does not exist): run `systemctl daemon-reload && "
            f"systemctl start weightcache@{gpu}.socket` (or restart weightcache.target)"
            for gpu, names in gpus_without_instance(listening, config).items()]
