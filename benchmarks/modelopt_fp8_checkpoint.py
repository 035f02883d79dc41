#!/usr/bin/env python3
"""Writes a Llama-3-8B-shaped NVIDIA ModelOpt FP8 checkpoint with random weights (benchmarks; no torch).

The layout of ``nvidia-modelopt``'s ``export_hf_checkpoint`` (as
``tests/fp8_fixtures.py`` describes it):

- every linear ``M`` of the decoder layers: ``M.weight`` ``F8_E4M3 [N, K]``
  (random codes, NaN codes ``0x7f``/``0xff`` left out), ``M.weight_scale``
  ``F32``: 0-d (``FP8``, a different value per part, so fused ``qkv_proj`` /
  ``gate_up_proj`` parts are requantised to the largest) or ``[N]``
  (``FP8_PER_CHANNEL_PER_TOKEN``); ``M.input_scale`` ``F32`` 0-d (``FP8``
  only); ``k_proj.k_scale`` / ``v_proj.v_scale`` ``F32`` 0-d (``FP8``: FP8 KV cache);
- embedding, norms and ``lm_head`` in ``BF16`` (``lm_head`` and the embedding excluded);
- ``hf_quant_config.json`` (``producer``, ``quantization.quant_algo``,
  ``kv_cache_quant_algo``, ``exclude_modules``) and ``config.json`` with
  ``quantization_config`` (``quant_method: "modelopt"``, ``quant_algo``,
  ``config_groups``, ``ignore``, ``kv_cache_scheme``, ``producer``).

Llama-3-8B: hidden 4096, intermediate 14336, 32 heads of 128, 8 KV heads,
32 layers, vocab 128256: 8.0 GB of FP8 weights and 2.1 GB of BF16
embedding and ``lm_head`` (9.1 GB in all).

Usage: modelopt_fp8_checkpoint.py DEST [--algo FP8|FP8_PER_CHANNEL_PER_TOKEN] [--layers N]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import zlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import LlamaShape  # noqa: E402

#: Llama-3-8B's dimensions.
LLAMA3_8B = LlamaShape(4096, 14336, 32, 8, 128, 32, 128256)
PER_TENSOR, PER_CHANNEL = "FP8", "FP8_PER_CHANNEL_PER_TOKEN"
EXCLUDE = ["lm_head", "model.embed_tokens"]
_ITEM = {"BF16": 2, "F32": 4, "F8_E4M3": 1}
_BLOCK = 64 << 20


def _entries(shape: LlamaShape, algo: str, rng: np.random.Generator) -> list[tuple[str, str, tuple, bytes | None]]:
    """``(name, dtype, shape, bytes or None for random)`` in file order."""
    out: list[tuple[str, str, tuple, bytes | None]] = []
    for name, shp in shape.tensors():
        module = name.rsplit(".", 1)[0]
        linear = module.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj")
        if not linear:
            out.append((name, "BF16", shp, None))
            continue
        out.append((name, "F8_E4M3", shp, None))
        if algo == PER_CHANNEL:
            out.append((f"{module}.weight_scale", "F32", (shp[0],),
                        rng.uniform(1e-3, 4e-3, shp[0]).astype(np.float32).tobytes()))
            continue
        out.append((f"{module}.weight_scale", "F32", (), struct.pack("<f", rng.uniform(1e-3, 4e-3))))
        out.append((f"{module}.input_scale", "F32", (), struct.pack("<f", rng.uniform(0.01, 0.05))))
        if module.endswith("k_proj"):
            out.append((f"{module}.k_scale", "F32", (), struct.pack("<f", rng.uniform(0.01, 0.05))))
        if module.endswith("v_proj"):
            out.append((f"{module}.v_scale", "F32", (), struct.pack("<f", rng.uniform(0.01, 0.05))))
    return out


def _quant_configs(algo: str) -> tuple[dict, dict]:
    kv = "FP8" if algo == PER_TENSOR else None
    producer = {"name": "modelopt", "version": "0.29.0"}
    hf = {"producer": producer, "quantization": {"quant_algo": algo, "kv_cache_quant_algo": kv,
                                                 "exclude_modules": list(EXCLUDE)}}
    weights = {"dynamic": False, "num_bits": 8, "type": "float"}
    acts = {"dynamic": False, "num_bits": 8, "type": "float"}
    if algo == PER_CHANNEL:
        weights = {**weights, "strategy": "channel"}
        acts = {"dynamic": True, "num_bits": 8, "type": "float", "strategy": "token"}
    cj = {"config_groups": {"group_0": {"input_activations": acts, "weights": weights, "targets": ["Linear"]}},
          "ignore": list(EXCLUDE), "quant_algo": algo, "producer": producer, "quant_method": "modelopt"}
    if kv:
        cj["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    return hf, cj


def write_modelopt_fp8(dest: Path, shape: LlamaShape = LLAMA3_8B, algo: str = PER_TENSOR, seed: int = 0,
                       max_file_bytes: int = 4 * 10**9) -> Path:
    """Writes the checkpoint into ``dest`` (reused when a complete one of the same parameters is there).

    Args:
        dest (`Path`): directory.
        shape (`LlamaShape`): dimensions (default Llama-3-8B).
        algo (`str`): ``FP8`` (per-tensor) or ``FP8_PER_CHANNEL_PER_TOKEN``.
        seed (`int`): scales' and weights' random seed.
        max_file_bytes (`int`): shard size limit.

    Returns:
        `Path`: ``dest``.
    """
    dest = Path(dest)
    marker = dest / ".complete"
    want = json.dumps({"shape": shape.__dict__, "algo": algo, "seed": seed, "max": max_file_bytes})
    if marker.exists() and marker.read_text() == want:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    for f in dest.iterdir():
        f.unlink()
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, _BLOCK, dtype=np.uint8).tobytes()
    blocks = {"BF16": raw, "F8_E4M3": raw.translate(bytes(b - 1 if b & 0x7F == 0x7F else b for b in range(256)))}
    shards: list[list] = [[]]
    size = 0
    for e in _entries(shape, algo, rng):
        n = _ITEM[e[1]] * int(np.prod(e[2], dtype=np.int64))
        if shards[-1] and size + n > max_file_bytes:
            shards.append([])
            size = 0
        shards[-1].append((*e, n))
        size += n
    weight_map = {}
    for i, entries in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        meta: dict = {"__metadata__": {"format": "pt"}}
        off = 0
        for name, dtype, shp, _, n in entries:
            meta[name] = {"dtype": dtype, "shape": list(shp), "data_offsets": [off, off + n]}
            off += n
        hdr = json.dumps(meta, separators=(",", ":")).encode()
        hdr += b" " * (-len(hdr) % 8)
        with open(dest / fname, "wb") as f:
            f.write(len(hdr).to_bytes(8, "little") + hdr)
            for name, dtype, shp, data, n in entries:
                if data is not None:
                    f.write(data)
                    continue
                block, left, at = blocks[dtype], n, (zlib.crc32(name.encode()) & 0xFFFF) * 64
                while left:
                    k = min(left, len(block) - at)
                    f.write(memoryview(block)[at : at + k])
                    left -= k
                    at = 0
        weight_map.update({e[0]: fname for e in entries})
    total = sum(e[-1] for s in shards for e in s)
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    hf, cj = _quant_configs(algo)
    (dest / "hf_quant_config.json").write_text(json.dumps(hf, indent=2))
    (dest / "config.json").write_text(json.dumps({**shape.config(), "quantization_config": cj}, indent=2))
    marker.write_text(want)
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dest")
    ap.add_argument("--algo", choices=(PER_TENSOR, PER_CHANNEL), default=PER_TENSOR)
    ap.add_argument("--layers", type=int, default=LLAMA3_8B.layers)
    args = ap.parse_args()
    shape = LlamaShape(**{**LLAMA3_8B.__dict__, "layers": args.layers})
    print(write_modelopt_fp8(Path(args.dest), shape, args.algo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
