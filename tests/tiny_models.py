"""Tiny real checkpoints and tensor-parallel helpers shared by the tests.

Import from a test module (``tests/`` is not a package)::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_models import tiny_llama, tiny_qwen2, tiny_mistral, load_rank, reassemble

Fixtures (session-scoped, built once with transformers from a config, fixed
seed, float32, saved as *sharded* safetensors checkpoints):

- ``tiny_llama``: LlamaForCausalLM, 8 heads / 4 KV heads, vocab 130 (padded to
  192: at TP = 4 rank 3 holds padding only), untied.
- ``tiny_qwen2``: Qwen2ForCausalLM, 8 heads / 2 KV heads (replicated at TP = 4),
  q/k/v biases, vocab 151, tied embeddings (no ``lm_head.weight`` on disk).
- ``tiny_mistral``: MistralForCausalLM, 8 heads / 1 KV head (MQA), ``head_dim``
  16 (so ``q_proj`` is [128, 64] with hidden 64), vocab 100, untied.

Helpers: :func:`build_tiny_model`,
:func:`checkpoint_tensors`, :func:`load_rank`, :func:`reassemble`,
:func:`unfuse`, :func:`tp_forward`, :func:`reference_logits`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, vocab_size=130,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.1,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, vocab_size=151,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, initializer_range=0.1,
        use_sliding_window=False,
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1, head_dim=16, vocab_size=100,
        max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.1,
    ),
}


def build_tiny_model(dest: Path, family: str, *, seed: int = 0, max_shard_size: str = "60KB",
                     **overrides: Any) -> Path:
    """Builds a random tiny model of ``family`` with transformers and saves it, sharded.

    Args:
        dest (`Path`): directory to create (``config.json``, ``model-0000N-of-0000M.safetensors``,
            ``model.safetensors.index.json``).
        family (`str`): a key of :data:`TINY_CONFIGS`.
        seed (`int`): ``torch.manual_seed`` before initialisation.
        max_shard_size (`str`): passed to ``save_pretrained``; small, so the checkpoint has several files.
        **overrides: ``config.json`` fields replacing the defaults.

    Returns:
        `Path` of the checkpoint directory. Weights are F32.
    """
    import transformers

    fields = {**TINY_CONFIGS[family], **overrides}
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[family]
    fields = {k: v for k, v in fields.items() if k not in ("model_type",)}
    config = cls(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    with torch.no_grad():  # transformers starts biases at 0 and norms at 1: make them tell ranks apart
        for pname, param in model.named_parameters():
            if pname.endswith(".bias"):
                param.normal_(0.0, config.initializer_range)
            elif "norm" in pname:
                param.normal_(1.0, config.initializer_range)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, max_shard_size=max_shard_size)
    return dest


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, read with ``safetensors.torch.load_file``."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def load_rank(path: Path, tp_size: int, tp_rank: int, naming: str, dtype: str = "auto",
              backend: str = "host", gpu: int = 0):
    """Runs ``pipeline.plan`` + ``execute`` into a sealed slab of ``backend`` (``host`` or ``cuda``, GPU ``gpu``).

    Returns:
        ``(manifest, views, slab)``: the :class:`Manifest`, ``build_views``
        over the sealed slab's read-only mapping, and the sealed slab. Close
        it only once no view is left: ``HostSealedSlab.close()`` unmaps even
        under live views (``torch.frombuffer`` holds no buffer export); the
        tests close just ``slab.fd`` and let the last view drop the mapping.
    """
    from weightcache import pipeline
    from weightcache.config import ModelConfig
    from weightcache.spec import RankRequest
    from weightcache.manifest import build_views
    from weightcache.memory import get_backend

    backend = get_backend(backend, gpu)
    model = ModelConfig(name=Path(path).name, path=str(path), dtype=dtype, naming=naming)
    p = pipeline.plan(RankRequest(model, tp_size, tp_rank), backend.device_info())
    ws = backend.allocate(p.slab_size_bytes, f"{model.name}-tp{tp_size}-r{tp_rank}")
    try:
        manifest = pipeline.execute(p, ws.tensor)
    except BaseException:
        ws.abort()
        raise
    sealed = ws.seal()
    return manifest, build_views(sealed.tensor, manifest), sealed


def _place(full: dict, covered: dict, src: str, t: torch.Tensor, lay: dict[str, Any], where: str) -> None:
    """Puts one rank's piece of checkpoint tensor ``src`` back into ``full[src]``."""
    logical = tuple(lay["logical_shape"])
    if src not in full:
        full[src] = torch.zeros(logical, dtype=t.dtype)
        covered[src] = torch.zeros(logical[lay["tp_dim"]] if lay.get("tp_dim") is not None else 1, dtype=torch.int32)
    dst = full[src]
    d = lay.get("tp_dim")
    if d is None:
        t = t.reshape(logical)
        if covered[src][0]:
            assert torch.equal(dst.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), \
                f"replicas of {src} differ ({where})"
        dst.copy_(t)
        covered[src][0] += 1
        return
    start, size = lay["shard_start"], lay["shard_size"]
    real = t.narrow(d, 0, size)
    pad = t.narrow(d, size, t.shape[d] - size)
    assert not pad.view(torch.uint8).any(), f"padding rows of {src} are not zero ({where})"
    assert t.shape[d] - size == lay.get("pad_rows", 0), f"pad_rows of {src} disagree with its shape ({where})"
    seg = dst.narrow(d, start, size)
    if covered[src][start:start + size].any():
        assert torch.equal(seg.view(torch.uint8), real.view(torch.uint8)), f"KV replicas of {src} differ ({where})"
    seg.copy_(real)
    covered[src][start:start + size] += 1


def reassemble(ranks: list[tuple[Any, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Puts the ranks' shards back together into whole checkpoint tensors, driven only by the manifests' layouts.

    Args:
        ranks: ``[(manifest, views)]`` of ranks ``0..tp_size-1`` (hf or vllm naming).

    Returns:
        `dict[str, torch.Tensor]`: checkpoint name -> whole tensor. Tied aliases
        are not included (they have no bytes of their own). Asserts that every
        element is covered, replicas agree and padding rows are zeros.
    """
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for manifest, views in ranks:
        for rec in manifest.tensors:
            if rec.alias_of is not None:
                continue
            v, lay = views[rec.name], rec.layout
            where = f"rank {manifest.tp_rank}, {rec.name}"
            if "fused_parts" in lay:
                for part in lay["fused_parts"]:
                    _place(full, covered, part["source"], v.narrow(0, part["offset"], part["size"]), part, where)
            else:
                if "logical_shape" not in lay:
                    lay = {**lay, "logical_shape": list(v.shape)}
                _place(full, covered, lay.get("source", rec.name), v, lay, where)
    for name, c in covered.items():
        assert bool((c > 0).all()), f"{name}: elements not covered by any rank"
    return full


def unfuse(manifest: Any, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One rank's tensors under hf names: fused vLLM parameters split by their ``fused_parts``."""
    out: dict[str, torch.Tensor] = {}
    for rec in manifest.tensors:
        v = views[rec.name]
        if "fused_parts" in rec.layout:
            for part in rec.layout["fused_parts"]:
                out[part["source"]] = v.narrow(0, part["offset"], part["size"])
        else:
            out[rec.layout.get("source", rec.name)] = v
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    # HF Llama convention (rotate_half); x: [seq, heads, head_dim].
    seq, _, dim = x.shape
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def tp_forward(config: dict[str, Any], ranks: list[dict[str, torch.Tensor]], input_ids: torch.Tensor) -> torch.Tensor:
    """Reference tensor-parallel forward of a Llama-style decoder on CPU.

    Each rank computes its partial output from its own shards only; the
    row-parallel outputs (vocab-parallel embedding, ``o_proj``, ``down_proj``)
    are summed over ranks (the all-reduce), and the vocab-parallel logits are
    concatenated (the all-gather) and cut to ``vocab_size``.

    Args:
        config (`dict`): ``config.json``.
        ranks (`list[dict]`): per rank, hf-named shards (see :func:`unfuse`).
        input_ids (`torch.Tensor`): ``[seq]`` int64.

    Returns:
        `torch.Tensor` ``[seq, vocab_size]`` float32 logits.
    """
    T = len(ranks)
    hidden, nh = config["hidden_size"], config["num_attention_heads"]
    nkv = config.get("num_key_value_heads") or nh
    hd = config.get("head_dim") or hidden // nh
    eps = config["rms_norm_eps"]
    rope = config.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    group = nh // nkv
    f32 = [{k: v.float() for k, v in r.items()} for r in ranks]

    h = 0
    for rank, r in enumerate(f32):
        w = r["model.embed_tokens.weight"]
        start = rank * w.shape[0]  # the rank's range of the padded vocabulary
        inside = (input_ids >= start) & (input_ids < start + w.shape[0])
        local = torch.where(inside, input_ids - start, torch.zeros_like(input_ids))
        h = h + w[local] * inside[:, None]
    seq = input_ids.shape[0]
    causal = torch.full((seq, seq), float("-inf")).triu(1)
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        attn_out = 0
        for rank, r in enumerate(f32):
            x = _rms(h, r[pre + "input_layernorm.weight"], eps)

            def proj(m: str) -> torch.Tensor:
                y = x @ r[f"{pre}self_attn.{m}.weight"].T
                b = r.get(f"{pre}self_attn.{m}.bias")
                return y if b is None else y + b

            q = _rope(proj("q_proj").view(seq, -1, hd), theta)
            k = _rope(proj("k_proj").view(seq, -1, hd), theta)
            v = proj("v_proj").view(seq, -1, hd)
            nh_r = q.shape[1]
            # The rank's q heads are global heads rank*nh_r ...; they need global KV heads from
            # (rank*nh_r)//group on, which the rank must hold (checked by the result, not assumed).
            kv_start = (rank * nh_r) // group
            heads = []
            for j in range(nh_r):
                kv = (rank * nh_r + j) // group - kv_start  # global q head -> its KV head, local index
                s = (q[:, j] @ k[:, kv].T) / math.sqrt(hd) + causal
                heads.append(torch.softmax(s, dim=-1) @ v[:, kv])
            attn_out = attn_out + torch.cat(heads, dim=-1) @ r[pre + "self_attn.o_proj.weight"].T
        ob = f32[0].get(pre + "self_attn.o_proj.bias")
        h = h + attn_out + (0 if ob is None else ob)
        mlp_out = 0
        for r in f32:
            x = _rms(h, r[pre + "post_attention_layernorm.weight"], eps)
            g = x @ r[pre + "mlp.gate_proj.weight"].T
            u = x @ r[pre + "mlp.up_proj.weight"].T
            mlp_out = mlp_out + (torch.nn.functional.silu(g) * u) @ r[pre + "mlp.down_proj.weight"].T
        h = h + mlp_out
    logits = []
    for r in f32:
        x = _rms(h, r["model.norm.weight"], eps)
        logits.append(x @ r["lm_head.weight"].T)
    return torch.cat(logits, dim=-1)[:, : config["vocab_size"]]


def reference_logits(path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[seq, vocab_size]`` of transformers' own model loaded from ``path`` (float32, eager attention)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids[None]).logits[0]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """Sharded F32 checkpoint of a tiny LlamaForCausalLM (see module docstring)."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """Sharded F32 checkpoint of a tiny Qwen2ForCausalLM: GQA 8/2, q/k/v biases, tied embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2", seed=2)


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory) -> Path:
    """Sharded F32 checkpoint of a tiny MistralForCausalLM: MQA (1 KV head), head_dim 16."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-mistral", "mistral", seed=3)
