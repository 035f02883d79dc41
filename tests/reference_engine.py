"""A tiny reference Llama engine that runs from a dict of weights, for tests.

It consumes weights exactly as an engine receives them from weightcache —
read-only views, never written — in either form:

- **processed** (a slab's views plus the manifest ``layout`` of each record):
  FP8 linears are the ``[K_pad, N_pad]`` column-major view, ``weight_scale``
  0-d or ``[1, N_pad]``, ``input_scale`` 0-d or absent (dynamic per token);
  fused ``qkv_proj`` / ``gate_up_proj`` are split by ``layout["fused_parts"]``.
- **raw** ModelOpt tensors straight from ``model.safetensors`` (``[N, K]``
  FP8 weights with per-module scales, no layout): used as an independent
  cross-check of the processing.

FP8 linears are computed like ``torch._scaled_mm(x_q, w_t, scale_a, scale_b)``:
the activation is quantized per tensor with the static ``input_scale`` or per
token dynamically (``amax / 448``), padded with zeros to ``K_pad``, and on
CPU the product is emulated in float32 as
``(x_q.float() * scale_a) @ (w_t.float() * scale_b)`` sliced back to the
logical width. On CUDA, :func:`fp8_linear` calls ``torch._scaled_mm``.

Tensor parallelism, in one process: pass one weight dict per rank; column-parallel
outputs stay local (local heads), row-parallel partial sums are added over ranks
(the all-reduce), vocab-parallel embeddings / ``lm_head`` are concatenated.

One rank per process (``torch.distributed``, e.g. under ``torchrun``): pass only
this rank's dict and a :class:`RankGroup`; the row-parallel partial sums, the
vocab-parallel embedding lookup and the vocab-parallel logits then go through
``RankGroup.all_reduce``, so every rank ends with the whole logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

FP8_MAX = 448.0


def _scale_b(scale: torch.Tensor) -> torch.Tensor:
    return scale.float()


def quantize_activation(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q F8_E4M3 [M, K], scale_a)``: static per-tensor (``input_scale``, 0-d) or dynamic per-token ``[M, 1]``."""
    xf = x.float()
    if input_scale is not None:
        sa = input_scale.float().reshape(())
    else:
        sa = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    xq = (xf / sa).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return xq, sa


def fp8_linear(x: torch.Tensor, w_t: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
               n: int, k: int) -> torch.Tensor:
    """FP8 linear on the processed layout.

    Args:
        x: ``[M, k]`` activations (float).
        w_t: ``F8_E4M3 [K_pad, N_pad]`` view, strides ``(1, K_pad)``.
        weight_scale: ``F32`` 0-d or ``[1, N_pad]``.
        input_scale: ``F32`` 0-d, or ``None`` for dynamic per-token activations.
        n, k: logical output / input widths (``layout["logical_output_width"]`` ...).

    Returns:
        ``[M, n]`` float32.
    """
    k_pad = w_t.shape[0]
    if k_pad != k:
        x = torch.nn.functional.pad(x, (0, k_pad - k))  # the engine's own buffer, zeros
    xq, sa = quantize_activation(x, input_scale)
    sb = _scale_b(weight_scale)
    if w_t.is_cuda:
        sa_ = sa if sa.dim() == 0 else sa.reshape(-1, 1)
        out = torch._scaled_mm(xq, w_t, scale_a=sa_.float(), scale_b=sb.float(), out_dtype=torch.bfloat16)
        return out[:, :n].float()
    out = (xq.float() * sa) @ (w_t.float() * sb)
    return out[:, :n]


@dataclass(frozen=True)
class RankGroup:
    """This process's place in a tensor-parallel group of one rank per process.

    Attributes:
        rank (`int`), size (`int`): the TP rank and TP size.
        all_reduce (`Callable[[torch.Tensor], None]`): sums a tensor over the
            group in place (``torch.distributed.all_reduce`` or a wrapper).
    """

    rank: int
    size: int
    all_reduce: Callable[[torch.Tensor], None]


class ReferenceLlama:
    """Greedy Llama decoder over per-rank weight dicts.

    Args:
        config (`dict`): the checkpoint's ``config.json``.
        ranks (`list[dict[str, torch.Tensor]]`): one weight dict per TP rank
            (a single dict for TP = 1, or this process's rank with ``group``).
        layouts (`list[dict[str, dict]]`, *optional*): per rank, the manifest
            ``layout`` of each tensor (``None`` for raw checkpoint tensors).
        group (`RankGroup`, *optional*): set when ``ranks`` holds only this
            process's rank of a group; partial results are all-reduced.
    """

    def __init__(self, config: dict, ranks: list[dict], layouts: list[dict] | None = None,
                 group: RankGroup | None = None) -> None:
        if group is not None and len(ranks) != 1:
            raise ValueError(f"with a RankGroup, pass this process's rank only, got {len(ranks)} weight dicts")
        self.cfg = config
        self.ranks = ranks
        self.layouts = layouts or [{} for _ in ranks]
        self.group = group
        self.h = config["hidden_size"]
        self.nh = config["num_attention_heads"]
        self.nkv = config["num_key_value_heads"]
        self.hd = config.get("head_dim") or self.h // self.nh
        self.eps = config.get("rms_norm_eps", 1e-6)
        rope = config.get("rope_parameters") or {}
        self.theta = config.get("rope_theta") or rope.get("rope_theta", 10000.0)
        self.vocab = config["vocab_size"]

    # -- weights ---------------------------------------------------------------

    def _get(self, r: int, name: str) -> torch.Tensor | None:
        return self.ranks[r].get(name)

    def _full(self, name: str) -> torch.Tensor:
        """A replicated or vocab-parallel tensor, whole (concatenated over ranks when sharded)."""
        ts = [w[name] for w in self.ranks]
        if len(ts) == 1 or all(t.shape == ts[0].shape and t.data_ptr() == ts[0].data_ptr() for t in ts):
            return ts[0]
        if ts[0].shape[0] * len(ts) >= self.vocab and ts[0].dim() == 2 and ts[0].shape[0] < self.vocab:
            return torch.cat(ts, 0)[: self.vocab]
        return ts[0]

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over the group's ranks (``t`` itself without a group)."""
        if self.group is not None:
            self.group.all_reduce(t)
        return t

    def _embed(self, ids: list[int]) -> torch.Tensor:
        """``[T, hidden]`` float32 embeddings; with a group, each rank looks up its vocabulary rows."""
        if self.group is None:
            emb = self._full("model.embed_tokens.weight")
            return emb[torch.tensor(ids, device=emb.device)].float()
        shard = self.ranks[0]["model.embed_tokens.weight"]
        ids_t = torch.tensor(ids, device=shard.device) - self.group.rank * shard.shape[0]
        inside = (ids_t >= 0) & (ids_t < shard.shape[0])
        h = shard[ids_t.clamp(0, shard.shape[0] - 1)].float() * inside[:, None]
        return self._reduce(h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[T, vocab]`` logits; with a group, each rank's vocabulary columns, gathered by an all-reduce."""
        head_name = "lm_head.weight" if "lm_head.weight" in self.ranks[0] else "model.embed_tokens.weight"
        if self.group is None:
            return (h @ self._full(head_name).float().t())[:, : self.vocab]  # TP 1, vllm naming: padded rows
        head = self.ranks[0][head_name]
        rows = head.shape[0]
        out = torch.zeros(h.shape[0], rows * self.group.size, dtype=torch.float32, device=h.device)
        out[:, self.group.rank * rows:(self.group.rank + 1) * rows] = h @ head.float().t()
        return self._reduce(out)[:, : self.vocab]

    def linear(self, r: int, module: str, x: torch.Tensor) -> torch.Tensor | None:
        """``x @ W.T`` of ``module`` on rank ``r`` (float32), or ``None`` if the rank lacks it."""
        w = self._get(r, module + ".weight")
        if w is None:
            return None
        lay = self.layouts[r].get(module + ".weight") or {}
        if w.dtype == torch.float8_e4m3fn:
            ws = self._get(r, module + ".weight_scale")
            ins = self._get(r, module + ".input_scale")
            if lay.get("scheme"):
                n, k = lay["logical_output_width"], lay["logical_input_width"]
                if lay.get("activation_scheme") == "dynamic_token":
                    ins = None
                return fp8_linear(x, w, ws, ins, n, k)
            # raw checkpoint layout: [N, K] weight, 0-d or [N] scale
            n, k = w.shape
            sb = ws.float().reshape(()) if ws.numel() == 1 else ws.float().reshape(1, n)
            return fp8_linear(x, w.t(), sb, ins if ins is not None else None, n, k)
        out = x.float() @ w.float().t()
        b = self._get(r, module + ".bias")
        return out + b.float() if b is not None else out

    def _proj(self, r: int, prefix: str, fused: str, part_names: tuple[str, ...], x: torch.Tensor) -> list[torch.Tensor]:
        w = self._get(r, f"{prefix}.{fused}.weight")
        if w is None:
            return [self.linear(r, f"{prefix}.{p}", x) for p in part_names]
        out = self.linear(r, f"{prefix}.{fused}", x)
        lay = self.layouts[r].get(f"{prefix}.{fused}.weight") or {}
        parts = {p["name"]: p for p in lay.get("fused_parts", [])}
        return [out[:, parts[p]["offset"] : parts[p]["offset"] + parts[p]["size"]] for p in part_names]

    # -- model -----------------------------------------------------------------

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * w.float()

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        half = self.hd // 2
        inv = 1.0 / (self.theta ** (torch.arange(0, half, dtype=torch.float32, device=x.device) * 2 / self.hd))
        ang = pos[:, None].float() * inv[None, :]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        x1, x2 = x[..., :half], x[..., half:]
        rot = torch.cat([-x2, x1], -1)
        return x * cos[:, None, :] + rot * sin[:, None, :]

    def forward(self, ids: list[int]) -> torch.Tensor:
        """Logits ``[T, vocab]`` (float32) of the sequence ``ids``."""
        t = len(ids)
        h = self._embed(ids)
        dev = h.device
        pos = torch.arange(t, device=dev)
        mask = torch.full((t, t), float("-inf"), device=dev).triu(1)
        for li in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{li}"
            x = self._rms(h, self._get(0, f"{p}.input_layernorm.weight"))
            attn_out = torch.zeros_like(h)
            for r in range(len(self.ranks)):
                q, k, v = self._proj(r, f"{p}.self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj"), x)
                q = self._rope(q.reshape(t, -1, self.hd), pos)
                k = self._rope(k.reshape(t, -1, self.hd), pos)
                v = v.reshape(t, -1, self.hd)
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
                s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.hd) + mask
                o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, -1)
                attn_out = attn_out + self.linear(r, f"{p}.self_attn.o_proj", o)
            h = h + self._reduce(attn_out)
            x = self._rms(h, self._get(0, f"{p}.post_attention_layernorm.weight"))
            mlp_out = torch.zeros_like(h)
            for r in range(len(self.ranks)):
                g, u = self._proj(r, f"{p}.mlp", "gate_up_proj", ("gate_proj", "up_proj"), x)
                mlp_out = mlp_out + self.linear(r, f"{p}.mlp.down_proj", torch.nn.functional.silu(g) * u)
            h = h + self._reduce(mlp_out)
        return self._logits(self._rms(h, self._get(0, "model.norm.weight")))

    @torch.no_grad()
    def generate(self, prompt: list[int], new_tokens: int = 16) -> list[int]:
        """Greedy decoding (full recompute each step): the ``new_tokens`` generated ids.

        Runs on one intra-op thread (restored after): the matrices are tiny and
        thread hand-offs cost far more than the math on a loaded CI machine.
        """
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            ids = list(prompt)
            for _ in range(new_tokens):
                ids.append(int(self.forward(ids)[-1].argmax()))
            return ids[len(prompt) :]
        finally:
            torch.set_num_threads(threads)
