"""``ReferenceLlama`` with one rank per "process" (a ``RankGroup``) equals the in-process TP forward.

``scripts/tp2-check`` runs the reference engine one rank per torchrun process;
here two threads stand in for the processes, with an all-reduce that sums the
ranks' tensors in rank order. Checkpoint: tiny Qwen2 (GQA 8/2, q/k/v biases,
tied, vocab 151 padded to 192), TP 2, vLLM naming, host slabs.

The row-parallel sums are the same additions in the same order as the
in-process forward, but the logits are two ``[T, 96]`` products instead of
one ``[T, 192]`` product, which BLAS may block differently: logits within
1e-5, greedy tokens equal. The control gives both threads rank 0's shard.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_engine import RankGroup, ReferenceLlama  # noqa: E402
from tiny_models import load_rank, tiny_qwen2  # noqa: E402,F401  (fixture)

PROMPT = [1, 5, 17, 7, 64, 99, 3]


def _ranks(path: Path) -> tuple[list[dict], list[dict]]:
    tensors, layouts = [], []
    for rank in range(2):
        manifest, views, slab = load_rank(path, 2, rank, "vllm")
        os.close(slab.fd)  # the views keep the mapping alive
        slab.fd = -1
        tensors.append(views)
        layouts.append({r.name: r.layout for r in manifest.tensors})
    return tensors, layouts


def _threaded(config: dict, tensors: list[dict], layouts: list[dict]) -> list[tuple[torch.Tensor, list[int]]]:
    """Each rank's (logits, greedy tokens), ranks in two threads joined by an in-memory all-reduce."""
    barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

    def all_reduce(rank: int, t: torch.Tensor) -> None:
        slots[rank] = t.clone()
        barrier.wait()
        total = slots[0] + slots[1]
        barrier.wait()
        t.copy_(total)

    def run(rank: int) -> None:
        group = RankGroup(rank, 2, lambda t: all_reduce(rank, t))
        eng = ReferenceLlama(config, [tensors[rank]], [layouts[rank]], group)
        with torch.no_grad():
            out[rank] = (eng.forward(PROMPT), eng.generate(PROMPT, 8))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(o is not None for o in out), "a rank failed (see the thread's traceback)"
    return out


def test_rank_group_equals_in_process_tp(tiny_qwen2):
    config = json.loads((tiny_qwen2 / "config.json").read_text())
    tensors, layouts = _ranks(tiny_qwen2)
    ref = ReferenceLlama(config, tensors, layouts)
    with torch.no_grad():
        want_logits, want_tokens = ref.forward(PROMPT), ref.generate(PROMPT, 8)
    assert want_logits.shape == (len(PROMPT), config["vocab_size"])
    for logits, tokens in _threaded(config, tensors, layouts):
        torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
        assert tokens == want_tokens


def test_control_wrong_shard_changes_logits(tiny_qwen2):
    config = json.loads((tiny_qwen2 / "config.json").read_text())
    tensors, layouts = _ranks(tiny_qwen2)
    ref = ReferenceLlama(config, tensors, layouts)
    with torch.no_grad():
        want = ref.forward(PROMPT)
    logits, _ = _threaded(config, [tensors[0], tensors[0]], [layouts[0], layouts[0]])[1]
    assert (logits - want).abs().max().item() > 1e-2
