"""vLLM model loader ``weightcache_publish``: vLLM's own load, published to the node's service, attached next time.

Usage (registered by the same ``vllm.general_plugins`` entry point as ``weightcache``)::

    vllm serve /srv/models/Qwen3-8B --load-format weightcache_publish \\
        --model-loader-extra-config '{"socket_dir": "/run/weightcache"}'

For any architecture, quantization method or parallel rank that vLLM's default loader runs (issue 35):

1. The loader works out this engine's **key** (:func:`engine_key`: vLLM and its version, the architecture, the
   dtype, the quantization method and a hash of its config, every parallel rank and size, the draft role, the
   kernel choices, the compute capability) and asks the service for a publication of the rank under it
   (:func:`weightcache.client.attach_published`).
2. Held: the model is built on the meta device, the published tensors become its parameters and buffers
   (zero-copy, read-only), and vLLM's ``process_weights_after_loading`` runs inside
   ``weights_already_processed()``, as vLLM's own loader of pre-processed weights does. Log:
   ``weightcache attached published``.
3. Not held (or refused): vLLM's default loader loads and processes the model (on the CPU build with plain
   ``torch.nn.functional.linear`` layers, so that the processed weights are tensors of the model, not oneDNN
   packs), then every parameter and buffer is published (:func:`weightcache.client.publish`; tied names once,
   views kept, JSON-able Python attributes as ``attrs``). Log: ``weightcache published``. The engine then
   moves its parameters onto the published slab and drops its own copy (:func:`_move_onto`), so the weights
   are in memory once. Buffers vLLM computes or writes itself (rotary caches, attention's scales) stay its own
   (:func:`_slots`).

Every failure of the service's side (none held, another key, no service, a refused publication) ends in vLLM's
default loader, logged once; this loader never stops an engine the default loader starts.

vLLM's GPU worker asks ``get_external_weight_memory`` before the load: the held publication's size when step 2
will run (attached then, the attachment kept for the load), 0 when step 3 will (the service's allocation comes
after vLLM's memory snapshot, which counts it itself); :data:`EXTERNAL_BYTES` says why.

Extra config keys: ``socket_dir`` (the service's socket directory), ``gpu`` (its instance; default: the
model's device), ``timeout_s`` (seconds for each request, default 60).

Forbidden imports: weightcache.daemon.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import time
import weakref
from typing import Any

import torch
from torch import nn
from vllm import __version__ as VLLM_VERSION
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_default_torch_dtype

from ..client import Attachment, allocate_home, attach_published, physical_gpu, publish
from ..errors import ConfigError, WeightcacheError
from ..hashes import blake2b_hex
from ..journal import event
from . import vllm_fallback as fb
from . import vllm_zero_copy as zc
from .params import move_storages, register_tensors

log = init_logger("vllm." + __name__)

#: The ``--load-format`` value.
LOAD_FORMAT = "weightcache_publish"
#: Bumped when what this module publishes for the same model changes (part of the engine key).
PUBLISH_FORMAT = 1
#: Extra config keys: name -> (accepted types, default).
EXTRA_CONFIG: dict[str, tuple[tuple[type, ...], Any]] = {
    "socket_dir": ((str, type(None)), None),
    "gpu": ((int, type(None)), None),
    "timeout_s": ((int, float), 60.0),
}


def parse_extra_config(extra: dict[str, Any] | None) -> dict[str, Any]:
    """Validates ``--model-loader-extra-config`` for ``weightcache_publish``.

    Raises:
        ConfigError (`config_invalid`): an unknown key or a value of the wrong type.
    """
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(EXTRA_CONFIG))
    if unknown:
        raise ConfigError(f"load format {LOAD_FORMAT!r}: unknown model_loader_extra_config key {unknown[0]!r} "
                          f"(known: {', '.join(EXTRA_CONFIG)})", key=unknown[0])
    out = {}
    for key, (types, default) in EXTRA_CONFIG.items():
        v = extra.get(key, default)
        if not isinstance(v, types) or isinstance(v, bool):
            raise ConfigError(f"load format {LOAD_FORMAT!r}: {key} must be "
                              f"{' or '.join(t.__name__ for t in types)}, got {v!r}", key=key)
        out[key] = v
    return out


def _json_hash(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, (dict, list)):
        value = getattr(value, "to_dict", lambda: vars(value))()
    return blake2b_hex(json.dumps(value, sort_keys=True, default=str, separators=(",", ":")).encode())


def _parallel(vllm_config: VllmConfig) -> dict[str, int]:
    """Every parallel size and rank of this worker (TP, PP, DP, EP)."""
    from vllm.distributed import get_pp_group

    pc = vllm_config.parallel_config
    tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    pp = get_pp_group()
    dp_size, dp_rank = int(pc.data_parallel_size), int(getattr(pc, "data_parallel_rank", 0) or 0)
    ep = bool(getattr(pc, "enable_expert_parallel", False))
    return {"tp_size": tp_size, "tp_rank": tp_rank, "pp_size": pp.world_size, "pp_rank": pp.rank_in_group,
            "dp_size": dp_size, "dp_rank": dp_rank, "ep_size": tp_size * dp_size if ep else 1,
            "ep_rank": dp_rank * tp_size + tp_rank if ep else 0}


def engine_key(vllm_config: VllmConfig, model_config: ModelConfig) -> dict[str, Any]:
    """This vLLM worker's engine key (docs/protocol.md, "The engine key")."""
    hf = model_config.hf_config
    archs = getattr(hf, "architectures", None) or [getattr(hf, "model_type", "")]
    spec = vllm_config.speculative_config
    draft = ""
    if spec is not None and getattr(spec, "draft_model_config", None) is model_config:
        draft = str(getattr(spec, "method", "draft"))
    cap = current_platform.get_device_capability()
    quant_config = getattr(hf, "quantization_config", None) or getattr(hf, "compression_config", None)
    return {
        "engine": "vllm", "engine_version": VLLM_VERSION, "architecture": str(archs[0]),
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "quantization": {"method": model_config.quantization or "",
                         "config_blake2b": _json_hash(quant_config) if model_config.quantization else ""},
        "parallel": _parallel(vllm_config), "draft": draft,
        "kernels": {"platform": str(current_platform.device_type),
                    "attention": os.environ.get("VLLM_ATTENTION_BACKEND", "auto"),
                    "cpu_linear": "plain" if current_platform.is_cpu() else ""},
        "compute_capability": f"{cap.major}.{cap.minor}" if cap is not None else "",
        "revision": model_config.revision or "", "publish_format": PUBLISH_FORMAT,
        "hf_overrides": _json_hash(getattr(model_config, "hf_overrides", None) or None),
    }


def _jsonable(v: Any) -> bool:
    if isinstance(v, (bool, int, float, str)) or v is None:
        return not isinstance(v, float) or math.isfinite(v)  # JSON has no NaN or infinity
    if isinstance(v, (list, tuple)):
        return all(_jsonable(x) for x in v)
    return False


def collect(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Every parameter and buffer of ``model`` by name (tied names each: they are one tensor), and each
    parameter's JSON-able Python attributes (vLLM's ``output_dim``, ``input_dim``, ``packed_dim``...)."""
    tensors: dict[str, torch.Tensor] = {}
    attrs: dict[str, dict[str, Any]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tensors[name] = p.detach()
        a = {k: v for k, v in vars(p).items() if not k.startswith("_") and _jsonable(v)}
        if a:
            attrs[name] = a
    for name, b in model.named_buffers(remove_duplicate=False):
        tensors[name] = b.detach()
    return tensors, attrs


def _slots(model: nn.Module, tensors: dict[str, torch.Tensor], buffers: bool = True) -> dict[str, torch.Tensor]:
    """The published tensors to register in ``model``: every parameter's, and (``buffers``) those of the buffers
    still on meta (storage waiting for weights). A buffer vLLM computed when it built the model (rotary caches,
    attention's ``_k_scale``, which its processing writes in place) stays the model's own: a shared tensor is
    read-only."""
    params = dict(model.named_parameters(remove_duplicate=False))
    bufs = dict(model.named_buffers(remove_duplicate=False)) if buffers else {}
    return {n: t for n, t in tensors.items() if n in params or (n in bufs and bufs[n].is_meta)}


def _restore_attrs(model: nn.Module, w: Attachment) -> None:
    """Sets the published attributes a registered parameter lacks (those vLLM's processing added)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, p in params.items():
        for k, v in (w.layouts.get(name, {}) or {}).get("attrs", {}).items():
            if not hasattr(p, k):
                setattr(p, k, v)


class Plan(enum.Enum):
    """What this engine start does with the service, from what ``attach_published`` answered (:func:`plan_after`)."""

    #: A publication of this engine's key is held: it is attached zero-copy (or, where this vLLM cannot take it
    #: pre-processed, vLLM's own load moves onto it).
    ATTACH = "attach"
    #: None held for this key (or another key held): vLLM's default load, published, then moved onto the slab.
    PUBLISH = "publish"
    #: The service cannot take part (absent, the model not configured there, refused): vLLM's default load only.
    DEFAULT = "default"


#: Bytes to report to vLLM's memory profiler (``get_external_weight_memory``) for each plan, as a multiple of the
#: held publication's size. vLLM (0.32 to 0.34 alike) takes its initial memory snapshot right after asking, then
#: counts everything the device's free memory lost from that snapshot to the end of its profiling run as the
#: engine's own consumption (``total_consumed``), and subtracts the reported bytes from the
#: ``gpu_memory_utilization`` budget. ATTACH: the publication was resident before the snapshot, outside it, so
#: its size is reported (the daemon's slab, as vLLM's own weight cache daemon reports it). PUBLISH: the service
#: allocates the publication after the snapshot (the engine's copy is freed once it moves onto it), so the
#: profiler already counts those bytes; reporting them too would count them twice and shrink the KV cache by the
#: weights' size: 0. DEFAULT: the weights are vLLM's own memory: 0.
EXTERNAL_BYTES: dict[Plan, int] = {Plan.ATTACH: 1, Plan.PUBLISH: 0, Plan.DEFAULT: 0}


def plan_after(error: WeightcacheError | None) -> Plan:
    """The :class:`Plan` after ``attach_published`` held (``error is None``) or raised ``error``
    (:func:`publishes_after`)."""
    if error is None:
        return Plan.ATTACH
    return Plan.PUBLISH if publishes_after(error) else Plan.DEFAULT


def external_bytes(plan: Plan, publication_bytes: int) -> int:
    """What ``get_external_weight_memory`` answers for ``plan`` (:data:`EXTERNAL_BYTES`).

    Args:
        plan (`Plan`): the engine start's plan.
        publication_bytes (`int`): the held publication's resident bytes (``Attachment.resident_bytes``); 0 when
            none is held.

    Returns:
        `int`: bytes of weights held outside vLLM's allocator before its initial memory snapshot.
    """
    return EXTERNAL_BYTES[plan] * publication_bytes


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One rank's publication on one service instance: the key of :data:`_PROFILED` and of the rank's charge in
    vLLM 0.34's account of external weight bytes (:func:`.vllm_fallback.charge_key`)."""

    path: str
    gpu: int
    device: str
    tp_size: int
    tp_rank: int


#: Publications ``get_external_weight_memory`` attached, with the engine key they were attached under, kept for
#: the same rank's load in this process (vLLM asks each question of a fresh loader): one attach per engine start.
_PROFILED: dict[_Slot, tuple[dict[str, Any], Attachment]] = {}


def _drop_profiled(slot: _Slot) -> None:
    held = _PROFILED.pop(slot, None)
    if held is not None:
        held[1].close()


def _take_profiled(slot: _Slot, key: dict[str, Any]) -> Attachment | None:
    """The profiler's attachment of ``slot`` when it was made under ``key``; else none (one of another key closed)."""
    held = _PROFILED.pop(slot, None)
    if held is None:
        return None
    if held[0] != key:
        held[1].close()
        return None
    return held[1]


class WeightcachePublishLoader(DefaultModelLoader):
    """``--load-format weightcache_publish`` (see the module docstring)."""

    def __init__(self, load_config: LoadConfig, fallback: bool = True) -> None:
        self.options = parse_extra_config(load_config.model_loader_extra_config)
        #: False (the ``weightcache`` format's ``fallback = false``): a reason the service cannot take part (absent,
        #: refused, the model not configured) is raised, typed, instead of ending in vLLM's default load.
        self.fallback = fallback
        plain = dataclasses.replace(load_config, load_format="auto", model_loader_extra_config={})
        super().__init__(plain)

    def _where(self, vllm_config: VllmConfig) -> tuple[torch.device, str, int]:
        dev = torch.device(vllm_config.load_config.device or vllm_config.device_config.device)
        if dev.type == "cuda":
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            gpu = self.options["gpu"]
            return dev, f"cuda:{index}", physical_gpu(index, os.environ.get("CUDA_VISIBLE_DEVICES")) if gpu is None \
                else gpu
        return dev, "cpu", self.options["gpu"] or 0

    def _request(self, vllm_config: VllmConfig, model_config: ModelConfig
                 ) -> tuple[torch.device, dict[str, Any], _Slot]:
        """The load's target device, the client's request arguments (``device``, ``socket_dir``, ``gpu``,
        ``timeout``) and this rank's :class:`_Slot` (``tp_size``, ``tp_rank`` from the parallel state)."""
        path = model_config.model_weights or model_config.model
        target, device, gpu = self._where(vllm_config)
        where = {"device": device, "socket_dir": self.options["socket_dir"], "gpu": gpu,
                 "timeout": float(self.options["timeout_s"])}
        slot = _Slot(path, gpu, device, get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank())
        return target, where, slot

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """Bytes of this rank's weights that will be held outside vLLM's allocator, asked by vLLM's GPU worker
        before the load (a fresh loader, parallel state initialised; vLLM's CPU worker does not ask).

        :func:`external_bytes` of the engine start's :class:`Plan`: the held publication's size when one is held
        for this engine's key (it is attached now and the attachment kept for this rank's load in this process:
        one attach per engine start; on vLLM 0.34 the bytes are also recorded in its account, and given back
        when the load does not map the publication after all); 0 when the start will publish (the service's
        allocation comes after vLLM's memory snapshot, which then counts it) or cannot use the service.
        """
        model_config = vllm_config.model_config
        path = model_config.model_weights or model_config.model
        if not os.path.isdir(path):
            return 0
        try:
            _, where, slot = self._request(vllm_config, model_config)
            key = engine_key(vllm_config, model_config)
        except Exception as e:  # noqa: BLE001 - the load logs it and loads with vLLM's default loader
            log.debug("weightcache external weight memory 0 checkpoint=%s reason=%r", path, e)
            return 0
        _drop_profiled(slot)  # a repeated question: its answer replaces the last one's (and its charge)
        try:
            w = attach_published(path, key, slot.tp_size, slot.tp_rank, **where)
        except WeightcacheError as e:
            plan = plan_after(e)
            log.info("weightcache external weight memory 0 checkpoint=%s tp_rank=%d plan=%s reason=%s: %s", path,
                     slot.tp_rank, plan.value, e.code, e.message)
            return external_bytes(plan, 0)
        _PROFILED[slot] = (key, w)
        size = external_bytes(Plan.ATTACH, w.resident_bytes)
        fb.charge(slot, size)
        return size

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        path = model_config.model_weights or model_config.model
        target, where, slot = self._request(vllm_config, model_config)
        if not os.path.isdir(path):  # a hub id: the service holds local checkpoints by path
            log.info("weightcache publication skipped checkpoint=%s reason=not a local checkpoint directory", path)
            return self._own_load(vllm_config, model_config, prefix, target)
        try:
            key = engine_key(vllm_config, model_config)
        except Exception as e:  # noqa: BLE001 - a vLLM whose config lacks a field read here: its own load runs
            _drop_profiled(slot)
            fb.uncharge(slot)
            log.warning("weightcache publication skipped checkpoint=%s reason=the engine key could not be worked "
                        "out: %r", path, e)
            return self._own_load(vllm_config, model_config, prefix, target)
        par = key["parallel"]
        t0 = time.monotonic()
        try:
            w = _take_profiled(slot, key)  # the memory profiler's attachment: not attached twice
            if w is None:
                w = attach_published(path, key, par["tp_size"], par["tp_rank"], **where)
        except WeightcacheError as e:
            fb.uncharge(slot)
            if not publishes_after(e):  # no service, not configured there, refused: vLLM's load, nothing published
                return self._without_service(vllm_config, model_config, prefix, target, path, par, e)
            log.debug("weightcache no publication to attach checkpoint=%s tp_rank=%d reason=%s: %s", path,
                      par["tp_rank"], e.code, e.message)
        else:
            model = self._attached(vllm_config, model_config, prefix, target, w)
            if model is not None:
                log.info("weightcache attached published checkpoint=%s source=daemon mode=zero_copy tp_size=%d "
                         "tp_rank=%d tensors=%d size_bytes=%d duration_ms=%.1f", path, par["tp_size"],
                         par["tp_rank"], len(w.tensors), w.manifest.slab_size_bytes, (time.monotonic() - t0) * 1e3)
                return model
        home: list[Any] = []  # the publisher's own allocation its model is moved into (CUDA), if it has room
        model = self._own_load(vllm_config, model_config, prefix, target, home=home if target.type == "cuda"
                               else None, device=where["device"])
        tensors, attrs = collect(model)
        try:
            got = publish(path, key, tensors, par["tp_size"], par["tp_rank"], attrs=attrs,
                          home=home[0] if home else None, **where)
        except (WeightcacheError, OSError, RuntimeError) as e:  # refused, no memfd, a copy failed: keep its own
            fb.uncharge(slot)
            if not self.fallback and isinstance(e, WeightcacheError):
                raise
            log.warning("weightcache publication refused checkpoint=%s tp_rank=%d reason=%s: %s; the engine keeps "
                        "its own copy", path, par["tp_rank"], getattr(e, "code", type(e).__name__), e)
            return model
        log.info("weightcache published checkpoint=%s slab=%s created=%s tp_size=%d tp_rank=%d tensors=%d "
                 "size_bytes=%d (loaded with vLLM's default loader; the next start attaches it zero-copy)", path,
                 got.label, got.created, par["tp_size"], par["tp_rank"], len(tensors), got.size_bytes)
        if not self._move_onto(model, path, key, where):
            fb.uncharge(slot)  # a held publication charged by the profiler is not mapped after all
        elif home:
            _leave_home(model, home.pop())
        return model

    def _without_service(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
                         target: torch.device, path: str, par: dict[str, int], e: WeightcacheError) -> nn.Module:
        """The service cannot take part (``e``): raised when ``fallback`` is false, else logged once (WARNING, the
        journal's ``fallback`` event) and vLLM's own load, nothing published."""
        if not self.fallback:
            raise e
        log.warning("weightcache cannot serve, loading with vLLM's default loader checkpoint=%s tp_size=%d "
                    "tp_rank=%d reason=%s: %s", path, par["tp_size"], par["tp_rank"], e.code, e.message,
                    extra=event("fallback", path, par["tp_rank"], tp_size=par["tp_size"], error_code=e.code))
        return self._own_load(vllm_config, model_config, prefix, target)

    def _own_load(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
                  target: torch.device, home: list[Any] | None = None, device: str = "") -> nn.Module:
        """vLLM's default load and processing; on the CPU build with plain linear layers (the processed weights
        stay the model's tensors, which is what is published and what a later attach registers).

        ``home`` (a load that publishes, on ``device`` ``cuda:N``): the freshly built model is moved into one
        VMM allocation of this process laid out as the slab its publication will be
        (:func:`weightcache.client.allocate_home`, :func:`~weightcache.integrations.params.move_storages`),
        before the checkpoint is read into it; the allocation is appended to ``home``. The publication is then
        the service's copy of it, not a second one (none when the GPU lacks room for it: the model stays as
        built)."""
        with set_default_torch_dtype(model_config.dtype):
            with target:
                model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
            if home is not None:
                _move_home(model, device, home)
            self.load_weights(model, model_config)
            if current_platform.is_cpu():
                zc.mark_plain_cpu_linear(model)
            process_weights_after_loading(model, model_config, target)
        return model.eval()

    def _attached(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str, target: torch.device,
                  w: Attachment) -> nn.Module | None:
        """The model on meta with the published tensors registered and vLLM's processing run in pre-processed
        mode; None (logged, ``w`` closed) when this vLLM cannot take them so."""
        undo = zc.registry_undo(vllm_config)
        try:
            with set_default_torch_dtype(model_config.dtype):
                model = zc.initialize_on_meta(vllm_config, model_config, prefix, target)
                reason = zc.quant_refusal(model)
                if reason is not None:
                    raise ConfigError(reason, key="quantization")
                reg = register_tensors(model, _slots(model, w.tensors), check="none", source="the publication",
                                       hint="this vLLM's model differs from the publishing engine's")
                shared = set(reg.shared_ids)
                _restore_attrs(model, w)
                if current_platform.is_cpu():
                    zc.mark_plain_cpu_linear(model)
                zc.finish(model, model_config, target, shared, current_platform.is_cpu())
        except WeightcacheError as e:
            undo()
            w.close()
            log.warning("weightcache publication not usable, loading with vLLM's default loader reason=%s: %s",
                        e.code, e.message)
            return None
        except Exception as e:  # noqa: BLE001 - vLLM's processing refused the published tensors: its own load runs
            # E.g. vLLM 0.32's MLA attention derives its absorbed matrices from kv_b_proj while processing, which
            # the CPU build emptied after the publisher's processing: vLLM's default load runs instead (and the
            # engine still moves onto the publication afterwards, _move_onto).
            undo()
            w.close()
            log.warning("weightcache publication not usable, loading with vLLM's default loader reason=%s: %r",
                        type(e).__name__, e)
            return None
        _keep_lease(model, w)
        return model.eval()

    def _move_onto(self, model: nn.Module, path: str, key: dict[str, Any], where: dict[str, Any]) -> bool:
        """Replaces the engine's own parameters and buffers by the published slab's (the same bytes), so that
        its private copy is freed and the weights are in memory once; on any failure it keeps its own.

        Returns:
            `bool`: whether the model is on the slab now.
        """
        par = key["parallel"]
        try:
            w = attach_published(path, key, par["tp_size"], par["tp_rank"], **where)
        except WeightcacheError as e:
            log.warning("weightcache keeps its own copy after publishing reason=%s: %s", e.code, e.message)
            return False
        try:
            register_tensors(model, _slots(model, w.tensors, buffers=False), check="dtype_shape",
                             source="the publication", hint="the published slab differs from this engine's model")
        except WeightcacheError as e:
            w.close()
            log.warning("weightcache keeps its own copy after publishing reason=%s: %s", e.code, e.message)
            return False
        _keep_lease(model, w)
        return True


def _move_home(model: nn.Module, device: str, home: list[Any]) -> None:
    """Moves a freshly built ``model`` into a publication home on ``device`` (appended to ``home``), if there is
    room; logs either way. A failure leaves the model as built (the publication then stages a copy)."""
    t0 = time.monotonic()
    try:
        tensors, attrs = collect(model)
        got = allocate_home(tensors, attrs, device=device)
        if got is None:
            log.info("weightcache publication home skipped device=%s reason=no room for a second copy of the model "
                     "beside it (the publication stages a copy)", device)
            return
        w, copies = got
        n = move_storages(model, w.tensor, copies)
        torch.cuda.empty_cache()  # the built model's own blocks go back to the driver
    except Exception as e:  # noqa: BLE001 - an optimisation: the load goes on as vLLM's own
        log.warning("weightcache publication home skipped device=%s reason=%r", device, e)
        return
    home.append(w)
    log.info("weightcache publication home device=%s tensors=%d size_bytes=%d duration_ms=%.1f", device, n,
             w.size_bytes, (time.monotonic() - t0) * 1e3)


def _leave_home(model: nn.Module, home: Any) -> None:
    """After the model moved onto the published slab: buffers still in the publication home (those vLLM keeps
    private, e.g. rotary caches) are copied out, so that the home is freed when the last reference goes."""
    base = home.ptr
    left: list[str] = []
    for mod_name, module in model.named_modules():
        for leaf, b in list(module._buffers.items()):
            if b is not None and not b.is_meta and b.untyped_storage().data_ptr() == base:
                module._buffers[leaf] = b.clone()
        for leaf, p in module._parameters.items():
            if p is not None and not p.is_meta and p.untyped_storage().data_ptr() == base:
                left.append(f"{mod_name}.{leaf}" if mod_name else leaf)
    if left:
        log.warning("weightcache publication home kept alive by parameters not on the slab: %s", ", ".join(left[:8]))


def publishes_after(error: WeightcacheError) -> bool:
    """Whether an ``attach_published`` that raised ``error`` leaves this engine to load and publish: none published
    for it yet (``model_not_found`` with ``publication = "none"``: a model configured there, waiting for its engine
    or laid out otherwise), or held under another engine key (``cache_key_mismatch``). Any other reason (no service,
    the model not configured there, refused) means the service cannot take a publication either."""
    return error.code == "cache_key_mismatch" or (error.code == "model_not_found"
                                                  and error.details.get("publication") == "none")


def _refuse_reload(*args: Any, **kwargs: Any) -> None:
    """``load_weights`` of a model on a published slab (vLLM's ``reload_weights``): refused.

    Raises:
        ConfigError (`config_invalid`): always.
    """
    raise ConfigError(f"reload_weights: the weights of this model are the weightcache service's read-only memory "
                      f"(load format {LOAD_FORMAT!r}); start the engine with vLLM's default loader to reload them",
                      key="load_format")


def _keep_lease(model: nn.Module, w: Attachment) -> None:
    """Ties the attachment (the lease) to ``model``: closed when the model is collected or at exit; the model's
    ``load_weights`` is refused (the weights are read-only)."""
    model._weightcache = w
    weakref.finalize(model, w.close)
    model.load_weights = _refuse_reload


def register() -> None:
    """Registers load format ``weightcache_publish`` (called by :func:`weightcache.integrations.vllm.register`)."""
    register_model_loader(LOAD_FORMAT)(WeightcachePublishLoader)
