"""transformers helper: a model whose parameters are the tensors of :func:`weightcache.attach`.

::

    from weightcache.integrations.transformers import from_pretrained

    model = from_pretrained("/srv/models/all-MiniLM-L6-v2")          # AutoModel
    model = from_pretrained(path, model_cls=AutoModelForCausalLM, fallback=False)
    model._weightcache.source, model._weightcache.fallback_reason

It does what ``PreTrainedModel.from_pretrained`` does (transformers 5), with
the checkpoint read replaced by an attachment:

1. attach the checkpoint (``tp_size = 1``, ``naming = "hf"``) with the given
   :func:`~weightcache.attach` arguments (``mode``, ``fallback``, ``device``,
   ``socket_dir``...); same fallback semantics;
2. build the model on the meta device (``AutoConfig`` + ``model_cls``, default
   ``AutoModel``) in the attached weights' dtype;
3. register every attached tensor as the parameter (or persistent buffer) of
   the same name (:func:`weightcache.integrations.params.register_tensors`): in ``zero_copy`` mode the model's parameters *are* the
   shared read-only views (no copy, ``requires_grad=False``); checkpoint
   names may differ from the model's by its ``base_model_prefix``
   (``bert.``, ``model.``) or use the legacy LayerNorm ``gamma``/``beta``;
4. tie weights with the model's own ``tie_weights`` (a tied ``lm_head`` is
   the embedding's parameter object, whichever of the two the checkpoint has);
5. re-materialise every buffer the checkpoint does not hold (``position_ids``,
   rotary ``inv_freq``...) on the device and initialise it with the model's
   own ``_init_weights``, exactly as ``from_pretrained`` does; modules whose
   tensors all came from the attachment are marked initialised and never
   written.

The attachment stays alive as ``model._weightcache`` (its lease ends when it
is closed or garbage collected). Zero-copy parameters are read-only: inference
works; training or in-place edits need ``mode="copy"``.

Forbidden imports: weightcache.daemon.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from ..client import Attachment, attach
from ..errors import ShapeMismatch

log = logging.getLogger(__name__)

#: Legacy parameter suffixes of old BERT-style checkpoints, as transformers renames them.
_LEGACY_SUFFIXES = ((".gamma", ".weight"), (".beta", ".bias"))


def _candidates(name: str, prefix: str) -> list[str]:
    names = [name]
    for old, new in _LEGACY_SUFFIXES:
        if name.endswith(old):
            names.append(name[: -len(old)] + new)
    out = []
    for n in names:
        out.append(n)
        if prefix:
            out.append(n[len(prefix) + 1:] if n.startswith(prefix + ".") else f"{prefix}.{n}")
    return out


def map_names(checkpoint_names: list[str], model_keys: set[str], prefix: str) -> tuple[dict[str, str], list[str]]:
    """Maps checkpoint tensor names to the model's state-dict keys.

    A name maps to itself, to itself with ``prefix.`` removed or added (a
    base-model checkpoint loaded into a model with a head, or the reverse),
    and ``gamma``/``beta`` to ``weight``/``bias``.

    Args:
        checkpoint_names (`list[str]`): names in the attachment.
        model_keys (`set[str]`): the model's ``state_dict()`` keys.
        prefix (`str`): the model's ``base_model_prefix`` (``""`` for none).

    Returns:
        ``(mapping, unexpected)``: model key -> checkpoint name, and the
        checkpoint names that fit no key (ignored, as ``from_pretrained``'s
        unexpected keys).

    Example:
        >>> map_names(["bert.pooler.dense.weight"], {"pooler.dense.weight"}, "bert")
        ({'pooler.dense.weight': 'bert.pooler.dense.weight'}, [])
    """
    mapping: dict[str, str] = {}
    unexpected: list[str] = []
    for name in checkpoint_names:
        key = next((c for c in _candidates(name, prefix) if c in model_keys), None)
        if key is None or key in mapping:
            unexpected.append(name)
        else:
            mapping[key] = name
    return mapping, unexpected


def _dominant_float_dtype(tensors: dict[str, Any]):
    counts: collections.Counter = collections.Counter()
    for t in tensors.values():
        if t.dtype.is_floating_point and t.element_size() > 1:
            counts[t.dtype] += t.numel()
    return counts.most_common(1)[0][0] if counts else None


def from_pretrained(path: str, *, model_cls: Any = None, attn_implementation: str | None = None,
                    **attach_kwargs: Any) -> Any:
    """Builds a transformers model whose weights come from :func:`weightcache.attach`.

    Args:
        path (`str`): checkpoint directory (``config.json`` + safetensors).
        model_cls (*optional*): a model class (``BertModel``) or an auto class
            (``AutoModelForCausalLM``); defaults to ``AutoModel``.
        attn_implementation (`str`, *optional*): passed to the model's config,
            as in ``from_pretrained``.
        **attach_kwargs: passed to :func:`weightcache.attach` (``device``,
            ``mode``, ``fallback``, ``timeout``, ``socket_dir``, ``gpu``,
            ``dtype``); ``tp_size``/``tp_rank``/``naming`` are fixed to 1/0/``hf``.

    Returns:
        The model in eval mode, on ``device``, with ``model._weightcache``
        the `Attachment` (``source``, ``fallback_reason``). Parameters are
        the attached tensors (shape and dtype as stored, e.g. ``F32``
        ``(vocab_size, hidden_size)`` for the word embeddings): read-only
        views valid while the attachment is open in ``zero_copy`` mode,
        private copies in ``copy`` mode.

    Raises:
        DaemonUnavailable, CacheKeyMismatch, ModelLoading, ...: from
            :func:`weightcache.attach` when ``fallback=False``.
        ShapeMismatch (`shape_mismatch`): a model parameter has no tensor in
            the checkpoint, or a tensor's shape differs from the parameter's.

    Example:
        >>> model = from_pretrained(minilm_dir, fallback=True)
        >>> model(input_ids).last_hidden_state.shape
        torch.Size([1, 8, 384])
    """
    from transformers import AutoModel, GenerationConfig

    for fixed in ("tp_size", "tp_rank", "naming"):
        if fixed in attach_kwargs:
            raise TypeError(f"from_pretrained() fixes {fixed}; a transformers model is one tensor-parallel rank")
    t0 = time.monotonic()
    w: Attachment = attach(path, tp_size=1, tp_rank=0, naming="hf", **attach_kwargs)
    try:
        model = _build(path, w, model_cls or AutoModel, attn_implementation, attach_kwargs.get("device", "cpu"))
    except BaseException:
        w.close()
        raise
    if model.can_generate():
        try:
            model.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            pass  # no generation_config.json: keep the one derived from config.json
    model._weightcache = w
    log.info("model built checkpoint=%s class=%s source=%s tensors=%d duration_ms=%.1f", path,
             type(model).__name__, w.source, len(w.tensors), (time.monotonic() - t0) * 1e3)
    return model  # a fallback was already logged, with its reason, by attach()


def _build(path: str, w: Attachment, model_cls: Any, attn_implementation: str | None, device: str) -> Any:
    import torch
    from transformers import AutoConfig

    from .params import register_tensors

    config = AutoConfig.from_pretrained(path)
    dtype = _dominant_float_dtype(w.tensors) or torch.float32
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        if hasattr(model_cls, "from_config"):
            model = model_cls.from_config(config, **kwargs)
        else:
            model = model_cls._from_config(config, **kwargs)
    model_keys = set(model.state_dict().keys())
    mapping, unexpected = map_names(list(w.tensors), model_keys, getattr(model, "base_model_prefix", "") or "")
    if unexpected:
        log.debug("unused checkpoint tensors checkpoint=%s count=%d first=%s", path, len(unexpected), unexpected[:5])
    reg = register_tensors(model, {key: w.tensors[name] for key, name in mapping.items()}, check="shape",
                           source=f"checkpoint {path}",
                           hint="the checkpoint does not match its config.json or model class")
    for t in [*reg.parameters.values(), *reg.buffers.values()]:
        t._is_hf_initialized = True  # from_pretrained's mark: _init_weights must not write it
    missing = model_keys - set(mapping)
    model.tie_weights(missing_keys=set(missing), recompute_mapping=False)
    # Missing persistent buffers are initialised below like non-persistent ones; missing parameters are errors.
    param_keys = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    still = sorted(k for k in missing if k in param_keys and model.get_parameter(k).device.type == "meta")
    if still:
        raise ShapeMismatch(
            f"checkpoint {path} has no tensor for {type(model).__name__} parameters {still[:5]} ({len(still)} in all); "
            f"load it with the model class the checkpoint was saved from", tensor=still[0])
    _materialise_buffers(model, device)
    return model.eval()


def _materialise_buffers(model: Any, device: str) -> None:
    """Buffers still on meta (non-persistent, or absent from the checkpoint): allocate, then init as the model does."""
    import torch

    for module in model.modules():
        own = [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]
        meta = [k for k, b in module._buffers.items() if b is not None and b.device.type == "meta"]
        for k in meta:
            module._buffers[k] = torch.empty_like(module._buffers[k], device=device)
        if not meta and own:
            # Every tensor of this module is attached: _init_weights must not run on it
            # (an attached zero-copy tensor is read-only).
            module._is_hf_initialized = True
    model.initialize_weights()
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise ShapeMismatch(f"{type(model).__name__}: tensors {left[:5]} are still unmaterialised after loading",
                            tensor=left[0])
