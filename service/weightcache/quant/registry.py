"""The scheme registry: every quantization scheme weightcache processes, and what each one owns.

A scheme family is one :class:`SchemeRules` object, registered with
:func:`register` (``weightcache.quant`` registers ModelOpt FP8 at import). It
owns, for its schemes:

- its **capability rows** (``(quant_method, QUANT_ALGO) -> Capability``),
  added to :data:`weightcache.quant.capabilities.SUPPORTED`;
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

``weightcache.pipeline`` and ``weightcache.sharding`` only iterate this
registry; adding a scheme is one module in ``quant/`` plus its capability rows
(``docs/quantization.md``, "Adding a scheme").

Forbidden imports: torch at module level, socket, weightcache.daemon, weightcache.client,
weightcache.sharding, weightcache.pipeline.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from . import capabilities
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
    """One quantization scheme family. Subclass it, fill the attributes, register an instance.

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


_lock = threading.Lock()
_rules: dict[str, SchemeRules] = {}
_by_scheme: dict[str, SchemeRules] = {}
_version = [0]


def register(rules: SchemeRules) -> SchemeRules:
    """Adds a scheme family: its capability rows, side tensors and ops become active.

    Returns:
        `SchemeRules`: ``rules``.

    Raises:
        ValueError: a family, scheme name, capability row, op name or side
            tensor (with another rule) that another registered family has.
    """
    with _lock:
        taken = {op for r in _rules.values() for op in r.ops}
        sides = {s.param: s for r in _rules.values() for s in r.side_tensors}
        clash = ([rules.family] if rules.family in _rules or not rules.family else []) \
            + [c.scheme for c in rules.capabilities.values() if c.scheme in _by_scheme] \
            + [f"{m} {a}" for m, a in rules.capabilities if (m, a) in capabilities.SUPPORTED] \
            + [op for op in rules.ops if op in taken or op == "copy"] \
            + [s.param for s in rules.side_tensors if s.param in sides and sides[s.param] != s]
        if clash:
            raise ValueError(f"quantization scheme family {rules.family!r} cannot be registered: "
                             f"{clash} already belong to another registered family")
        _rules[rules.family] = rules
        for key, cap in rules.capabilities.items():
            capabilities.SUPPORTED[key] = cap
            _by_scheme[cap.scheme] = rules
        _version[0] += 1
    return rules


def unregister(rules: SchemeRules) -> None:
    """Removes a family :func:`register` added (tests register toy schemes and take them out again)."""
    with _lock:
        if _rules.get(rules.family) is not rules:
            return
        del _rules[rules.family]
        for key, cap in rules.capabilities.items():
            capabilities.SUPPORTED.pop(key, None)
            _by_scheme.pop(cap.scheme, None)
        _version[0] += 1


def families() -> list[SchemeRules]:
    """The registered families, in registration order."""
    return list(_rules.values())


def for_scheme(scheme: str) -> SchemeRules | None:
    """The family that processes scheme ``scheme`` (a ``Capability.scheme``), or ``None``."""
    return _by_scheme.get(scheme)


def side_tensors() -> dict[str, SideTensor]:
    """Every registered side tensor rule, by ``param``."""
    return {s.param: s for r in _rules.values() for s in r.side_tensors}


def op(name: str) -> Op | None:
    """The registered processing op ``name``, or ``None``."""
    for r in _rules.values():
        fn = r.ops.get(name)
        if fn is not None:
            return fn
    return None


def placer(name: str) -> Callable[..., Any] | None:
    """The registered torch-free placement of op ``name`` (see :attr:`SchemeRules.placers`), or ``None``."""
    for r in _rules.values():
        fn = r.placers.get(name)
        if fn is not None:
            return fn
    return None


def version() -> int:
    """A number that changes with every :func:`register` / :func:`unregister` (for caches of derived tables)."""
    return _version[0]
