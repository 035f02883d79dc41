"""A checkpoint's quantization config, normalised, and the checks every scheme shares.

:func:`read_config` reads the quantization config where vLLM reads it:
``config.json``'s ``quantization_config`` (any ``quant_method``, the Hugging
Face convention), each registered scheme family's own file (ModelOpt:
``hf_quant_config.json``), ``text_config.quantization_config``,
``compression_config``, then ``quantize_config.json`` / ``quant_config.json``
(GPTQ, AWQ); a checkpoint with quantized tensors and none of these is refused.
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


#: Files of other toolchains that vLLM reads for the method's own config
#: (``get_config_filenames``: ``AutoGPTQConfig`` ``quantize_config.json``, ``AutoAWQConfig`` also
#: ``quant_config.json``; GPTQ's and AWQ's classic exports), in vLLM's order.
TOOLCHAIN_FILES = ("quantize_config.json", "quant_config.json")

#: Tensor name suffixes that only a quantized checkpoint stores, which no engine loads without the
#: scheme's config (packed integer weights, their zero points and group indices, compressed-tensors' packed
#: weights, block FP8's inverse scales): a checkpoint that has one and no quantization config is refused
#: rather than planned as unquantized. ModelOpt-style ``weight_scale`` and ``F8_E4M3`` weights are not on
#: the list: vLLM loads those as plain tensors when no config says otherwise, and so does the service.
QUANTIZED_ONLY = (".qweight", ".qzeros", ".g_idx", ".weight_packed", ".weight_zero_point", ".weight_scale_inv")


def _from_config_object(qc: Any, file: str, key: str) -> QuantConfig:
    """A ``quantization_config``-style object (``quant_method`` and its keys) as a :class:`QuantConfig`."""
    if not isinstance(qc, dict):
        raise CheckpointCorrupt(f"{file}: {key} must be an object, got {qc!r:.200}; fix the checkpoint's "
                                f"quantization config", file=file, key=key)
    method = str(qc.get("quant_method", "")).lower().replace("compressed_tensors", "compressed-tensors")
    if method.startswith("modelopt"):
        method = "modelopt"
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = str(inner.get("quant_algo") or "").upper()
    exclude = inner.get("ignore", inner.get("exclude_modules"))
    kv = inner.get("kv_cache_quant_algo", inner.get("kv_cache_scheme"))
    return QuantConfig(file, method, algo, kv_algo(kv), exclude_list(exclude, file, f"{key}.ignore"), qc)


def _toolchain_method(cfg: dict) -> str:
    """``quant_method`` of a ``quantize_config.json`` / ``quant_config.json``: its own ``quant_method``
    when it has one, else ``awq`` for AutoAWQ's keys (``w_bit``, ``q_group_size``, ``zero_point``), else
    ``gptq`` (AutoGPTQ's ``bits``, ``group_size``, ``desc_act``)."""
    method = cfg.get("quant_method")
    if isinstance(method, str) and method:
        return method.lower()
    return "awq" if {"w_bit", "q_group_size", "zero_point"} & set(cfg) else "gptq"


def read_config(ck: Checkpoint, families: Iterable[SchemeRules] = ()) -> QuantConfig | None:
    """The checkpoint's quantization config, or ``None`` when it has none.

    Read where vLLM reads it (``transformers_utils/config.py``,
    ``model_arch_config_convertor.py`` and ``weight_utils.get_quant_config``
    of vLLM 0.32 to 0.34), first found wins:

    1. ``config.json`` → ``quantization_config`` (the Hugging Face convention, any ``quant_method``);
    2. each family's own file, in the order of ``families``
       (:meth:`weightcache.quant.registry.SchemeRules.read_config`;
       ModelOpt: ``hf_quant_config.json``, which vLLM reads when 1 is absent);
    3. ``config.json`` → ``text_config`` → ``quantization_config`` (vision-language models);
    4. ``config.json`` → ``compression_config`` (older compressed-tensors exports);
    5. ``quantize_config.json``, then ``quant_config.json`` (AutoGPTQ and AutoAWQ exports, which vLLM
       reads with ``--quantization gptq|awq``): ``quant_method`` from the file, else guessed from its
       keys (:func:`_toolchain_method`).

    A checkpoint with none of these whose tensors are quantized (:func:`quantized_tensor`) is refused:
    planning it as unquantized would give a slab no engine can use.

    Raises:
        CheckpointCorrupt (`checkpoint_corrupt`): the config is not a JSON
            object, or ``exclude_modules`` / ``ignore`` is not a list of strings.
        UnsupportedQuantization (`unsupported_quantization`): no quantization config, yet quantized
            tensors (``details["tensor"]`` names the first).
    """
    config_file = str(ck.path / "config.json")
    qc = ck.config.get("quantization_config")
    if qc:
        return _from_config_object(qc, config_file, "quantization_config")
    for rules in families:
        found = rules.read_config(ck)
        if found is not None:
            return found
    text = ck.config.get("text_config")
    if isinstance(text, dict) and text.get("quantization_config"):
        return _from_config_object(text["quantization_config"], config_file, "text_config.quantization_config")
    if ck.config.get("compression_config"):
        return _from_config_object(ck.config["compression_config"], config_file, "compression_config")
    for name in TOOLCHAIN_FILES:
        raw = ck.read_side_file(name)
        if raw is None:
            continue
        file = str(ck.path / name)
        try:
            cfg = json.loads(raw)
        except ValueError as e:
            raise CheckpointCorrupt(f"{file} is not valid JSON: {e}", file=file) from None
        if not isinstance(cfg, dict):
            raise CheckpointCorrupt(f"{file}: expected a JSON object, got {cfg!r:.200}", file=file)
        return _from_config_object({**cfg, "quant_method": _toolchain_method(cfg)}, file, name)
    tensor = quantized_tensor(ck)
    if tensor is not None:
        info = ck.tensors[tensor]
        raise UnsupportedQuantization(
            f"{ck.path}: tensor {tensor!r} ({info.dtype}) is quantized, but the checkpoint has no quantization "
            f"config (config.json quantization_config or compression_config, hf_quant_config.json, "
            f"quantize_config.json, quant_config.json); weightcache cannot tell its scheme and will not serve it as "
            f"unquantized. Add the exporter's config file, or serve this model without weightcache",
            scheme="unknown", tensor=tensor, file=config_file)
    return None


def quantized_tensor(ck: Checkpoint) -> str | None:
    """The first tensor (natural order) that only a quantized checkpoint stores, or ``None``.

    A name ending in :data:`QUANTIZED_ONLY`; the names of the index's ``weight_map`` where the checkpoint has
    one and its headers are not read yet (:attr:`weightcache.checkpoint.Checkpoint.names`), else the headers'.
    """
    hits = [n for n in ck.names if n.endswith(QUANTIZED_ONLY)]
    return min(hits, key=natural_key) if hits else None


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
