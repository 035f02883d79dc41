"""Guard: the cache key's fields and values are pinned (issue 40; survivors of `make mutate` on identity.py).

The key is compared with keys written by earlier runs (the fd store's kept
manifests) and by the engine's own computation: a renamed field, a field
computed from another source, or a changed default is a format change that
must bump ``PIPELINE_VERSION``, not slip by because both sides changed alike.
These tests write each field out by hand for a tiny checkpoint, plain and
FP8, and check the paths that decide whether a key matches.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from checkpoints import write_checkpoint
from weightcache import identity
from weightcache.checkpoint import Checkpoint
from weightcache.config import ModelConfig, Placement
from weightcache.hashes import blake2b_hex

DEVICE = {"backend": "host", "gpu_uuid": "", "compute_capability": ""}


def _placement(path, tp_size: int = 2, tp_rank: int = 1, **model) -> Placement:
    return Placement(ModelConfig("m", str(path), **model), tp_size, tp_rank, 0)


@pytest.fixture
def plain(tmp_path):
    """A float32 checkpoint with a config.json naming its architecture."""
    config = {"architectures": ["ToyForCausalLM"], "model_type": "toy"}
    return write_checkpoint(tmp_path / "ck", {"w": torch.arange(8, dtype=torch.float32).reshape(2, 4)}, config)


def test_key_fields_of_a_plain_checkpoint_written_out(plain):
    """Invariant: every field of the key but ``checkpoint``, by name and value, for an unquantized rank."""
    ck = Checkpoint(str(plain), validate=False)
    fields = identity.key_fields(_placement(plain, revision="r1", naming="vllm"), ck, DEVICE)
    assert fields == {
        "revision": "r1", "architecture": "ToyForCausalLM", "dtype": "auto", "naming": "vllm", "tp_size": 2,
        "tp_rank": 1, "quant_scheme": "", "quant_config_blake2b": "", "kernel": "", "pipeline_version": 1,
        "device": DEVICE}
    assert fields["device"] is not DEVICE  # a copy: the caller's dict is not shared into the key
    key = identity.cache_key(_placement(plain, revision="r1", naming="vllm"), ck, DEVICE)
    assert key == {"checkpoint": ck.identity(), **fields}
    assert list(key) == ["checkpoint", *fields]


def test_key_fields_take_the_architecture_from_model_type_without_architectures(tmp_path):
    ck_dir = write_checkpoint(tmp_path / "ck", {"w": torch.zeros(2)}, {"model_type": "toy"})
    fields = identity.key_fields(_placement(ck_dir), Checkpoint(str(ck_dir), validate=False), DEVICE)
    assert fields["architecture"] == "toy"
    ck_dir = write_checkpoint(tmp_path / "none", {"w": torch.zeros(2)}, {})
    assert identity.key_fields(_placement(ck_dir), Checkpoint(str(ck_dir), validate=False), DEVICE)[
        "architecture"] == ""


@pytest.mark.parametrize("dtype, want", [("float32", "auto"), ("bfloat16", "bfloat16"), ("auto", "auto")])
def test_the_key_carries_the_effective_dtype(plain, dtype, want):
    """Invariant: a configured dtype that changes no byte of the rank is ``auto`` in the key."""
    ck = Checkpoint(str(plain), validate=False)
    p = _placement(plain, 1, 0, dtype=dtype)
    assert identity.key_fields(p, ck, DEVICE)["dtype"] == want
    assert identity.key_fields(p, ck, DEVICE, dtype="float16")["dtype"] == "float16"
    assert identity.cache_key(p, ck, DEVICE, dtype="float16")["dtype"] == "float16"  # a dtype given is used


def test_key_fields_of_an_fp8_checkpoint_name_its_scheme_config_and_kernel(tmp_path):
    """Invariant: a quantized rank's key names the detected scheme, the blake2b of hf_quant_config.json and the
    configured kernel; a scheme passed in is used as given (None: unquantized)."""
    from fp8_fixtures import write_fp8_per_tensor
    from weightcache import quant

    path = write_fp8_per_tensor(tmp_path / "fp8")
    ck = Checkpoint(str(path), validate=False)
    p = _placement(path, naming="vllm")
    fields = identity.key_fields(p, ck, DEVICE)
    scheme = quant.detect(ck)
    assert (fields["quant_scheme"], fields["quant_config_blake2b"], fields["kernel"]) == (
        "modelopt_fp8", scheme.config_hash, p.model.kernel)
    assert len(scheme.config_hash) == len(blake2b_hex(b"")) and fields["kernel"] == "cutlass"
    assert identity.key_fields(p, ck, DEVICE, scheme=None)["quant_scheme"] == ""
    key = identity.cache_key(p, ck, DEVICE)  # the scheme detected here too, unless given
    assert (key["quant_scheme"], key["kernel"]) == ("modelopt_fp8", "cutlass")
    assert identity.cache_key(p, ck, DEVICE, scheme=None)["quant_scheme"] == ""


@pytest.mark.parametrize("a, b, want", [
    (1, 2, ["<key>"]),
    ({"a": [1]}, {"a": [2]}, ["a"]),
    ({"d": {"x": 1}}, {"d": {"x": 2}}, ["d.x"]),
    ({1: "a", 2: "b"}, {1: "a"}, ["2"]),
    ({1: 0, "a": 0}, {}, ["1", "a"]),  # keys of mixed types are ordered by their text
])
def test_diff_keys_names_what_differs(a, b, want):
    """The dotted path of each difference; ``<key>`` when the two keys themselves are not dicts."""
    assert identity.diff_keys(a, b) == want


def test_the_engines_check_names_checkpoint_fields_changed_on_disk(plain):
    """Invariant: check_key compares the checkpoint identity by stat() and names each changed field under
    ``checkpoint.``; equal fields and an unchanged checkpoint give no difference."""
    ck = Checkpoint(str(plain), validate=False)
    p = _placement(plain)
    key = identity.cache_key(p, ck, DEVICE)
    fields = identity.key_fields(p, ck, DEVICE)
    assert identity.check_key(fields, Checkpoint(str(plain), validate=False), key) == []
    st = os.stat(plain / "model.safetensors")
    os.utime(plain / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    diff = identity.check_key(fields, Checkpoint(str(plain), validate=False), key)
    assert "checkpoint.files.model.safetensors.mtime_ns" in diff and all(d.startswith("checkpoint.") for d in diff)
    no_identity = {k: v for k, v in key.items() if k != "checkpoint"}
    assert identity.check_key(fields, ck, no_identity) == ["checkpoint.index"]  # a key without an identity


def test_dtype_matches_follows_the_effective_dtype(plain, tmp_path):
    """Invariant (one dtype rule): an engine asking for ``r`` is served a slab configured ``c`` when ``r == c``
    or both have the same effective dtype; an unknown name never matches; an unreadable checkpoint matches
    (the engine then hears the slab's own error)."""
    f32 = _placement(plain, 1, 0, dtype="float32")
    assert identity.dtype_matches(f32, "float32") and identity.dtype_matches(f32, "auto")
    assert not identity.dtype_matches(f32, "bfloat16") and not identity.dtype_matches(f32, "int4")
    auto = _placement(plain, 1, 0)
    assert identity.dtype_matches(auto, "float32") and not identity.dtype_matches(auto, "float16")
    bf16 = _placement(plain, 1, 0, dtype="bfloat16")
    key = {"dtype": "bfloat16"}
    assert not identity.dtype_matches(bf16, "auto", key) and identity.dtype_matches(bf16, "bfloat16", key)
    assert not identity.dtype_matches(bf16, "float32", key)
    assert identity.dtype_matches(auto, "auto", {"dtype": "auto"})
    assert not identity.dtype_matches(_placement(plain, 1, 0, dtype="float16"), "auto", {"dtype": "float16"})
    gone = _placement(tmp_path / "missing", 1, 0, dtype="bfloat16")
    assert identity.dtype_matches(gone, "float16")
    # With the slab's key: auto is served only by a key whose dtype is auto, whatever the checkpoint is now.
    assert identity.dtype_matches(f32, "auto", {"dtype": "auto"})
    assert not identity.dtype_matches(gone, "auto", {"dtype": "bfloat16"})
    # The key's effective dtype decides, not the one the configuration gives now.
    assert identity.dtype_matches(bf16, "float32", {"dtype": "auto"})


def test_served_dtypes_and_effective_dtype_written_out():
    f32 = frozenset({"F32"})
    assert identity.effective_dtype("float32", f32) == "auto"
    assert identity.effective_dtype("float16", f32) == "float16"
    assert identity.effective_dtype("float32", frozenset()) == "auto"  # nothing to cast
    assert identity.effective_dtype("bfloat16", frozenset({"F32", "BF16"})) == "bfloat16"
    assert sorted(identity.served_dtypes("auto", f32)) == ["auto", "float32"]
    assert sorted(identity.served_dtypes("bfloat16", f32)) == ["bfloat16"]
    assert sorted(identity.served_dtypes("float32", frozenset())) == ["auto", "bfloat16", "float16", "float32"]
    assert json.dumps(sorted(identity.served_dtypes("float16", frozenset({"F16"})))) == '["auto", "float16"]'
