"""First start without torch: an unquantized load without a cast reaches ``ready`` with torch unimportable.

The service runs as a real subprocess whose ``sitecustomize`` puts a
``sys.meta_path`` finder in front of every other: any ``import torch`` (from
any module, any thread) is written down with its thread's name and then
fails with ``ImportError``. A load that needed torch would fail; the slab
must instead be ready and serve the checkpoint's exact bytes, and the only
thread that may have asked for torch is the loader's background import
(``weightcache-torch-import``), which starts after the load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from service_harness import SERVICE_DIR, compare_bytes, llama_checkpoint, read_checkpoint, start_service

BLOCKER = '''
import json, os, sys, threading, traceback

class _NoTorch:
    """Writes down and refuses every import of torch."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            with open(os.environ["WC_TEST_TORCH_LOG"], "a") as f:
                f.write(json.dumps({"thread": threading.current_thread().name,
                                    "stack": "".join(traceback.format_stack())}) + "\\n")
            raise ImportError("torch is blocked by the test's sitecustomize")
        return None

sys.meta_path.insert(0, _NoTorch())
'''


def _blocked_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    log = tmp_path / "torch-imports.jsonl"
    return {"PYTHONPATH": os.pathsep.join([str(site), str(SERVICE_DIR)]), "WC_TEST_TORCH_LOG": str(log)}, log


def _attempts(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_unquantized_host_load_needs_no_torch(tmp_path):
    from weightcache.client import attach

    ck = llama_checkpoint(tmp_path / "ck", seed=3, files=2)
    env, log = _blocked_env(tmp_path)
    svc = start_service(tmp_path / "s", {"m": {"path": ck}}, backend="host", env=env)
    try:
        st = svc.wait_settled()
        slab = st["slabs"][0]
        assert slab["state"] == "ready", (slab, svc.log())
        before_ready = [a for a in _attempts(log) if a["thread"] != "weightcache-torch-import"]
        assert before_ready == [], before_ready[0]["stack"] if before_ready else ""
        with attach("m", socket_dir=svc.socket_dir, device="cpu") as w:
            assert w.source == "daemon"
            n = compare_bytes(dict(w.tensors), read_checkpoint(ck))
        assert n == sum(t.numel() * t.element_size() for t in read_checkpoint(ck).values())
        assert "torch_free=yes" in svc.log()
    finally:
        svc.kill()


def test_the_blocker_bites_on_a_load_that_needs_torch(tmp_path):
    """Control: a cast (F32 stored, bfloat16 configured) needs torch, so under the same hook it fails."""
    ck = llama_checkpoint(tmp_path / "ck", seed=4, files=1)
    env, log = _blocked_env(tmp_path)
    svc = start_service(tmp_path / "s", {"m": {"path": ck, "dtype": "bfloat16"}}, backend="host", env=env)
    try:
        slab = svc.wait_settled()["slabs"][0]
        assert slab["state"] == "failed", slab
        assert any(a["thread"] == "weightcache-loader" for a in _attempts(log))
    finally:
        svc.kill()
