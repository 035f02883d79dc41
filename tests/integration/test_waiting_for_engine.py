"""Issue 35: a model only its engine can lay out waits for its engine, and publications live in the budget's tiers.

Against a real ``weightcache serve`` (host backend) over its socket:

- ``naming = "vllm"`` for an architecture without vLLM naming rules is ``waiting_for_engine`` (not ``failed``) in
  ``status``, ``weightcache status``, the STATUS line and the ``weightcache_slab_state`` metric, with one journal
  line (``waiting_for_engine`` event); an ``attach`` says so (``model_load_failed`` with ``waiting_for_engine``);
  an engine's publication is then attached by key, and ``status`` says the model is published;
- a publication is no longer pinned: a demand load that needs its room demotes it to the host tier (or, without
  one, drops it: the model is back to waiting for its engine alone); an ``attach_published`` of a publication in
  the host tier promotes it, bytes equal; the budget is never exceeded meanwhile (sampled);
- a (shared) publication makes room as a demand load does, and is refused (``insufficient_memory``, nothing
  kept or moved) when no room can be made; two identical publications at once leave one slab.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from checkpoints import write_checkpoint  # noqa: E402
from service_harness import make_config, poll_until, service_env  # noqa: E402
from weightcache import attach, errors, protocol  # noqa: E402
from weightcache.client import attach_published, publish  # noqa: E402

pytestmark = pytest.mark.timeout(180)

#: Elements of the tiny model's one tensor: 2 MiB of float32 (a slab is 2 MiB).
N = 512 * 1024
SLAB = N * 4


def _key() -> dict:
    return {"engine": "test-engine", "engine_version": "1.0", "architecture": "TinyForCausalLM", "dtype": "float32",
            "quantization": {"method": "", "config_blake2b": ""},
            "parallel": {"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "dp_size": 1, "dp_rank": 0,
                         "ep_size": 1, "ep_rank": 0},
            "draft": "", "kernels": {"attention": "torch_sdpa"}, "compute_capability": ""}


def _tiny(dest, seed: int = 7):
    """A checkpoint of an architecture weightcache has no vLLM naming rules for."""
    g = torch.Generator().manual_seed(seed)
    return write_checkpoint(dest, {"w": torch.randn(N, generator=g)},
                            config={"architectures": ["TinyForCausalLM"], "model_type": "tiny"})


def _plain(dest, seed: int):
    g = torch.Generator().manual_seed(seed)
    return write_checkpoint(dest, {"w": torch.randn(N, generator=g)})


def _processed(ck) -> dict:
    """What the engine's processing made of the checkpoint (here: the tensor doubled, so it is not the file's)."""
    from safetensors.torch import load_file

    return {"w2": load_file(str(ck / "model.safetensors"))["w"] * 2}


def _tiers(svc) -> dict[str, str]:
    return {s["model"] + ("+pub" if s.get("publication") else ""): f"{s['state']}/{s['tier']}"
            for s in svc.status()["slabs"]}


def test_naming_vllm_without_rules_waits_for_its_engine_then_is_published(daemon, tmp_path):
    ck = _tiny(tmp_path / "ck")
    svc = daemon({"m": {"path": str(ck), "naming": "vllm"}})
    st = svc.wait_settled()
    (slab,) = st["slabs"]
    assert slab["state"] == "waiting_for_engine" and slab["error"]["code"] == "unsupported_architecture", slab
    assert "waiting for its engine to publish: m/tp1/rank0" in st["status_line"], st["status_line"]
    assert svc.log().count("waiting for its engine model=m") == 1, svc.log()
    assert "load failed model=m" not in svc.log()
    out = subprocess.run([sys.executable, "-m", "weightcache", "status", "--socket-dir", svc.socket_dir, "--gpu", "0"],
                         capture_output=True, text=True, timeout=60, env=service_env(), check=False)
    assert "waiting_for_engine (unsupported_architecture)" in out.stdout, out.stdout + out.stderr
    assert out.returncode == 0, out.stdout + out.stderr  # not a failure
    out = subprocess.run([sys.executable, "-m", "weightcache", "list", "--socket-dir", svc.socket_dir],
                         capture_output=True, text=True, timeout=60, env=service_env(), check=False)
    head, row = out.stdout.splitlines()
    assert row.split()[:5] == ["0", "m", "1", "0", "waiting_for_engine"], out.stdout
    assert head.index("RESIDENT") + len("RESIDENT") == row.index(" 0 B") + len(" 0 B"), out.stdout  # columns align
    metrics = svc.request(protocol.Metrics()).status
    assert [s["state"] for s in metrics["slabs"]] == ["waiting_for_engine"]
    if not os.path.isdir("/run/systemd/system"):  # `weightcache metrics` asks only running units under systemd
        text = subprocess.run([sys.executable, "-m", "weightcache", "metrics", "--socket-dir", svc.socket_dir],
                              capture_output=True, text=True, timeout=60, env=service_env(), check=False).stdout
        series = [ln for ln in text.splitlines() if ln.startswith("weightcache_slab_state{") and 'model="m"' in ln]
        assert [ln.rsplit(" ", 1)[1] for ln in series if 'state="waiting_for_engine"' in ln] == ["1.0"], text[-3000:]
        assert [ln for ln in series if ln.endswith(" 1.0")] == [
            ln for ln in series if 'state="waiting_for_engine"' in ln], series
    with pytest.raises(errors.ModelLoadFailed) as e:
        attach(str(ck), socket_dir=svc.socket_dir, fallback=False, naming="vllm", timeout=10)
    assert e.value.details["waiting_for_engine"] is True and e.value.details["cause"] == "unsupported_architecture"
    assert "--load-format weightcache" in e.value.message
    # its engine publishes it; the next engine start attaches the publication
    tensors = _processed(ck)
    assert publish(str(ck), _key(), tensors, socket_dir=svc.socket_dir).created
    with attach_published(str(ck), _key(), socket_dir=svc.socket_dir) as w:
        assert torch.equal(w.tensors["w2"], tensors["w2"])
    st = svc.status()
    assert "waiting for its engine to publish: m/tp1/rank0 (published)" in st["status_line"], st["status_line"]
    # the operator's evict frees the publication: the model is back to waiting for its engine alone
    assert svc.request(protocol.Evict("m", force=True)).evicted
    assert _tiers(svc) == {"m": "waiting_for_engine/disk"}
    with pytest.raises(errors.ModelNotFound) as e:
        attach_published(str(ck), _key(), socket_dir=svc.socket_dir)
    assert e.value.details["publication"] == "none"


@pytest.mark.parametrize("host_tier", [0, 4 * SLAB], ids=["no-host-tier", "host-tier"])
def test_a_publication_moves_through_the_tiers_like_a_slab(daemon, tmp_path, host_tier):
    """Budget of two slabs: the publication and model ``a`` fill it; an attach of ``b`` (same priority) needs room,
    and the publication, least recently used, leaves: to the host tier (then ``attach_published`` promotes it back,
    bytes equal, and ``b`` leaves in turn) or, without a host tier, out of the service (back to waiting)."""
    from test_tiers import Sampler

    ck = _tiny(tmp_path / "ck")
    cks = {"a": _plain(tmp_path / "a", 1), "b": _plain(tmp_path / "b", 2)}
    svc = daemon(make_config({"m": {"path": str(ck), "naming": "vllm"}, "a": cks["a"],
                              "b": {"path": str(cks["b"]), "preload": "disk"}},
                             memory_budget_bytes=2 * SLAB + SLAB // 2, host_tier_bytes=host_tier))
    svc.wait_settled()
    assert _tiers(svc) == {"m": "waiting_for_engine/disk", "a": "ready/gpu", "b": "on_disk/disk"}
    tensors = _processed(ck)
    with Sampler(svc):
        assert publish(str(ck), _key(), tensors, socket_dir=svc.socket_dir).created
        with attach(str(cks["a"]), socket_dir=svc.socket_dir, fallback=False, timeout=30):
            pass  # a is used after the publication: the publication is the least recently used
        poll_until(lambda: not svc.slab("a")["leases"], "a's lease to end")
        with attach(str(cks["b"]), socket_dir=svc.socket_dir, fallback=False, timeout=30):
            pass
        poll_until(lambda: not svc.slab("b")["leases"], "b's lease to end")
        if not host_tier:
            assert _tiers(svc) == {"m": "waiting_for_engine/disk", "a": "ready/gpu", "b": "ready/gpu"}
            assert "publication dropped model=m" in svc.log() and "its model waits for its engine" in svc.log()
            with pytest.raises(errors.ModelNotFound):
                attach_published(str(ck), _key(), socket_dir=svc.socket_dir)
            return
        assert _tiers(svc) == {"m": "waiting_for_engine/disk", "a": "ready/gpu", "b": "ready/gpu",
                               "m+pub": "hosted/host"}
        with attach_published(str(ck), _key(), socket_dir=svc.socket_dir) as w:  # promoted back for this attach
            assert torch.equal(w.tensors["w2"], tensors["w2"])
            tiers = _tiers(svc)
        assert tiers["m+pub"] == "ready/gpu" and sorted(tiers.values()).count("ready/gpu") == 2, tiers
    log = svc.log()
    assert "demoted model=m" in log and "promoted model=m" in log, log


def test_only_an_engine_layout_error_of_a_vllm_named_model_waits_for_its_engine(daemon, tmp_path):
    """``waiting_for_engine`` is for ``naming = "vllm"`` and an architecture (or quantization) only the engine
    can lay out: a damaged checkpoint named for vLLM fails (``checkpoint_corrupt``), and an architecture without
    rules at tp 2 under ``naming = "hf"`` fails (``unsupported_architecture``): no engine publishes for them."""
    torn = _tiny(tmp_path / "torn")
    f = torn / "model.safetensors"
    os.truncate(f, f.stat().st_size - 1024)
    tiny = _tiny(tmp_path / "tiny")
    svc = daemon(make_config({"torn": {"path": str(torn), "naming": "vllm"},
                              "tp2": {"path": str(tiny), "layouts": [{"tp": 2, "gpus": [0, 1]}]},
                              "m": {"path": str(tiny), "naming": "vllm"}}))
    st = {s["model"]: s for s in svc.wait_settled()["slabs"]}
    assert (st["torn"]["state"], st["torn"]["error"]["code"]) == ("failed", "checkpoint_corrupt"), st["torn"]
    assert (st["tp2"]["state"], st["tp2"]["error"]["code"]) == ("failed", "unsupported_architecture"), st["tp2"]
    assert st["m"]["state"] == "waiting_for_engine", st["m"]


def test_a_publication_makes_room_as_a_demand_load_and_is_refused_when_none_can_be_made(daemon, tmp_path):
    """Budget of 1.5 slabs, ``a`` resident. While ``a`` is leased no room can be made: the publication is refused
    (``insufficient_memory``) and nothing is kept or moved. Once released, the same publication (root's: shared)
    makes room as a demand load does (``a``, the same priority, leaves), the budget never exceeded (sampled)."""
    from test_tiers import Sampler

    ck = _tiny(tmp_path / "ck")
    a = _plain(tmp_path / "a", 1)
    svc = daemon(make_config({"m": {"path": str(ck), "naming": "vllm"}, "a": a}, memory_budget_bytes=SLAB + SLAB // 2))
    svc.wait_settled()
    tensors = _processed(ck)
    with Sampler(svc):
        with attach(str(a), socket_dir=svc.socket_dir, fallback=False, timeout=30):
            before = svc.status()["slabs"]
            with pytest.raises(errors.InsufficientMemory) as e:
                publish(str(ck), _key(), tensors, socket_dir=svc.socket_dir)
            assert e.value.details["budget_bytes"] == SLAB + SLAB // 2
            assert [r["slab"] for r in e.value.details["resident"]] == ["a/tp1/rank0"]
            assert svc.status()["slabs"] == before
        poll_until(lambda: not svc.slab("a")["leases"], "a's lease to end")
        assert publish(str(ck), _key(), tensors, socket_dir=svc.socket_dir).created
        assert _tiers(svc) == {"m": "waiting_for_engine/disk", "a": "on_disk/disk", "m+pub": "ready/gpu"}
    assert "shelved model=a" in svc.log() and "reason=room for m/tp1/rank0+pub:" in svc.log(), svc.log()


def test_an_untrusted_publication_takes_only_free_room_and_moves_nothing(daemon, tmp_path):
    """A uid that is not a trusted publisher (here ``nobody``: a private publication) takes free room only: with
    ``a`` resident and no room free, its publication is refused (``insufficient_memory``) and ``a`` stays on the
    GPU; root's publication of the same key then makes room as a demand load does."""
    import shutil
    import tempfile
    from pathlib import Path

    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another uid")
    nobody = 65534
    d = Path(tempfile.mkdtemp(prefix="wcpriv-", dir="/tmp"))
    try:
        os.chmod(d, 0o755)
        ck = _tiny(d / "ck")
        a = _plain(tmp_path / "a", 1)
        svc = daemon(make_config({"m": {"path": str(ck), "naming": "vllm"}, "a": a},
                                 memory_budget_bytes=SLAB + SLAB // 2))
        svc.wait_settled()
        os.chmod(os.path.dirname(svc.socket_dir), 0o755)
        os.chmod(svc.socket_dir, 0o755)
        os.chmod(svc.socket_path, 0o777)
        tensors = _processed(ck)
        assert _tiers(svc) == {"m": "waiting_for_engine/disk", "a": "ready/gpu"}
        before = svc.status()["slabs"]
        os.setegid(nobody)
        os.seteuid(nobody)
        try:
            with pytest.raises(errors.InsufficientMemory) as e:
                publish(str(ck), _key(), tensors, socket_dir=svc.socket_dir)
        finally:
            os.seteuid(0)
            os.setegid(0)
        assert "no room to publish" in str(e.value) and e.value.details["budget_bytes"] == SLAB + SLAB // 2, e.value
        assert svc.status()["slabs"] == before
        assert "shelved model=a" not in svc.log()
        assert publish(str(ck), _key(), tensors, socket_dir=svc.socket_dir).created  # root's: shared, makes room
        assert _tiers(svc) == {"m": "waiting_for_engine/disk", "a": "on_disk/disk", "m+pub": "ready/gpu"}
    finally:
        shutil.rmtree(d)


def test_two_identical_publications_at_once_leave_one_slab(daemon, tmp_path):
    """Two engines publish the same key at the same moment (threads released together): one is created, the other
    finds it (``created: false``); one slab, within the budget (sampled meanwhile), attached by both keys' engines."""
    import threading

    from test_tiers import Sampler

    ck = _tiny(tmp_path / "ck")
    svc = daemon(make_config({"m": {"path": str(ck), "naming": "vllm"}}, memory_budget_bytes=SLAB + SLAB // 2))
    svc.wait_settled()
    tensors = _processed(ck)
    go, got, failed = threading.Barrier(2), [], []

    def one() -> None:
        try:
            go.wait(10)
            got.append(publish(str(ck), _key(), tensors, socket_dir=svc.socket_dir))
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            failed.append(e)

    with Sampler(svc):
        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not failed, failed
    assert sorted(g.created for g in got) == [False, True] and got[0].label == got[1].label, got
    pubs = [s for s in svc.status()["slabs"] if s.get("publication")]
    assert len(pubs) == 1 and pubs[0]["state"] == "ready", pubs
    with attach_published(str(ck), _key(), socket_dir=svc.socket_dir) as w:
        assert torch.equal(w.tensors["w2"], tensors["w2"])
