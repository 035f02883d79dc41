"""``weightcache publish``: vLLM loads and processes a model its own way, and every rank is published to the node's
services (issue 35), through the plugin's own code path (load format ``weightcache_publish``,
:mod:`weightcache.integrations.vllm_publish`): a preload that needs no engine running, for an operator after an
install, an ``ExecStartPost=`` or a Kubernetes init container. Run it with the engine's interpreter (vLLM
installed). Engines that start later with the same engine key attach the publication zero-copy.

Forbidden imports: torch at module level, vllm at module level, weightcache.daemon, weightcache.client,
weightcache.pipeline, weightcache.memory.
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import protocol
from ..wire import SlotState
from .common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, ask_each, socket_dir_of


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """``vllm.LLM``'s arguments: the plugin's load format and options, and the engine's own."""
    from ..integrations.vllm_publish import LOAD_FORMAT

    extra = {"socket_dir": args.socket_dir, "gpu": args.gpu, "timeout_s": args.timeout}
    kwargs = {"model": args.model, "load_format": LOAD_FORMAT, "tensor_parallel_size": args.tp,
              "model_loader_extra_config": {k: v for k, v in extra.items() if v is not None},
              "enforce_eager": True}
    for name in ("dtype", "quantization", "max_model_len"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    return kwargs


def published(args: argparse.Namespace) -> list[protocol.SlabInfo]:
    """The ready publications of ``args.model`` at ``--tp`` on the instances asked (``--gpu``, else 0..tp-1)."""
    where = socket_dir_of(args)
    gpus = [args.gpu] if args.gpu is not None else list(range(args.tp))
    path = os.path.realpath(args.model) if os.path.isdir(args.model) else None
    out = []
    for gpu, reply, e in ask_each(args, where, sorted(set(gpus)), protocol.List):
        if e is not None:
            print(f"GPU {gpu}: {e.code}: {e.message}", file=sys.stderr)
            continue
        for sl in reply.slabs():
            same = args.model in (sl.model, sl.path) or (path is not None and os.path.realpath(sl.path) == path)
            if sl.publication and sl.tp_size == args.tp and sl.state is SlotState.READY and same:
                out.append(sl)
    return out


def cmd_publish(args: argparse.Namespace) -> int:
    """Starts a vLLM engine on ``MODEL`` with load format ``weightcache_publish``, then checks that every rank is
    published. Exit status: 0 every rank published (or already held), 1 some rank not, 2 vLLM missing."""
    try:
        import vllm  # noqa: F401 - the engine's interpreter
    except ImportError as e:
        print(f"weightcache publish runs vLLM's own loader, which this interpreter ({sys.executable}) cannot "
              f"import ({e}); run it with the engine's interpreter", file=sys.stderr)
        return EXIT_USAGE
    from vllm import LLM

    from ..integrations import vllm as plugin

    plugin.register()  # the entry point does it in every vLLM process; here before the first engine, too
    llm = LLM(**_engine_kwargs(args))
    del llm
    ranks = published(args)
    for sl in ranks:
        print(f"{sl.label}: {sl.tensors} tensors, {sl.resident_bytes} bytes, "
              f"engine key {sl.publication.get('engine_key_blake2b', '')[:16]}")
    if len({sl.tp_rank for sl in ranks}) < args.tp:
        missing = sorted(set(range(args.tp)) - {sl.tp_rank for sl in ranks})
        print(f"weightcache publish: ranks {missing} of {args.model} tp={args.tp} are not published (the engine's "
              f"log says why)", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
