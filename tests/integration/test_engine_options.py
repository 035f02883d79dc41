"""What an engine asks for is what it gets, or a typed error: attach options against a real service.

A model attached by name takes the dtype and naming the operator configured
when the engine leaves them out; a dtype or naming the engine gives is a
requirement (``model_not_found`` when the service holds the name otherwise),
never silently replaced by the operator's choice.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tiny_models import tiny_llama  # noqa: F401 (fixture)
from weightcache import attach, errors


@pytest.fixture
def vllm_named(daemon, tiny_llama):
    """A service holding the tiny float32 Llama as ``llama``, vLLM naming, float32."""
    svc = daemon({"llama": {"path": str(tiny_llama), "naming": "vllm", "dtype": "float32"}})
    svc.wait_settled()
    return svc


def test_by_name_without_options_is_the_operators_slab(vllm_named):
    with attach("llama", socket_dir=str(vllm_named.socket_dir), fallback=False) as w:
        assert (w.source, w.manifest.key["naming"]) == ("daemon", "vllm")
        assert "model.layers.0.self_attn.qkv_proj.weight" in w.tensors


@pytest.mark.parametrize("asked", [{"naming": "hf"}, {"dtype": "bfloat16"}, {"dtype": "float16", "naming": "vllm"}])
def test_by_name_an_option_the_slab_does_not_have_is_model_not_found(vllm_named, asked):
    # Before: the options were dropped for a name, and the engine got the vLLM-named float32 slab.
    for fallback in (False, True):  # a name has no disk fallback either way
        with pytest.raises(errors.ModelNotFound) as e:
            attach("llama", socket_dir=str(vllm_named.socket_dir), fallback=fallback, **asked)
        assert e.value.code == "model_not_found" and e.value.details["model"] == "llama"


@pytest.mark.parametrize("asked", [{"naming": "vllm"}, {"dtype": "float32", "naming": "vllm"},
                                   {"dtype": "auto"}])  # the checkpoint is float32: auto is the same bytes
def test_by_name_options_the_slab_has_attach(vllm_named, asked):
    with attach("llama", socket_dir=str(vllm_named.socket_dir), fallback=False, **asked) as w:
        assert (w.source, w.manifest.key["naming"]) == ("daemon", "vllm")
        assert w.tensors["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float32


def test_by_name_the_engine_must_see_the_checkpoint(daemon, tiny_llama, tmp_path):
    """The key check stat()s the files the service loaded: an engine that cannot see them is told so, by name."""
    copy = Path(shutil.copytree(tiny_llama, tmp_path / "llama"))
    svc = daemon({"llama": {"path": str(copy)}})
    svc.wait_settled()
    copy.rename(tmp_path / "elsewhere")  # as from an engine (a container) without that mount
    for fallback in (False, True):  # a name has no disk fallback
        with pytest.raises(errors.CheckpointNotFound) as e:
            attach("llama", socket_dir=svc.socket_dir, fallback=fallback)
        assert e.value.code == "checkpoint_not_found"
        assert e.value.details == {"model": "llama", "path": str(copy)}
