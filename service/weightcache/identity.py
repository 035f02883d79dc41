"""A slab's identity, derived from one :class:`~weightcache.spec.RankRequest`: its cache key and the dtypes it serves.

:func:`weightcache.pipeline.plan` derives both once per load (``Plan.key``,
``Plan.dtypes_served``); the service publishes them in the manifest file; the
client compares its own view (:func:`key_fields`, :func:`check_key`) with
them; the fd store's adoption recomputes the key (:func:`cache_key`) to decide
whether a kept slab is still this configuration's. Headers and ``stat()``
only, never a tensor byte.

The dtype rule (one place): a configured ``dtype`` is *effective* when casting
to it changes some tensor of the rank; otherwise the slab holds the same bytes
as ``auto`` and the key says ``auto`` (:func:`effective_dtype`). An engine
asking for dtype ``r`` is served by a slab when ``r`` is the configured dtype
or has the same effective dtype (:func:`served_dtypes`, :func:`dtype_matches`).

Forbidden imports: torch, socket, selectors, weightcache.config, weightcache.daemon, weightcache.client,
weightcache.pipeline; weightcache.quant and weightcache.sharding at module level (an engine's attach of an
unquantized slab checks its key without them: tests/unit/test_lazy_imports.py).
"""

from __future__ import annotations

from typing import Any

from .checkpoint import Checkpoint
from .errors import WeightcacheError
from .spec import DETECT, DTYPE_NAMES, RankRequest


#: Bumped whenever the bytes produced for the same inputs change (the cache key's ``pipeline_version``).
PIPELINE_VERSION = 1


def effective_dtype(dtype: str, cast_from: frozenset[str]) -> str:
    """The dtype the cache key carries: ``dtype``, or ``"auto"`` when casting to it changes nothing here.

    Args:
        dtype (`str`): ``auto``, ``bfloat16``, ``float16`` or ``float32``.
        cast_from (`frozenset[str]`): the rank's stored dtypes a cast would
            change (:func:`weightcache.sharding.cast_dtypes`).

    Returns:
        `str`: ``"auto"`` or ``dtype``.

    Example:
        >>> effective_dtype("float32", frozenset({"F32"})), effective_dtype("bfloat16", frozenset({"F32"}))
        ('auto', 'bfloat16')
    """
    if dtype == "auto" or cast_from <= {DTYPE_NAMES[dtype]}:
        return "auto"
    return dtype


def served_dtypes(configured: str, cast_from: frozenset[str]) -> frozenset[str]:
    """Every dtype name (:data:`weightcache.spec.DTYPE_NAMES`) an engine may ask for and get a slab configured
    with ``configured``: that name, and every name with the same effective dtype.

    Example:
        >>> sorted(served_dtypes("auto", frozenset({"F32"})))
        ['auto', 'float32']
    """
    have = effective_dtype(configured, cast_from)
    return frozenset(r for r in DTYPE_NAMES if r == configured or effective_dtype(r, cast_from) == have)


def rank_cast_dtypes(rank: RankRequest, ck: Checkpoint, registry: Any = None) -> frozenset[str]:
    """:func:`weightcache.sharding.cast_dtypes` of ``rank`` (headers only); ``registry``: the
    ``quant.Registry`` whose side tensors keep their dtype (None: ``quant.REGISTRY``)."""
    from . import sharding  # reads headers: only when a dtype must be worked out

    if registry is None:
        return sharding.cast_dtypes(ck, rank.tp_size, rank.tp_rank, rank.model.naming)
    return sharding.cast_dtypes(ck, rank.tp_size, rank.tp_rank, rank.model.naming, registry)


def key_fields(rank: RankRequest, ck: Checkpoint, device: dict[str, Any], scheme: Any = DETECT,
               dtype: str | None = None) -> dict[str, Any]:
    """Every field of :func:`cache_key` but ``checkpoint``.

    Reads ``config.json``; safetensors headers only when the checkpoint is
    quantized (and ``scheme`` is not given) or the effective dtype must be
    worked out (``dtype`` not given and ``rank.model.dtype`` not ``auto``).

    Args:
        rank (`RankRequest`): what is loaded, and the rank.
        ck (`Checkpoint`): the checkpoint.
        device (`dict`): ``{backend, gpu_uuid, compute_capability}`` of the slab's device.
        scheme (`quant.Scheme | None`, *optional*): the checkpoint's scheme if
            already detected (``None``: unquantized); detected here otherwise.
        dtype (`str`, *optional*): the effective dtype if already known (:func:`effective_dtype`).

    Raises:
        The errors of :func:`weightcache.quant.detect` and :func:`weightcache.sharding.shard_specs`.
    """
    model = rank.model
    if scheme is DETECT:
        from . import quant  # only when the scheme is not given (an unquantized slab's check passes None)

        scheme = quant.detect(ck)
    if dtype is None:
        dtype = "auto" if model.dtype == "auto" else effective_dtype(model.dtype, rank_cast_dtypes(rank, ck))
    return {
        "revision": model.revision,
        "architecture": (ck.config.get("architectures") or [ck.config.get("model_type", "")])[0],
        "dtype": dtype,
        "naming": model.naming,
        "tp_size": rank.tp_size,
        "tp_rank": rank.tp_rank,
        "quant_scheme": scheme.name if scheme else "",
        "quant_config_blake2b": scheme.config_hash if scheme else "",
        "kernel": model.kernel if scheme else "",
        "pipeline_version": PIPELINE_VERSION,
        "device": dict(device),
    }


def cache_key(rank: RankRequest, ck: Checkpoint, device: dict[str, Any], scheme: Any = DETECT,
              dtype: str | None = None) -> dict[str, Any]:
    """The cache key of DESIGN §5, as a nested JSON-able dict: the checkpoint's identity plus :func:`key_fields`.

    Args:
        rank, ck, device, scheme, dtype: as :func:`key_fields`.
    """
    return {"checkpoint": ck.identity(), **key_fields(rank, ck, device, scheme, dtype)}


def dtype_matches(rank: RankRequest, requested: str, key: dict[str, Any] | None = None) -> bool:
    """Whether the slab of ``rank`` (configured with ``rank.model.dtype``) serves an engine asking for ``requested``.

    The rule of :func:`served_dtypes`, for a slab not planned yet (a planned
    one has ``Plan.dtypes_served``). ``key`` is the slab's cache key when it
    is loaded (its ``dtype`` is already effective); otherwise the checkpoint's
    headers are read, once. A checkpoint that cannot be read matches, so that
    the engine hears the slab's own error rather than ``model_not_found``.
    """
    model = rank.model
    if requested == model.dtype:
        return True
    if requested not in DTYPE_NAMES:
        return False
    if requested == "auto" and key is not None:
        return key["dtype"] == "auto"
    try:
        cast_from = rank_cast_dtypes(rank, Checkpoint(model.path, validate=False))
    except WeightcacheError:
        return True
    have = key["dtype"] if key is not None else effective_dtype(model.dtype, cast_from)
    return have == effective_dtype(requested, cast_from)


def check_key(fields: dict[str, Any], ck: Checkpoint, key: dict[str, Any]) -> list[str]:
    """Fields in which a service's cache ``key`` differs from this engine's view.

    Args:
        fields (`dict`): :func:`key_fields` computed here.
        ck (`Checkpoint`): the checkpoint as it is now; its identity is checked
            with :meth:`Checkpoint.identity_diff` (``stat()`` only).
        key (`dict`): the key from the service's manifest.

    Returns:
        `list[str]`: dotted field paths, empty on a match.
    """
    diff = diff_keys(fields, {k: v for k, v in key.items() if k != "checkpoint"})
    return diff + ["checkpoint." + d for d in ck.identity_diff(key.get("checkpoint") or {})]


def diff_keys(expected: Any, actual: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the fields that differ between two cache keys.

    Example:
        >>> diff_keys({"a": 1, "b": {"c": 2}}, {"a": 1, "b": {"c": 3}})
        ['b.c']
    """
    if expected == actual:  # the usual case, compared in C
        return []
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = []
        for k in sorted(set(expected) | set(actual), key=str):
            p = f"{prefix}.{k}" if prefix else str(k)
            if k not in expected or k not in actual:
                out.append(p)
            else:
                out.extend(diff_keys(expected[k], actual[k], p))
        return out
    return [] if expected == actual else [prefix or "<key>"]
