"""Scale: a rank of 150,000 tensors loads and attaches (protocol 3's manifest file beside the slab).

Large FP8 mixture-of-experts checkpoints pass 100k tensors per rank (94 layers x
128 experts x 3 projections x weight and scales). With protocol 2 the packed
manifest travelled inside the attach frame, whose 16 MiB limit about 105k plain
tensors exceeded: the service showed ``ready`` and closed every attach without a
word. The checkpoint here is synthetic: 150,000 one-element I32 tensors whose
values are their index, so every byte an engine sees can be checked at once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from service_harness import make_config
from weightcache import attach, protocol
from weightcache.client import read_manifest_file

N = 150_000
PROJ = ("gate", "up", "down")


def _names(n: int) -> list[str]:
    """MoE-like names: 512 experts x 3 projections per layer."""
    return [f"model.layers.{i // 1536}.mlp.experts.{i % 1536 // 3}.{PROJ[i % 3]}_proj.weight" for i in range(n)]


def many_tensor_checkpoint(dest: Path, n: int) -> list[str]:
    """Writes ``model.safetensors`` with ``n`` I32 ``[1]`` tensors valued 0..n-1 (the format by hand:
    safetensors' own writer takes seconds for this many); returns the names in file order."""
    dest.mkdir(parents=True)
    names = _names(n)
    header = {name: {"dtype": "I32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, name in enumerate(names)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(dest / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.write(np.arange(n, dtype="<i4").tobytes())
    return names


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_rank_of_150k_tensors_loads_and_attaches(daemon, tmp_path):
    names = many_tensor_checkpoint(tmp_path / "moe", N)
    svc = daemon(make_config({"moe": tmp_path / "moe"}))
    st = svc.wait_settled(timeout=200)
    slab = next(s for s in st["slabs"] if s["model"] == "moe")
    assert (slab["state"], slab["tensors"]) == ("ready", N), svc.log()

    # The manifest is past what one frame could carry, and it travels beside the frame.
    s = svc.session()
    try:
        reply = s.request(protocol.Attach(model="moe"))
        slab_fd, manifest_fd = s.last_fds
        assert reply.manifest_size_bytes > protocol.MAX_FRAME_BYTES
        assert len(read_manifest_file(manifest_fd, reply.manifest_size_bytes).tensors) == N
        os.close(slab_fd)
        os.close(manifest_fd)
    finally:
        s.close()

    with attach(str(tmp_path / "moe"), socket_dir=svc.socket_dir, fallback=False, timeout=60) as w:
        assert w.source == "daemon" and len(w.tensors) == N
        got = torch.cat([w.tensors[name] for name in names])
        assert torch.equal(got, torch.arange(N, dtype=torch.int32))
