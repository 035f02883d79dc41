"""The scheme registry: every quantization scheme weightcache processes, and what each one owns.

A scheme family is one :class:`SchemeRules` object; the families are one literal
table, ``weightcache.quant.FAMILIES``, and :class:`Registry` derives the lookup
tables from it once (``weightcache.quant.REGISTRY``). A family owns, for its schemes:

- its **capability rows** (``(quant_method, QUANT_ALGO) -> Capability``),
  (:attr:`Registry.capabilities`);
- its **config detection** beyond ``config.json``'s ``quantization_config``
  (:meth:`SchemeRules.read_config`, e.g. ModelOpt's ``hf_quant_config.json``);
- its **layer checks** (:meth:`SchemeRules.check_layers`, headers only);
- its **processing**: spec rewriting (:meth:`SchemeRules.process_specs`) and
  the ops that run it (:attr:`SchemeRules.ops`), and for each op the
  torch-free placement that gives the same bytes (:attr:`SchemeRules.placers`,
  run by ``weightcache.placement``);
- the **shard rule of its side tensors** (:attr:`SchemeRules.side_tensors`:
  scales and the like, which ``weightcache.sharding`` shards by this table);
- the **inverse** of its processing (:meth:`SchemeRules.checkpoint_form`), which
  engine integrations call to give a processed tensor back in checkpoint form.

``weightcache.pipeline`` and ``weightcache.sharding`` only read a registry's tables;
adding a scheme is one module in ``quant/`` and one entry of ``FAMILIES``
(``docs/quantization.md``, "Adding a scheme").

Forbidden imports: torch at module level, socket, weightcache.daemon, weightcache.client,
weightcache.sharding, weightcache.pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping

from .capabilities import Capability

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint
    from ..tensor_spec import TensorSpec

#: A processing op: ``fn(spec, parts, fetch) -> tensor`` of ``spec.stored_shape`` and ``spec.dtype``.
#: ``parts`` are the spec's sources, already sliced; ``fetch(name)`` returns any whole checkpoint tensor.
Op = Callable[["TensorSpec", list, Callable[[str], Any]], Any]

#: ``SideTensor.shard`` values.
SHARD_RULES = ("scalar", "output")


@dataclass(frozen=True)
class SideTensor:
    """How a linear module's side tensor (a scale) is sharded, fused and named; read by ``weightcache.sharding``.

    Attributes:
        param (`str`): the parameter name after the module (``weight_scale``, ``k_scale``).
        shard (`str`): ``scalar``: one element (0-d or ``[1]``), replicated on
            every rank; ``output``: one element (replicated), or one value per
            output row (``[N]`` or ``[N, 1]``) split like the module's bias
            (column-parallel: the rank's rows; row-parallel: replicated). An
            ``output`` side tensor of ``embed_tokens``/``lm_head`` follows the
            vocabulary split.
        fuse (`bool`): concatenated into vLLM's fused module (``qkv_proj``)
            with ``naming = "vllm"``, one row per part for a scalar.
        vllm_name (`str | None`): with ``naming = "vllm"``, the name under the
            layer's prefix instead of ``<module>.<param>`` (``attn.{param}``:
            ``self_attn.k_proj.k_scale`` becomes ``self_attn.attn.k_scale``, as
            vLLM's ``maybe_remap_kv_scale_name``); implies ``fuse = False``.

    Side tensors keep their stored dtype whatever the model's ``dtype``.
    """

    param: str
    shard: str = "scalar"
    fuse: bool = True
    vllm_name: str | None = None

    def __post_init__(self) -> None:
        if self.shard not in SHARD_RULES:
            raise ValueError(f"side tensor {self.param!r}: shard must be one of {SHARD_RULES}, got {self.shard!r}")
        if not self.param.isidentifier() or self.param in ("weight", "bias"):
            raise ValueError(f"side tensor param {self.param!r} must be an identifier other than weight/bias")


class SchemeRules:
    """One quantization scheme family. Subclass it, fill the attributes, list an instance in ``quant.FAMILIES``.

    Attributes:
        family (`str`): the family's name (``modelopt_fp8``), unique in the registry.
        capabilities (`Mapping[tuple[str, str], Capability]`): its rows; each
            ``Capability.scheme`` is a scheme name this family processes (the
            cache key's ``quant_scheme``, the layout's ``scheme``).
        side_tensors (`tuple[SideTensor]`): its side tensors' shard rules.
        ops (`Mapping[str, Op]`): its processing ops, by the name a spec's ``op`` carries.
        placers (`Mapping[str, Placer]`): for some of those ops, the torch-free
            placement that writes the same bytes (``fn(spec, record, checkpoint)
            -> weightcache.placement.Placement | None``); an op without one (or
            a placer answering ``None``) runs on the torch pipeline.
    """

    family: str = ""
    capabilities: Mapping[tuple[str, str], Capability] = {}
    side_tensors: tuple[SideTensor, ...] = ()
    ops: Mapping[str, Op] = {}
    placers: Mapping[str, Callable[..., Any]] = {}

    def read_config(self, ck: "Checkpoint") -> Any:
        """The scheme's own config file, when ``config.json`` has no ``quantization_config``.

        Returns:
            `weightcache.quant.config.QuantConfig | None`: ``None`` (the default) when it has none.
        """
        return None

    def check_layers(self, ck: "Checkpoint", qc: Any, cap: Capability) -> set[str]:
        """Validates the quantized layers from the headers; returns their module names.

        Raises:
            UnsupportedQuantization (`unsupported_quantization`): a layer that does not fit the scheme.
        """
        raise NotImplementedError

    def process_specs(self, ck: "Checkpoint", specs: list["TensorSpec"], kernel: str,
                      scheme: Any) -> list["TensorSpec"]:
        """Rewrites the rank's sharded specs for ``kernel`` (headers only).

        Args:
            scheme (`weightcache.quant.Scheme`): the detected scheme (capability, config, quantized layers).
        """
        raise NotImplementedError

    def checkpoint_form(self, tensor: Any, layout: Mapping[str, Any]) -> Any:
        """The inverse of the processing for one attached tensor: a view in checkpoint form, no copy.

        Args:
            tensor (`torch.Tensor`): the attached tensor.
            layout (`Mapping`): its manifest layout, whose ``scheme`` is one of this family's.

        Returns:
            `torch.Tensor`: the tensor as the checkpoint stores it, up to a
            reshape of the same elements (the caller reshapes to the header's
            shape). The default gives ``tensor`` back.
        """
        return tensor


@dataclass(frozen=True)
class Registry:
    """The scheme families weightcache processes, and the tables derived from them once.

    A value, not a global to register into: the package's is ``weightcache.quant.REGISTRY``, built
    from the literal ``weightcache.quant.FAMILIES``; a test builds its own (``Registry((*FAMILIES, toy))``)
    and passes it to ``pipeline.plan`` or ``quant.detect``.

    Attributes:
        families (`tuple[SchemeRules]`): the families, in order (config detection asks them in it).
        capabilities (`dict[tuple[str, str], Capability]`): every family's capability rows.
        by_scheme (`dict[str, SchemeRules]`): scheme name -> its family.
        side_tensors (`dict[str, SideTensor]`): every side tensor rule, by ``param``.
        ops (`dict[str, Op]`), placers (`dict[str, Placer]`): every family's processing ops and placements.

    Raises:
        ValueError: two families share a name, a scheme name, a capability row, an op name (or name the
            pipeline's own ``copy``), or a side tensor with different rules.
    """

    families: tuple[SchemeRules, ...]
    capabilities: Mapping[tuple[str, str], Capability] = field(init=False, repr=False, compare=False)
    by_scheme: Mapping[str, SchemeRules] = field(init=False, repr=False, compare=False)
    side_tensors: Mapping[str, SideTensor] = field(init=False, repr=False, compare=False)
    ops: Mapping[str, Op] = field(init=False, repr=False, compare=False)
    placers: Mapping[str, Callable[..., Any]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        caps: dict[tuple[str, str], Capability] = {}
        by_scheme: dict[str, SchemeRules] = {}
        sides: dict[str, SideTensor] = {}
        ops: dict[str, Op] = {}
        placers: dict[str, Callable[..., Any]] = {}
        names: set[str] = set()
        for rules in self.families:
            clash = ([rules.family] if rules.family in names or not rules.family else []) \
                + [c.scheme for c in rules.capabilities.values() if c.scheme in by_scheme] \
                + [f"{m} {a}" for m, a in rules.capabilities if (m, a) in caps] \
                + [op for op in rules.ops if op in ops or op == "copy"] \
                + [s.param for s in rules.side_tensors if s.param in sides and sides[s.param] != s]
            if clash:
                raise ValueError(f"quantization scheme family {rules.family!r} cannot join the registry: "
                                 f"{clash} already belong to another family")
            names.add(rules.family)
            caps.update(rules.capabilities)
            by_scheme.update({cap.scheme: rules for cap in rules.capabilities.values()})
            sides.update({s.param: s for s in rules.side_tensors})
            ops.update(rules.ops)
            placers.update(rules.placers)
        for name, table in (("capabilities", caps), ("by_scheme", by_scheme), ("side_tensors", sides),
                            ("ops", ops), ("placers", placers)):
            object.__setattr__(self, name, MappingProxyType(table))

    def for_scheme(self, scheme: str) -> SchemeRules | None:
        """The family that processes scheme ``scheme`` (a ``Capability.scheme``), or ``None``."""
        return self.by_scheme.get(scheme)

    def op(self, name: str) -> Op | None:
        """The processing op ``name``, or ``None``."""
        return self.ops.get(name)

    def placer(self, name: str) -> Callable[..., Any] | None:
        """The torch-free placement of op ``name`` (see :attr:`SchemeRules.placers`), or ``None``."""
        return self.placers.get(name)
