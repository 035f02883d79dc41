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

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service_harness import ROOT, service_env

pytestmark = pytest.mark.slow


def _session_pids(sid: int) -> list[int]:
    """Every live process of session ``sid`` (``/proc/PID/stat``: the field after the process group)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # a zombie is dead already
            pids.append(int(d))
    return pids


def run_session(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`` in a session of its own, every
    process of which is killed on timeout: the script's service instances and torchrun's ranks (each in a
    process group of its own) outlived a timed-out run, since only the script itself was killed."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for _ in range(50):  # a process may fork while the first pass kills
            left = _session_pids(p.pid)
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        out, err = p.communicate()
        pytest.fail(f"{cmd[1]} ran past {timeout} s; every process of its session was killed\n"
                    f"{out[-6000:]}{err[-6000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


@pytest.mark.parametrize("gpus, mode, instances", [(2, "cpu", "`--gpu 0`, `--gpu 1`"),
                                                   (1, "cpu-one-instance", "`--gpu 0` (backend")])
def test_tp2_check_cpu(tmp_path: Path, gpus: int, mode: str, instances: str):
    out = tmp_path / "result.md"
    p = run_session([sys.executable, str(ROOT / "scripts" / "tp2-check"), "--device", "cpu", "--gpus", str(gpus),
                     "--new-tokens", "8", "--out", str(out)], 240, env=service_env())
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
