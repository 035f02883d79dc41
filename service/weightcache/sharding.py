"""Tensor-parallel partition rules: checkpoint tensors -> per-rank slab specs.

Rules follow vLLM's parallel layers (``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``), which follow Megatron-LM:

- column-parallel ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj``:
  ``weight`` (and ``bias``, per-channel ``weight_scale``) split on the output
  dim 0, rank ``r`` takes rows ``[r * n, (r + 1) * n)``;
- grouped-query attention (``QKVParallelLinear``): with
  ``num_key_value_heads >= tp_size`` each rank takes
  ``num_key_value_heads // tp_size`` KV heads; otherwise every rank takes one
  KV head, replicated on ``tp_size // num_key_value_heads`` ranks: rank ``r``
  takes KV head ``r // (tp_size // num_key_value_heads)``;
- row-parallel ``o_proj``/``down_proj``: ``weight`` split on the input dim 1;
  ``bias`` and per-channel ``weight_scale`` (output dim) replicated (the engine
  adds the bias once, after the all-reduce, as vLLM's rank 0 does);
- vocab-parallel ``embed_tokens``/``lm_head``: the vocabulary is padded to a
  multiple of :data:`VOCAB_PADDING` (vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``;
  ``pad_vocab_size``), which must then divide by ``tp_size``; rank ``r`` holds
  padded rows ``[r * Vp / T, (r + 1) * Vp / T)``, rows ``>= vocab_size`` are
  zeros. No padding at ``tp_size = 1`` with ``naming = "hf"`` (the checkpoint's
  own shape);
- 1-D weights (norms) and 0-d scales replicated;
- side tensors of quantized linears (scales) follow the rule their scheme
  family registers (:class:`weightcache.quant.registry.SideTensor`): a scalar
  is replicated, a per-output-row tensor is split like the module's bias;
- tied embeddings: ``lm_head.weight`` is an alias of the embedding (no bytes).

See ``docs/sharding.md``. ``tp_size = 1`` with ``naming = "hf"`` works for
any architecture (every tensor whole); anything else needs a family in
:data:`FAMILIES`.

Forbidden imports: torch at module level, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from . import quant
from .checkpoint import Checkpoint
from .checkpoint.header import TensorInfo
from .errors import ConfigError, ShapeMismatch, UnsupportedArchitecture
from .quant import SideTensor
from .sizes import round_up
from .spec import FUSED_PARTS
from .tensor_spec import SourceRef, TensorSpec
from .wire import NAMINGS

log = logging.getLogger(__name__)

#: vLLM pads the vocabulary of VocabParallelEmbedding / ParallelLMHead to a
#: multiple of this (``DEFAULT_VOCAB_PADDING_SIZE``), independent of tp_size.
VOCAB_PADDING = 64



@dataclass(frozen=True)
class Family:
    """An architecture family with tensor-parallel rules.

    Attributes:
        name (`str`): family name (``llama``).
        architectures (`tuple[str]`): ``config.json`` ``architectures`` entries.
        model_types (`tuple[str]`): ``config.json`` ``model_type`` values.
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]


#: Families with rules. All three are Llama-style decoders: the same module
#: names; Qwen2 adds q/k/v biases, Mistral may set ``head_dim`` apart from
#: ``hidden_size // num_attention_heads``.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", ("LlamaForCausalLM",), ("llama",)),
        Family("mistral", ("MistralForCausalLM",), ("mistral",)),
        Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",)),
    )
}

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_PART_OF = {p: fused for fused, parts in FUSED_PARTS.items() for p in parts}


@dataclass(frozen=True)
class _Patterns:
    """The name patterns of one registry version: linear params and vocab params, side tensors by param."""

    linear: re.Pattern
    vocab: re.Pattern
    side: dict[str, SideTensor]


@functools.lru_cache(maxsize=4)
def _patterns(registry: quant.Registry) -> _Patterns:
    """The patterns for ``registry``'s side tensors, built once per registry."""
    side = registry.side_tensors
    params = "|".join(["weight", "bias", *(re.escape(p) for p in side)])
    vocab = "|".join(["weight", *(re.escape(p) for p, s in side.items() if s.shard == "output")])
    pats = _Patterns(
        re.compile(r"^(?P<prefix>(?:.+\.)?)(?P<module>q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
                   rf"\.(?P<param>{params})$"),
        re.compile(rf"^(?:.+\.)?(?:embed_tokens|lm_head)\.(?:{vocab})$"),
        dict(side),
    )
    return pats


#: The dtype argument with which :func:`cast_dtypes` asks :func:`shard_specs` which tensors follow a
#: configured dtype: such a tensor's dtype comes back as this prefix plus its stored dtype.
_PROBE = "probe:"


def _target_dtype(stored: str, target: str | None) -> str:
    # Only floating-point tensors follow the configured dtype; ints, bools and
    # FP8 keep theirs (FP8 is handled by weightcache.quant).
    if target is None or stored not in ("F16", "BF16", "F32", "F64"):
        return stored
    return _PROBE + stored if target == _PROBE else target


def _arch(config: dict[str, Any]) -> str:
    return (config.get("architectures") or [config.get("model_type", "?")])[0]


def family_of(config: dict[str, Any]) -> Family | None:
    """The family of a ``config.json`` (by ``architectures``, then ``model_type``), or ``None``."""
    archs = config.get("architectures") or []
    for fam in FAMILIES.values():
        if any(a in fam.architectures for a in archs):
            return fam
    for fam in FAMILIES.values():
        if config.get("model_type") in fam.model_types:
            return fam
    return None


def padded_vocab_size(vocab_size: int) -> int:
    """vLLM's ``pad_vocab_size``: ``vocab_size`` rounded up to :data:`VOCAB_PADDING`."""
    return round_up(vocab_size, VOCAB_PADDING)


@dataclass(frozen=True)
class _Dims:
    """Sizes from ``config.json`` the rules need."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: dict[str, Any], where: str) -> "_Dims":
        def need(key: str) -> int:
            v = config.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ShapeMismatch(
                    f"{where}: config.json field {key!r} is {v!r}, a positive integer is needed to shard "
                    f"{_arch(config)}; fix config.json",
                    field=key,
                )
            return v

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv = config.get("num_key_value_heads")
        kv_heads = heads if kv is None else need("num_key_value_heads")
        head_dim = config.get("head_dim")
        head_dim = need("head_dim") if head_dim is not None else hidden // heads
        return cls(hidden, heads, kv_heads, head_dim, need("intermediate_size"), need("vocab_size"))


def _check_args(tp_size: int, tp_rank: int, naming: str) -> None:
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp_size {tp_size!r} must be an integer >= 1", key="tp_size")
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank {tp_rank!r} must be in [0, {tp_size})", key="tp_rank")
    if naming not in NAMINGS:
        raise ConfigError(f"naming {naming!r} is not one of {', '.join(NAMINGS)}", key="naming")


def _supported_text() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for f in FAMILIES.values())


def check_supported(config_json: dict[str, Any], tp_size: int, naming: str, where: str = "config.json") -> None:
    """Checks, from ``config.json`` alone, that a layout can be sharded.

    Call it at config load (``weightcache check-config``, service start) so a
    bad layout fails before any byte is read.

    Args:
        config_json (`dict`): the checkpoint's parsed ``config.json``.
        tp_size (`int`): tensor-parallel size of the layout.
        naming (`str`): ``hf`` or ``vllm``.
        where (`str`, *optional*): the checkpoint path, for messages.

    Raises:
        UnsupportedArchitecture (`unsupported_architecture`): ``tp_size > 1`` or
            ``naming = "vllm"`` for an architecture outside :data:`FAMILIES`;
            ``details["supported"]`` lists the families.
        ShapeMismatch (`shape_mismatch`): ``num_attention_heads``,
            ``num_key_value_heads`` (or ``tp_size`` by it, when smaller),
            ``intermediate_size`` or the padded ``vocab_size`` not divisible by
            ``tp_size``; ``details["field"]`` names the ``config.json`` key.
        ConfigError (`config_invalid`): ``tp_size < 1`` or an unknown naming.
    """
    _check_args(tp_size, 0, naming)
    fam = family_of(config_json)
    if fam is None:
        if tp_size == 1 and naming == "hf":
            return
        arch = _arch(config_json)
        raise UnsupportedArchitecture(
            f"{where}: architecture {arch!r} has no tensor-parallel rules (tp_size={tp_size}, naming={naming!r}); "
            f"supported families: {_supported_text()}; "
            + ("a vLLM engine started with --load-format weightcache lays it out and publishes it (a configured "
               "model waits for it: waiting_for_engine)" if naming == "vllm" else
               "use tp = 1 with naming = \"hf\" for this model"),
            architecture=arch,
            supported=sorted(FAMILIES),
            tp_size=tp_size,
            naming=naming,
        )
    d = _Dims.of(config_json, where)

    def divisible(key: str, value: int, by: int, what: str) -> None:
        if value % by:
            raise ShapeMismatch(
                f"{where}: config.json {key} = {value} is not divisible by {what}; "
                f"choose a tp_size that divides it",
                field=key,
                value=value,
                tp_size=tp_size,
            )

    divisible("num_attention_heads", d.heads, tp_size, f"tp_size = {tp_size}")
    if d.kv_heads >= tp_size:
        divisible("num_key_value_heads", d.kv_heads, tp_size, f"tp_size = {tp_size}")
    elif tp_size % d.kv_heads:
        raise ShapeMismatch(
            f"{where}: tp_size = {tp_size} is not a multiple of config.json num_key_value_heads = {d.kv_heads} "
            f"(KV heads are replicated on tp_size / num_key_value_heads ranks); choose another tp_size",
            field="num_key_value_heads",
            value=d.kv_heads,
            tp_size=tp_size,
        )
    divisible("intermediate_size", d.intermediate, tp_size, f"tp_size = {tp_size}")
    divisible("vocab_size", padded_vocab_size(d.vocab), tp_size,
              f"tp_size = {tp_size} once padded to a multiple of {VOCAB_PADDING} ({padded_vocab_size(d.vocab)})")


@dataclass(frozen=True)
class _Piece:
    """The rank's slice of one checkpoint tensor."""

    name: str
    info: TensorInfo
    tp_dim: int | None  # None: replicated, whole tensor
    start: int = 0
    size: int = 0  # real rows/cols taken from the checkpoint
    pad: int = 0  # zero rows appended (vocab padding)
    layout: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.tp_dim is None:
            return self.info.shape
        s = list(self.info.shape)
        s[self.tp_dim] = self.size + self.pad
        return tuple(s)

    @property
    def source(self) -> SourceRef:
        if self.tp_dim is None or (self.start == 0 and self.size == self.info.shape[self.tp_dim]):
            return SourceRef(self.name)
        return SourceRef(self.name, self.tp_dim, self.start, self.start + self.size)


class _Rules:
    """The rank's ranges of a Llama-style decoder."""

    def __init__(self, ck: Checkpoint, d: _Dims, tp_size: int, tp_rank: int, pad_vocab: bool) -> None:
        self.ck, self.d, self.tp, self.rank, self.pad_vocab = ck, d, tp_size, tp_rank, pad_vocab
        if d.kv_heads >= tp_size:
            self.kv_per_rank, self.kv_replicas = d.kv_heads // tp_size, 1
        else:
            self.kv_per_rank, self.kv_replicas = 1, tp_size // d.kv_heads

    def out_rows(self, module: str) -> int:
        """Logical output rows of ``module`` (``config.json``)."""
        d = self.d
        return {
            "q_proj": d.heads * d.head_dim,
            "k_proj": d.kv_heads * d.head_dim,
            "v_proj": d.kv_heads * d.head_dim,
            "o_proj": d.hidden,
            "gate_proj": d.intermediate,
            "up_proj": d.intermediate,
            "down_proj": d.hidden,
        }[module]

    def in_cols(self, module: str) -> int:
        d = self.d
        return {"o_proj": d.heads * d.head_dim, "down_proj": d.intermediate}.get(module, d.hidden)

    def col_range(self, module: str) -> tuple[int, int, dict[str, Any]]:
        """(start, size, extra layout) of the rank's output rows of a column-parallel module."""
        if module in ("k_proj", "v_proj"):
            size = self.kv_per_rank * self.d.head_dim
            shard_id = self.rank // self.kv_replicas
            return shard_id * size, size, {"kv_head_replicas": self.kv_replicas}
        size = self.out_rows(module) // self.tp
        return self.rank * size, size, {}

    def row_range(self, module: str) -> tuple[int, int]:
        size = self.in_cols(module) // self.tp
        return self.rank * size, size

    def _bad(self, info: TensorInfo, expected: Any, why: str) -> ShapeMismatch:
        return ShapeMismatch(
            f"checkpoint {self.ck.path}: tensor {info.name!r} in {info.file} has shape {list(info.shape)}, "
            f"expected {expected} from config.json ({why}); the checkpoint and its config.json disagree",
            file=info.file,
            tensor=info.name,
            expected=expected,
            actual=list(info.shape),
        )

    def _layout(self, info: TensorInfo, dim: int, start: int, size: int, **extra: Any) -> dict[str, Any]:
        return {"tp_dim": dim, "tp_size": self.tp, "tp_rank": self.rank, "logical_shape": list(info.shape),
                "shard_start": start, "shard_size": size, **extra}

    def linear(self, info: TensorInfo, module: str, param: str, side: SideTensor | None = None) -> _Piece:
        """The rank's piece of ``module.param``: the weight, the bias, or a side tensor with rule ``side``."""
        rows, cols = self.out_rows(module), self.in_cols(module)
        d = self.d
        why = (f"hidden_size={d.hidden}, num_attention_heads={d.heads}, num_key_value_heads={d.kv_heads}, "
               f"head_dim={d.head_dim}, intermediate_size={d.intermediate}")
        shape = info.shape
        column = module in _COLUMN
        if param == "weight":
            if shape != (rows, cols):
                raise self._bad(info, [rows, cols], why)
            if column:
                start, size, extra = self.col_range(module)
                return _Piece(info.name, info, 0, start, size, layout=self._layout(info, 0, start, size, **extra))
            start, size = self.row_range(module)
            return _Piece(info.name, info, 1, start, size, layout=self._layout(info, 1, start, size))
        numel = 1
        for s in shape:
            numel *= s
        if side is not None and (side.shard == "scalar" or numel == 1):
            if numel != 1:
                raise self._bad(info, "a single element (0-d or [1])", "per-tensor scale")
            return _Piece(info.name, info, None, layout={"tp_dim": None})
        # bias [rows], or a per-output-row side tensor (per-channel weight_scale) [rows] / [rows, 1]
        if shape not in ((rows,), (rows, 1)) or (param == "bias" and len(shape) != 1):
            raise self._bad(info, [rows], why)
        if not column:
            return _Piece(info.name, info, None, layout={"tp_dim": None})
        start, size, extra = self.col_range(module)
        return _Piece(info.name, info, 0, start, size, layout=self._layout(info, 0, start, size, **extra))

    def vocab(self, info: TensorInfo) -> _Piece:
        v, d = self.d.vocab, self.d
        if info.shape[:1] != (v,) or (info.name.endswith(".weight") and info.shape != (v, d.hidden)):
            raise self._bad(info, [v, d.hidden] if info.name.endswith(".weight") else [v],
                            f"vocab_size={v}, hidden_size={d.hidden}")
        if not self.pad_vocab:
            return _Piece(info.name, info, 0, 0, v, layout=self._layout(
                info, 0, 0, v, logical_vocab_size=v, padded_vocab_size=v, pad_rows=0))
        vp = padded_vocab_size(v)
        per = vp // self.tp
        start = self.rank * per
        size = max(0, min(v, start + per) - start)
        start = min(start, v)
        return _Piece(info.name, info, 0, start, size, per - size, layout=self._layout(
            info, 0, start, size, logical_vocab_size=v, padded_vocab_size=vp, pad_rows=per - size))

    def other(self, info: TensorInfo) -> _Piece:
        if len(info.shape) <= 1 or self.tp == 1:
            return _Piece(info.name, info, None, layout={"tp_dim": None})
        raise UnsupportedArchitecture(
            f"checkpoint {self.ck.path}: tensor {info.name!r} in {info.file} (shape {list(info.shape)}) has no "
            f"tensor-parallel rule for architecture {_arch(self.ck.config)!r}; only tp_size = 1 can load it",
            architecture=_arch(self.ck.config),
            tensor=info.name,
            file=info.file,
        )


def _spec(p: _Piece, dtype: str | None, side: dict[str, SideTensor], name: str | None = None) -> TensorSpec:
    param = p.name.rsplit(".", 1)[-1]
    out_dtype = p.info.dtype if param in side else _target_dtype(p.info.dtype, dtype)
    op_args = {"pad_rows": p.pad} if p.pad else {}
    return TensorSpec(name or p.name, out_dtype, p.shape, (p.source,), op_args=op_args, layout=dict(p.layout))


def _fused_spec(ck: Checkpoint, name: str, pieces: list[tuple[str, _Piece]], dtype: str | None,
                side: dict[str, SideTensor]) -> TensorSpec:
    """vLLM fused parameter: the parts' rank slices concatenated on dim 0 (0-d parts become [1])."""
    dtypes = {p.info.dtype for _, p in pieces}
    if len(dtypes) != 1:
        raise ShapeMismatch(
            f"checkpoint {ck.path}: parts of {name!r} have different dtypes "
            f"{ {p.name: p.info.dtype for _, p in pieces} }; they must match to be fused",
            tensor=name,
        )
    parts, offset, trailing = [], 0, None
    for part, p in pieces:
        shape = p.shape if p.shape else (1,)
        if trailing is None:
            trailing = shape[1:]
        elif shape[1:] != trailing:
            raise ShapeMismatch(
                f"checkpoint {ck.path}: {p.name!r} in {p.info.file} has shape {list(p.info.shape)}, "
                f"incompatible with the other parts of {name!r}",
                file=p.info.file, tensor=p.name,
            )
        entry = {"name": part, "source": p.name, "offset": offset, "size": shape[0]}
        entry.update({k: v for k, v in p.layout.items() if k not in ("tp_size", "tp_rank")})
        entry.setdefault("logical_shape", list(p.info.shape))
        parts.append(entry)
        offset += shape[0]
    first = pieces[0][1]
    param = name.rsplit(".", 1)[-1]
    out_dtype = first.info.dtype if param in side else _target_dtype(first.info.dtype, dtype)
    sharded = any(p.tp_dim is not None for _, p in pieces)
    layout: dict[str, Any] = {"fused_parts": parts, "tp_dim": 0 if sharded else None}
    if sharded:
        layout.update(tp_size=first.layout.get("tp_size"), tp_rank=first.layout.get("tp_rank"))
    return TensorSpec(name, out_dtype, (offset, *trailing), tuple(p.source for _, p in pieces), cat_dim=0,
                      layout=layout)


def shard_specs(ck: Checkpoint, tp_size: int, tp_rank: int, naming: str, dtype: str | None,
                registry: quant.Registry = quant.REGISTRY) -> list[TensorSpec]:
    """Specs of the rank's slab, from headers and ``config.json`` only.

    Shapes below use ``T = tp_size``, ``H = hidden_size``, ``I = intermediate_size``,
    ``D = head_dim``, ``V = vocab_size``, ``Vp`` = ``V`` padded to :data:`VOCAB_PADDING`.

    ==========================  ======================  ==================================
    checkpoint tensor           rank's stored shape     rule
    ==========================  ======================  ==================================
    ``q_proj.weight/bias``      ``(heads * D / T, H)``  column-parallel, dim 0
    ``k_proj``/``v_proj``       ``(kv_r * D, H)``       dim 0, KV heads replicated if < T
    ``gate_proj``/``up_proj``   ``(I / T, H)``          column-parallel, dim 0
    ``o_proj.weight``           ``(H, heads * D / T)``  row-parallel, dim 1
    ``down_proj.weight``        ``(H, I / T)``          row-parallel, dim 1
    ``embed_tokens``/``lm_head``  ``(Vp / T, H)``       vocab-parallel, zero padding rows
    norms, 1-D, 0-d scales      as stored               replicated
    ==========================  ======================  ==================================

    With ``naming = "vllm"``, q|k|v and gate|up slices are concatenated on
    dim 0 into ``qkv_proj`` and ``gate_up_proj`` (``weight``, ``bias``,
    and the side tensors their scheme registers as fused, such as ``weight_scale``
    and ``input_scale``; 0-d scales become one element each), and side tensors
    with a vLLM name (``k_proj.k_scale``/``v_proj.v_scale``) are renamed
    (``attn.k_scale``/``attn.v_scale``, as vLLM's ``maybe_remap_kv_scale_name``). Each spec's ``layout``
    records how to put the shards back together (``docs/sharding.md``).

    Args:
        ck (`Checkpoint`): opened checkpoint.
        tp_size (`int`), tp_rank (`int`): layout and rank, ``0 <= tp_rank < tp_size``.
        naming (`str`): ``hf`` or ``vllm``.
        dtype (`str | None`): safetensors code floating-point tensors are cast
            to, or ``None`` to keep the stored dtype. FP8 tensors and the
            registered side tensors (scales) keep theirs.
        registry (`quant.Registry`, *optional*): whose side tensors (scales) are sharded by their rules;
            ``quant.REGISTRY`` by default.

    Returns:
        `list[TensorSpec]`, sorted by name; tied ``lm_head.weight`` as an
        alias (``alias_of``) of the embedding, never a copy.

    Raises:
        UnsupportedArchitecture (`unsupported_architecture`): TP > 1 or
            ``naming = "vllm"`` for an architecture without rules, or a 2-D
            tensor without a rule at TP > 1.
        ShapeMismatch (`shape_mismatch`): a divisibility error (names the
            ``config.json`` field) or a tensor whose shape disagrees with
            ``config.json`` (names the file and tensor).
        ConfigError (`config_invalid`): bad ``tp_size``/``tp_rank``/``naming``.
    """
    _check_args(tp_size, tp_rank, naming)
    fam = family_of(ck.config)
    if fam is None and tp_size == 1 and naming == "hf":
        return [
            TensorSpec(name, _target_dtype(info.dtype, dtype), info.shape, (SourceRef(name),), layout={"tp_dim": None})
            for name, info in sorted(ck.tensors.items())
        ]
    check_supported(ck.config, tp_size, naming, where=str(ck.path))
    pats = _patterns(registry)
    rules = _Rules(ck, _Dims.of(ck.config, str(ck.path)), tp_size, tp_rank, pad_vocab=tp_size > 1 or naming == "vllm")

    embed = next((n for n in sorted(ck.tensors) if n.endswith("embed_tokens.weight")), None)
    tied = embed is not None and (ck.config.get("tie_word_embeddings") is True or "lm_head.weight" not in ck.tensors)
    specs: dict[str, TensorSpec] = {}
    groups: dict[tuple[str, str, str], dict[str, _Piece]] = {}
    for name, info in sorted(ck.tensors.items()):
        if tied and name == "lm_head.weight":
            log.debug("tied lm_head aliased checkpoint=%s tensor=%s", ck.path, name)
            continue  # tied: the checkpoint's copy is ignored, lm_head aliases the embedding
        m = pats.linear.match(name)
        if m:
            prefix, module, param = m["prefix"], m["module"], m["param"]
            side = pats.side.get(param)
            piece = rules.linear(info, module, param, side)
            if naming == "vllm" and module in _PART_OF and (side is None or (side.fuse and not side.vllm_name)):
                groups.setdefault((prefix, _PART_OF[module], param), {})[module] = piece
                continue
            out = name
            if naming == "vllm" and side is not None and side.vllm_name:
                # vLLM: self_attn.k_proj.k_scale -> self_attn.attn.k_scale (maybe_remap_kv_scale_name)
                out = prefix + side.vllm_name.format(param=param)
            spec = _spec(piece, dtype, pats.side, out)
            if out != name:
                spec.layout["source"] = name
            specs[out] = spec
        elif pats.vocab.match(name):
            specs[name] = _spec(rules.vocab(info), dtype, pats.side)
        else:
            specs[name] = _spec(rules.other(info), dtype, pats.side)
    for (prefix, fused, param), got in groups.items():
        missing = [p for p in FUSED_PARTS[fused] if p not in got]
        if missing:
            raise ShapeMismatch(
                f"checkpoint {ck.path}: {prefix}{missing[0]}.{param} is missing, so {prefix}{fused}.{param} "
                f"cannot be fused (parts present: {sorted(got)}); use naming = \"hf\" or fix the checkpoint",
                tensor=f"{prefix}{missing[0]}.{param}",
            )
        out = f"{prefix}{fused}.{param}"
        specs[out] = _fused_spec(ck, out, [(p, got[p]) for p in FUSED_PARTS[fused]], dtype, pats.side)
    if tied:
        target = specs[embed]
        specs["lm_head.weight"] = TensorSpec(
            "lm_head.weight", target.dtype, target.stored_shape, alias_of=embed,
            layout={"tied_to": embed, **target.layout},
        )
    return [specs[n] for n in sorted(specs)]


def cast_dtypes(ck: Checkpoint, tp_size: int, tp_rank: int, naming: str,
                registry: quant.Registry = quant.REGISTRY) -> frozenset[str]:
    """The stored dtypes of the rank's tensors that a configured ``dtype`` would cast (headers only).

    Casting to a dtype changes nothing on this rank exactly when every one of
    them already is that dtype (an empty set: no cast changes anything), the
    rule of :func:`weightcache.identity.effective_dtype`. One :func:`shard_specs`
    run, whatever the number of dtypes asked about.

    Raises:
        The errors of :func:`shard_specs`.

    Example:
        >>> cast_dtypes(Checkpoint("/srv/models/llama-f32"), 2, 0, "vllm")  # doctest: +SKIP
        frozenset({'F32'})
    """
    specs = shard_specs(ck, tp_size, tp_rank, naming, _PROBE, registry)
    return frozenset(s.dtype[len(_PROBE):] for s in specs if s.dtype.startswith(_PROBE))
