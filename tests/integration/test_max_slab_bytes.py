"""``[models.X] max_slab_bytes`` (issue 38, P6): the operator bounds what one slab of a model may take.

Against a real service (host backend): a checkpoint whose plan is larger than its model's cap is never loaded
(its load fails ``checkpoint_corrupt``, ``cause = "over_max_slab_bytes"``, naming the model and the field, nothing
allocated; an attach hears ``model_load_failed`` with it),
another model beside it loads as before; a publication of the model larger than the cap is refused
(``publication_invalid``) and nothing is kept, one within it is taken; ``check-config`` reports the slab over its
cap as an error.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from checkpoints import compare_bytes, one_tensor_checkpoint, ONE_TENSOR_N, ONE_TENSOR_SLAB, read_checkpoint  # noqa: E402
from service_harness import make_config, to_toml  # noqa: E402
from weightcache import attach, errors, protocol  # noqa: E402
from weightcache.session import Session  # noqa: E402

pytestmark = pytest.mark.timeout(180)

#: Elements of each model's one tensor: 2 MiB of float32, so a slab is 2 MiB and a page.
N, SLAB = ONE_TENSOR_N, ONE_TENSOR_SLAB
CAP = 1024 * 1024


def _ckpt(dest, seed: int):
    return one_tensor_checkpoint(dest, seed, {"architectures": ["TinyForCausalLM"], "model_type": "tiny"})


def _key() -> dict:
    return {"engine": "test-engine", "engine_version": "1.0", "architecture": "TinyForCausalLM", "dtype": "float32",
            "quantization": {"method": "", "config_blake2b": ""},
            "parallel": {"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "dp_size": 1, "dp_rank": 0,
                         "ep_size": 1, "ep_rank": 0},
            "draft": "", "kernels": {"attention": "torch_sdpa"}, "compute_capability": ""}


def _publish(svc, ck, size_bytes: int) -> protocol.Message:
    """Sends ``publish`` of model ``capped`` with a sealable memfd of ``size_bytes`` and a manifest of one 16-byte
    tensor; returns the reply (or raises its error)."""
    from weightcache.manifest import Manifest, TensorRecord, pack_file
    from weightcache.memory.host import sealed_memfd

    data = pack_file(Manifest("capped", 1, 0, {}, 256, [TensorRecord("t", "F32", (4,), (1,), 0, 16)]))
    mfd = sealed_memfd(data, "test-manifest")
    fd = os.memfd_create("pub", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size_bytes)
    s = Session(svc.socket_path, timeout=10)
    try:
        s.send_with_fds(protocol.Publish(os.path.realpath(ck), 1, 0, _key(), size_bytes, len(data)), [fd, mfd])
        return s.replies(1)[0]
    finally:
        s.close()
        os.close(mfd)
        os.close(fd)


def test_a_slab_over_its_model_cap_is_refused_naming_the_model_and_the_field(daemon, tmp_path, capsys):
    from weightcache.cli import main

    cks = {"capped": _ckpt(tmp_path / "capped", 1), "free": _ckpt(tmp_path / "free", 2)}
    config = make_config({"capped": {"path": cks["capped"], "max_slab_bytes": CAP}, "free": cks["free"]},
                         memory_budget_bytes=4 * SLAB)
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(to_toml(config))
    capsys.readouterr()
    assert main(["check-config", "--config", str(cfg), "--as-user", "root"]) == 1
    err = capsys.readouterr().err
    assert (f"error: model capped tp=1 rank=0 (GPU 0, defined in {cfg}): model capped (capped/tp1/rank0) needs a "
            f"slab of {SLAB} bytes, more than its models.capped.max_slab_bytes = {CAP}" in err), err
    assert "model free" not in err, err

    svc = daemon(config)
    st = svc.wait_settled()
    with pytest.raises(errors.ModelLoadFailed) as e:  # its load failed checkpoint_corrupt, as the slot records
        attach("capped", socket_dir=svc.socket_dir, fallback=False, timeout=60)
    assert "models.capped.max_slab_bytes = 1048576" in e.value.message and "model capped" in e.value.message
    assert e.value.details["cause"] == "checkpoint_corrupt", e.value.details
    d = e.value.details["cause_details"]
    assert (d["cause"], d["limit"], d["value"], d["actual"]) == (
        "over_max_slab_bytes", "models.capped.max_slab_bytes", CAP, SLAB), d
    st = svc.status()
    assert st["memory"]["gpu_bytes"] == SLAB, st["memory"]  # only free's slab: nothing allocated for capped
    free = attach("free", socket_dir=svc.socket_dir, fallback=False, timeout=60)
    try:
        compare_bytes(free.tensors, read_checkpoint(cks["free"]))
    finally:
        free.close()

    slabs = len(st["slabs"])
    with pytest.raises(errors.PublicationInvalid) as e:
        _publish(svc, cks["capped"], SLAB)
    d = e.value.details
    assert (d["reason"], d["limit"], d["value"], d["actual"]) == (
        "over_max_slab_bytes", "models.capped.max_slab_bytes", CAP, SLAB), d
    assert "models.capped.max_slab_bytes" in e.value.message and "the engine keeps its own copy" in e.value.message
    assert len(svc.status()["slabs"]) == slabs  # nothing kept
    assert _publish(svc, cks["capped"], CAP).created  # within the cap: taken
    assert len(svc.status()["slabs"]) == slabs + 1
