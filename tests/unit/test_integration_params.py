"""integrations/params.py: attached tensors become a module tree's parameters and buffers.

A small torch tree built on the meta device (as engines build theirs): an embedding, a
norm, a head tied to the embedding, a buffer. The "attached" tensors are ``arange``
values, so every registered parameter can be compared with them byte for byte and by
storage (zero-copy: the parameter *is* the tensor's memory).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from weightcache.errors import ShapeMismatch
from weightcache.integrations.params import private_names, register_tensors

VOCAB, HIDDEN = 6, 4


class Tiny(nn.Module):
    def __init__(self, tie: bool = True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight  # the model's own tie: one placeholder under two names
        self.register_buffer("position_ids", torch.arange(8).reshape(1, 8))
        self.register_buffer("inv_freq", torch.ones(2), persistent=False)

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


def meta_tiny(tie: bool = True) -> Tiny:
    with torch.device("meta"):
        return Tiny(tie)


def weights() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.arange(VOCAB * HIDDEN, dtype=torch.float32).reshape(VOCAB, HIDDEN),
        "norm.weight": torch.full((HIDDEN,), 2.0),
        "norm.bias": torch.zeros(HIDDEN),
        "position_ids": torch.arange(8).reshape(1, 8) + 100,
    }


def test_parameters_are_the_attached_memory_read_only():
    model, w = meta_tiny(), weights()
    reg = register_tensors(model, w)
    for name in ("embed.weight", "norm.weight", "norm.bias"):
        p = model.get_parameter(name)
        assert isinstance(p, nn.Parameter) and p.requires_grad is False
        assert p.data_ptr() == w[name].data_ptr() and torch.equal(p, w[name])
        assert reg.parameters[name] is p and id(p) in reg.shared_ids
    assert model.position_ids is w["position_ids"] and reg.buffers == {"position_ids": w["position_ids"]}


def test_tied_head_follows_the_embedding_it_is_tied_to():
    model = meta_tiny(tie=True)
    reg = register_tensors(model, weights())
    assert model.head.weight is model.embed.weight
    assert reg.tied == {"head.weight": "embed.weight"}
    assert reg.parameters["head.weight"] is reg.parameters["embed.weight"]
    model.inv_freq = torch.ones(2)  # the engine's own buffer, computed after registration
    out = model(torch.tensor([[1, 5]]))
    assert out.shape == (1, 2, VOCAB) and not out.is_meta


def test_two_names_of_one_tensor_share_one_parameter():
    model, w = meta_tiny(tie=False), weights()
    w["head.weight"] = w["embed.weight"]  # a tied alias in the slab: the same tensor object
    reg = register_tensors(model, w)
    assert model.head.weight is model.embed.weight and reg.tied == {}
    assert len({id(p) for p in reg.parameters.values()}) == 3  # embed/head, norm.weight, norm.bias


def test_untied_model_keeps_its_own_head_private():
    model = meta_tiny(tie=False)
    reg = register_tensors(model, weights())
    assert model.head.weight.is_meta and "head.weight" in reg.private and reg.tied == {}
    assert "inv_freq" in reg.private  # a buffer the attachment does not hold stays the model's
    assert private_names(model, reg.shared_ids) == ["head.weight"]


def test_module_reachable_under_two_names_is_set_once():
    model = meta_tiny(tie=False)
    model.lm_head = model.embed  # vLLM's tie: the module itself under a second name
    reg = register_tensors(model, weights())
    assert model.lm_head.weight is model.embed.weight is reg.parameters["lm_head.weight"]
    assert reg.tied == {}


def test_a_name_missing_from_the_tree_is_shape_mismatch_and_nothing_is_registered():
    model, w = meta_tiny(), weights()
    w["layers.0.mlp.weight"] = torch.zeros(2)
    with pytest.raises(ShapeMismatch) as e:
        register_tensors(model, w, source="checkpoint /x")
    assert e.value.code == "shape_mismatch" and e.value.details["tensor"] == "layers.0.mlp.weight"
    assert model.embed.weight.is_meta and model.norm.weight.is_meta and model.position_ids.is_meta


def test_shape_and_dtype_checks():
    bad_shape = weights() | {"norm.weight": torch.ones(HIDDEN + 1)}
    with pytest.raises(ShapeMismatch) as e:
        register_tensors(meta_tiny(), bad_shape)
    assert e.value.details["tensor"] == "norm.weight"
    assert e.value.details["expected"] == [HIDDEN] and e.value.details["actual"] == [HIDDEN + 1]
    bad_dtype = weights() | {"norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    register_tensors(meta_tiny(), bad_dtype, check="shape")  # shape only: accepted
    with pytest.raises(ShapeMismatch):
        register_tensors(meta_tiny(), bad_dtype, check="dtype_shape")
    model = meta_tiny()
    register_tensors(model, bad_shape, check="none")  # processed tensors differ by design
    assert model.norm.weight.shape == (HIDDEN + 1,)


def test_private_names_lists_what_processing_replaced():
    model = meta_tiny()
    reg = register_tensors(model, weights())
    model.norm.weight = nn.Parameter(model.norm.weight.clone(), requires_grad=False)  # e.g. a repacked copy
    assert private_names(model, reg.shared_ids) == ["norm.weight"]
    assert private_names(model, reg.shared_ids, buffers=True) == ["norm.weight", "inv_freq"]


def test_the_registration_holds_every_object_whose_id_it_lists():
    """An id is unique only while its object lives: the registration holds each attached tensor and Parameter
    whose ``id()`` is in ``shared_ids``, so a copy the engine makes after the caller dropped its dict of tensors
    cannot take a freed tensor's id and pass for shared (``test_private_names_lists_what_processing_replaced``
    failed so, 1 run in 4, before)."""
    tensors = weights()
    reg = register_tensors(meta_tiny(), tensors)
    assert {id(t) for t in reg.shared} == set(reg.shared_ids)
    assert all(any(t is h for h in reg.shared) for t in tensors.values())
