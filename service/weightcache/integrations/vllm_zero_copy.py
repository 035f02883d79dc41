"""vLLM zero-copy: the model's parameters are the attachment's read-only tensors.

The steps :class:`weightcache.integrations.vllm.WeightcacheModelLoader` runs
in mode ``zero_copy``, modelled on vLLM 0.32's own weight-cache loader
(``vllm/model_executor/model_loader/weight_cache/ipc_loader.py``):

1. :func:`initialize_on_meta`: vLLM's ``initialize_model``, with every
   *uninitialised* allocation (``torch.empty*``, which is how vLLM's linear,
   embedding and quantized layers create their parameters) on the meta device.
   No parameter memory is allocated; what vLLM computes at construction
   (rotary ``cos_sin_cache``, attention ``_k_scale``/``_v_scale`` constants,
   RMSNorm weights of ones) is made on the device by vLLM's own code.
2. :func:`quant_refusal`: every quant method must declare
   ``supports_pre_processed_weights`` (vLLM 0.32: not ModelOpt FP8).
3. :func:`canary`: vLLM's own loading and processing of decoder layer 0 from
   the checkpoint, compared dtype, shape, stride and byte for byte with the
   slab's tensors of that layer.
4. :func:`share`: every attached tensor becomes the parameter or buffer of the
   same name on its owning module (``nn.Parameter(view, requires_grad=False)``;
   tied aliases are the same object under both names).
5. :func:`finish`: vLLM's ``process_weights_after_loading`` inside
   ``weights_already_processed()`` (quant methods only rebuild Python-side
   state), then a check that nothing is left on meta.

On vLLM's CPU build, unquantized linears are repacked for oneDNN in
``process_weights_after_loading`` (a private copy, the shared weight dropped).
In zero-copy mode every layer gets ``_cpu_skip_gemm_dispatch`` (vLLM then uses
plain ``torch.nn.functional.linear`` on the shared weight), and the vocabulary
layers, whose method ignores that flag in 0.32, are set back to plain linear
after processing (their packed copy lives only during start-up). Plain linear
is slower than oneDNN on CPU; that is the price of sharing (docs/engines.md).

Forbidden imports: weightcache.daemon.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Iterator
import torch
from safetensors import safe_open
from torch import nn
from torch.overrides import TorchFunctionMode
from vllm.config import ModelConfig, VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.model_executor.utils import weights_already_processed

from ..checkpoint import Checkpoint
from ..client import Attachment
from ..errors import ShapeMismatch
from .params import private_names, register_tensors

log = init_logger("vllm." + __name__)

#: Factory functions whose result is uninitialised memory: sent to the meta device by :class:`EmptyOnMeta`.
_UNINITIALISED = frozenset({torch.empty, torch.empty_strided, torch.empty_like})

#: vLLM features that write into weights after loading: (name, predicate on the VllmConfig).
WRITING_FEATURES: tuple[tuple[str, Callable[[VllmConfig], bool]], ...] = (
    ("LoRA (enable_lora)", lambda c: c.lora_config is not None),
    ("sleep mode (enable_sleep_mode: weight offload)", lambda c: bool(c.model_config.enable_sleep_mode)),
    ("weight transfer (weight_transfer_config: in-place weight updates)",
     lambda c: getattr(c, "weight_transfer_config", None) is not None),
)

#: The decoder layer the canary processes: the first one.
_CANARY_LAYER = re.compile(r"^(.*\.layers\.0)\.")


class EmptyOnMeta(TorchFunctionMode):
    """Places every ``torch.empty``/``empty_strided``/``empty_like`` on the meta device.

    Anything else (``torch.ones``, ``arange``, ``tensor``...) stays on the
    device of the enclosing ``torch.device`` context: those are values vLLM
    computes, not storage waiting for a checkpoint.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _UNINITIALISED:
            kwargs = {**(kwargs or {}), "device": "meta"}
        return func(*args, **(kwargs or {}))


def writing_features(vllm_config: VllmConfig) -> list[str]:
    """The enabled vLLM features that write into weights (see :data:`WRITING_FEATURES`)."""
    return [name for name, enabled in WRITING_FEATURES if enabled(vllm_config)]


def initialize_on_meta(vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
                       device: torch.device) -> nn.Module:
    """vLLM's ``initialize_model`` with uninitialised storage on meta, computed buffers on ``device``.

    Call inside ``set_default_torch_dtype(model_config.dtype)``.

    Returns:
        `nn.Module`: parameters created with ``torch.empty`` are meta tensors
        of vLLM's own classes (``ModelWeightParameter``...) with their loader
        attributes; they take no memory.
    """
    with device, EmptyOnMeta():
        return initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)


def registry_undo(vllm_config: VllmConfig) -> Callable[[], None]:
    """A function that unregisters the layers a model registers from now on (for a model thrown away).

    vLLM's layers register themselves by name in the compilation config
    (``static_forward_context``: attention layers, which get KV cache;
    ``static_all_moe_layers``). When zero-copy is refused the meta model is
    dropped and vLLM builds another one under the same names.
    """
    cc = vllm_config.compilation_config
    keys, moe = set(cc.static_forward_context), len(cc.static_all_moe_layers)

    def undo() -> None:
        for key in set(cc.static_forward_context) - keys:
            del cc.static_forward_context[key]
        del cc.static_all_moe_layers[moe:]

    return undo


def quant_refusal(model: nn.Module) -> str | None:
    """Why the installed vLLM cannot take ``model``'s weights pre-processed, or ``None``.

    Every module's quant method must declare ``supports_pre_processed_weights``
    (vLLM 0.32: unquantized linears and embeddings, ``Fp8``, ModelOpt FP4 and
    MXFP8 do; ModelOpt FP8 does not).
    """
    for name, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if isinstance(qm, QuantizeMethodBase) and not qm.supports_pre_processed_weights:
            return (f"layer {name or '<root>'}: {type(qm).__name__} of this vLLM does not support pre-processed "
                    f"weights (supports_pre_processed_weights is false)")
    return None


def share(model: nn.Module, w: Attachment, check_shapes: bool) -> set[int]:
    """Registers every attached tensor as the parameter or buffer of the same name.

    :func:`weightcache.integrations.params.register_tensors` on vLLM's names
    (``naming = "vllm"``): parameters become ``nn.Parameter(view,
    requires_grad=False)``, tied aliases one object.

    Args:
        model (`nn.Module`): from :func:`initialize_on_meta`.
        w (`Attachment`): ``naming = "vllm"`` tensors of this rank.
        check_shapes (`bool`): require each tensor's dtype and shape to be the
            meta placeholder's (unquantized models; processed quantized
            tensors differ from the placeholders by design and are checked by
            the :func:`canary`).

    Returns:
        `set[int]`: ``id()`` of every registered parameter and buffer.

    Raises:
        ShapeMismatch (`shape_mismatch`): a tensor with no parameter or buffer
            of its name, or (``check_shapes``) of another dtype or shape;
            nothing is registered then.
    """
    reg = register_tensors(model, w.tensors, check="dtype_shape" if check_shapes else "none",
                           source="the attachment (naming = \"vllm\")",
                           hint="the service's layout does not fit this vLLM's model (another dtype, layout or "
                                "version): use mode \"copy\"")
    return set(reg.shared_ids)


def check_all_shared(model: nn.Module, shared: set[int]) -> None:
    """Every parameter must be one of ``shared`` (the default loader's strict check).

    Zero-copy checks an unquantized model's parameters against the attached
    tensors; copy mode (``naming = "vllm"``) against the parameters it filled.

    Raises:
        ShapeMismatch (`shape_mismatch`): parameters vLLM initialised itself
            (e.g. a norm of ones) that the checkpoint does not hold.
    """
    missing = private_tensors(model, shared)
    if missing:
        raise ShapeMismatch(
            f"vLLM parameters {missing[:5]} ({len(missing)} in all) got no tensor from the attachment; the "
            f"checkpoint does not hold them, or the service's layout does not cover this model", tensor=missing[0])


def private_tensors(model: nn.Module, shared: set[int]) -> list[str]:
    """Names of parameters that vLLM's processing replaced by private tensors (not shared)."""
    return private_names(model, shared)


def mark_plain_cpu_linear(model: nn.Module) -> None:
    """Sets ``_cpu_skip_gemm_dispatch`` on every layer with a quant method (vLLM's CPU build only).

    vLLM's CPU ``process_weights_after_loading`` then keeps the shared weight
    and uses ``torch.nn.functional.linear`` instead of repacking it for oneDNN.
    """
    for module in model.modules():
        if getattr(module, "quant_method", None) is not None:
            module._cpu_skip_gemm_dispatch = True


def _unpack_cpu_linears(model: nn.Module, shared: set[int]) -> list[str]:
    """Sets layers that vLLM packed anyway (0.32: vocabulary layers) back to plain linear on the shared weight."""
    fixed = []
    for name, module in model.named_modules():
        fn = getattr(module, "cpu_linear", None)
        weight = module._parameters.get("weight")
        if fn is not None and fn is not torch.nn.functional.linear and weight is not None and id(weight) in shared:
            module.cpu_linear = torch.nn.functional.linear
            fixed.append(name)
    return fixed


def finish(model: nn.Module, model_config: ModelConfig, device: torch.device, shared: set[int],
           plain_cpu: bool) -> None:
    """Runs vLLM's processing in pre-processed mode, then checks that nothing is left on meta.

    Args:
        shared (`set[int]`): from :func:`share`.
        plain_cpu (`bool`): vLLM's CPU build in zero-copy mode (see the module docstring).

    Raises:
        ShapeMismatch (`shape_mismatch`): a parameter or buffer still on meta
            (vLLM expects a tensor the checkpoint does not hold and vLLM does
            not compute).
    """
    with weights_already_processed():
        process_weights_after_loading(model, model_config, device)
    if plain_cpu:
        fixed = _unpack_cpu_linears(model, shared)
        if fixed:
            log.debug("weightcache plain cpu linear layers=%s", fixed)
    left = [n for n, t in _tensors(model) if t.is_meta]
    if left:
        raise ShapeMismatch(
            f"vLLM tensors {left[:5]} ({len(left)} in all) are still on the meta device after loading: the "
            f"checkpoint does not hold them and vLLM does not compute them; use mode \"copy\"", tensor=left[0])


def _tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters, buffers and plain tensor attributes (workspaces) of every module."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)
    for module_name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield f"{module_name}.{attr}", value


@dataclasses.dataclass(frozen=True)
class CanaryDiff:
    """The first difference the :func:`canary` found.

    Attributes:
        tensor (`str`): vLLM's name of the layer or tensor, e.g.
            ``model.layers.0.self_attn.qkv_proj.weight``.
        reason (`str`): ``canary: layer L field F: what differs``.
    """

    tensor: str
    reason: str


def canary(vllm_config: VllmConfig, model_config: ModelConfig, prefix: str, ck: Checkpoint, w: Attachment,
           device: torch.device, plain_cpu: bool) -> CanaryDiff | None:
    """vLLM's own loading and processing of decoder layer 0, compared with the slab.

    A second model is built on meta (:func:`_private_registries`: its
    attention layers do not join the engine's forward context); the
    parameters of layer 0 are materialised on ``device`` (vLLM's
    ``materialize_meta_tensor``: same classes and loader attributes), filled
    by the model's own ``load_weights`` from the checkpoint's tensors of that
    layer (read with safetensors), and each quantized or linear module of
    the layer is processed by its quant method's
    ``process_weights_after_loading``. Every parameter and buffer of those
    modules is then compared with the slab's tensor of the same name: dtype,
    shape, stride, bytes; so is every tensor the slab holds for them
    (buffers vLLM computes for itself and the slab lacks are not
    compared). Transient memory: one decoder layer.

    Call inside ``set_default_torch_dtype(model_config.dtype)``.

    Returns:
        `CanaryDiff | None`: the first difference (layer, field, vLLM's
        value, the slab's), or ``None`` when the layer is identical.
    """
    probe = initialize_on_meta(_private_registries(vllm_config), model_config, prefix, device)
    modules = dict(probe.named_modules())
    layer = next((m.group(1) for n in modules if (m := _CANARY_LAYER.match(n + "."))), None)
    if layer is None:
        return CanaryDiff("", "canary: the model has no decoder layer named '*.layers.0'")
    with device:
        for module_name, module in modules.items():
            if not module_name.startswith(layer + "."):
                continue
            for leaf, t in list(module._parameters.items()):
                if t is not None and t.is_meta:
                    module._parameters[leaf] = materialize_meta_tensor(t)
    names = [n for n in ck.tensors if n.startswith(layer + ".")]
    if not names:
        return CanaryDiff(layer, f"canary: the checkpoint has no tensor of {layer}")
    probe.load_weights(_read(ck, names, device))
    checked = []
    for module_name, module in modules.items():
        qm = getattr(module, "quant_method", None)
        if not module_name.startswith(layer + ".") or not isinstance(qm, QuantizeMethodBase):
            continue
        if plain_cpu:
            module._cpu_skip_gemm_dispatch = True
        qm.process_weights_after_loading(module)
        checked.append(module_name)
        slab_leaves = {n[len(module_name) + 1:] for n in w.tensors if n.rpartition(".")[0] == module_name}
        for leaf in sorted(set(module._parameters) | slab_leaves):
            mine = module._parameters.get(leaf)
            mine = mine if mine is not None else module._buffers.get(leaf)
            diff = _compare(mine, w.tensors.get(f"{module_name}.{leaf}"))
            if diff:
                return CanaryDiff(f"{module_name}.{leaf}", f"canary: layer {module_name} field {leaf}: {diff}")
    if not checked:
        return CanaryDiff(layer, f"canary: {layer} has no layer with a quant method")
    log.debug("weightcache canary passed layers=%s", checked)
    return None


def _private_registries(vllm_config: VllmConfig) -> VllmConfig:
    """A shallow copy of ``vllm_config`` whose compilation config has empty layer registries.

    The probe model is built while the engine's meta model exists: on the
    engine's own config its layers would collide with that model's
    (``Duplicate layer name``, see :func:`registry_undo`).
    """
    cc = copy.copy(vllm_config.compilation_config)
    cc.static_forward_context = {}
    cc.static_all_moe_layers = []
    out = copy.copy(vllm_config)
    out.compilation_config = cc
    return out


def _read(ck: Checkpoint, names: list[str], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(ck.tensors[n].file, []).append(n)
    for file, file_names in by_file.items():
        with safe_open(str(ck.path / file), framework="pt", device="cpu") as f:
            for n in file_names:
                yield n, f.get_tensor(n).to(device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def _compare(mine: torch.Tensor | None, slab: torch.Tensor | None) -> str | None:
    if mine is None:
        return None if slab is None else "the slab holds it, vLLM's processing does not"
    if slab is None:
        return "vLLM's processing keeps it, the slab does not hold it"
    for what, a, b in (("dtype", mine.dtype, slab.dtype), ("shape", tuple(mine.shape), tuple(slab.shape)),
                       ("stride", mine.stride(), slab.stride())):
        if a != b:
            return f"{what} {a} from vLLM's processing, {b} in the slab"
    if not torch.equal(_bytes(mine), _bytes(slab)):
        return "bytes differ between vLLM's processing and the slab"
    return None
