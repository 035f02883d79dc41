"""vLLM model loader ``weightcache``: the rank's weights come from the node's service.

Usage (the plugin is found through the ``vllm.general_plugins`` entry point,
so it is active in the engine process and in every worker)::

    vllm serve /srv/models/Llama-3.1-8B --load-format weightcache \\
        --model-loader-extra-config '{"socket_dir": "/run/weightcache", "fallback": true, "mode": "copy"}'

    LLM(model=path, load_format="weightcache",
        model_loader_extra_config={"fallback": False})

vLLM builds the model as usual (its own parameters, on its own device); this
loader attaches the rank's tensors with :func:`weightcache.attach` (tensor
parallel size and rank from vLLM's parallel state, the device from the
model's parameters) and feeds them to the model, after which vLLM's own
``process_weights_after_loading`` runs unchanged:

- ``tp_size == 1``: tensors with checkpoint (Hugging Face) names go through
  ``model.load_weights``, exactly like vLLM's default loader. Tensors the
  service stored in a kernel layout (ModelOpt FP8: transposed, padded) are
  given back in checkpoint form (a view, then a private copy), as the
  ``layouts`` metadata describes.
- ``tp_size > 1``: the service holds the rank's shard in vLLM's naming
  (fused ``qkv_proj``/``gate_up_proj``, padded vocabulary), which is copied
  straight into the parameters of the same name and shape, as vLLM's
  ``ShardedStateLoader`` does; unquantized checkpoints only.

Extra config keys (anything else is an error):

=============  ===============  =====================================================
key            default          meaning
=============  ===============  =====================================================
socket_dir     ``None``         service socket directory (else ``$WEIGHTCACHE_SOCKET_DIR``,
                                else ``/run/weightcache``)
fallback       ``true``         load from disk through weightcache's pipeline when the
                                service cannot serve (the reason is logged)
mode           ``"copy"``       ``copy``: vLLM's parameters are its own memory, filled from
                                the attachment. ``zero_copy`` is designed (docs/engines.md)
                                but not shipped: rejected
timeout_s      ``30``           seconds to wait for the service (a load in progress included)
gpu            derived          service instance; default: the physical index of the
                                model's CUDA device (``CUDA_VISIBLE_DEVICES``), 0 on CPU
dtype          ``"auto"``       dtype to ask for (must match the service's config)
kernel         ``"cutlass"``    kernel layout target of quantized weights
=============  ===============  =====================================================

Log lines go to vLLM's logger tree (``vllm.weightcache...``) so that they show
in vLLM's own log: one ``weightcache attached`` line with ``source=daemon|disk``
and, on a disk fallback, a WARNING with the reason.

Forbidden imports: weightcache.daemon.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ..checkpoint import Checkpoint
from ..client import Attachment, attach, physical_gpu  # noqa: F401  (physical_gpu: re-exported)
from ..errors import ConfigError, ShapeMismatch

# vLLM attaches its handler to the "vllm" logger only; a child of it shows in
# vLLM's log with vLLM's format (getLogger(__name__) would be silent there).
log = init_logger("vllm." + __name__)

#: The ``--load-format`` value.
LOAD_FORMAT = "weightcache"

#: Extra config keys: name -> (accepted types, default).
EXTRA_CONFIG: dict[str, tuple[tuple[type, ...], Any]] = {
    "socket_dir": ((str, type(None)), None),
    "fallback": ((bool,), True),
    "mode": ((str,), "copy"),
    "timeout_s": ((int, float), 30.0),
    "gpu": ((int, type(None)), None),
    "dtype": ((str,), "auto"),
    "kernel": ((str,), "cutlass"),
}


def parse_extra_config(extra: dict[str, Any] | None) -> dict[str, Any]:
    """Validates ``--model-loader-extra-config`` for the ``weightcache`` format.

    Args:
        extra (`dict`, *optional*): the parsed JSON object.

    Returns:
        `dict`: every key of :data:`EXTRA_CONFIG`, defaults filled in.

    Raises:
        ConfigError (`config_invalid`): an unknown key, a value of the wrong
            type, an unknown ``mode``, or ``mode = "zero_copy"`` (not shipped).

    Example:
        >>> parse_extra_config({"fallback": False})["mode"]
        'copy'
    """
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(EXTRA_CONFIG))
    if unknown:
        raise ConfigError(
            f"--model-loader-extra-config for load format {LOAD_FORMAT!r}: unknown keys {unknown}; "
            f"accepted keys are {sorted(EXTRA_CONFIG)}", key=unknown[0])
    out: dict[str, Any] = {}
    for key, (types, default) in EXTRA_CONFIG.items():
        value = extra.get(key, default)
        # bool is an int subclass: reject True where a number or an index is expected.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ConfigError(
                f"--model-loader-extra-config for load format {LOAD_FORMAT!r}: {key} must be "
                f"{' or '.join(t.__name__ for t in types)}, got {value!r}", key=key)
        out[key] = value
    if out["mode"] == "zero_copy":
        raise ConfigError(
            f"--model-loader-extra-config for load format {LOAD_FORMAT!r}: mode 'zero_copy' is not available "
            f"for vLLM yet (it needs vLLM's pre-processed restore path, see docs/engines.md); use mode 'copy'",
            key="mode")
    if out["mode"] != "copy":
        raise ConfigError(
            f"--model-loader-extra-config for load format {LOAD_FORMAT!r}: mode must be 'copy', "
            f"got {out['mode']!r}", key="mode")
    if out["timeout_s"] <= 0:
        raise ConfigError(f"--model-loader-extra-config: timeout_s must be > 0, got {out['timeout_s']!r}",
                          key="timeout_s")
    return out


def checkpoint_form(name: str, tensor: torch.Tensor, layout: dict[str, Any],
                    ck_shapes: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """Gives a processed tensor back in the form its checkpoint stores (a view, no copy).

    vLLM's ``load_weights`` expects checkpoint tensors and re-processes them
    itself. For ModelOpt FP8 (``layout["view"] == "transpose"``) the service
    stores ``F8_E4M3`` ``[N_pad, K_pad]`` exposed as the ``[K_pad, N_pad]``
    view; the checkpoint form is its transpose cut to ``logical_shape``
    ``[N, K]``. A per-channel ``weight_scale`` (``layout["role"] ==
    "weight_scale"``) is ``F32`` ``[1, N_pad]``; its checkpoint form is the
    first ``logical_output_width`` values, reshaped to the checkpoint's shape
    (``[N]`` or ``[N, 1]``). Anything else is returned as is.

    Args:
        name (`str`): tensor name (checkpoint naming).
        tensor (`torch.Tensor`): the attached tensor.
        layout (`dict`): its manifest layout (``Attachment.layouts[name]``).
        ck_shapes (`dict`): checkpoint header shapes by name.

    Raises:
        ShapeMismatch (`shape_mismatch`): the result differs from the checkpoint's shape.
    """
    out = tensor
    if layout.get("view") == "transpose":
        n, k = layout["logical_shape"]
        out = tensor.t()[:n, :k]
    elif layout.get("role") == "weight_scale" and tensor.dim() == 2:
        n = int(layout["logical_output_width"])
        out = tensor[0, :n]
    want = ck_shapes.get(name)
    if want is not None and tuple(out.shape) != tuple(want):
        if out.numel() == _numel(want):
            out = out.reshape(want)
        else:
            raise ShapeMismatch(
                f"tensor {name!r}: attached layout gives {list(out.shape)}, the checkpoint stores {list(want)}; "
                f"the service's manifest and the checkpoint disagree (restart the service or evict the model)",
                tensor=name, expected=list(want), actual=list(out.shape))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class WeightcacheModelLoader(BaseModelLoader):
    """Model loader for ``--load-format weightcache`` (see the module docstring).

    Raises:
        ConfigError (`config_invalid`): bad extra config (at construction).
    """

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options = parse_extra_config(load_config.model_loader_extra_config)
        self.attachment: Attachment | None = None

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: the checkpoint is a local directory or served by name."""

    def get_external_weight_memory(self, vllm_config: Any) -> int:
        """0: in ``copy`` mode every weight lives in vLLM's own memory."""
        return 0

    def _device(self, model: nn.Module) -> tuple[str, int | None]:
        param = next(model.parameters(), None)
        dev = param.device if param is not None else torch.device("cpu")
        if dev.type == "cpu":
            return "cpu", self.options["gpu"]
        if dev.type != "cuda":
            raise ConfigError(f"load format {LOAD_FORMAT!r} supports cpu and cuda devices, the model is on {dev}",
                              key="device")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        gpu = self.options["gpu"]
        if gpu is None:
            gpu = physical_gpu(index, os.environ.get("CUDA_VISIBLE_DEVICES"))
        return f"cuda:{index}", gpu

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Attaches the rank's weights and loads them into ``model``.

        Raises:
            DaemonUnavailable, CacheKeyMismatch, ModelLoading, ... : from
                :func:`weightcache.attach` when ``fallback`` is false.
            UnsupportedQuantization (`unsupported_quantization`): always.
            ConfigError (`config_invalid`): ``tp_size > 1`` with a quantized model.
            ShapeMismatch (`shape_mismatch`): a tensor that fits no parameter.
        """
        o = self.options
        tp_size = get_tensor_model_parallel_world_size()
        tp_rank = get_tensor_model_parallel_rank()
        if tp_size > 1 and model_config.quantization is not None:
            raise ConfigError(
                f"load format {LOAD_FORMAT!r}: tensor parallelism (tp_size={tp_size}) with quantization "
                f"{model_config.quantization!r} is not supported yet; use tp_size 1 or the default loader",
                key="tensor_parallel_size")
        device, gpu = self._device(model)
        path = model_config.model_weights or model_config.model
        naming = "hf" if tp_size == 1 else "vllm"
        t0 = time.monotonic()
        w = attach(path, tp_size=tp_size, tp_rank=tp_rank, device=device, mode="zero_copy",
                   fallback=o["fallback"], timeout=float(o["timeout_s"]), socket_dir=o["socket_dir"], gpu=gpu,
                   dtype=o["dtype"], naming=naming, kernel=o["kernel"])
        try:
            if w.fallback_reason is not None:
                log.warning("weightcache fallback to disk checkpoint=%s tp_rank=%d reason=%s",
                            path, tp_rank, w.fallback_reason)
            if tp_size == 1:
                loaded = model.load_weights(self._weights(path, w))
                self._track(model, model_config, loaded)
            else:
                self._copy_into(model, w)
            log.info("weightcache attached checkpoint=%s source=%s tp_size=%d tp_rank=%d device=%s gpu=%s "
                     "tensors=%d size_bytes=%d duration_ms=%.1f", path, w.source, tp_size, tp_rank, device, gpu,
                     len(w.tensors), w.resident_bytes, (time.monotonic() - t0) * 1e3)
        finally:
            # copy mode: every byte now lives in vLLM's parameters; end the lease.
            w.close()

    def _weights(self, path: str, w: Attachment) -> Iterator[tuple[str, torch.Tensor]]:
        ck_shapes: dict[str, tuple[int, ...]] = {}
        if any(lay.get("view") or lay.get("role") for lay in w.layouts.values()):
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
                    f"(found {list(dst.shape) if dst is not None else None}); this architecture's tensor-parallel "
                    f"naming differs from vLLM's: use tp_size 1 or the default loader",
                    tensor=name, actual=list(tensor.shape))
            if id(dst) in filled:
                continue
            dst.data.copy_(tensor)
            filled.add(id(dst))
        missing = sorted(n for n, p in model.named_parameters() if id(p) not in filled)
        if missing:
            raise ShapeMismatch(
                f"vLLM parameters {missing[:5]} ({len(missing)} in all) got no tensor from the attachment; "
                f"the service's layout does not cover this model", tensor=missing[0])


def register() -> None:
    """Entry point of ``vllm.general_plugins``: registers load format ``weightcache``.

    vLLM calls it in every process that loads plugins (engine, workers); a
    repeated call re-registers the same class.
    """
    register_model_loader(LOAD_FORMAT)(WeightcacheModelLoader)
