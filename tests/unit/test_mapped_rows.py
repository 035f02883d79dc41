"""Row-parallel shards copied from a mapping of the checkpoint file (:func:`weightcache.loader.copy_mapped_rows`):
what an operator or an attacker can do to the file around and during the load.

Real safetensors files written by the test, the real host backend and the fake CUDA stager of
``test_torch_free_load``; bytes are compared with the torch pipeline (:func:`pipeline.execute`), errors by
``code`` and the file and tensor they name, leaks by ``/proc/self/fd`` and ``/proc/self/maps``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service_harness import llama_checkpoint  # noqa: E402

from weightcache import loader, pipeline, protocol  # noqa: E402
from weightcache.config import ModelConfig  # noqa: E402
from weightcache.errors import CheckpointCorrupt  # noqa: E402
from weightcache.memory import get_backend  # noqa: E402
from weightcache.spec import RankRequest  # noqa: E402

DEVICE = {"backend": "host", "gpu_uuid": "", "compute_capability": ""}


def _plan(ck: Path, tp: int, rank: int):
    return pipeline.plan(RankRequest(ModelConfig(name="m", path=str(ck), naming="vllm"), tp, rank), DEVICE)


def _fill_error(p, **opts) -> CheckpointCorrupt:
    """Fills a real host slab for the plan ``p``; returns the ``checkpoint_corrupt`` it raised."""
    w = get_backend("host").allocate(p.slab_size_bytes, "m")
    try:
        with pytest.raises(CheckpointCorrupt) as e:
            pipeline.fill(p, w, options=loader.LoaderOptions(**opts))
    finally:
        w.abort()
    return e.value


def _cut_when_opened(monkeypatch, size: int) -> None:
    """The reader's files are cut to ``size`` bytes just after it opens them (past the header-time ``fstat``
    check of :meth:`Checkpoint.open_member`): a file truncated during the load."""
    real = loader.open_file

    def open_then_cut(path, flags=os.O_RDONLY | os.O_CLOEXEC):
        fd = real(path, flags)
        os.truncate(path, size)
        return fd

    monkeypatch.setattr(loader, "open_file", open_then_cut)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_file_cut_during_the_load_fails_it_with_a_status_record_that_serialises(tmp_path, monkeypatch, tp):
    """A checkpoint cut while it is read (by ``cp`` over it, say) fails the reader with ``checkpoint_corrupt``
    naming the file and tensor: as a row-parallel shard copied from the mapping (TP 2) or read with ``pread``
    (TP 1). The error becomes the slab's record in ``status`` and ``list`` (:class:`protocol.ErrorInfo`): it
    must serialise (a checkpoint member's path, a ``str`` subclass bound to its checkpoint, made every later
    ``status`` fail with ``internal``), and ``details.file`` is a plain path."""
    ck = llama_checkpoint(tmp_path / "ck", seed=3, files=1, hidden=64, inter=4096)
    p = _plan(ck, tp, 0)
    f = next(ck.glob("*.safetensors"))
    _cut_when_opened(monkeypatch, 4096)
    e = _fill_error(p, threads=2, staging_bytes=1 << 20)
    assert e.code == "checkpoint_corrupt" and str(f) in e.message and repr(e.details["tensor"]) in e.message
    assert type(e.details["file"]) is str and e.details["file"] == str(f)
    record = protocol.ErrorInfo(**e.to_wire()).to_json()
    assert json.loads(json.dumps(record))["details"]["file"] == str(f)
    member = p.checkpoint.file_path(f.name)  # what the reader opens; any error may name it
    assert type(copy.deepcopy({"file": member})["file"]) is str and copy.deepcopy(member) == member == str(f)
