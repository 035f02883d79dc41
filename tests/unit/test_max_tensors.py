"""A checkpoint listing more tensors than ``service.max_tensors_per_checkpoint`` (default 150,000) is refused at
plan time, before its headers are parsed (issue 38, P12): a 600,000-tensor header (50 MB, under the header cap)
took 25.9 s to load, 1.7 GB of the service's RSS at peak, and sent a 75 MB manifest to every engine."""

from __future__ import annotations

import json
import time

import pytest

from weightcache.checkpoint import Checkpoint
from weightcache.config import ServiceConfig, load_config
from weightcache.errors import CheckpointCorrupt, ConfigError

pytestmark = pytest.mark.timeout(120)


def _many(dest, n: int) -> None:
    dest.mkdir()
    header = {f"model.layers.{i // 1536}.mlp.experts.{i % 1536 // 3}.w{i % 3}.weight":
              {"dtype": "I32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(n)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(dest / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + bytes(4 * n))


def test_the_default_is_150k():
    assert ServiceConfig().max_tensors_per_checkpoint == 150_000


def test_over_the_cap_is_refused_before_the_parse(tmp_path):
    _many(tmp_path / "big", 600_000)
    t0 = time.monotonic()
    with pytest.raises(CheckpointCorrupt) as e:
        Checkpoint(str(tmp_path / "big"), max_tensors=150_000)
    took = time.monotonic() - t0
    d = e.value.details
    assert (e.value.code, d["cause"], d["limit"], d["value"], d["actual"]) == (
        "checkpoint_corrupt", "too_many_tensors", "max_tensors_per_checkpoint", 150_000, 600_000)
    assert took < 5, took  # the header is read, counted, not parsed


def test_at_the_cap_and_without_one_it_loads(tmp_path):
    _many(tmp_path / "ok", 1000)
    assert len(Checkpoint(str(tmp_path / "ok"), max_tensors=1000).tensors) == 1000
    assert len(Checkpoint(str(tmp_path / "ok"), validate=False).tensors) == 1000
    with pytest.raises(CheckpointCorrupt):
        Checkpoint(str(tmp_path / "ok"), max_tensors=999)


def test_the_key_is_read_and_bounded(tmp_path):
    f = tmp_path / "w.toml"
    f.write_text("[service]\nmax_tensors_per_checkpoint = 200000\n")
    assert load_config(str(f)).service.max_tensors_per_checkpoint == 200_000
    f.write_text("[service]\nmax_tensors_per_checkpoint = 0\n")
    with pytest.raises(ConfigError):
        load_config(str(f))
