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

from service_harness import (
    blocked_torch_env, compare_bytes, llama_checkpoint, poll_until, read_checkpoint, start_service,
    torch_import_attempts,
)


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
