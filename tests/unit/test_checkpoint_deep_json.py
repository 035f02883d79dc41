"""A checkpoint's JSON files nested too deep to parse (issue 38, P8): ``config.json``, the index, a side file and a
safetensors header 200,000 levels deep are ``checkpoint_corrupt`` naming the file (``cause`` ``too_deep``), never
a bare ``RecursionError``."""

from __future__ import annotations

import json
import struct

import pytest

torch = pytest.importorskip("torch")

from checkpoints import write_checkpoint  # noqa: E402
from weightcache.checkpoint import Checkpoint  # noqa: E402
from weightcache.errors import CheckpointCorrupt  # noqa: E402

pytestmark = pytest.mark.timeout(60)

DEEP = b"[" * 200_000 + b"]" * 200_000


def _ck(tmp_path):
    return write_checkpoint(tmp_path / "ck", {"w": torch.arange(4, dtype=torch.float32).reshape(2, 2)})


def test_a_deep_config_json_is_checkpoint_corrupt_naming_it(tmp_path):
    ck = _ck(tmp_path)
    (ck / "config.json").write_bytes(b'{"a": ' + DEEP + b"}")
    with pytest.raises(CheckpointCorrupt) as e:
        Checkpoint(str(ck), validate=False)
    assert e.value.code == "checkpoint_corrupt"
    assert e.value.details["file"] == str(ck / "config.json") and e.value.details["cause"] == "too_deep"


def test_a_deep_index_is_checkpoint_corrupt_naming_it(tmp_path):
    ck = _ck(tmp_path)
    (ck / "model.safetensors.index.json").write_bytes(b'{"weight_map": ' + DEEP + b"}")
    with pytest.raises(CheckpointCorrupt) as e:
        Checkpoint(str(ck), validate=False).files  # noqa: B018
    assert e.value.details["file"] == str(ck / "model.safetensors.index.json")
    assert e.value.details["cause"] == "too_deep"


def test_a_deep_quant_config_is_checkpoint_corrupt_naming_it(tmp_path):
    ck = _ck(tmp_path)
    (ck / "hf_quant_config.json").write_bytes(DEEP)
    c = Checkpoint(str(ck), validate=False)
    with pytest.raises(CheckpointCorrupt) as e:
        c.extra_json("hf_quant_config.json")
    assert e.value.details["file"] == str(ck / "hf_quant_config.json")


def test_a_deep_safetensors_header_is_checkpoint_corrupt_naming_the_file(tmp_path):
    ck = _ck(tmp_path)
    f = next(ck.glob("*.safetensors"))
    header = b'{"__metadata__": ' + DEEP + b"}"
    f.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointCorrupt) as e:
        Checkpoint(str(ck), validate=False).tensors  # noqa: B018
    assert e.value.details["file"] == str(f) and e.value.details["cause"] == "too_deep"


def test_shallow_json_still_parses(tmp_path):
    ck = _ck(tmp_path)
    (ck / "config.json").write_text(json.dumps({"a": [[[1]]]}))
    assert Checkpoint(str(ck), validate=False).config == {"a": [[[1]]]}
