"""A checkpoint's writer cannot block a reload nor break an engine's fallback (issue 38, P8): ``config.json`` nested
200,000 deep, written under a running service (as an unprivileged uid)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attackers import SERVICE_UID  # noqa: E402
from service_harness import make_config, record_figures  # noqa: E402
from checkpoints import compare_bytes, read_checkpoint, write_checkpoint  # noqa: E402
from weightcache import attach, protocol  # noqa: E402
from weightcache.errors import CheckpointCorrupt  # noqa: E402

pytestmark = pytest.mark.timeout(180)

DEEP = b'{"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"


def _ckpt(dest, seed):
    g = torch.Generator().manual_seed(seed)
    return write_checkpoint(dest, {"a.weight": torch.randn(4, 8, generator=g)}, config={"model_type": "toy"})


def test_a_deep_config_json_is_skipped_by_the_reload_which_applies_the_rest(daemon, tmp_path):
    """Before: the reload was refused whole (``config_invalid`` cause ``unreadable``, ``RecursionError``, no file
    named) and ``attach(fallback=True)`` raised a bare ``RecursionError``. After: the reload adds ``c`` and keeps
    ``bad`` as it was; the attach raises ``checkpoint_corrupt`` naming ``config.json``."""
    cks = {n: _ckpt(tmp_path / n, s) for n, s in (("ok", 1), ("bad", 2), ("c", 3))}
    svc = daemon({"ok": cks["ok"], "bad": cks["bad"]}, run_as=SERVICE_UID)
    svc.wait_settled()
    (cks["bad"] / "config.json").write_bytes(DEEP)
    svc.write_config(make_config({"ok": cks["ok"], "bad": cks["bad"], "c": cks["c"]}))
    r = svc.request(protocol.Reload())
    assert r.added == ["c/tp1/rank0"] and sorted(r.kept) == ["bad/tp1/rank0", "ok/tp1/rank0"], r
    svc.wait_settled()
    with attach("c", socket_dir=svc.socket_dir, fallback=False, timeout=30) as w:
        compared = compare_bytes(w.tensors, read_checkpoint(cks["c"]))
    with pytest.raises(CheckpointCorrupt) as e:
        attach(str(cks["bad"]), socket_dir=svc.socket_dir, fallback=True, timeout=30)
    assert e.value.code == "checkpoint_corrupt" and e.value.details["file"] == str(cks["bad"] / "config.json")
    assert svc.proc.poll() is None
    assert "reload skips checkpoint" in svc.log()
    record_figures("attack.deep_checkpoint_json", "a checkpoint's config.json nested 200,000 deep, then a reload",
                   "service as uid 64000; the reload skips that checkpoint (WARNING) and adds the new model; "
                   "attach(fallback=True) raises checkpoint_corrupt naming config.json", clients=2,
                   faults_injected=1, bytes_compared=compared)
