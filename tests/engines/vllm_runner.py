"""Runs one vLLM engine (CPU build) on a checkpoint and prints its greedy tokens as JSON.

Used by ``test_vllm.py`` as a subprocess of the ``.venv-vllm`` interpreter,
so every engine starts from a clean process (vLLM keeps process-wide state:
the distributed group, registered plugins, the in-process engine core)::

    python tests/engines/vllm_runner.py '{"model": DIR, "dtype": "float32",
        "load_format": "weightcache", "extra": {...}, "prompts": [[1, 5]], "max_tokens": 12}'

The last line of stdout is ``RESULT {"tokens": [[...], ...]}`` or, when the
engine failed, ``RESULT {"error": {"type": "DaemonUnavailable", "code":
"daemon_unavailable"}}`` (the first weightcache error in the exception's
chain; ``code`` is null when there is none). Whether the engine core runs
in-process is the caller's ``VLLM_ENABLE_V1_MULTIPROCESSING``; the
``if __name__ == "__main__"`` guard is required by vLLM's multi-process mode
(it spawns).
"""

from __future__ import annotations

import json
import os
import sys

# vLLM's CPU build in a sandbox: small KV cache, no hub, no usage reports.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


def _error_info(exc: BaseException) -> dict:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = getattr(e, "code", None)
        if isinstance(code, str) and type(e).__module__.startswith("weightcache"):
            return {"type": type(e).__name__, "code": code, "message": str(e)}
        e = e.__cause__ or e.__context__
    return {"type": type(exc).__name__, "code": None, "message": str(exc)}


def main(argv: list[str]) -> int:
    job = json.loads(argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if job.get("load_format"):
        kwargs["load_format"] = job["load_format"]
        kwargs["model_loader_extra_config"] = job.get("extra") or {}
    try:
        llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), enforce_eager=True,
                  skip_tokenizer_init=True, max_model_len=int(job.get("max_model_len", 64)), max_num_seqs=4, seed=0,
                  tensor_parallel_size=int(job.get("tensor_parallel_size", 1)), **kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on the code
        print("RESULT " + json.dumps({"error": _error_info(e)}), flush=True)
        return 0
    params = SamplingParams(temperature=0.0, max_tokens=int(job.get("max_tokens", 12)), detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
