#!/usr/bin/env python3
"""A reference engine: sentence embeddings with all-MiniLM-L6-v2 from weightcache.

Builds a transformers ``BertModel`` on the meta device, takes its parameters
from :func:`weightcache.attach` (zero-copy from the service, or the disk
fallback), and writes mean-pooled, L2-normalised sentence embeddings
(float32, ``[num_sentences, 384]``) to ``--out`` as safetensors.

Usage::

    python examples/minilm_engine.py CHECKPOINT_DIR --out emb.safetensors \
        [--socket-dir DIR] [--device cpu|cuda:N] [--no-fallback] [--disk]

``--disk`` uses transformers' own ``from_pretrained`` instead (the reference).
Prints one JSON line: source, fallback_reason, load_ms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SENTENCES = [
    "weightcache keeps model weights resident in GPU memory.",
    "Inference engines restart in milliseconds instead of minutes.",
    "The quick brown fox jumps over the lazy dog.",
]


def embed(model, tokenizer, sentences, device):
    import torch

    enc = tokenizer(sentences, padding=True, truncation=True, return_tensors="pt").to(device)
    with torch.inference_mode():
        out = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).to(out.dtype)
    pooled = (out * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1).float().cpu()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--out", required=True)
    ap.add_argument("--socket-dir", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-fallback", action="store_true")
    ap.add_argument("--disk", action="store_true", help="transformers from_pretrained (reference)")
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)

    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, BertModel

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    t0 = time.perf_counter()
    if args.disk:
        model = BertModel.from_pretrained(args.checkpoint).to(args.device).eval()
        source, reason = "transformers", None
    else:
        from weightcache.integrations.transformers import from_pretrained

        model = from_pretrained(args.checkpoint, model_cls=BertModel, device=args.device,
                                socket_dir=args.socket_dir, fallback=not args.no_fallback, timeout=args.timeout)
        model.eval()
        source, reason = model._weightcache.source, model._weightcache.fallback_reason
    load_ms = (time.perf_counter() - t0) * 1e3
    emb = embed(model, tokenizer, SENTENCES, args.device)
    save_file({"embeddings": emb.contiguous()}, args.out)
    print(json.dumps({"source": source, "fallback_reason": reason, "load_ms": round(load_ms, 2), "pid": os.getpid()}))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
