"""Adding a quantization scheme is one registry entry: a toy scheme defined here loads, shards and attaches.

``toy_int8`` (per-output-channel int8 weights, ``quant_method: "toy_int8"`` in
``config.json``) is registered by this test alone: its capability row, its
side tensor ``qscale`` (one F32 scale per output row, sharded with the rows),
its processing (the scale stored as ``[1, N]`` by its own op) and its inverse.
Nothing in ``pipeline.py`` or ``sharding.py`` names it. A tiny Llama quantized
this way is loaded at TP 1 (``hf``) and TP 2 (``vllm``, fused ``qkv_proj`` /
``gate_up_proj``), through the service's own handlers and loader (in-process),
and every attached byte is compared with the checkpoint's, sliced by hand.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from daemon_helpers import Clock, close_slabs
from checkpoints import llama_config, llama_tensors, write_checkpoint
from weightcache import pipeline, protocol, quant
from weightcache.checkpoint import Checkpoint
from weightcache.config import ModelConfig, Placement
from weightcache.daemon import handlers, load_results, loads
from weightcache.daemon.effects import Context
from weightcache.daemon.state import Peer, ServiceState
from weightcache.errors import UnsupportedQuantization
from weightcache.reader import LoaderOptions
from weightcache.manifest import build_views
from weightcache.manifest import read_file
from weightcache.memory.host import HostBackend
from weightcache.quant.capabilities import Capability
from weightcache.spec import RankRequest
from weightcache.tensor_spec import SourceRef, TensorSpec

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
DEVICE = {"backend": "host", "gpu_uuid": "", "compute_capability": ""}


class ToyInt8(quant.SchemeRules):
    """Per-channel int8: ``M.weight`` ``I8 [N, K]`` and ``M.qscale`` ``F32 [N]``; the scale is stored ``[1, N]``."""

    family = "toy_int8"
    capabilities = {("toy_int8", ""): Capability("toy_int8", "channel", "dynamic_token", ("cutlass",))}
    side_tensors = (quant.SideTensor("qscale", "output"),)

    def __init__(self) -> None:
        self.ops = {"toy_int8_scale": self.op_scale}

    def check_layers(self, ck, qc, cap):
        layers = {n[:-7] for n, i in ck.tensors.items() if n.endswith(".weight") and i.dtype == "I8"}
        for m in layers:
            if f"{m}.qscale" not in ck.tensors:
                raise UnsupportedQuantization(f"{ck.path}: layer {m!r} has no qscale", scheme="toy_int8", layer=m)
        return layers

    def process_specs(self, ck, specs, kernel, scheme):
        out = []
        for s in specs:
            if s.name.endswith(".qscale") and s.alias_of is None:
                n = s.stored_shape[0]
                out.append(replace(s, stored_shape=(1, n), op="toy_int8_scale",
                                   layout={**s.layout, "scheme": "toy_int8", "role": "qscale", "n": n}))
            elif s.dtype == "I8":
                out.append(replace(s, layout={**s.layout, "scheme": "toy_int8", "role": "weight"}))
            else:
                out.append(s)
        return out

    @staticmethod
    def op_scale(spec: TensorSpec, parts: list, fetch) -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in parts]).reshape(spec.stored_shape)

    def checkpoint_form(self, tensor, layout):
        return tensor[0] if layout.get("role") == "qscale" else tensor


@pytest.fixture
def toy():
    """The package's families plus the toy one: a registry value the tests pass in (nothing is registered)."""
    return quant.Registry((*quant.FAMILIES, ToyInt8()))


@pytest.fixture
def int8_llama(tmp_path):
    """A tiny Llama with int8 linears and per-row F32 ``qscale``s; returns (path, checkpoint tensors)."""
    t = llama_tensors(seed=3)
    for i in range(2):
        for lin in LINEARS:
            name = f"model.layers.{i}.{lin}"
            w = t[name + ".weight"]
            scale = w.abs().amax(dim=1) / 127
            t[name + ".weight"] = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
            t[name + ".qscale"] = scale
    cfg = {**llama_config(), "quantization_config": {"quant_method": "toy_int8"}}
    return write_checkpoint(tmp_path / "ck", t, cfg, files=2), t


def _expected(t: dict, tp: int, r: int, naming: str) -> dict[str, torch.Tensor]:
    """The rank's tensors as the sharding rules and the toy scheme lay them out, sliced by hand
    (hidden 64, 4 heads of 16, 2 KV heads, intermediate 128, vocab 96 padded to 128 when sharded)."""
    q, kv, inter, hid = 64 // tp, 32 // tp, 128 // tp, 64 // tp

    def rows(x, n):
        return x[r * n:(r + 1) * n]

    out = {"model.norm.weight": t["model.norm.weight"]}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if tp == 1 and naming == "hf":
            out[name] = t[name]
        else:
            padded = torch.cat([t[name], torch.zeros(128 - 96, 64)])
            out[name] = rows(padded, 128 // tp)
    for i in range(2):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}{norm}.weight"] = t[f"{p}{norm}.weight"]
        col = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "mlp.gate_proj": inter,
               "mlp.up_proj": inter}
        parts = {}
        for lin, n in col.items():
            parts[lin] = (rows(t[f"{p}{lin}.weight"], n), rows(t[f"{p}{lin}.qscale"], n))
        for lin, n in (("self_attn.o_proj", hid), ("mlp.down_proj", inter)):
            w = t[f"{p}{lin}.weight"]
            parts[lin] = (w[:, r * n:(r + 1) * n], t[f"{p}{lin}.qscale"])  # row-parallel: the scale is whole
        groups = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
        if naming == "vllm":
            for fused, members in groups.items():
                parts[fused] = (torch.cat([parts[m][0] for m in members]), torch.cat([parts[m][1] for m in members]))
                for m in members:
                    del parts[m]
        for lin, (w, s) in parts.items():
            out[f"{p}{lin}.weight"] = w
            out[f"{p}{lin}.qscale"] = s.reshape(1, -1)  # the toy op's [1, N]
    return out


def _same_bytes(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, e in expected.items():
        g = got[name]
        assert g.dtype == e.dtype and tuple(g.shape) == tuple(e.shape), (name, g.dtype, g.shape, e.dtype, e.shape)
        assert torch.equal(g.contiguous().view(torch.uint8), e.contiguous().view(torch.uint8)), name


def test_toy_scheme_loads_shards_and_attaches_through_the_service(toy, int8_llama):
    path, t = int8_llama
    backend = HostBackend()
    hf, vl = ModelConfig("hf", str(path)), ModelConfig("vl", str(path), naming="vllm")
    placements = [Placement(hf, 1, 0, 0), Placement(vl, 2, 0, 0), Placement(vl, 2, 1, 0)]
    st = ServiceState(0, "host", backend.device_info(), placements, service_uid=os.getuid() + 1)
    ctx = Context(st, lambda: (111, 222), monotonic=Clock(), wall=lambda: 1.7e9, pid=4242)
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    loader = loads.Loader(loads.LoadSettings(backend, st.device, 60.0, LoaderOptions(threads=1), "test.toml",
                                             registry=toy), w)
    try:
        for slot in st.slots:
            final = loader._supervise(slot)  # the loader thread's body, run here
            for result in loader.results() + [final]:
                load_results.apply(st, result)
        peer = Peer(10, os.getuid(), os.getgid())
        for p in placements:
            (reply,) = handlers.handle(ctx, peer, protocol.Attach(p.model.name, p.tp_size, p.tp_rank)).replies
            assert isinstance(reply.msg, protocol.AttachReply), reply.msg
            slab_fd, manifest_fd = reply.fds
            mf = read_file(manifest_fd, reply.msg.manifest_size_bytes)
            manifest = mf.manifest
            assert manifest.key["quant_scheme"] == "toy_int8"
            assert mf.request.to_json() == RankRequest(p.model, p.tp_size, p.tp_rank).to_json()
            views = build_views(backend.import_fd(slab_fd, manifest.slab_size_bytes).tensor, manifest)
            _same_bytes(views, _expected(t, p.tp_size, p.tp_rank, p.model.naming))
            layouts = {rec.name: rec.layout for rec in manifest.tensors}
            if p.tp_size == 1:  # the scheme's inverse gives the checkpoint's tensors back
                back = {n: quant.checkpoint_form(v, layouts[n], toy) for n, v in views.items()}
                _same_bytes(back, t)
    finally:
        close_slabs(st)
        os.close(r)
        os.close(w)


def test_a_scheme_not_registered_is_rejected_before_any_read(int8_llama):
    path, _ = int8_llama
    with pytest.raises(UnsupportedQuantization) as ei:
        pipeline.plan(RankRequest(ModelConfig("m", str(path)), 1, 0), DEVICE)
    assert ei.value.code == "unsupported_quantization"


def test_a_registry_with_a_clashing_family_is_refused(toy):
    with pytest.raises(ValueError):
        quant.Registry((*toy.families, ToyInt8()))
    other = ToyInt8()
    other.family = "toy_int8_again"
    other.side_tensors = (quant.SideTensor("qscale", "scalar"),)  # same param, another rule
    other.capabilities = {}
    other.ops = {}
    with pytest.raises(ValueError):
        quant.Registry((*toy.families, other))
    assert toy.for_scheme("toy_int8") is toy.families[-1]
    assert quant.REGISTRY.for_scheme("toy_int8") is None  # the package's table is untouched


def test_unquantized_specs_do_not_change_with_a_scheme_in_the_registry(int8_llama, toy, tmp_path):
    """A side tensor of another family changes nothing for checkpoints that have none (the FP8 bytes are
    test_fp8's)."""
    ck = write_checkpoint(tmp_path / "plain", llama_tensors(seed=1), llama_config(), files=1)
    rank = RankRequest(ModelConfig("m", str(ck), naming="vllm"), 2, 1)
    assert pipeline.plan(rank, DEVICE, registry=toy).specs == pipeline.plan(rank, DEVICE).specs


def test_the_package_registry_is_the_literal_table():
    """``FAMILIES`` is the one list of families; ``REGISTRY``'s tables are derived from it and read-only."""
    assert quant.REGISTRY.families == quant.FAMILIES
    assert set(quant.REGISTRY.by_scheme) == {"modelopt_fp8", "modelopt_fp8_per_channel"}
    with pytest.raises(TypeError):
        quant.REGISTRY.ops["x"] = None  # type: ignore[index]
