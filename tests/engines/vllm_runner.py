"""Runs one vLLM engine (CPU build) on a checkpoint and prints its greedy tokens as JSON.

Used by ``test_vllm.py`` and ``benchmarks/bench_vllm_start.py`` as a
subprocess of the ``.venv-vllm`` interpreter, so every engine starts from a
clean process (vLLM keeps process-wide state: the distributed group,
registered plugins, the in-process engine core)::

    python tests/engines/vllm_runner.py '{"model": DIR, "dtype": "float32",
        "load_format": "weightcache", "extra": {...}, "prompts": [[1, 5]], "max_tokens": 12}'

The last ``RESULT`` line of stdout is ``RESULT {"tokens": [[...], ...],
"probe": [...], "start_s": ..., "first_token_s": ..., "load_s": ...}``
(seconds from the runner's start to the engine built and to the first
token; ``import_s``: to vLLM imported; ``load_s``: vLLM's ``get_model``, the
loader included, when the engine core runs in this process, else null) or, when the engine
failed, ``RESULT {"error": {"type": "DaemonUnavailable", "code":
"daemon_unavailable", "message": ..., "details": {...}}}`` (the first weightcache error in the exception's
chain; ``code`` is null when there is none). Whether the engine core runs
in-process is the caller's ``VLLM_ENABLE_V1_MULTIPROCESSING``; the
``if __name__ == "__main__"`` guard is required by vLLM's multi-process mode
(it spawns).

Optional job keys:

- ``extra``: ``None`` leaves ``model_loader_extra_config`` unset (the
  loader's defaults, as a user meets them);
- ``probe``: after generating, each worker reports (:func:`probe`) where its
  parameters live against the ``memfd:weightcache`` mappings of
  ``/proc/self/maps``, its ``/proc/self/smaps_rollup`` and ``status``
  memory, tied parameters, and what a fresh loader's
  ``get_external_weight_memory`` says;
- ``write_after``: after printing ``RESULT``, writes one element of the first
  parameter in place (in-process engine only): with a zero-copy model the
  shared mapping is ``PROT_READ`` and the process dies of ``SIGSEGV``;
- ``enable_lora``: ``LLM(enable_lora=True)``;
- ``profile_first``: before the model load, a fresh loader's
  ``get_external_weight_memory`` (as vLLM's GPU worker asks; the CPU worker
  does not), reported as ``external_weight_bytes`` (in-process engine only);
- ``inject``: ``"linear_n_contig"`` stands in for a vLLM whose processed
  layout differs from the service's: vLLM's unquantized linear processing
  (when the weights are not pre-processed) first makes the weight
  N-contiguous (``weight.t().contiguous().t()``: same values, other strides,
  what vLLM's XPU path does with ``VLLM_XPU_FORCE_N_CONTIG_WEIGHT``).
"""

from __future__ import annotations

import json
import os
import sys
import time

# vLLM's CPU build in a sandbox: small KV cache, no hub, no usage reports.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
# The probe travels to the workers as a function (vLLM's collective_rpc).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

#: /proc/self/smaps_rollup and /proc/self/status fields reported by the probe, in kB.
_MEMORY_FIELDS = ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty", "Anonymous",
                  "RssAnon", "RssFile", "RssShmem")


def _error_info(exc: BaseException) -> dict:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = getattr(e, "code", None)
        if isinstance(code, str) and type(e).__module__.startswith("weightcache"):
            return {"type": type(e).__name__, "code": code, "message": str(e), "details": getattr(e, "details", None)}
        e = e.__cause__ or e.__context__
    return {"type": type(exc).__name__, "code": None, "message": str(exc)}


def _memfd_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's ``memfd:weightcache:*`` mappings (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:weightcache:" in line:
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def _memory_kb() -> dict[str, int]:
    out = {}
    for path in ("/proc/self/smaps_rollup", "/proc/self/status"):
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in _MEMORY_FIELDS and rest.strip().endswith("kB"):
                    out[key] = int(rest.split()[0])
    return out


def _span(t) -> int:
    """Bytes from ``t``'s first element to one past its last (strided views included); 0 when empty."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def probe(worker) -> dict:
    """Runs in each worker (``collective_rpc``): where the model's parameters live.

    Returns:
        `dict`: ``params`` (count), ``outside`` (names of parameters whose
        bytes are not inside a ``memfd:weightcache`` mapping), ``param_bytes``
        (bytes of distinct parameters), ``tied`` (``lm_head.weight`` is the
        embedding's object), ``memory_kb`` (:data:`_MEMORY_FIELDS`),
        ``external_weight_bytes`` (a fresh loader's
        ``get_external_weight_memory``), ``pid``.
    """
    from vllm.model_executor.model_loader import get_model_loader

    model = worker.model_runner.get_model()
    ranges = _memfd_ranges()
    named = list(model.named_parameters(remove_duplicate=False))
    outside = []
    sizes: dict[int, int] = {}
    for name, p in named:
        lo, span = p.data_ptr(), _span(p)
        sizes[id(p)] = p.numel() * p.element_size()
        if not span or not any(a <= lo and lo + span <= b for a, b in ranges):
            outside.append(name)
    params = dict(named)
    tied = "lm_head.weight" in params and params["lm_head.weight"] is params.get("model.embed_tokens.weight")
    ext = get_model_loader(worker.vllm_config.load_config).get_external_weight_memory(worker.vllm_config)
    return {"params": len(named), "outside": outside, "param_bytes": sum(sizes.values()), "tied": tied,
            "memory_kb": _memory_kb(), "external_weight_bytes": ext, "pid": os.getpid()}


def _write_first_weight(worker) -> None:
    p = next(worker.model_runner.get_model().parameters())
    print(f"WRITING {tuple(p.shape)} at {p.data_ptr():#x}", flush=True)
    p.data.view(-1)[0] = 1.0


def _inject_linear_n_contig() -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.utils import is_weights_pre_processed

    original = UnquantizedLinearMethod.process_weights_after_loading

    def process(self, layer):
        if not is_weights_pre_processed():
            layer.weight.data = layer.weight.data.t().contiguous().t()
        return original(self, layer)

    UnquantizedLinearMethod.process_weights_after_loading = process


def _time_model_load(into: dict, profile_first: bool) -> None:
    """Records ``load_s``, the seconds of the CPU model runner's ``get_model`` (loader included), in this process.

    ``profile_first``: ask a fresh loader's ``get_external_weight_memory`` first, as vLLM's GPU worker
    does, into ``external_weight_bytes``.
    """
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.v1.worker import cpu_model_runner

    get_model = cpu_model_runner.get_model

    def timed(*args, **kwargs):
        if profile_first:
            config = kwargs["vllm_config"]
            into["external_weight_bytes"] = get_model_loader(config.load_config).get_external_weight_memory(config)
        t = time.monotonic()
        try:
            return get_model(*args, **kwargs)
        finally:
            into["load_s"] = time.monotonic() - t

    cpu_model_runner.get_model = timed


def main(argv: list[str]) -> int:
    job = json.loads(argv[1])
    t0 = time.monotonic()
    if job.get("inject") == "linear_n_contig":
        _inject_linear_n_contig()
    timing: dict = {"load_s": None}
    _time_model_load(timing, bool(job.get("profile_first")))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    timing["import_s"] = time.monotonic() - t0
    kwargs = {"enable_lora": True} if job.get("enable_lora") else {}
    if job.get("load_format"):
        kwargs["load_format"] = job["load_format"]
        if job.get("extra") is not None:
            kwargs["model_loader_extra_config"] = job["extra"]
    try:
        llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), enforce_eager=True,
                  skip_tokenizer_init=True, max_model_len=int(job.get("max_model_len", 64)), max_num_seqs=4, seed=0,
                  tensor_parallel_size=int(job.get("tensor_parallel_size", 1)), **kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on the code
        print("RESULT " + json.dumps({"error": _error_info(e)}), flush=True)
        return 0
    start_s = time.monotonic() - t0
    params = SamplingParams(temperature=0.0, max_tokens=int(job.get("max_tokens", 12)), detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    first = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1, detokenize=False), use_tqdm=False)
    first_token_s = time.monotonic() - t0
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "start_s": start_s,
              "first_token_s": first_token_s, "first": list(first[0].outputs[0].token_ids), **timing}
    if job.get("probe"):
        result["probe"] = llm.collective_rpc(probe)
    print("RESULT " + json.dumps(result), flush=True)
    if job.get("write_after"):
        llm.collective_rpc(_write_first_weight)
        print("WROTE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
