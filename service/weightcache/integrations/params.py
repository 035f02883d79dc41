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


def move_storages(root: nn.Module, dest: torch.Tensor, copies: list[tuple[torch.UntypedStorage, int, int, int]]
                  ) -> int:
    """Copies byte ranges of storages into ``dest`` and points every parameter and buffer of ``root`` on those
    storages at ``dest`` instead, keeping each value, dtype, shape, stride, view and tie, and each ``Parameter``
    object with its attributes (only its ``.data`` changes).

    The publisher's side of an in-place publication: ``copies`` is :func:`weightcache.client.pack`'s plan of
    the model's tensors (``(storage, src_byte_offset, dst_byte_offset, size_bytes)``, one per storage), ``dest``
    an allocation laid out as that slab, so that a later ``pack`` of the same tensors finds each already at its
    place and the service can copy the allocation as it is.

    Args:
        root (`nn.Module`): the model (changed in place).
        dest (`torch.Tensor`): a 1-D ``uint8`` tensor covering every ``dst_byte_offset + size_bytes``, on the
            storages' device.
        copies (`list[tuple]`): as above; a storage's tensors must lie inside its copied range.

    Returns:
        `int`: the number of parameters and buffers now on ``dest``.

    Raises:
        ValueError: a tensor of a listed storage reaches outside its copied range, or a byte shift that is not a
            multiple of its element size (nothing is changed then).
    """
    where: dict[int, list[tuple[int, int, int]]] = {}  # a storage's copied ranges (unaligned views: one each)
    for st, lo, dst, n in copies:
        where.setdefault(st.data_ptr(), []).append((lo, dst, n))
    dst_storage = dest.untyped_storage()
    plan: list[tuple[_Slot, torch.Tensor, int]] = []
    for name, slot in _slots(root).items():
        t = slot.old
        if t is None or t.is_meta or t.device != dest.device:
            continue
        ranges = where.get(t.untyped_storage().data_ptr())
        if ranges is None:
            continue
        es = t.element_size()
        start = t.storage_offset() * es
        extent = 0 if 0 in t.shape else (1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride()))) * es
        inside = [r for r in ranges if r[0] <= start and start + extent <= r[0] + r[2] and (r[1] - r[0]) % es == 0]
        if not inside:
            raise ValueError(f"move_storages: {name!r} (bytes {start}..{start + extent} of its storage) is outside "
                             f"every copied range of its storage {[(r[0], r[0] + r[2]) for r in ranges]} or "
                             f"misaligned for its element size")
        lo, dst, n = inside[0]
        plan.append((slot, t, (dst - lo + start) // es))
    for st, lo, dst, n in copies:
        if n:
            src = torch.empty(0, dtype=torch.uint8, device=dest.device).set_(st)
            dest[dst:dst + n].copy_(src[lo:lo + n])
    for slot, t, offset in plan:
        view = torch.empty(0, dtype=t.dtype, device=dest.device).set_(dst_storage, offset, t.size(), t.stride())
        if slot.is_param:
            slot.module._parameters[slot.leaf].data = view
        else:
            slot.module._buffers[slot.leaf] = view
    return len(plan)
