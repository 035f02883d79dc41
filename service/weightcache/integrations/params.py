"""Attached tensors as a module tree's parameters and buffers: the engine-neutral step of zero-copy.

Every engine integration ends the same way: the engine builds its model with
placeholders (meta tensors, no memory), and each attached tensor must become
the parameter or buffer of the same name on the module that owns it.
:func:`register_tensors` does that once for every engine:

- a name the tree holds as a parameter becomes
  ``nn.Parameter(tensor, requires_grad=False)`` (a zero-copy tensor is a
  read-only view: no gradient, no in-place update); any other name the tree
  holds (a buffer) becomes the tensor itself;
- names tied to one object share one object: two attached names of one
  tensor (a tied alias in the slab) get one ``Parameter``, a module reachable
  under two names (vLLM's ``lm_head = embed_tokens``) is set once, and a
  parameter the tree ties to another (the same placeholder under both
  names) follows it when the attachment holds only one of them;
- every name and (on request) every dtype and shape is checked before the
  tree is touched: on error nothing is registered;
- it returns what is shared and what was left private (the tree's own
  tensors, still placeholders or computed by the engine).

A new engine integration is then one file in ``integrations/``: build the
model on meta, :func:`register_tensors`, run the engine's own post-processing,
check :func:`private_names`. Torch is imported here and in the engine
integrations only, never by the service.

Forbidden imports: weightcache.daemon, weightcache.client, vllm, transformers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

import torch
from torch import nn

from ..errors import ShapeMismatch

#: What :func:`register_tensors` compares with the placeholder before registering.
Check = Literal["none", "shape", "dtype_shape"]


@dataclasses.dataclass(frozen=True)
class Registration:
    """What :func:`register_tensors` did to a module tree.

    Attributes:
        parameters (`dict[str, nn.Parameter]`): every tree name now holding
            an attached tensor as a parameter (tied names: the same object),
            e.g. ``model.embed_tokens.weight`` -> ``Parameter`` of an
            ``F32`` ``(vocab_size, hidden_size)`` view.
        buffers (`dict[str, torch.Tensor]`): every tree name now holding an
            attached tensor as a buffer (the tensor itself).
        tied (`dict[str, str]`): tree names the attachment does not hold that
            got a tensor because the tree ties them to a name it does hold
            (``lm_head.weight`` -> ``model.embed_tokens.weight``).
        private (`tuple[str, ...]`): tree names of parameters and
            buffers that got no attached tensor (still the engine's own:
            placeholders to fill, or values the engine computed).
        shared_ids (`frozenset[int]`): ``id()`` of every registered
            ``Parameter`` and of every attached tensor; what
            :func:`private_names` compares with after the engine's processing.
            The registration holds those objects (``shared``), so that no id in
            the set can be reused by a tensor the engine creates later (a repacked
            copy given a freed attached tensor's id would pass for shared).
    """

    parameters: dict[str, nn.Parameter]
    buffers: dict[str, torch.Tensor]
    tied: dict[str, str]
    private: tuple[str, ...]
    shared_ids: frozenset[int]
    shared: tuple[torch.Tensor, ...] = dataclasses.field(default=(), repr=False)


@dataclasses.dataclass
class _Slot:
    module: nn.Module
    leaf: str
    is_param: bool
    old: torch.Tensor | None


def _slots(root: nn.Module) -> dict[str, _Slot]:
    """Every parameter and buffer name of the tree (module aliases included) -> where it lives."""
    out: dict[str, _Slot] = {}
    for prefix, module in root.named_modules(remove_duplicate=False):
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for leaf, t in table.items():
                out[f"{prefix}.{leaf}" if prefix else leaf] = _Slot(module, leaf, is_param, t)
    return out


def register_tensors(root: nn.Module, tensors: Mapping[str, torch.Tensor], *, check: Check = "shape",
                     source: str = "the attachment", hint: str = "") -> Registration:
    """Registers each of ``tensors`` as the parameter or buffer of the same name in ``root``'s tree.

    Args:
        root (`nn.Module`): the model, typically built on the meta device;
            its parameters and buffers (placeholders) name the slots.
        tensors (`Mapping[str, torch.Tensor]`): tree name -> tensor (an
            attachment's tensors, renamed to the tree's names where the
            engine's names differ). Two names of one tensor object are a tie.
        check (`str`, *optional*, defaults to ``"shape"``): compare each
            tensor with the placeholder it replaces: ``"shape"``,
            ``"dtype_shape"`` or ``"none"`` (processed quantized tensors
            differ from their placeholders by design).
        source (`str`, *optional*): what the tensors are, for error messages
            (``"checkpoint /srv/models/x"``).
        hint (`str`, *optional*): the fix, appended to error messages.

    Returns:
        `Registration`: parameters, buffers, ties followed, private names and
        the ids of what is shared.

    Raises:
        ShapeMismatch (`shape_mismatch`): a name the tree holds no parameter
            or buffer of, or (``check``) a tensor whose shape or dtype differs
            from its placeholder's. Raised before any registration.

    Example:
        >>> m = nn.Linear(2, 2, bias=False, device="meta")
        >>> r = register_tensors(m, {"weight": torch.eye(2)})
        >>> m.weight is r.parameters["weight"], r.private
        (True, ())
    """
    slots = _slots(root)
    kind = type(root).__name__
    for name, t in tensors.items():
        slot = slots.get(name)
        if slot is None:
            raise ShapeMismatch(f"{source}: tensor {name!r} has no parameter or buffer of that name in {kind}; "
                                f"{hint or 'the tensor names do not fit this model'}", tensor=name)
        old = slot.old
        if old is None or check == "none":
            continue
        if tuple(old.shape) != tuple(t.shape) or (check == "dtype_shape" and old.dtype != t.dtype):
            raise ShapeMismatch(
                f"{source}: tensor {name!r} is {t.dtype} {list(t.shape)}, {kind}.{name} expects {old.dtype} "
                f"{list(old.shape)}; {hint or 'the tensors do not fit this model'}",
                tensor=name, expected=list(old.shape), actual=list(t.shape))

    by_tensor: dict[int, nn.Parameter] = {}  # id(attached tensor) -> its Parameter: tied names share it
    parameters: dict[str, nn.Parameter] = {}
    buffers: dict[str, torch.Tensor] = {}
    replaced: dict[int, tuple[str, nn.Parameter]] = {}  # id(placeholder) -> (name, what replaced it)
    for name, t in tensors.items():
        slot = slots[name]
        if slot.is_param:
            p = by_tensor.get(id(t))
            if p is None:
                p = by_tensor[id(t)] = nn.Parameter(t, requires_grad=False)
            slot.module._parameters[slot.leaf] = parameters[name] = p
            if slot.old is not None:
                replaced.setdefault(id(slot.old), (name, p))
        else:
            slot.module._buffers[slot.leaf] = buffers[name] = t

    tied: dict[str, str] = {}
    for name, slot in slots.items():
        if name in tensors or not slot.is_param or slot.old is None or id(slot.old) not in replaced:
            continue
        if slot.module._parameters.get(slot.leaf) is slot.old:  # not already set through a module alias
            src, p = replaced[id(slot.old)]
            slot.module._parameters[slot.leaf] = parameters[name] = p
            tied[name] = src
        else:
            parameters[name] = slot.module._parameters[slot.leaf]
    held = (*by_tensor.values(), *tensors.values())  # kept alive with the registration: their ids stay theirs
    shared = frozenset(id(t) for t in held)
    return Registration(parameters=parameters, buffers=buffers, tied=tied,
                        private=tuple(private_names(root, shared, buffers=True, remove_duplicate=False)),
                        shared_ids=shared, shared=held)


def private_names(root: nn.Module, shared_ids: frozenset[int] | set[int], *, buffers: bool = False,
                  remove_duplicate: bool = True) -> list[str]:
    """Names of ``root``'s parameters (and ``buffers``) that are not among ``shared_ids``, in tree order.

    After an engine's post-processing this lists the tensors it replaced by
    private ones (e.g. a repacked weight): what does not come from the
    attachment's memory.

    Args:
        root (`nn.Module`): the model.
        shared_ids: ``Registration.shared_ids`` (or any set of ``id()``).
        buffers (`bool`, *optional*, defaults to ``False``): include buffers.
        remove_duplicate (`bool`, *optional*, defaults to ``True``): one name
            per object (``named_parameters``' default) or every alias.
    """
    found = list(root.named_parameters(remove_duplicate=remove_duplicate))
    if buffers:
        found += list(root.named_buffers(remove_duplicate=remove_duplicate))
    return [n for n, t in found if id(t) not in shared_ids]


#: Bytes of one allocation :func:`colocate` fills (a tensor larger than this gets one of its own).
COLOCATE_GROUP_BYTES = 1 << 30
#: Free bytes :func:`colocate` leaves on the device beside the allocation it makes.
COLOCATE_MARGIN_BYTES = 1 << 30


def colocate(root: nn.Module, device: torch.device | str, *, group_bytes: int = COLOCATE_GROUP_BYTES,
             margin_bytes: int = COLOCATE_MARGIN_BYTES) -> int:
    """Moves the storage of every parameter and buffer of ``root`` on ``device`` into a few large allocations
    (each about ``group_bytes``), keeping every value, dtype, shape, stride, view and tie, and each
    ``Parameter`` object with its attributes (only its ``.data`` changes).

    Why: a publisher whose weights lie in a few allocations hands the service a few CUDA IPC handles, and the
    service copies straight from them (one copy, each tensor's digest in the same pass); torch's caching
    allocator gives each weight of more than 10 MB a ``cudaMalloc`` of its own, and the service pays about
    0.04 ms to open each (1,200 of them: 50 ms, five copies of 15 GB on an H100; benchmarks/RESULTS.md). Run on
    an engine's freshly built model, before its checkpoint is read into it: the copy here is then of the
    initial values, outside the publication's time.

    Storages are moved one group at a time and the old ones dropped as each group is filled, so the device
    needs room for one group beside the model (``group_bytes`` + ``margin_bytes`` free; a larger tensor: its
    own size). Tensors that share a storage (views, ties) stay views of one new storage. Storage offsets are
    kept 256-byte aligned.

    Args:
        root (`nn.Module`): the model (changed in place).
        device (`torch.device | str`): only storages on this device move (``cuda:N``; on ``cpu`` too, for tests).
        group_bytes (`int`, *optional*): bytes per allocation.
        margin_bytes (`int`, *optional*): free bytes a CUDA device must keep beside a new allocation.

    Returns:
        `int`: the number of allocations now holding the moved storages; 0 when nothing moved (nothing on
        ``device``, or a CUDA device without room for the first group: the model is left as it was).
    """
    device = torch.device(device)
    slots = _slots(root)
    by_storage: dict[int, list[tuple[_Slot, torch.Tensor]]] = {}
    nbytes: dict[int, int] = {}
    for slot in slots.values():
        t = slot.old
        if t is None or t.device != device or t.is_meta:
            continue
        st = t.untyped_storage()
        key = st.data_ptr()
        if key == 0:
            continue
        by_storage.setdefault(key, []).append((slot, t))
        nbytes[key] = st.nbytes()
    if not by_storage:
        return 0

    def pad(n: int) -> int:
        return -(-n // 256) * 256

    groups: list[list[int]] = [[]]
    size = 0
    for key in sorted(by_storage, key=lambda k: nbytes[k], reverse=True):
        if groups[-1] and size + pad(nbytes[key]) > group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += pad(nbytes[key])
    made = 0
    for keys in groups:
        total = sum(pad(nbytes[k]) for k in keys)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            if free < total + margin_bytes and made == 0:
                return 0
        home = torch.empty(total, dtype=torch.uint8, device=device)
        hs = home.untyped_storage()
        pos = 0
        for k in keys:
            entries = by_storage.pop(k)
            old = entries[0][1].untyped_storage()
            home[pos:pos + nbytes[k]].copy_(torch.empty(0, dtype=torch.uint8, device=device).set_(old))
            for slot, t in entries:
                esize = t.element_size()
                view = torch.empty(0, dtype=t.dtype, device=device).set_(
                    hs, pos // esize + t.storage_offset(), t.size(), t.stride())
                if slot.is_param:
                    slot.module._parameters[slot.leaf].data = view
                else:
                    slot.module._buffers[slot.leaf] = view
            pos += pad(nbytes[k])
            del entries, old
        made += 1
        del home, hs
    return made
