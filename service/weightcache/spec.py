"""What goes into a slab: the request (:class:`LoadRequest`, :class:`RankRequest`), decided before any byte is read.

The planning stages speak in :class:`TensorSpec`: an output tensor of the slab,
built from slices of checkpoint tensors (:class:`SourceRef`), concatenated
along ``cat_dim`` and then passed through a named processing ``op``. Those two
live in :mod:`weightcache.tensor_spec`, which an engine's attach never imports:
it builds requests, never specs, and each frozen dataclass costs about a
millisecond of code generation at import.

- ``sharding`` turns checkpoint tensors into per-rank specs (op ``copy``,
  fused names, tied aliases);
- ``quant`` rewrites specs of quantized layers (ops of the scheme registry, such as
  ``modelopt_fp8_weight``);
- ``pipeline`` assigns offsets, then executes each spec into the slab.

Forbidden imports: torch at module level, socket, weightcache.daemon,
weightcache.client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .wire import DEFAULT_DTYPE, DEFAULT_KERNEL, DEFAULT_NAMING


#: Default of the ``scheme`` arguments of :func:`weightcache.identity.key_fields` and
#: :func:`weightcache.quant.process_specs`: detect the scheme from the checkpoint.
DETECT: Any = object()

#: ``dtype`` names -> safetensors dtype code of the slab (``auto``: the checkpoint's own).
DTYPE_NAMES = {"auto": None, "bfloat16": "BF16", "float16": "F16", "float32": "F32"}

#: vLLM fused modules: name -> parts, in concatenation order (vLLM's ``packed_modules_mapping``;
#: the one table, read by ``sharding`` and by the quantization schemes' exclusion rules).
FUSED_PARTS: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                           "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class LoadRequest:
    """What the pipeline needs to know about one model: where it is and how to lay it out.

    The operator's :class:`weightcache.config.ModelConfig` is one (it adds
    allow lists, layouts and its source file); an engine's ``attach()``
    builds one from its arguments. Both feed :func:`weightcache.pipeline.plan`
    and the cache key.

    Attributes:
        name (`str`): the model's name (the manifest's ``model``).
        path (`str`): checkpoint directory.
        dtype (`str`, *optional*, defaults to ``"auto"``): a key of :data:`DTYPE_NAMES`.
        naming (`str`, *optional*, defaults to ``"hf"``): ``hf`` or ``vllm`` (fused names).
        kernel (`str`, *optional*, defaults to ``"cutlass"``): layout target of quantized weights.
        revision (`str`, *optional*): the operator's label, part of the cache key.
    """

    name: str
    path: str
    dtype: str = DEFAULT_DTYPE
    naming: str = DEFAULT_NAMING
    kernel: str = DEFAULT_KERNEL
    revision: str = ""

    def to_json(self) -> dict[str, Any]:
        """The request as a JSON object (``name``, ``path``, ``dtype``, ``naming``, ``kernel``, ``revision``)."""
        return {"name": self.name, "path": self.path, "dtype": self.dtype, "naming": self.naming,
                "kernel": self.kernel, "revision": self.revision}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LoadRequest":
        """Reverses :meth:`to_json`; keys it does not know (a configured model's allow lists) are ignored.

        Raises:
            ValueError: ``name`` or ``path`` missing, or a field that is not a string.
        """
        fields = {k: d[k] for k in ("name", "path", "dtype", "naming", "kernel", "revision") if k in d}
        if "name" not in fields or "path" not in fields or not all(isinstance(v, str) for v in fields.values()):
            raise ValueError(f"load request {d!r:.200} needs string fields name, path, dtype, naming, kernel, revision")
        return cls(**fields)


@dataclass(frozen=True)
class RankRequest:
    """One tensor-parallel rank of one load request: the value a slab's identity is derived from.

    :func:`weightcache.pipeline.plan`, :func:`weightcache.identity.cache_key`,
    :func:`weightcache.identity.key_fields`, :func:`weightcache.identity.dtype_matches`
    and the client's disk fallback take one. The service's
    :class:`weightcache.config.Placement` is one (plus its GPU).

    Attributes:
        model (`LoadRequest`): what is loaded and how it is laid out.
        tp_size (`int`): tensor-parallel size of the layout.
        tp_rank (`int`): this rank, ``0 <= tp_rank < tp_size``.
    """

    model: LoadRequest
    tp_size: int
    tp_rank: int

    def to_json(self) -> dict[str, Any]:
        """``{"model": LoadRequest.to_json(), "tp_size": int, "tp_rank": int}``."""
        return {"model": self.model.to_json(), "tp_size": self.tp_size, "tp_rank": self.tp_rank}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RankRequest":
        """Reverses :meth:`to_json` (a :meth:`weightcache.config.Placement.to_json` object reads as one too).

        Raises:
            ValueError: a field missing or of the wrong type.
        """
        try:
            tp_size, tp_rank = d["tp_size"], d["tp_rank"]
            if type(tp_size) is not int or type(tp_rank) is not int:
                raise TypeError("tp_size and tp_rank must be integers")
            return cls(LoadRequest.from_json(d["model"]), tp_size, tp_rank)
        except (KeyError, TypeError) as e:
            raise ValueError(f"rank request {d!r:.200} is damaged: {e!r}") from None
