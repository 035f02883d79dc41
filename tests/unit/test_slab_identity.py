"""A slab's identity and its records: the manifest file's fields, the one dtype rule, the FP8 layout records.

- the manifest file carries the operator's rank request and the served
  dtypes; a file of an older service (without them) reads as ``None`` for both;
- the dtype a slab serves is one rule (:func:`weightcache.identity.served_dtypes`)
  that the plan, the unplanned match and the key agree on;
- the FP8 layout record writes the manifest's JSON exactly (key order
  included) and reads it back by attribute.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from weightcache import identity, pipeline, sharding
from weightcache.checkpoint import Checkpoint
from weightcache.config import ModelConfig, Placement
from weightcache.errors import ManifestInvalid
from weightcache.manifest import Manifest, TensorRecord
from weightcache.manifest import FILE_FORMAT, pack_file, read_file
from weightcache.quant.fp8_layout import Fp8ScaleLayout, Fp8WeightLayout, layout_of
from weightcache.spec import DTYPE_NAMES, LoadRequest, RankRequest

DEVICE = {"backend": "host", "gpu_uuid": "", "compute_capability": ""}


def _memfd(raw: bytes) -> int:
    fd = os.memfd_create("manifest-test", os.MFD_CLOEXEC)
    os.write(fd, raw)
    return fd


def _manifest() -> Manifest:
    rec = TensorRecord("w", "F32", (2, 2), (2, 1), 0, 16, "xxh3_128:00")
    return Manifest("m", 2, 1, {"dtype": "auto"}, 256, (rec,))


def test_manifest_file_carries_the_rank_request_and_served_dtypes():
    placement = Placement(ModelConfig("m", "/srv/m", dtype="float32", naming="vllm", revision="r7"), 2, 1, 3)
    fd = _memfd(pack_file(_manifest(), backend="host", size_bytes=4096, checkpoint_path="/srv/m",
                          placement=placement.to_json(), dtypes_served=["auto", "float32"]))
    try:
        mf = read_file(fd, os.fstat(fd).st_size)
        assert mf.request == RankRequest(LoadRequest("m", "/srv/m", "float32", "vllm", "cutlass", "r7"), 2, 1)
        assert mf.dtypes_served == frozenset({"auto", "float32"})
        assert (mf.backend, mf.allocation_bytes, mf.fields["format"]) == ("host", 4096, FILE_FORMAT)
        assert [r.name for r in mf.manifest.tensors] == ["w"]
        with pytest.raises(ManifestInvalid) as ei:
            read_file(fd, mf.size_bytes + 1)  # another announced size
        assert ei.value.code == "manifest_invalid" and ei.value.details["section"] == "file"
    finally:
        os.close(fd)


def test_manifest_file_of_an_older_service_reads_without_request_or_dtypes():
    fd = _memfd(pack_file(_manifest(), backend="host", size_bytes=4096, checkpoint_path="/srv/m"))
    try:
        mf = read_file(fd)
        assert mf.request is None and mf.dtypes_served is None and mf.placement is None
    finally:
        os.close(fd)
    fd = _memfd(pack_file(_manifest(), placement={"model": {"name": "m"}}, dtypes_served=["bf16"]))
    try:
        mf = read_file(fd)  # damaged fields are not trusted
        assert mf.request is None and mf.dtypes_served is None
    finally:
        os.close(fd)


def test_rank_request_round_trips_and_placement_is_one():
    rank = RankRequest(LoadRequest("m", "/srv/m", "bfloat16", "vllm", "cutlass", "r1"), 4, 3)
    assert RankRequest.from_json(json.loads(json.dumps(rank.to_json()))) == rank
    p = Placement(ModelConfig("m", "/srv/m"), 2, 1, 0)
    assert isinstance(p, RankRequest) and (p.tp_size, p.tp_rank) == (2, 1)
    for bad in ({"model": {"name": "m", "path": "/x"}, "tp_size": "2", "tp_rank": 0}, {"tp_size": 1}):
        with pytest.raises(ValueError):
            RankRequest.from_json(bad)


@pytest.fixture
def mixed(tmp_path):
    """A checkpoint with a BF16 and an F32 float tensor (and an int tensor no cast touches)."""
    save_file({"a": torch.zeros(2, 2, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.float32),
               "ids": torch.arange(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize("configured", list(DTYPE_NAMES))
def test_one_dtype_rule_for_plan_match_and_key(mixed, tmp_path, configured):
    rank = RankRequest(ModelConfig("m", str(mixed), dtype=configured), 1, 0)
    plan = pipeline.plan(rank, DEVICE)
    cast_from = sharding.cast_dtypes(Checkpoint(mixed), 1, 0, "hf")
    assert cast_from == {"BF16", "F32"}
    assert plan.dtypes_served == identity.served_dtypes(configured, cast_from)
    assert plan.dtypes_served == {r for r in DTYPE_NAMES if identity.dtype_matches(rank, r)}
    assert plan.dtypes_served == {r for r in DTYPE_NAMES if identity.dtype_matches(rank, r, plan.key)}
    # Casting a mixed checkpoint to any dtype changes bytes: each name is its own slab.
    assert plan.dtypes_served == {configured}
    assert plan.key["dtype"] == configured
    # The cast decides the effective dtype: what the plan's specs hold.
    stored = [s.dtype for s in sharding.shard_specs(Checkpoint(mixed), 1, 0, "hf", None)]
    assert ([s.dtype for s in plan.specs] == stored) == (plan.key["dtype"] == "auto")


def test_a_dtype_the_checkpoint_is_stored_in_serves_auto_too(tmp_path):
    save_file({"a": torch.zeros(2, 2, dtype=torch.float32), "ids": torch.arange(2)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    plan = pipeline.plan(RankRequest(ModelConfig("m", str(tmp_path), dtype="float32"), 1, 0), DEVICE)
    assert plan.key["dtype"] == "auto" and plan.dtypes_served == {"auto", "float32"}


def test_fp8_layout_records_write_the_manifest_json_and_read_it_back():
    sharding_layout = {"tp_dim": 0, "tp_size": 2, "tp_rank": 1, "logical_shape": [80, 64], "shard_start": 40,
                       "shard_size": 40}
    rec = Fp8WeightLayout("modelopt_fp8", "cutlass", (40, 64), (48, 64), "tensor", "static_tensor",
                          "x.weight_scale", "x.input_scale", None, (80, 64))
    lay = rec.merged(sharding_layout)
    # The JSON of earlier releases (docs/quantization.md section 4), key order included.
    assert json.dumps(lay) == json.dumps({
        "tp_dim": 0, "tp_size": 2, "tp_rank": 1, "logical_shape": [80, 64], "shard_start": 40, "shard_size": 40,
        "scheme": "modelopt_fp8", "kernel": "cutlass", "unpadded_shape": [40, 64], "stored_shape": [48, 64],
        "view_shape": [64, 48], "view_stride": [1, 64], "view": "transpose",
        "processed_dims": {"input": 0, "output": 1}, "padding": {"output": 8, "input": 0},
        "logical_output_width": 40, "logical_input_width": 64, "scale_granularity": "tensor",
        "activation_scheme": "static_tensor", "weight_scale": "x.weight_scale", "input_scale": "x.input_scale",
        "fused_scale": None})
    back = layout_of(json.loads(json.dumps(lay)))
    assert back == rec and back.logical_output_width == 40 and back.view_stride == (1, 64)
    scale = Fp8ScaleLayout("modelopt_fp8_per_channel", "cutlass", "weight_scale", "x.weight", "channel", 40, 8, 1.0)
    assert list(scale.to_json()) == ["scheme", "kernel", "role", "weight", "scale_granularity",
                                     "logical_output_width", "padding", "pad_value"]
    assert layout_of(scale.to_json()) == scale
    assert layout_of({"tp_dim": None}) is None and layout_of({"scheme": "other", "view": "transpose"}) is None
    with pytest.raises(ManifestInvalid) as ei:
        layout_of({**lay, "stored_shape": [48]})
    assert ei.value.code == "manifest_invalid"
