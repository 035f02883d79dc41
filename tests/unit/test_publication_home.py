"""The publisher's home (issue 35's one-copy CUDA publication), checked on the CPU with torch: a freshly built
model moved by ``move_storages`` into one allocation laid out as ``pack``'s slab keeps every value, view, tie and
Parameter, and a later ``pack`` of the same model finds every copy already in place (what ``publish(home=...)``
checks before it hands the allocation to the service); a tensor the engine's processing replaced is not."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from weightcache.client import pack  # noqa: E402
from weightcache.client._publish import _in_place  # noqa: E402
from weightcache.integrations.params import move_storages  # noqa: E402


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 24).to(torch.bfloat16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # a tie: one Parameter under two names
        base = torch.arange(40, dtype=torch.float32)
        self.register_buffer("cos", base[4:20].view(4, 4))  # views at offsets of one storage, one transposed
        self.register_buffer("sin", base[20:36].view(4, 4).t())
        self.proj.weight.output_dim = 0  # an engine's attribute on the Parameter


def tensors_of(m: nn.Module) -> dict:
    out = {n: p.detach() for n, p in m.named_parameters(remove_duplicate=False)}
    out.update({n: b for n, b in m.named_buffers(remove_duplicate=False)})
    return out


def home_for(m: nn.Module) -> tuple[types.SimpleNamespace, torch.Tensor]:
    _, slab_bytes, copies = pack(tensors_of(m))
    size = -(-slab_bytes // (2 << 20)) * (2 << 20)
    dest = torch.full((size,), 0xEE, dtype=torch.uint8)
    assert move_storages(m, dest, copies) == 8  # 5 parameter names (one tied) + 2 buffers + the tie's alias
    return types.SimpleNamespace(ptr=dest.data_ptr(), size_bytes=size, granularity=2 << 20), dest


def test_a_moved_model_keeps_everything_and_is_in_place_for_publish():
    torch.manual_seed(0)
    m = Tiny()
    want = {n: (t.clone(), t.stride(), t.dtype) for n, t in tensors_of(m).items()}
    params = dict(m.named_parameters(remove_duplicate=False))
    home, dest = home_for(m)
    for n, t in tensors_of(m).items():
        v, stride, dtype = want[n]
        assert t.dtype == dtype and t.stride() == stride, n
        assert torch.equal(t, v), n
        assert t.untyped_storage().data_ptr() == dest.data_ptr(), n  # every tensor is in the home now
    assert dict(m.named_parameters(remove_duplicate=False)) == params  # the same Parameter objects
    assert m.head.weight is m.embed.weight and m.proj.weight.output_dim == 0
    records, slab_bytes, copies = pack(tensors_of(m))
    assert _in_place(copies, slab_bytes, home)
    # a write through one name of the tie shows under the other, and in the home's bytes
    m.embed.weight.data[0, 0] = 7.0
    assert m.head.weight[0, 0] == 7.0


def test_a_replaced_tensor_is_not_in_place_and_publish_stages():
    m = Tiny()
    home, _ = home_for(m)
    m.proj.weight.data = m.proj.weight.data.clone()  # the engine's processing made a new tensor
    _, slab_bytes, copies = pack(tensors_of(m))
    assert not _in_place(copies, slab_bytes, home)
    m2 = Tiny()
    home2, _ = home_for(m2)
    m2.extra = nn.Linear(512, 4096, bias=False)  # processing added weights: the slab outgrows the home
    _, slab_bytes, copies = pack(tensors_of(m2))
    assert not _in_place(copies, slab_bytes, home2)


def test_move_storages_refuses_a_plan_that_does_not_cover_a_tensor():
    m = Tiny()
    _, _, copies = pack(tensors_of(m))
    st, lo, dst, n = copies[0]
    short = [(st, lo, dst, n // 2), *copies[1:]]
    ptrs = {k: t.data_ptr() for k, t in tensors_of(m).items()}
    dest = torch.empty(1 << 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside every copied range"):
        move_storages(m, dest, short)
    assert {k: t.data_ptr() for k, t in tensors_of(m).items()} == ptrs  # nothing changed


def test_a_slab_that_shrank_below_its_home_is_not_in_place():
    # processing dropped a 4 MiB buffer at the slab's end: every other copy is still at its place in the home, but
    # the slab is now more than the VMM granularity (2 MiB) smaller than the home, which the service would copy whole: publish stages instead
    m = Tiny()
    m.register_buffer("table", torch.arange(1 << 20, dtype=torch.float32))  # 4 MiB, the last storage pack places
    home, dest = home_for_n(m, 9)
    kept = {n: t for n, t in tensors_of(m).items() if n != "table"}
    _, slab_bytes, copies = pack(kept)
    assert all(st.data_ptr() + src == home.ptr + dst for st, src, dst, _ in copies)  # each still at its place
    assert home.size_bytes - slab_bytes >= 2 << 20
    assert not _in_place(copies, slab_bytes, home)
    _, slab_bytes, copies = pack(tensors_of(m))
    assert _in_place(copies, slab_bytes, home)  # the slab it was laid out for


def home_for_n(m: nn.Module, moved: int) -> tuple[types.SimpleNamespace, torch.Tensor]:
    _, slab_bytes, copies = pack(tensors_of(m))
    size = -(-slab_bytes // (2 << 20)) * (2 << 20)
    dest = torch.zeros(size, dtype=torch.uint8)
    assert move_storages(m, dest, copies) == moved
    return types.SimpleNamespace(ptr=dest.data_ptr(), size_bytes=size, granularity=2 << 20), dest


def test_move_storages_refuses_a_shift_that_is_not_a_multiple_of_the_element_size():
    # a plan placing a float32 storage 2 bytes past a 4-byte boundary cannot be viewed as float32 there: refused,
    # nothing changed (not a view at a rounded offset, which would read other bytes)
    m = Tiny()
    _, _, copies = pack(tensors_of(m))
    before = {k: (t.data_ptr(), t.clone()) for k, t in tensors_of(m).items()}
    i = next(i for i, c in enumerate(copies) if c[0].data_ptr() == m.norm.weight.untyped_storage().data_ptr())
    st, lo, dst, n = copies[i]
    shifted = [*copies[:i], (st, lo, dst + 2, n), *copies[i + 1:]]
    dest = torch.zeros(1 << 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"'norm.weight' .* misaligned for its element size"):
        move_storages(m, dest, shifted)
    for k, t in tensors_of(m).items():
        assert t.data_ptr() == before[k][0] and torch.equal(t, before[k][1]), k
