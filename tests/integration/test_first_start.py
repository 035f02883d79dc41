"""First start without torch: an unquantized load without a cast reaches ``ready`` with torch unimportable.

The service runs as a real subprocess whose ``sitecustomize`` puts a
``sys.meta_path`` finder in front of every other: any ``import torch`` (from
any module, any thread) is written down with its thread's name and then
fails with ``ImportError``. A load that needed torch would fail; the slab
must instead be ready and serve the checkpoint's exact bytes, and nothing
may have asked for torch at all: with no queued model that may need it, the
service never imports it (``weightcache.daemon.loads``).
"""

from __future__ import annotations

from weightcache import protocol

from service_harness import blocked_torch_env, poll_until, start_service, torch_import_attempts
from checkpoints import compare_bytes, llama_checkpoint, read_checkpoint


def test_unquantized_host_load_needs_no_torch(tmp_path):
    from weightcache.client import attach

    ck = llama_checkpoint(tmp_path / "ck", seed=3, files=2)
    env, log = blocked_torch_env(tmp_path)
    svc = start_service(tmp_path / "s", {"m": {"path": ck}}, backend="host", env=env)
    try:
        st = svc.wait_settled()
        slab = st["slabs"][0]
        assert slab["state"] == "ready", (slab, svc.log())
        attempts = torch_import_attempts(log)
        assert attempts == [], attempts[0]["stack"] if attempts else ""
        expected = read_checkpoint(ck)
        with attach("m", socket_dir=svc.socket_dir, device="cpu") as w:
            assert w.source == "daemon"
            n = compare_bytes(dict(w.tensors), expected)
        assert n == sum(t.numel() * t.element_size() for t in expected.values())
        assert "torch_free=yes" in svc.log()
        verify = svc.request(protocol.Verify("m")).results[0]
        assert verify["mismatched"] == [] and verify["tensors"] == 21
        assert torch_import_attempts(log) == []  # verify on a host slab needs no torch either
    finally:
        svc.kill()


def test_the_blocker_bites_on_a_load_that_needs_torch(tmp_path):
    """Control: a cast (F32 stored, bfloat16 configured) needs torch, so under the same hook it fails."""
    ck = llama_checkpoint(tmp_path / "ck", seed=4, files=1)
    env, log = blocked_torch_env(tmp_path)
    svc = start_service(tmp_path / "s", {"m": {"path": ck, "dtype": "bfloat16"}}, backend="host", env=env)
    try:
        slab = svc.wait_settled()["slabs"][0]
        assert slab["state"] == "failed", slab
        # the load's own worker thread (weightcache-load-<label>, supervised by weightcache-loader)
        assert any(a["thread"].startswith("weightcache-load-") for a in torch_import_attempts(log))
    finally:
        svc.kill()


def test_torch_is_imported_in_the_background_for_a_queued_model_that_needs_it(tmp_path):
    """Two models: the first needs no torch, the second a cast. While the first loads (torch-free, ready), the
    look-ahead imports torch on its own thread; the second, needing it, fails under the hook."""
    plain = llama_checkpoint(tmp_path / "plain", seed=5, files=1)
    cast = llama_checkpoint(tmp_path / "cast", seed=6, files=1)
    env, log = blocked_torch_env(tmp_path)
    svc = start_service(tmp_path / "s", {"plain": {"path": plain}, "cast": {"path": cast, "dtype": "bfloat16"}},
                        backend="host", env=env)
    try:
        states = {s["model"]: s["state"] for s in svc.wait_settled()["slabs"]}
        assert states == {"plain": "ready", "cast": "failed"}, svc.log()
        poll_until(lambda: any(a["thread"] == "weightcache-torch-import" for a in torch_import_attempts(log)),
                   "the look-ahead's import of torch on thread weightcache-torch-import", timeout=30, period_s=0.05)
    finally:
        svc.kill()


def test_vllm_layouts_and_modelopt_fp8_load_without_torch(tmp_path):
    """naming = "vllm" at TP 2 (fused qkv/gate_up, strided row-parallel shards, vocab padding) of a Llama and of
    a ModelOpt FP8 checkpoint (per-tensor scales that differ between fused parts) reach ``ready`` with torch
    unimportable, log ``torch_free=yes`` for every rank, and serve the bytes of the torch pipeline."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fp8_fixtures as F

    from weightcache import pipeline
    from weightcache.client import attach
    from weightcache.config import ModelConfig
    from weightcache.spec import RankRequest
    from weightcache.manifest import build_views

    cks = {"llama": llama_checkpoint(tmp_path / "ck", seed=3, files=2), "fp8": F.write_fp8_per_tensor(tmp_path / "f8")}
    env, log = blocked_torch_env(tmp_path)
    models = {name: {"path": ck, "naming": "vllm", "layouts": [{"tp": 2, "gpus": [0, 0]}]} for name, ck in cks.items()}
    svc = start_service(tmp_path / "s", models, backend="host", env=env)
    try:
        slabs = svc.wait_settled()["slabs"]
        assert sorted((s["model"], s["state"]) for s in slabs) == [("fp8", "ready")] * 2 + [("llama", "ready")] * 2, \
            svc.log()
        attempts = torch_import_attempts(log)
        assert attempts == [], attempts[0]["stack"] if attempts else ""
        loaded = [line for line in svc.log().splitlines() if "torch_free=" in line]
        assert len(loaded) == 4 and all("torch_free=yes" in line for line in loaded), loaded
        for name, ck in cks.items():
            for rank in range(2):
                p = pipeline.plan(RankRequest(ModelConfig(name=name, path=str(ck), naming="vllm"), 2, rank),
                                  {"backend": "host", "gpu_uuid": "", "compute_capability": ""})
                slab = torch.zeros(p.slab_size_bytes, dtype=torch.uint8)
                want = build_views(slab, pipeline.execute(p, slab))
                with attach(name, tp_size=2, tp_rank=rank, naming="vllm", socket_dir=svc.socket_dir,
                            device="cpu", fallback=False) as w:
                    assert w.source == "daemon"
                    assert compare_bytes(dict(w.tensors), want) == sum(r.size_bytes for r in p.records
                                                                       if r.alias_of is None)
    finally:
        svc.kill()
