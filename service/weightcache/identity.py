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

import json

from .checkpoint import Checkpoint
from .errors import PublicationInvalid, WeightcacheError
from .hashes import blake2b_hex
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


# --- the engine's key of a published slab (DESIGN §6.4) -------------------------------------------------------

#: Every parallel rank and size an engine key carries (``parallel``): tensor, pipeline, data and expert parallelism.
PARALLEL_FIELDS = ("tp_size", "tp_rank", "pp_size", "pp_rank", "dp_size", "dp_rank", "ep_size", "ep_rank")
#: The fields every engine key has, and their JSON types (an engine may add fields of its own: they are compared too).
ENGINE_KEY_FIELDS: dict[str, type] = {
    "engine": str, "engine_version": str, "architecture": str, "dtype": str, "quantization": dict,
    "parallel": dict, "draft": str, "kernels": dict, "compute_capability": str,
}
#: Names a publisher may not use: the service writes them (the checkpoint identity it computes, the slab's device).
RESERVED_KEY_FIELDS = ("checkpoint", "device")


def _invalid(field: str, what: str) -> PublicationInvalid:
    return PublicationInvalid(f"engine key: {field} {what} (docs/protocol.md, \"The engine key\")", field=field)


def engine_key(fields: dict[str, Any], tp_size: int, tp_rank: int) -> dict[str, Any]:
    """Checks an engine's key fields (what ``publish`` and ``attach_published`` carry) and returns them.

    Required: ``engine`` and ``engine_version`` (non-empty strings), ``architecture`` (the ``config.json``
    architecture the engine ran), ``dtype`` (the model dtype it resolved, e.g. ``bfloat16``), ``quantization``
    (``{"method": str, "config_blake2b": str}``; ``""`` for both when unquantized), ``parallel`` (every one of
    :data:`PARALLEL_FIELDS`, integers, ``0 <= rank < size``), ``draft`` (``""`` for the target model, else the
    draft's role, e.g. ``eagle``), ``kernels`` (the kernel backend chosen per kind, strings) and
    ``compute_capability`` (``"9.0"``; ``""`` on a CPU). Other fields (RoPE parameters, KV-cache dtype...) are
    allowed and compared like the rest; :data:`RESERVED_KEY_FIELDS` are the service's.

    Args:
        fields (`dict`): the engine's key, a JSON object.
        tp_size, tp_rank (`int`): the rank the request names; must equal ``parallel``'s.

    Returns:
        `dict`: ``fields`` itself.

    Raises:
        PublicationInvalid (`publication_invalid`): a field is missing, reserved or of the wrong type
            (``details["field"]`` names it).

    Example:
        >>> k = engine_key({"engine": "vllm", "engine_version": "0.32.0", "architecture": "Qwen3ForCausalLM",
        ...                 "dtype": "bfloat16", "quantization": {"method": "", "config_blake2b": ""},
        ...                 "parallel": dict.fromkeys(PARALLEL_FIELDS, 0) | {"tp_size": 1, "pp_size": 1,
        ...                                                                  "dp_size": 1, "ep_size": 1},
        ...                 "draft": "", "kernels": {}, "compute_capability": ""}, 1, 0)
        >>> engine_key_blake2b(k) == engine_key_blake2b(dict(k))
        True
    """
    for name in RESERVED_KEY_FIELDS:
        if name in fields:
            raise _invalid(name, "is the service's own field: leave it out")
    for name, typ in ENGINE_KEY_FIELDS.items():
        if name not in fields:
            raise _invalid(name, "is missing")
        if not isinstance(fields[name], typ):
            raise _invalid(name, f"must be a JSON {'string' if typ is str else 'object'}, got "
                                 f"{type(fields[name]).__name__}")
    for name in ("engine", "engine_version"):
        if not fields[name]:
            raise _invalid(name, "must not be empty")
    q = fields["quantization"]
    for name in ("method", "config_blake2b"):
        if not isinstance(q.get(name), str):
            raise _invalid(f"quantization.{name}", "must be a string (\"\" when unquantized)")
    par = fields["parallel"]
    for name in PARALLEL_FIELDS:
        v = par.get(name)
        if type(v) is not int or v < (1 if name.endswith("_size") else 0):
            raise _invalid(f"parallel.{name}", f"must be an integer >= {1 if name.endswith('_size') else 0}, "
                                               f"got {v!r}")
    for kind in ("tp", "pp", "dp", "ep"):
        if par[f"{kind}_rank"] >= par[f"{kind}_size"]:
            raise _invalid(f"parallel.{kind}_rank", f"is {par[kind + '_rank']}, not below "
                                                    f"{kind}_size = {par[kind + '_size']}")
    if (par["tp_size"], par["tp_rank"]) != (tp_size, tp_rank):
        raise _invalid("parallel.tp_size", f"says tp_size={par['tp_size']} tp_rank={par['tp_rank']}, the request "
                                           f"tp_size={tp_size} tp_rank={tp_rank}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in fields["kernels"].items()):
        raise _invalid("kernels", "must map each kernel kind to the backend's name (strings)")
    return fields


def engine_key_blake2b(fields: dict[str, Any]) -> str:
    """blake2b-128 (hex) of an engine key as sorted, compact JSON: what names its publication."""
    return blake2b_hex(json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                                  allow_nan=False).encode())


def published_key(fields: dict[str, Any], ck: Checkpoint, device: dict[str, Any]) -> dict[str, Any]:
    """The cache key of a published slab: the engine's key ``fields``, the checkpoint identity computed here from
    the files (never the publisher's word), and the slab's ``device`` (:func:`cache_key`'s).

    Reads the checkpoint's headers and ``stat()``s its files; no tensor byte.
    """
    return {"checkpoint": ck.identity(), **fields, "device": dict(device)}
