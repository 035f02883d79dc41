"""vLLM's own default loader and the publication path as the plugin's fallbacks, and the plugin's vLLM version
branches (issue 35).

With ``fallback = true`` (the default) the ``weightcache`` load format never
stops an engine that vLLM's default loader starts: every reason weightcache
cannot serve a rank from the service's own slab ends in **the publication
path** (:mod:`.vllm_publish`: the publication of this engine's key attached,
else vLLM's default load, published and moved onto, so that the next start
attaches it) or in **vLLM's own** ``DefaultModelLoader`` (the checkpoint read
by vLLM, ``process_weights_after_loading`` as without the plugin), the reason
logged once in vLLM's log (``weightcache takes the publication path ...
reason=CODE: MESSAGE``, INFO; ``weightcache cannot serve, loading with vLLM's
default loader ... reason=CODE: MESSAGE``, WARNING). With ``fallback = false``
the same reason is raised, a typed error naming the cause. Which reason takes
which path is one table, :data:`PATHS` (:func:`path_for`; docs/engines.md,
"Which path each checkpoint takes"). Reasons (:class:`Reason`):

- found from the checkpoint's files before the service is asked
  (:func:`unservable`): an architecture without vLLM naming rules
  (``unsupported_architecture``: the service cannot lay it out in vLLM's
  naming); a quantization scheme weightcache cannot pre-process
  (compressed-tensors, AWQ, GPTQ, block FP8, ...: ``unsupported_quantization``,
  ``details["scheme"]``; the config read where vLLM reads it,
  :func:`weightcache.quant.quant_config.read_config`); ``tp_size > 1`` with a
  quantized model (ModelOpt FP8) that cannot be zero-copy (vLLM 0.32 and 0.33
  do not take ModelOpt FP8 pre-processed, found once vLLM's model is built on
  meta; copy mode shards unquantized models only): ``config_invalid``,
  ``details["key"] == "tensor_parallel_size"``;
- met on the way (:func:`default_loader_reason`): every other weightcache
  error, the service's included: absent (``daemon_unavailable``), full
  (``resource_exhausted``, ``insufficient_memory``), old
  (``protocol_violation``: another protocol version), holding another key (``cache_key_mismatch``) or not the model
  (``model_not_found``), after the loader's ``retries``; ``--model`` not a
  local directory (vLLM's loader downloads it); a slab that does not fit
  vLLM's model (``shape_mismatch``). The plugin asks the client with
  ``fallback=False``: vLLM's loader, not the client's own disk load, reads
  the checkpoint.

Version branches (vLLM 0.32 to 0.34; ``tests/unit/test_vllm_surface.py``
checks every vLLM name the plugin uses against each wheel):

- 0.34 keeps an account of the external weight bytes a loader reports
  (``ExternalWeightCharges`` around ``get_external_weight_memory`` and the
  load): :func:`record_charge` records the slab's bytes and
  :func:`record_fallback` gives them back to the KV-cache budget when the
  rank does not map the slab after all. On 0.32 and 0.33 there is no account
  (the answer of ``get_external_weight_memory`` is all the worker keeps);
  both are no-ops.
- 0.33 wraps the model class for expert substitution inside
  ``initialize_model``, and 0.34 zero-fills ``materialize_meta_tensor`` and
  adds ``BaseModelLoader.get_all_weights``: the plugin calls them the same way
  on every version (no branch), and answers ``get_all_weights`` itself.

Forbidden imports: weightcache.daemon.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from .. import quant, sharding
from ..checkpoint import Checkpoint
from ..errors import ConfigError, UnsupportedArchitecture, WeightcacheError
from ..journal import event

log = init_logger("vllm." + __name__)

#: ``is_draft`` of the plugin's charges in vLLM 0.34's account (the plugin loads target models only).
_NOT_DRAFT = False

#: Ranks whose slab ``get_external_weight_memory`` charged (:func:`charge`): given back (:func:`uncharge`)
#: when the load does not map it. A fresh loader answers each of vLLM's questions, so it lives here.
_CHARGED: set[Any] = set()


def plain_load_config(load_config: LoadConfig) -> LoadConfig:
    """``load_config`` as vLLM's default loader takes it: ``load_format="auto"``, no extra config."""
    return dataclasses.replace(load_config, load_format="auto", model_loader_extra_config={})


class Reason(enum.Enum):
    """Why weightcache cannot serve a rank from the service's own slab (:func:`reason_of` of the error)."""

    #: ``unsupported_architecture``: no vLLM naming rules in weightcache for the architecture (Qwen3, Gemma...).
    NO_NAMING_RULES = "no_naming_rules"
    #: ``unsupported_quantization``: a scheme weightcache cannot pre-process (compressed-tensors, AWQ, GPTQ, block
    #: FP8...), on any family.
    UNSUPPORTED_QUANTIZATION = "unsupported_quantization"
    #: ``config_invalid`` key ``tensor_parallel_size``: a quantized model at ``tp_size > 1`` that this vLLM cannot
    #: take pre-processed (ModelOpt FP8 on vLLM 0.32/0.33): the service's FP8 slabs serve copy mode at TP 1 only.
    QUANTIZED_TP = "quantized_tp"
    #: ``config_invalid`` key ``mode``: a feature that writes into the weights, in mode ``zero_copy``.
    WRITES_WEIGHTS = "writes_weights"
    #: Anything else met on the way: the service absent, full, old, holding another key or not the model, after the
    #: loader's ``retries``; ``--model`` not a local directory; a slab that does not fit vLLM's model.
    SERVICE = "service"


class Path(enum.Enum):
    """Where a rank goes when weightcache cannot serve it from the service's own slab."""

    #: :mod:`.vllm_publish`: the publication of this engine's key, attached; else vLLM's default load, published
    #: and moved onto (the next start attaches it). A service that cannot take part (absent, the model not
    #: configured, a refused publication) is then vLLM's default load, logged (``fallback = false``: the error).
    PUBLICATION = "publication"
    #: vLLM's own ``DefaultModelLoader``, nothing published, the reason logged once (:func:`load_with_default`).
    DEFAULT = "default"
    #: The reason is the engine's error, typed.
    ERROR = "error"


#: Reason -> (path with ``fallback = true``, path with ``fallback = false``), in mode ``zero_copy`` (the default).
#: Mode ``copy`` never publishes (its weights are vLLM's own, writable): ``PUBLICATION`` reads ``DEFAULT`` with
#: ``fallback = true`` and ``ERROR`` with ``fallback = false`` there (:func:`path_for`).
PATHS: dict[Reason, tuple[Path, Path]] = {
    # The engine is the only one that can lay it out: it is served by publication whatever fallback says.
    Reason.NO_NAMING_RULES: (Path.PUBLICATION, Path.PUBLICATION),
    # The service could lay out the family, not the scheme (or not at this TP): published with fallback true.
    Reason.UNSUPPORTED_QUANTIZATION: (Path.PUBLICATION, Path.ERROR),
    Reason.QUANTIZED_TP: (Path.PUBLICATION, Path.ERROR),
    Reason.WRITES_WEIGHTS: (Path.ERROR, Path.ERROR),
    Reason.SERVICE: (Path.DEFAULT, Path.ERROR),
}


def reason_of(error: WeightcacheError) -> Reason:
    """The :class:`Reason` an error met while loading (or found by :func:`unservable`) stands for, by its code
    (and ``details["key"]`` for ``config_invalid``)."""
    if error.code == "unsupported_architecture":
        return Reason.NO_NAMING_RULES
    if error.code == "unsupported_quantization":
        return Reason.UNSUPPORTED_QUANTIZATION
    if error.code == "config_invalid" and error.details.get("key") == "tensor_parallel_size":
        return Reason.QUANTIZED_TP
    if error.code == "config_invalid" and error.details.get("key") == "mode":
        return Reason.WRITES_WEIGHTS
    return Reason.SERVICE


def path_for(error: WeightcacheError, fallback: bool, zero_copy: bool) -> Path:
    """:data:`PATHS`' path of ``error``'s reason (:func:`reason_of`) for ``fallback`` and the mode.

    Args:
        error (`WeightcacheError`): why the service's own slab cannot serve this rank.
        fallback (`bool`): the loader's ``fallback``.
        zero_copy (`bool`): mode ``zero_copy``; ``False``: mode ``copy``, which never publishes.

    Example:
        >>> path_for(UnsupportedQuantization("awq", scheme="awq"), fallback=True, zero_copy=True)
        <Path.PUBLICATION: 'publication'>
    """
    path = PATHS[reason_of(error)][0 if fallback else 1]
    if path is Path.PUBLICATION and not zero_copy:
        return Path.DEFAULT if fallback else Path.ERROR
    return path


def unservable(path: str, tp_size: int, kernel: str, quantization: str | None,
               zero_copy: bool) -> WeightcacheError | None:
    """Why the service's own slab cannot serve this rank, from the checkpoint's files; ``None`` when it may.

    Args:
        path (`str`): the checkpoint directory (a local directory).
        tp_size (`int`): vLLM's tensor-parallel size.
        kernel (`str`): the loader's kernel layout target of quantized weights.
        quantization (`str | None`): vLLM's ``model_config.quantization``.
        zero_copy (`bool`): the load may still be zero-copy (``naming = "vllm"`` at any ``tp_size``, a
            quantized model too where vLLM takes its weights pre-processed: ModelOpt FP8 on vLLM 0.34);
            ``False``: copy mode, which shards only unquantized models of a family with rules.

    Returns:
        `WeightcacheError | None` (:func:`path_for` says where it leads): ``UnsupportedQuantization``
        (`unsupported_quantization`) from :func:`weightcache.quant.detect`; ``UnsupportedArchitecture``
        (`unsupported_architecture`) for an architecture without vLLM naming rules in mode ``zero_copy`` (any
        ``tp_size``) or at ``tp_size > 1`` (copy mode at TP 1 serves it from a ``naming = "hf"`` slab);
        ``ConfigError`` (`config_invalid`, key ``tensor_parallel_size``) for a quantized model at ``tp_size > 1``
        in copy mode.
    """
    ck = Checkpoint(path, validate=False)
    try:
        scheme = quant.detect(ck, kernel)
    except WeightcacheError as e:
        if e.code != "unsupported_quantization":
            raise
        return e
    if sharding.family_of(ck.config) is None and (zero_copy or tp_size > 1):
        arch = ck.config.get("architectures")
        return UnsupportedArchitecture(
            f"architecture {arch} has no vLLM naming rules in weightcache (families: "
            f"{', '.join(sharding.FAMILIES)}): the engine lays it out and publishes it in mode zero_copy (the "
            f"default); with mode copy at TP 1 it is served from a naming = \"hf\" slab", architecture=arch,
            supported=sorted(sharding.FAMILIES), tp_size=tp_size)
    if tp_size > 1 and not zero_copy and (scheme is not None or quantization is not None):
        method = scheme.name if scheme is not None else quantization
        return ConfigError(
            f"tensor parallelism (tp_size={tp_size}) with quantization={method!r} needs vLLM to take its weights "
            f"pre-processed (zero-copy), which it does not (the service's own quantized slabs serve copy mode at "
            f"TP 1 only): with fallback true (the default) the engine publishes what it processed and later "
            f"starts attach that", key="tensor_parallel_size", quantization=method)
    return None


def check_servable(rank: Any, kernel: str, quantization: str | None, zero_copy: bool) -> None:
    """Raises :func:`unservable`'s reason for ``rank`` (``path``, ``tp_size``), if any."""
    reason = unservable(rank.path, rank.tp_size, kernel, quantization, zero_copy)
    if reason is not None:
        raise reason


def default_loader_reason(error: WeightcacheError) -> bool:
    """Whether ``error`` (met while loading with ``fallback = true``) leads away from an error: every weightcache
    error does but the engine's own contradiction that vLLM's loader would hide, ``config_invalid`` with key
    ``mode`` (a feature that writes into the weights in ``zero_copy`` mode, or ``zero_copy`` refused with
    ``fallback = false``): :data:`PATHS`' ``Reason.WRITES_WEIGHTS``. Extra-config errors are raised when the
    loader is built."""
    return PATHS[reason_of(error)][0] is not Path.ERROR


def load_with_default(loader_config: LoadConfig, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
                      rank: Any, error: WeightcacheError) -> nn.Module:
    """Logs ``error`` once (WARNING, vLLM's log) and loads the model with vLLM's own ``DefaultModelLoader``.

    Args:
        loader_config (`LoadConfig`): the plugin loader's config (:func:`plain_load_config` is applied).
        rank: the plugin's rank (``path``, ``tp_size``, ``tp_rank``), or ``None`` when it could not be worked out.
        error (`WeightcacheError`): why weightcache cannot serve.

    Returns:
        `nn.Module`: what ``DefaultModelLoader.load_model`` returns.
    """
    if rank is None:  # the rank could not be worked out (--model is not a local directory, a device...)
        path = model_config.model_weights or model_config.model
        tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    else:
        path, tp_size, tp_rank = rank.path, rank.tp_size, rank.tp_rank
    # The journal's `fallback` event (MESSAGE_ID), as the client's own disk fallback logs it.
    log.warning("weightcache cannot serve, loading with vLLM's default loader checkpoint=%s tp_size=%d tp_rank=%d "
                "reason=%s: %s", path, tp_size, tp_rank, error.code, error.message,
                extra=event("fallback", path, tp_rank, tp_size=tp_size, error_code=error.code))
    return DefaultModelLoader(plain_load_config(loader_config)).load_model(vllm_config, model_config, prefix)


def charge_key(rank: Any) -> str:
    """The key of ``rank``'s charge in vLLM 0.34's account of external weight bytes."""
    return f"weightcache:{rank.gpu}:{rank.path}:tp{rank.tp_size}:rank{rank.tp_rank}"


def record_charge(rank: Any, size_bytes: int) -> None:
    """vLLM >= 0.34: records ``size_bytes`` of ``rank``'s slab as held outside vLLM's allocator; else nothing."""
    try:
        from vllm.model_executor.model_loader.weight_cache.utils import record_external_weight_charge
    except ImportError:  # vLLM 0.32, 0.33: no account
        return
    record_external_weight_charge(charge_key(rank), _NOT_DRAFT, size_bytes)


def record_fallback(rank: Any) -> None:
    """vLLM >= 0.34: ``rank`` does not map its slab after all; its charge goes back to the KV-cache budget."""
    try:
        from vllm.model_executor.model_loader.weight_cache.utils import record_external_weight_fallback
    except ImportError:  # vLLM 0.32, 0.33: no account
        return
    record_external_weight_fallback(charge_key(rank), _NOT_DRAFT)


def charge(rank: Any, size_bytes: int) -> None:
    """:func:`record_charge`, remembered for :func:`uncharge`."""
    record_charge(rank, size_bytes)
    _CHARGED.add(rank)


def uncharge(rank: Any) -> None:
    """``rank``'s slab was charged and is not mapped after all: :func:`record_fallback`, once; else nothing."""
    if rank in _CHARGED:
        _CHARGED.discard(rank)
        record_fallback(rank)


def uncharged(rank: Any, model: nn.Module) -> nn.Module:
    """:func:`uncharge` of ``rank`` (its load did not map the slab: copy mode); returns ``model``."""
    uncharge(rank)
    return model


def get_all_weights(loader: Any, model_config: ModelConfig, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The loader's ``get_all_weights`` (vLLM 0.34's partial reloads): vLLM's default loader's, from the checkpoint.

    Args:
        loader (`WeightcacheModelLoader`): the loader (its ``load_config``; this is its method).

    Raises:
        ConfigError (`config_invalid`): ``model`` is zero-copy (its weights are the service's read-only
            memory; a reload would write into them).
    """
    if getattr(model, "_weightcache", None) is not None:
        raise ConfigError(
            "get_all_weights: the weights of this model are the weightcache service's read-only memory (load "
            "format 'weightcache', mode 'zero_copy') and cannot be reloaded; start the engine with mode 'copy' to "
            "reload weights in place", key="mode")
    return DefaultModelLoader(plain_load_config(loader.load_config)).get_all_weights(model_config, model)
