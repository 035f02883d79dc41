"""vLLM model loader ``weightcache``: the rank's weights come from the node's service.

Usage (the plugin is found through the ``vllm.general_plugins`` entry point,
so it is active in the engine process and in every worker)::

    vllm serve /srv/models/Llama-3.1-8B --load-format weightcache \\
        --model-loader-extra-config '{"socket_dir": "/run/weightcache", "fallback": true}'

    LLM(model=path, load_format="weightcache",
        model_loader_extra_config={"fallback": False})

The loader asks the service for vLLM's own model dtype (``--dtype``, e.g.
``float32``), never ``auto``. Two modes:

- ``zero_copy`` (the default): vLLM's parameters *are* the service's
  read-only tensors, attached with ``naming = "vllm"`` at any tensor-parallel
  size (:mod:`weightcache.integrations.vllm_zero_copy` has the steps).
  :meth:`WeightcacheModelLoader.get_external_weight_memory` gives vLLM's
  memory profiler the attached bytes; the attachment (the lease) is kept as
  ``model._weightcache`` and closed when the model goes or the process exits.
  Where vLLM cannot take the slab's tensors as they are (a quant method
  without ``supports_pre_processed_weights``, a failed canary) it loads in ``copy`` mode, the reason logged;
  ``fallback = false`` makes that an error. What the service cannot lay out
  itself (it shows the slab ``waiting_for_engine``): an architecture without
  vLLM naming rules, a scheme weightcache cannot pre-process (compressed-tensors,
  AWQ, GPTQ...), a quantized model at TP > 1 that vLLM cannot take pre-processed
  (ModelOpt FP8 on vLLM 0.32), takes the publication path of
  :mod:`.vllm_publish` instead (:meth:`WeightcacheModelLoader._load_published`):
  its publication attached zero-copy, else vLLM's default load, published and
  moved onto. :data:`.vllm_fallback.PATHS` is the table of which reason takes
  which path (the publication, vLLM's default loader, or the error with
  ``fallback = false``). Features that write into weights
  (LoRA, sleep mode, weight transfer, reloads) are ``config_invalid``.
- ``copy``: vLLM builds the model as usual (its own parameters, on its own
  device) and the attached tensors are copied in; vLLM's own
  ``process_weights_after_loading`` runs unchanged. Unquantized models of a
  family with vLLM naming rules (Llama, Mistral, Qwen2) attach with
  ``naming = "vllm"`` (the same slab as zero-copy), and each tensor is copied
  into the parameter of the same name and shape, as vLLM's
  ``ShardedStateLoader`` does. Quantized models (``tp_size == 1``) attach with
  ``naming = "hf"`` and go through ``model.load_weights``, exactly like
  vLLM's default loader; tensors the service stored in a kernel layout
  (ModelOpt FP8: transposed, padded) are given back in checkpoint form (a
  view, then a private copy) by the scheme that processed them
  (:func:`checkpoint_form`).

Extra config keys (anything else is an error):

=============  ===============  =====================================================
key            default          meaning
=============  ===============  =====================================================
socket_dir     ``None``         service socket directory (else ``$WEIGHTCACHE_SOCKET_DIR``,
                                else ``/run/weightcache``)
fallback       ``true``         when weightcache cannot serve: ``copy`` mode, the
                                publication path, or vLLM's default loader
                                (:data:`.vllm_fallback.PATHS`); the reason is
                                logged. ``false``: the reason is the error
mode           ``"zero_copy"``  ``zero_copy`` or ``copy`` (above)
timeout_s      ``30``           seconds to wait for the service (a load in progress included)
gpu            derived          service instance; default: the physical index of the
                                model's CUDA device (``CUDA_VISIBLE_DEVICES``), 0 on CPU
kernel         ``"cutlass"``    kernel layout target of quantized weights
retries        ``0``            ask the service again up to this many times after a
                                retryable error (it went away in a restart or an
                                upgrade, a cap, a full budget) before falling back;
                                ``weightcache.Retry``'s backoff, within ``timeout_s``;
                                once per engine start (the GPU worker's memory
                                question spends them, the load then asks once)
=============  ===============  =====================================================

Log lines go to vLLM's logger tree (``vllm.weightcache...``) so that they show
in vLLM's own log: one ``weightcache attached`` line with ``source=daemon`` and
``mode=zero_copy|copy``; a WARNING with the reason on a fall back to copy mode
(``weightcache zero-copy refused``) or to vLLM's default loader (``weightcache
cannot serve``). The client's own records (the ``weightcache`` logger tree: each
retry) are handed to that tree, prefixed ``weightcache``, by :class:`_IntoVllmLog`:
once, as vLLM's log shows them, never as a bare last-resort line.

Forbidden imports: weightcache.daemon.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_default_torch_dtype

from .. import quant, sharding
from ..checkpoint import Checkpoint
from ..client import MAX_TIMEOUT_S, Attachment, Retry, attach, physical_gpu
from ..errors import CheckpointNotFound, ConfigError, ShapeMismatch, WeightcacheError
from ..wire import DEFAULT_KERNEL, DEFAULT_MODE, AttachMode
from . import vllm_fallback as fb
from . import vllm_publish
from . import vllm_zero_copy as zc

# vLLM attaches its handler to the "vllm" logger only; a child of it shows in
# vLLM's log with vLLM's format (getLogger(__name__) would be silent there).
log = init_logger("vllm." + __name__)


class _IntoVllmLog(logging.Handler):
    """Hands the records of the ``weightcache`` logger tree (the client's) to :data:`log`, vLLM's logger tree,
    prefixed ``weightcache``: once, in vLLM's format (without it, also as a bare last-resort line).

    Installed once per process by :func:`_route_client_logs`; the ``weightcache`` logger's level decides
    what is emitted (WARNING and up unless the engine sets it), vLLM's level what is shown.
    """

    #: The handler's name: how :func:`_route_client_logs` finds one already installed, also one of another
    #: copy of this class (a reload of this module, or the module imported twice under two names).
    NAME = "weightcache-into-vllm"

    def __init__(self) -> None:
        super().__init__()
        self.set_name(self.NAME)

    def emit(self, record: logging.LogRecord) -> None:
        if not log.isEnabledFor(record.levelno):
            return
        record = copy.copy(record)  # another handler of the tree sees the client's own text
        record.msg = f"weightcache {record.msg}"
        log.handle(record)


def _route_client_logs() -> None:
    """Installs :class:`_IntoVllmLog` on the ``weightcache`` logger (once) and stops its records from also
    propagating to the root logger, so that each shows once, through vLLM's logger tree."""
    tree = logging.getLogger("weightcache")
    # By name, not by class: a reload creates another _IntoVllmLog class, and an isinstance check let a second
    # handler in, each line then shown twice.
    if not any(h.get_name() == _IntoVllmLog.NAME for h in tree.handlers):
        tree.addHandler(_IntoVllmLog())
    tree.propagate = False


_route_client_logs()

#: Attachments made by :meth:`WeightcacheModelLoader.get_external_weight_memory`, kept for the zero-copy load
#: of the same rank in this process (vLLM asks each question of a fresh loader: not on the loader).
_PROFILED: dict["_Rank", Attachment] = {}

#: Ranks whose profiling attach spent this engine start's ``retries`` (a retryable error): the load's attach
#: asks once more without retrying (``retries`` is per engine start, not per question).
_RETRIES_SPENT: set["_Rank"] = set()

#: The ``--load-format`` value.
LOAD_FORMAT = "weightcache"

#: ``mode`` values (:class:`~weightcache.wire.AttachMode`).
MODES = tuple(m.value for m in AttachMode)

#: Extra config keys: name -> (accepted types, default).
EXTRA_CONFIG: dict[str, tuple[tuple[type, ...], Any]] = {
    "socket_dir": ((str, type(None)), None),
    "fallback": ((bool,), True),
    "mode": ((str,), DEFAULT_MODE.value),
    "timeout_s": ((int, float), 30.0),
    "gpu": ((int, type(None)), None),
    "kernel": ((str,), DEFAULT_KERNEL),
    "retries": ((int,), 0),
}


def parse_extra_config(extra: dict[str, Any] | None) -> dict[str, Any]:
    """Validates ``--model-loader-extra-config`` for the ``weightcache`` format.

    Args:
        extra (`dict`, *optional*): the parsed JSON object.

    Returns:
        `dict`: every key of :data:`EXTRA_CONFIG`, defaults filled in.

    Raises:
        ConfigError (`config_invalid`): an unknown key (``dtype`` included:
            the dtype is vLLM's ``--dtype``), a value of the wrong type, a
            ``mode`` not in :data:`MODES`, ``timeout_s`` not in ``(0, 1e9]``, ``retries`` not in
            ``[0, 1000]``, or ``gpu < 0``.

    Example:
        >>> parse_extra_config({"fallback": False})["mode"]
        'zero_copy'
    """
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(EXTRA_CONFIG))
    if unknown:
        raise ConfigError(
            f"--model-loader-extra-config for load format {LOAD_FORMAT!r}: unknown keys {unknown}; "
            f"accepted keys are {sorted(EXTRA_CONFIG)} (the dtype is vLLM's own --dtype)", key=unknown[0])
    out: dict[str, Any] = {}
    for key, (types, default) in EXTRA_CONFIG.items():
        value = extra.get(key, default)
        # bool is an int subclass: reject True where a number or an index is expected.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ConfigError(
                f"--model-loader-extra-config for load format {LOAD_FORMAT!r}: {key} must be "
                f"{' or '.join(t.__name__ for t in types)}, got {value!r}", key=key)
        out[key] = value
    if out["mode"] not in MODES:
        raise ConfigError(
            f"--model-loader-extra-config for load format {LOAD_FORMAT!r}: mode must be one of {list(MODES)}, "
            f"got {out['mode']!r}", key="mode")
    if not 0 < out["timeout_s"] <= MAX_TIMEOUT_S:  # NaN included
        raise ConfigError(f"--model-loader-extra-config for load format {LOAD_FORMAT!r}: timeout_s must be > 0 and "
                          f"at most {MAX_TIMEOUT_S:.0e}, got {out['timeout_s']!r}", key="timeout_s")
    if not 0 <= out["retries"] <= 1000:
        raise ConfigError(f"--model-loader-extra-config for load format {LOAD_FORMAT!r}: retries must be an integer "
                          f"from 0 (off) to 1000, got {out['retries']!r}", key="retries")
    if out["gpu"] is not None and out["gpu"] < 0:
        raise ConfigError(f"--model-loader-extra-config for load format {LOAD_FORMAT!r}: gpu must be a service "
                          f"instance (a GPU index >= 0), got {out['gpu']!r}", key="gpu")
    return out


def dtype_name(dtype: torch.dtype) -> str:
    """The service's name for vLLM's model dtype (``torch.float32`` -> ``"float32"``).

    Raises:
        ConfigError (`config_invalid`): a dtype the service cannot hold.

    Example:
        >>> dtype_name(torch.bfloat16)
        'bfloat16'
    """
    name = str(dtype).removeprefix("torch.")
    if name not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"load format {LOAD_FORMAT!r}: vLLM's dtype {name} is not one the service holds "
                          f"(bfloat16, float16, float32); set --dtype", key="dtype")
    return name


def checkpoint_form(name: str, tensor: torch.Tensor, layout: dict[str, Any],
                    ck_shapes: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """Gives a processed tensor back in the form its checkpoint stores (a view, no copy).

    vLLM's ``load_weights`` expects checkpoint tensors and re-processes them
    itself. The scheme that processed the tensor undoes its processing
    (:func:`weightcache.quant.checkpoint_form`, dispatched on
    ``layout["scheme"]`` through the scheme registry; ModelOpt FP8: the
    transposed, padded ``[K_pad, N_pad]`` view becomes ``[N, K]``, a
    per-channel ``[1, N_pad]`` scale its first ``N`` values), then the result
    takes the checkpoint's shape (``[N]`` or ``[N, 1]``) when only the shape
    differs. A tensor of no scheme is returned as is.

    Args:
        name (`str`): tensor name (checkpoint naming).
        tensor (`torch.Tensor`): the attached tensor.
        layout (`dict`): its manifest layout (``Attachment.layouts[name]``).
        ck_shapes (`dict`): checkpoint header shapes by name.

    Raises:
        ShapeMismatch (`shape_mismatch`): the result differs from the checkpoint's shape.
        ManifestInvalid (`manifest_invalid`): a malformed layout of a registered scheme.
    """
    out = quant.checkpoint_form(tensor, layout)
    want = ck_shapes.get(name)
    if want is not None and tuple(out.shape) != tuple(want):
        if out.numel() == math.prod(want):
            out = out.reshape(want)
        else:
            raise ShapeMismatch(
                f"tensor {name!r}: attached layout gives {list(out.shape)}, the checkpoint stores {list(want)}; "
                f"the service's manifest and the checkpoint disagree (restart the service or evict the model)",
                tensor=name, expected=list(want), actual=list(out.shape))
    return out


def checkpoint_dir(model_config: ModelConfig) -> str:
    """The checkpoint directory to attach: vLLM's ``--model`` (its ``model_weights`` when set), as given.

    Raises:
        CheckpointNotFound (`checkpoint_not_found`): it is not a directory on
            this machine (a Hugging Face repo id, a typo): weightcache serves
            and falls back from local checkpoint directories only.

    Example:
        >>> checkpoint_dir(SimpleNamespace(model="/srv/models/llama", model_weights=""))
        '/srv/models/llama'
    """
    path = model_config.model_weights or model_config.model
    if not os.path.isdir(path):
        raise CheckpointNotFound(
            f"load format {LOAD_FORMAT!r}: --model {path!r} is not a checkpoint directory on this machine; the "
            f"service holds local checkpoints by path (a Hugging Face repo id is not one: give the directory the "
            f"service's config names, e.g. a snapshot .../models--ORG--NAME/snapshots/REVISION)", path=path)
    return path


@dataclasses.dataclass(frozen=True)
class _Rank:
    """What this worker attaches: checkpoint, tensor-parallel rank, device, service instance, dtype."""

    path: str
    tp_size: int
    tp_rank: int
    device: str  # "cpu" or "cuda:N"
    gpu: int  # the service instance
    dtype: str


class WeightcacheModelLoader(BaseModelLoader):
    """Model loader for ``--load-format weightcache`` (see the module docstring).

    Raises:
        ConfigError (`config_invalid`): bad extra config (at construction).
    """

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options = parse_extra_config(load_config.model_loader_extra_config)
        # A zero-copy attachment that copy mode takes over after a refused canary.
        self._handoff: Attachment | None = None

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: the checkpoint is a local directory or served by name."""

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """Bytes of this rank's slab, which zero-copy maps outside vLLM's allocator; 0 in ``copy`` mode.

        vLLM's GPU worker asks before loading (a fresh loader, parallel state
        initialised) and takes the bytes out of the KV-cache budget's
        accounting. The slab is attached to read its size, and the
        attachment is kept for this rank's zero-copy load in this process
        (one attach per engine start; a repeated question replaces it). When
        the service cannot serve (the load will then read from disk into
        vLLM's own memory) the answer is 0. A model only the engine lays out
        (:func:`engine_lays_out`) is answered by the publication path
        (:meth:`.vllm_publish.WeightcachePublishLoader.get_external_weight_memory`):
        the held publication's size, or 0 when this start publishes it.
        """
        if self.options["mode"] != AttachMode.ZERO_COPY:
            return 0
        rank = None
        try:
            rank = self._rank(vllm_config.model_config, self._target(vllm_config))
            reason = fb.unservable(rank.path, rank.tp_size, self.options["kernel"],
                                   vllm_config.model_config.quantization, zero_copy=True)
            if reason is not None and fb.path_for(reason, self.options["fallback"], True) is fb.Path.PUBLICATION:
                return self._publish_loader().get_external_weight_memory(vllm_config)  # see _load_published
            _drop_profiled(rank)
            _RETRIES_SPENT.discard(rank)  # this question is a new engine start's: its attach has the retries
            if reason is not None:
                raise reason
            w = self._attach(rank, "vllm")
        except WeightcacheError as e:  # the load says it too (falls back or raises)
            if rank is not None and e.retryable and self.options["retries"]:
                _RETRIES_SPENT.add(rank)
            log.info("weightcache external weight memory 0 checkpoint=%s reason=%s: %s",
                     getattr(rank, "path", None), e.code, e.message)
            return 0
        _PROFILED[rank] = w
        fb.charge(rank, w.resident_bytes)
        return w.resident_bytes

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        """Zero-copy when possible (and asked for), else vLLM's usual way plus a copy; when the service's own slab
        cannot serve, the path :data:`.vllm_fallback.PATHS` gives the reason: the publication path
        (:meth:`_load_published`), vLLM's own default loader, or the error (:mod:`.vllm_fallback`).

        Raises:
            WeightcacheError: with ``fallback = false``, why weightcache cannot serve (:mod:`.vllm_fallback`),
                typed (``unsupported_quantization`` naming the scheme, ``config_invalid`` key
                ``tensor_parallel_size``, the service's own errors); ``config_invalid`` for a feature that writes
                into weights in ``zero_copy`` mode.
        """
        undo = zc.registry_undo(vllm_config)
        rank: _Rank | None = None
        zero_copy = self.options["mode"] == AttachMode.ZERO_COPY
        try:
            rank = self._rank(model_config, self._target(vllm_config))
            fb.check_servable(rank, self.options["kernel"], model_config.quantization, zero_copy=zero_copy)
            model = self._load_zero_copy(vllm_config, model_config, prefix) if zero_copy else None
            if model is None:
                model = super().load_model(vllm_config, model_config, prefix)
        except WeightcacheError as e:
            path = fb.path_for(e, self.options["fallback"], zero_copy)
            if path is fb.Path.ERROR:
                raise
            error = e.with_traceback(None)  # the frames of the failed load (its model) are not kept
        else:
            return model if getattr(model, "_weightcache", None) is not None else fb.uncharged(rank, model)
        undo()  # the failed load's layers leave vLLM's registries: the default loader registers its own
        if rank is not None:
            _drop_profiled(rank)
            fb.uncharge(rank)  # the service's slab is not mapped (the publication path charges its own)
        if path is fb.Path.PUBLICATION:
            log.info("weightcache takes the publication path checkpoint=%s tp_size=%d tp_rank=%d reason=%s: %s",
                     rank.path, rank.tp_size, rank.tp_rank, error.code, error.message)
            return self._load_published(vllm_config, model_config, prefix)
        return fb.load_with_default(self.load_config, vllm_config, model_config, prefix, rank, error)

    get_all_weights = fb.get_all_weights  # vLLM 0.34's partial reloads

    # --- publication: what only the engine lays out ---------------------------------------

    def _load_published(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str) -> nn.Module:
        """What the service cannot lay out (:data:`.vllm_fallback.PATHS`' publication path: an architecture without
        vLLM naming rules, a scheme weightcache cannot pre-process, a quantized model at TP > 1 that vLLM cannot
        take pre-processed): the publication of this engine's key, zero-copy, when the service holds one;
        else vLLM's default loader, published (the next start attaches it). The same code path as
        ``--load-format weightcache_publish`` (:class:`.vllm_publish.WeightcachePublishLoader`).

        Raises:
            ConfigError (`config_invalid`, key ``mode``): a feature that writes into the weights.
            WeightcacheError: with ``fallback = false``, why the service cannot take part (absent, the model not
                configured there, the publication refused), typed.
        """
        features = zc.writing_features(vllm_config)
        if features:
            raise ConfigError(
                f"load format {LOAD_FORMAT!r}, mode 'zero_copy': {features[0]} writes into the weights, which "
                f"are the service's read-only memory in this mode; turn it off or use mode 'copy'", key="mode")
        return self._publish_loader().load_model(vllm_config, model_config, prefix)

    def _publish_loader(self) -> vllm_publish.WeightcachePublishLoader:
        """The ``weightcache_publish`` loader with this loader's ``socket_dir``, ``gpu``, ``timeout_s`` and
        ``fallback``."""
        o = self.options
        extra = {"socket_dir": o["socket_dir"], "gpu": o["gpu"], "timeout_s": o["timeout_s"]}
        return vllm_publish.WeightcachePublishLoader(
            dataclasses.replace(self.load_config, load_format=vllm_publish.LOAD_FORMAT,
                                model_loader_extra_config=extra), fallback=o["fallback"])

    # --- zero-copy -----------------------------------------------------------------------

    def _load_zero_copy(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str) -> nn.Module | None:
        features = zc.writing_features(vllm_config)
        if features:
            raise ConfigError(
                f"load format {LOAD_FORMAT!r}, mode 'zero_copy': {features[0]} writes into the weights, which "
                f"are the service's read-only memory in this mode; turn it off or use mode 'copy'", key="mode")
        target = self._target(vllm_config)
        rank = self._rank(model_config, target)
        t0 = time.monotonic()
        ck = Checkpoint(rank.path, validate=False)  # a family with vLLM naming rules (fb.unservable checked)
        plain_cpu = current_platform.is_cpu()
        quantized = model_config.quantization is not None
        undo = zc.registry_undo(vllm_config)
        with set_default_torch_dtype(model_config.dtype):
            model = zc.initialize_on_meta(vllm_config, model_config, prefix, target)
            reason = zc.quant_refusal(model)
            if reason is not None:
                undo()
                _drop_profiled(rank)
                fb.check_servable(rank, self.options["kernel"], model_config.quantization, zero_copy=False)
                return self._refused(rank, reason, ConfigError, key="mode")
            w: Attachment | None = _PROFILED.pop(rank, None)  # the profiler's attachment: not attached twice
            if w is None:
                w = self._attach(rank, "vllm")
            try:
                diff = zc.canary(vllm_config, model_config, prefix, ck, w, target, plain_cpu)
                if diff is not None:
                    undo()
                    self._handoff, w = w, None
                    return self._refused(rank, diff.reason, ShapeMismatch, tensor=diff.tensor)
                shared = zc.share(model, w, check_shapes=not quantized)
                if not quantized:
                    zc.check_all_shared(model, shared)
                if plain_cpu:
                    zc.mark_plain_cpu_linear(model)
                zc.finish(model, model_config, target, shared, plain_cpu)
            except BaseException:
                if w is not None:
                    w.close()
                raise
        _keep_lease(model, w)
        private = zc.private_tensors(model, shared)
        self._log_attached(rank, w, AttachMode.ZERO_COPY.value, t0, private=len(private))
        if private:
            log.info("weightcache private copies tensors=%s", private)
        return model.eval()

    def _refused(self, rank: _Rank, reason: str, error: type[WeightcacheError], **details: Any) -> None:
        """Zero-copy is not possible: copy mode with a logged reason, or (``fallback = false``) ``error``."""
        if not self.options["fallback"]:
            if self._handoff is not None:
                self._handoff.close()
                self._handoff = None
            raise error(f"load format {LOAD_FORMAT!r}: mode 'zero_copy' is not possible for {rank.path}: {reason}; "
                        f"use mode 'copy', or fallback true to let the loader do so", **details)
        log.warning("weightcache zero-copy refused, loading in copy mode checkpoint=%s tp_rank=%d reason=%s",
                    rank.path, rank.tp_rank, reason)

    # --- copy ----------------------------------------------------------------------------

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Copy mode: attaches the rank's weights and copies them into ``model``'s parameters.

        Raises:
            ConfigError (`config_invalid`): ``model`` is zero-copy (read-only weights: no reload).
            UnsupportedQuantization, ConfigError: :func:`.vllm_fallback.unservable`'s reasons.
            ShapeMismatch (`shape_mismatch`): a tensor that fits no parameter.
            DaemonUnavailable, CacheKeyMismatch, ModelLoading, ... : from
                :func:`weightcache.attach` when ``fallback`` is false.
        """
        if getattr(model, "_weightcache", None) is not None:
            _refuse_reload()
        param = next(model.parameters(), None)
        rank = self._rank(model_config, param.device if param is not None else torch.device("cpu"))
        t0 = time.monotonic()
        w, self._handoff = self._handoff, None
        if w is None:
            fb.check_servable(rank, self.options["kernel"], model_config.quantization, zero_copy=False)
            quantized = model_config.quantization is not None
            named = not quantized and sharding.family_of(Checkpoint(rank.path, validate=False).config) is not None
            w = self._attach(rank, "vllm" if named else "hf")
        try:
            if w.manifest.key.get("naming") == "vllm":
                self._copy_into(model, w)
            else:
                loaded = model.load_weights(self._weights(rank.path, w))
                self._track(model, model_config, loaded)
            self._log_attached(rank, w, AttachMode.COPY.value, t0)
        finally:
            # copy mode: every byte now lives in vLLM's parameters; end the lease.
            w.close()

    # --- shared ----------------------------------------------------------------------------

    def _target(self, vllm_config: VllmConfig) -> torch.device:
        """The device vLLM loads onto (``load_config.device``, else the device config's)."""
        return torch.device(vllm_config.load_config.device or vllm_config.device_config.device)

    def _rank(self, model_config: ModelConfig, dev: torch.device) -> _Rank:
        if dev.type == "cpu":
            device, gpu = "cpu", self.options["gpu"] or 0
        elif dev.type == "cuda":
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            device, gpu = f"cuda:{index}", self.options["gpu"]
            if gpu is None:
                gpu = physical_gpu(index, os.environ.get("CUDA_VISIBLE_DEVICES"))
        else:
            raise ConfigError(f"load format {LOAD_FORMAT!r} supports cpu and cuda devices, the model is on {dev}",
                              key="device")
        return _Rank(checkpoint_dir(model_config), get_tensor_model_parallel_world_size(),
                     get_tensor_model_parallel_rank(), device, gpu, dtype_name(model_config.dtype))

    def _attach(self, rank: _Rank, naming: str) -> Attachment:
        """:func:`weightcache.attach` of ``rank`` with this loader's options, ``fallback=False`` (vLLM's default
        loader is the plugin's fallback): ``retries`` retries unless the profiler's attach of this engine start
        spent them (:data:`_RETRIES_SPENT`: one attempt)."""
        o = self.options
        retries = 0 if rank in _RETRIES_SPENT else o["retries"]
        _RETRIES_SPENT.discard(rank)
        return attach(rank.path, tp_size=rank.tp_size, tp_rank=rank.tp_rank, device=rank.device, mode=AttachMode.ZERO_COPY,
                      fallback=False, timeout=float(o["timeout_s"]), socket_dir=o["socket_dir"], gpu=rank.gpu,
                      dtype=rank.dtype, naming=naming, kernel=o["kernel"],
                      retry=Retry(retries=retries) if retries else None)

    def _log_attached(self, rank: _Rank, w: Attachment, mode: str, t0: float, **extra: Any) -> None:
        log.info("weightcache attached checkpoint=%s source=%s mode=%s tp_size=%d tp_rank=%d device=%s gpu=%s "
                 "dtype=%s naming=%s tensors=%d size_bytes=%d duration_ms=%.1f%s", rank.path, w.source, mode,
                 rank.tp_size, rank.tp_rank, rank.device, rank.gpu, rank.dtype, w.manifest.key.get("naming"),
                 len(w.tensors), w.manifest.slab_size_bytes, (time.monotonic() - t0) * 1e3,
                 "".join(f" {k}={v}" for k, v in extra.items()))

    def _weights(self, path: str, w: Attachment) -> Iterator[tuple[str, torch.Tensor]]:
        ck_shapes: dict[str, tuple[int, ...]] = {}
        if any(lay.get("scheme") for lay in w.layouts.values()):  # a scheme processed some tensor
            ck_shapes = {n: tuple(i.shape) for n, i in Checkpoint(path).tensors.items()}
        for name, tensor in w.tensors.items():
            # A private copy per tensor: a model's load_weights may write into
            # what it is given, and a shared view is read-only (a write would
            # fault). Peak extra memory is one tensor.
            yield name, checkpoint_form(name, tensor, w.layouts.get(name, {}), ck_shapes).clone()

    def _track(self, model: nn.Module, model_config: ModelConfig, loaded: set[str] | None) -> None:
        # The same strict check as vLLM's default loader: every parameter of an
        # unquantized model must have come from the checkpoint.
        if model_config.quantization is None and loaded is not None:
            plain = dataclasses.replace(self.load_config, load_format="auto", model_loader_extra_config={})
            DefaultModelLoader(plain).track_weights_loading(model, loaded, quantized=False)

    def _copy_into(self, model: nn.Module, w: Attachment) -> None:
        targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        targets.update(model.named_buffers(remove_duplicate=False))
        filled: set[int] = set()
        for name, tensor in w.tensors.items():
            dst = targets.get(name)
            if dst is None or tuple(dst.shape) != tuple(tensor.shape):
                raise ShapeMismatch(
                    f"attached tensor {name!r} {list(tensor.shape)} has no vLLM parameter of that name and shape "
                    f"(found {list(dst.shape) if dst is not None else None}); weightcache's vLLM naming for this "
                    f"architecture differs from this vLLM's model: use the default loader",
                    tensor=name, actual=list(tensor.shape))
            if id(dst) in filled:
                continue
            dst.data.copy_(tensor)
            filled.add(id(dst))
        zc.check_all_shared(model, filled)


def engine_lays_out(path: str) -> bool:
    """Whether only the engine can lay out the checkpoint at ``path`` in vLLM's layout whatever ``fallback`` says:
    its architecture has no vLLM naming rules in weightcache (:func:`weightcache.sharding.family_of`). Such a
    model is published by the engine that loads it (:meth:`WeightcacheModelLoader._load_published`); so are, with
    ``fallback = true``, the other reasons :data:`.vllm_fallback.PATHS` sends there."""
    return sharding.family_of(Checkpoint(path, validate=False).config) is None


def _refuse_reload(*args: Any, **kwargs: Any) -> None:
    """``load_weights`` of a zero-copy model (vLLM's ``reload_weights``): refused.

    Raises:
        ConfigError (`config_invalid`): always.
    """
    raise ConfigError(
        f"reload_weights: the weights of this model are the weightcache service's read-only memory "
        f"(load format {LOAD_FORMAT!r}, mode 'zero_copy') and cannot be written; start the engine with "
        f"mode 'copy' to reload weights in place", key="mode")


def _drop_profiled(rank: _Rank) -> None:
    """Closes the attachment :meth:`WeightcacheModelLoader.get_external_weight_memory` kept for ``rank``, if any."""
    w = _PROFILED.pop(rank, None)
    if w is not None:
        w.close()


def _keep_lease(model: nn.Module, w: Attachment) -> None:
    """Ties the attachment (the lease) to ``model``: closed when the model is collected or at exit.

    The model's ``load_weights`` (what vLLM's ``reload_weights`` calls) is
    replaced by :func:`_refuse_reload`.
    """
    model._weightcache = w
    weakref.finalize(model, w.close)
    model.load_weights = _refuse_reload


def register() -> None:
    """Entry point of ``vllm.general_plugins``: registers load formats ``weightcache`` and ``weightcache_publish``.

    vLLM calls it in every process that loads plugins (engine, workers); a
    repeated call re-registers the same class.
    """
    register_model_loader(LOAD_FORMAT)(WeightcacheModelLoader)
    vllm_publish.register()  # load format weightcache_publish (issue 35): vLLM's own load, published
