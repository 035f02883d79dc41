"""A checkpoint's quantization config, normalised, and the checks every scheme shares.

:func:`read_config` reads ``config.json``'s ``quantization_config`` (any
``quant_method``, the Hugging Face convention), else asks each registered
scheme family for its own file (ModelOpt: ``hf_quant_config.json``).
:func:`capability` finds the config's capability row (or rejects it, naming
the first quantized layer); :func:`is_excluded` applies ``exclude_modules`` /
``ignore`` as vLLM does. Headers and JSON only.

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client, weightcache.sharding.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from ..checkpoint import Checkpoint
from ..errors import CheckpointCorrupt, UnsupportedQuantization
from ..hashes import blake2b_hex
from ..spec import FUSED_PARTS
from . import capabilities
from .capabilities import Capability

if TYPE_CHECKING:
    from .registry import SchemeRules

#: Suffixes of scale-like tensors, by which :func:`first_quantized_layer` finds a quantized module.
SCALE_LIKE = (".weight_scale", ".weight_scale_inv", ".weight_scale_2", ".input_scale", ".qweight",
              ".weight_packed", ".scales", ".qzeros")


@dataclass(frozen=True)
class QuantConfig:
    """A quantization config, normalised.

    Attributes:
        file (`str`): path of the file it came from (for messages).
        method (`str`): ``quant_method`` (lower case; ``modelopt`` for ``hf_quant_config.json``).
        algo (`str`): ``quant_algo`` upper-cased, ``""`` when absent.
        kv_cache_algo (`str | None`): ``kv_cache_quant_algo`` upper-cased.
        exclude (`tuple[str]`): ``exclude_modules`` / ``ignore`` patterns.
        raw (`dict`): the config object as read (hashed into the cache key).
    """

    file: str
    method: str
    algo: str
    kv_cache_algo: str | None
    exclude: tuple[str, ...]
    raw: dict


def config_hash(cfg: dict) -> str:
    """blake2b-128 hex digest of ``cfg`` as sorted, compact JSON."""
    return blake2b_hex(json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode())


def natural_key(name: str) -> list:
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def exclude_list(value: Any, file: str, key: str) -> tuple[str, ...]:
    """``exclude_modules`` / ``ignore`` as a tuple of patterns.

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): not a list of strings; names ``file`` and ``key``.
    """
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointCorrupt(
            f"{file}: {key} must be a list of module names or wildcards, got {value!r}; "
            f"fix the checkpoint's quantization config",
            file=file,
            key=key,
        )
    return tuple(value)


def kv_algo(value: Any) -> str | None:
    """The KV-cache algo upper-cased; config.json style ``{"type": "float", "num_bits": 8}`` is ``FP8``."""
    if value is None:
        return None
    if isinstance(value, dict):
        if value.get("type") == "float" and value.get("num_bits") == 8:
            return "FP8"
        return json.dumps(value, sort_keys=True)
    return str(value).upper()


def read_config(ck: Checkpoint, families: Iterable[SchemeRules] = ()) -> QuantConfig | None:
    """The checkpoint's quantization config, or ``None`` when it has none.

    Source: ``config.json`` → ``quantization_config`` first (as vLLM's
    ``get_quant_config``), else each registered family's own file
    (:meth:`weightcache.quant.registry.SchemeRules.read_config`), asked in the order of ``families``.

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): the config is not a JSON
            object, or ``exclude_modules`` / ``ignore`` is not a list of strings.
    """
    qc = ck.config.get("quantization_config")
    if qc:
        file = str(ck.path / "config.json")
        if not isinstance(qc, dict):
            raise CheckpointCorrupt(f"{file}: quantization_config must be an object, got {qc!r}", file=file)
        method = str(qc.get("quant_method", "")).lower()
        if method.startswith("modelopt"):
            method = "modelopt"
        inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
        algo = str(inner.get("quant_algo") or "").upper()
        exclude = inner.get("ignore", inner.get("exclude_modules"))
        kv = inner.get("kv_cache_quant_algo", inner.get("kv_cache_scheme"))
        return QuantConfig(file, method, algo, kv_algo(kv),
                           exclude_list(exclude, file, "quantization_config.ignore"), qc)
    for rules in families:
        found = rules.read_config(ck)
        if found is not None:
            return found
    return None


def is_excluded(module: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """Whether ``module`` is left unquantized by ``exclude_modules`` / ``ignore``.

    The rules of vLLM's ``ModelOptQuantConfigBase.is_layer_excluded``
    (``vllm/model_executor/layers/quantization/modelopt.py``), in order:

    1. exact match; for a fused name (``qkv_proj``, ``gate_up_proj``) every
       part (``q_proj``...) must be listed, and parts must agree;
    2. substring: a pattern other than ``module`` itself contained in it (also
       after stripping a ``language_model.`` prefix), e.g. ``lm_head``;
    3. ``fnmatch`` wildcard (``model.layers.*.mlp*``), case-sensitive.

    Args:
        module (`str`): module name without ``.weight`` (``model.layers.0.self_attn.q_proj``).
        patterns: the config's ``exclude_modules`` / ``ignore``.

    Raises:
        UnsupportedQuantization (`unsupported_quantization`): a fused name whose
            parts are excluded only partly.

    Example:
        >>> is_excluded("lm_head", ["lm_head"]), is_excluded("model.layers.3.mlp.up_proj", ["*mlp*"])
        (True, True)
    """
    if not patterns:
        return False
    proj = module.rsplit(".", 1)[-1]
    if proj in FUSED_PARTS:
        parent = module[: len(module) - len(proj)]
        flags = {p: (parent + p) in patterns for p in FUSED_PARTS[proj]}
        if len(set(flags.values())) > 1:
            raise UnsupportedQuantization(
                f"layer {module!r}: exclude list names only some of its parts {flags}; all parts of a fused "
                f"layer must have the same precision",
                layer=module,
            )
        if all(flags.values()):
            return True
    elif module in patterns:
        return True
    for p in patterns:
        if p != module and (p in module or (module.startswith("language_model.")
                                             and p in module.removeprefix("language_model."))):
            return True
    return any(fnmatchcase(module, p) for p in patterns)


def first_quantized_layer(ck: Checkpoint, exclude: tuple[str, ...] = ()) -> str:
    """Name of the first (natural order) quantized module of ``ck``, for messages.

    A module is taken as quantized when it has a scale-like tensor
    (:data:`SCALE_LIKE`) and is not excluded; failing that, the first 2-D
    ``*.weight`` not excluded.
    """
    cands = set()
    for name in ck.tensors:
        for suf in SCALE_LIKE:
            if name.endswith(suf):
                cands.add(name[: -len(suf)])
    for m in sorted(cands, key=natural_key):
        if not _safe_excluded(m, exclude):
            return m
    for name in sorted(ck.tensors, key=natural_key):
        info = ck.tensors[name]
        if name.endswith(".weight") and len(info.shape) == 2 and not _safe_excluded(name[:-7], exclude):
            return name[:-7]
    return "<none>"


def _safe_excluded(module: str, exclude) -> bool:
    try:
        return is_excluded(module, exclude)
    except UnsupportedQuantization:
        return False


def capability(ck: Checkpoint, qc: QuantConfig, supported: Mapping[tuple[str, str], Capability],
               kernel: str | None = None) -> Capability:
    """The capability row for ``qc`` (and ``kernel``) among ``supported`` (a registry's rows), checking the
    KV-cache algo too.

    Raises:
        UnsupportedQuantization (`unsupported_quantization`): unsupported
            scheme, KV-cache algo or kernel target; names the first quantized layer.
    """
    layer = first_quantized_layer(ck, qc.exclude)
    cap = capabilities.lookup(qc.method, qc.algo, supported, where=qc.file, layer=layer, kernel=kernel)
    if qc.kv_cache_algo not in capabilities.SUPPORTED_KV_CACHE:
        raise UnsupportedQuantization(
            f"{qc.file}: KV-cache quantization {qc.kv_cache_algo!r} of {cap.scheme} is not supported "
            f"(supported: FP8 or none); first affected layer {layer!r}",
            scheme=cap.scheme,
            layer=layer,
            file=qc.file,
        )
    return cap
