"""``scripts/tp2-check`` end to end on CPU, so the GPU check cannot rot between GPU runs.

The script starts real service instances (host backend) and two engine ranks
under ``torchrun`` (gloo); it exits non-zero if any rank's TP-2 logits or
greedy tokens differ from the disk fallback's (bit for bit) or from TP 1
(beyond its stated tolerance), or if a rank did not attach from its instance.
Both topologies run: two instances (``gpus = [0, 1]``, as on two GPUs) and one
instance holding both ranks (``gpus = [0, 0]``, as on one GPU). About 20 s each
on 2 cores.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from service_harness import ROOT, service_env

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("gpus, mode, instances", [(2, "cpu", "`--gpu 0`, `--gpu 1`"),
                                                   (1, "cpu-one-instance", "`--gpu 0` (backend")])
def test_tp2_check_cpu(tmp_path: Path, gpus: int, mode: str, instances: str):
    out = tmp_path / "result.md"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "tp2-check"), "--device", "cpu", "--gpus", str(gpus),
                        "--new-tokens", "8", "--out", str(out)],
                       env=service_env(), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-6000:]
    block = out.read_text()
    assert f"mode **{mode}**" in block and f"Instances {instances}" in block
    rows = [line for line in block.splitlines() if line.startswith(("| qwen2 ", "| fp8 "))]
    assert len(rows) == 4, block  # 2 models x 2 ranks
    assert all("| bit-equal |" in r for r in rows), block
    tp1 = [r for r in rows if "tol " in r]
    assert len(tp1) == 2 and all("rel: ok)" in r and "equal (2 prompts, 16 tokens)" in r for r in tp1), block
    assert "`CUDA_VISIBLE_DEVICES=1` check: skipped (CPU run" in block
    assert block.rstrip().endswith("Result: **PASS**.")
