"""``service.load_timeout_s``: a load past it fails with cause ``timeout``, the slab is freed, the service serves on."""

import pytest
from service_harness import make_config
from checkpoints import big_checkpoint

from weightcache import attach, errors


def test_load_past_timeout_fails_and_frees_the_slab(daemon, tmp_path):
    slow = big_checkpoint(64 * 1024 * 1024, tensors=16, base=str(tmp_path))
    svc = daemon(make_config({"slow": slow}, load_timeout_s=0.000001))
    slab = {s["model"]: s for s in svc.wait_settled()["slabs"]}["slow"]
    assert slab["state"] == "failed"
    assert slab["error"]["code"] == "model_load_failed"
    assert slab["error"]["details"]["cause"] == "timeout"
    assert "load_timeout_s" in slab["error"]["message"]
    assert slab["resident_bytes"] == 0
    with pytest.raises(errors.ModelLoadFailed) as e:
        attach("slow", socket_dir=svc.socket_dir, fallback=False)
    assert e.value.details["cause"] == "timeout"
    assert svc.status()["slabs"][0]["state"] == "failed"  # still answering
