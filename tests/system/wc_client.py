"""An engine stand-in run *inside* the test container (by test_systemd.py).

Usage: ``wc_client.py CHECKPOINT GPU [--hold]``

Attaches to the model at CHECKPOINT on the instance for GPU with
``fallback=False`` and compares every tensor with the checkpoint read by
safetensors. Prints one JSON line per answer:
``{"ok": true, "source": "daemon", "tensors": 104, "equal": true, ...}``, or
when attaching fails ``{"ok": false, "code": "daemon_unavailable", ...}``.

With ``--hold`` it keeps that attachment (an engine that attached before a
service restart) and answers commands read from stdin until EOF:
``check`` compares the held views again; ``attach GPU`` makes a new
attachment to GPU, compares and closes it (saves starting Python and torch
again for every new engine).
"""

from __future__ import annotations

import json
import sys

from weightcache import attach
from weightcache.errors import WeightcacheError

_reference = None


def _compare(w) -> dict:
    global _reference
    if _reference is None:
        from safetensors.torch import load_file  # imports torch: only once attached

        _reference = load_file(f"{CKPT}/model.safetensors")
    equal = sorted(w.tensors) == sorted(_reference) and all(w.tensors[k].equal(v) for k, v in _reference.items())
    return {"ok": True, "source": w.source, "tensors": len(w.tensors), "equal": equal,
            "resident_bytes": w.resident_bytes}


def _attach(gpu: int):
    try:
        return attach(CKPT, device="cpu", gpu=gpu, fallback=False, timeout=60), None
    except WeightcacheError as e:
        return None, {"ok": False, "code": e.code, "message": e.message}


def _say(answer: dict) -> None:
    print(json.dumps(answer), flush=True)


def main() -> int:
    gpu = int(sys.argv[2])
    held, err = _attach(gpu)
    if held is None:
        _say(err)
        return 1
    _say(_compare(held))
    if "--hold" in sys.argv[3:]:
        for line in sys.stdin:
            cmd = line.split()
            if cmd == ["check"]:
                _say(_compare(held))
            elif len(cmd) == 2 and cmd[0] == "attach":
                w, err = _attach(int(cmd[1]))
                if w is None:
                    _say(err)
                else:
                    with w:
                        _say(_compare(w))
            else:
                _say({"ok": False, "code": "bad_command", "message": line.strip()})
    held.close()
    return 0


if __name__ == "__main__":
    CKPT = sys.argv[1]
    sys.exit(main())
