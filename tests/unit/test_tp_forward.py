"""Reference tensor-parallel forward on CPU from per-rank slabs equals transformers' logits.

Each rank's shards come from ``pipeline.plan`` + ``execute`` into a sealed
host slab (the bytes an engine attaches to). The forward (``tiny_models.tp_forward``)
uses only the rank's own shards and sums the row-parallel partial outputs, as
an all-reduce would.

Tolerance: float32 throughout; the TP forward sums the same products in a
different order than transformers, so logits may differ by rounding only:
``atol = 1e-4``, ``rtol = 1e-4`` (observed max difference ~2e-6 on logits of
magnitude ~2.5). A wrong shard (e.g. a KV head given to the wrong rank) moves
logits by ~1e-1, see the control test.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import (  # noqa: E402
    load_rank,
    reference_logits,
    tiny_llama,  # noqa: F401  (fixture)
    tiny_mistral,  # noqa: F401
    tiny_qwen2,  # noqa: F401
    tp_forward,
    unfuse,
)

ATOL = RTOL = 1e-4
INPUT_IDS = torch.tensor([1, 5, 17, 7, 64, 99, 3, 0, 42, 63])

_reference: dict[str, torch.Tensor] = {}


def _ref(path: Path) -> torch.Tensor:
    key = str(path)
    if key not in _reference:
        _reference[key] = reference_logits(path, INPUT_IDS)
    return _reference[key]


def _rank_params(path: Path, tp: int, naming: str) -> list[dict[str, torch.Tensor]]:
    out = []
    for rank in range(tp):
        manifest, views, slab = load_rank(path, tp, rank, naming)
        os.close(slab.fd)  # the views keep the mapping alive
        slab.fd = -1
        assert manifest.tp_rank == rank
        out.append(unfuse(manifest, views))
    return out


@pytest.mark.parametrize("naming", ["hf", "vllm"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2", "tiny_mistral"])
def test_tp_forward_matches_transformers(family, tp, naming, request):
    path = request.getfixturevalue(family)
    config = json.loads((path / "config.json").read_text())
    ranks = _rank_params(path, tp, naming)
    for r in ranks:  # every rank holds only its shard
        assert r["model.layers.0.mlp.gate_proj.weight"].shape[0] == config["intermediate_size"] // tp
    logits = tp_forward(config, ranks, INPUT_IDS)
    ref = _ref(path)
    assert logits.shape == ref.shape == (len(INPUT_IDS), config["vocab_size"])
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=RTOL)


def test_control_swapped_kv_heads_change_logits(tiny_qwen2):
    # Qwen2 TP 4: ranks 0,1 hold KV head 0 and ranks 2,3 KV head 1. Giving rank 0
    # rank 2's K/V must break the match: the comparison above can fail.
    config = json.loads((tiny_qwen2 / "config.json").read_text())
    ranks = _rank_params(tiny_qwen2, 4, "hf")
    for i in range(config["num_hidden_layers"]):
        for m in ("k_proj", "v_proj"):
            for p in ("weight", "bias"):
                name = f"model.layers.{i}.self_attn.{m}.{p}"
                assert not torch.equal(ranks[0][name], ranks[2][name])
                ranks[0][name] = ranks[2][name]
    logits = tp_forward(config, ranks, INPUT_IDS)
    assert (logits - _ref(tiny_qwen2)).abs().max().item() > 100 * ATOL
