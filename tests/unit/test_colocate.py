"""weightcache.integrations.params.colocate: a model's storages moved into a few allocations, nothing else
changed (values, dtypes, shapes, strides, views, ties, Parameter objects and their attributes)."""

from __future__ import annotations

import torch
from torch import nn

from weightcache.integrations.params import colocate


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 24).to(torch.bfloat16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # a tie: one Parameter under two names
        base = torch.arange(40, dtype=torch.float32)
        self.register_buffer("cos", base[4:20].view(4, 4))  # a view at an offset into a larger storage
        self.register_buffer("sin", base[20:36].view(4, 4).t())  # another view of the same storage, transposed
        self.proj.weight.output_dim = 0  # an engine's attribute on the Parameter


def storages(m: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in m.state_dict(keep_vars=True).values()}


def test_colocate_keeps_every_value_view_tie_and_parameter():
    torch.manual_seed(0)
    m = Tiny()
    before = {n: (t.detach().clone(), t.stride(), t.dtype) for n, t in m.state_dict(keep_vars=True).items()}
    params = {n: p for n, p in m.named_parameters(remove_duplicate=False)}
    assert len(storages(m)) == 6  # embed (tied to head), proj x2, norm x2, one for both rotary views

    assert colocate(m, "cpu") == 1  # everything fits one default group

    assert len(storages(m)) == 1
    for n, t in m.state_dict(keep_vars=True).items():
        v, stride, dtype = before[n]
        assert t.dtype == dtype and t.stride() == stride, n
        assert torch.equal(t.detach(), v), n
    assert {n: p for n, p in m.named_parameters(remove_duplicate=False)} == params  # the same objects
    assert m.head.weight is m.embed.weight
    assert m.proj.weight.output_dim == 0
    assert m.cos.untyped_storage().data_ptr() == m.sin.untyped_storage().data_ptr()
    assert m.sin.storage_offset() - m.cos.storage_offset() == 16  # the two views keep their distance
    m.embed.weight.data[0, 0] = 7.0  # the tie is one storage: a write shows under both names
    assert m.head.weight[0, 0] == 7.0


def test_colocate_groups_and_large_tensors():
    m = nn.ModuleDict({f"l{i}": nn.Linear(64, 64, bias=False) for i in range(6)})  # 16 KiB each
    m["big"] = nn.Linear(256, 256, bias=False)  # 256 KiB: over a group, its own allocation
    assert colocate(m, "cpu", group_bytes=40 << 10) == 4  # big; then 2 + 2 + 2 of the 16 KiB ones
    assert len(storages(m)) == 4
    offsets = sorted(t.storage_offset() * t.element_size() for t in m.state_dict().values())
    assert all(o % 256 == 0 for o in offsets)


def test_colocate_leaves_other_devices_and_meta_alone():
    m = nn.Linear(4, 4)
    with torch.device("meta"):
        m.meta = nn.Linear(4, 4)
    assert colocate(m, "meta") == 0
    ptr = m.weight.data_ptr()
    assert colocate(m, "cuda:0") == 0  # nothing of it on that device
    assert m.weight.data_ptr() == ptr and m.meta.weight.is_meta
