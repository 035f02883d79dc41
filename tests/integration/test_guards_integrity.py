"""Guards of the slabs' content digests against a live service on the host backend (issue 40).

A slab's bytes can change after its load (a bad DIMM, a stray write by the
driver or a kernel bug); the digests recorded at load are what finds it. A
``sitecustomize`` (:data:`_FLIP`) flips one bit of a slab chosen by its label
just before the service seals it, after its digests were taken: the slab
served then differs from its digests, as a slab corrupted in place would.

- ``weightcache verify`` names the tensor whose resident bytes changed and exits
  non-zero (the verify reply carries the list of bad tensors);
- a slab corrupted while it sat in the host tier is not promoted and served:
  the attach gets ``model_load_failed`` with ``cause=digest_mismatch``.

On the host backend both tiers are the same memfd, so a demotion and a
promotion copy nothing and have nothing to check; :data:`_FLIP` with
``WC_TEST_COPY_TIERS`` makes them copy as the CUDA backend's do (a new sealed
memfd each way, the promotion running ``while_copying``: the digests of the
host copy), so that the promotion's check is reached on CI.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from service_harness import SERVICE_DIR, make_config, poll_until, service_env  # noqa: E402
from checkpoints import compare_bytes, ONE_TENSOR_N, ONE_TENSOR_SLAB, read_checkpoint, write_checkpoint  # noqa: E402
from weightcache import attach  # noqa: E402
from weightcache.errors import ModelLoadFailed  # noqa: E402

pytestmark = pytest.mark.timeout(180)

_FLIP = '''
import os
from weightcache.memory import host as _host

_init, _seal = _host.HostWritableSlab.__init__, _host.HostWritableSlab.seal


def __init__(self, size_bytes, label):
    _init(self, size_bytes, label)
    self.test_label = label


def seal(self):
    want = os.environ.get("WC_TEST_FLIP_LABEL")
    if want and self.test_label.startswith(want):  # after the digests were taken, before the seals
        self.buffer[int(os.environ["WC_TEST_FLIP_OFFSET"])] ^= 0x01
        with open(os.environ["WC_TEST_FLIP_LOG"], "a") as f:
            f.write(self.test_label + "\\n")
    return _seal(self)


def _copy(src, label):
    w = _host.HostWritableSlab(src.size_bytes, label)
    view = src.buffer
    try:
        w.buffer[:] = view
    finally:
        view.release()
    return w


def demote(self, sealed, label):
    return _copy(sealed, "host-tier:" + label).seal()


def promote(self, hosted, label, while_copying=None):
    w = _copy(hosted, label)
    if while_copying is not None:
        while_copying()
    return w.seal()


_host.HostWritableSlab.__init__ = __init__
_host.HostWritableSlab.seal = seal
if os.environ.get("WC_TEST_COPY_TIERS"):
    _host.HostBackend.demote = demote
    _host.HostBackend.promote = promote
'''


def _flip_env(tmp_path: Path, label: str, offset: int, copy_tiers: bool = False) -> tuple[dict, Path]:
    """``env=`` for a service that flips bit 0 of byte ``offset`` of the slabs whose label starts with
    ``label`` as they are sealed; returns it and the file listing each flipped slab's label."""
    site = tmp_path / "flip-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_FLIP)
    flipped = tmp_path / "flipped.log"
    flipped.write_text("")
    env = {"PYTHONPATH": f"{site}:{SERVICE_DIR}", "WC_TEST_FLIP_LABEL": label, "WC_TEST_FLIP_OFFSET": str(offset),
           "WC_TEST_FLIP_LOG": str(flipped)}
    if copy_tiers:
        env["WC_TEST_COPY_TIERS"] = "1"
    return env, flipped


def _ckpt(dest: Path, seed: int, n: int = 1024) -> Path:
    g = torch.Generator().manual_seed(seed)
    return write_checkpoint(dest, {"a.weight": torch.randn(n, generator=g), "b.weight": torch.randn(n, generator=g)})


def _verify(svc, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightcache", "verify", *args, "--socket-dir", svc.socket_dir],
                          capture_output=True, text=True, env=service_env(), timeout=60)


def _tensor_at(svc, model: str, offset: int) -> tuple[str, list[str]]:
    """The name of the tensor of ``model``'s slab holding byte ``offset``, and every tensor's name."""
    with attach(model, socket_dir=svc.socket_dir, fallback=False, timeout=30) as w:
        recs = [r for r in w.manifest.tensors if r.alias_of is None]
    (name,) = [r.name for r in recs if r.offset_bytes <= offset < r.offset_bytes + r.size_bytes]
    return name, [r.name for r in recs]


@pytest.mark.parametrize("which", [0, 1])
def test_verify_names_the_tensor_a_flipped_byte_of_the_slab_belongs_to(daemon, tmp_path, which):
    """Invariant: ``weightcache verify`` reports every tensor whose resident bytes differ from their load-time
    digests, and exits 1; the other model, untouched, verifies ok. (A verify reply that dropped its list of
    bad tensors printed ``ok``.)"""
    cks = {"m": _ckpt(tmp_path / "m", 1), "clean": _ckpt(tmp_path / "clean", 2)}
    offset = 4 if which == 0 else 4096 + 4  # a.weight or b.weight (each 4 KiB, 64-byte aligned)
    env, flipped = _flip_env(tmp_path, "m/", offset)
    svc = daemon(make_config(cks), env=env)
    svc.wait_settled()
    assert flipped.read_text() == "m/tp1/rank0\n"
    bad, names = _tensor_at(svc, "m", offset)
    assert bad == names[which]
    r = _verify(svc, "m")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"GPU 0 m tp=1 rank=0: MISMATCH in 1/2 tensors: {bad};" in r.stdout, r.stdout
    r = _verify(svc, "clean")
    assert r.returncode == 0 and "GPU 0 clean tp=1 rank=0: ok, 2 tensors match" in r.stdout, r.stdout + r.stderr
    assert "mismatched=1" in svc.log()


N, SLAB = ONE_TENSOR_N, ONE_TENSOR_SLAB  # a 2 MiB slab per model (tests/checkpoints.py)


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "flipped-in-host-tier"])
def test_a_slab_changed_in_the_host_tier_is_not_promoted(daemon, tmp_path, corrupt):
    """Invariant: a promotion from the host tier checks the host copy against the digests recorded at load.
    ``a`` is demoted to the host tier (its copy flipped there when ``corrupt``) by an attach of ``b`` under a
    budget of one slab; the attach of ``a`` that promotes it is then refused with ``model_load_failed``
    (``cause=digest_mismatch``) instead of serving the changed bytes; an intact copy is promoted and served."""
    g = torch.Generator()
    cks = {n: write_checkpoint(tmp_path / n, {"w": torch.randn(N, generator=g.manual_seed(i))})
           for i, n in enumerate("ab", 1)}
    env, flipped = _flip_env(tmp_path, "host-tier:a/" if corrupt else "no-such-label", 12345, copy_tiers=True)
    svc = daemon(make_config({"a": {"path": cks["a"], "priority": 1}, "b": {"path": cks["b"], "priority": 1}},
                             memory_budget_bytes=SLAB + SLAB // 2, host_tier_bytes=4 * SLAB), env=env)
    svc.wait_settled()

    def tiers() -> dict[str, str]:
        return {s["model"]: f"{s['state']}/{s['tier']}" for s in svc.status()["slabs"]}

    assert tiers() == {"a": "ready/gpu", "b": "on_disk/disk"}
    with attach("b", socket_dir=svc.socket_dir, fallback=False, timeout=60) as w:  # a leaves for the host tier
        compare_bytes(w.tensors, read_checkpoint(cks["b"]))
        assert tiers() == {"a": "hosted/host", "b": "ready/gpu"}
    del w  # its views map b's slab: the budget counts a slab something maps (issue 38, P2) until they go
    gc.collect()
    assert flipped.read_text() == ("host-tier:a/tp1/rank0\n" if corrupt else "")
    poll_until(lambda: not svc.slab("b")["leases"], "the lease on b to end")
    if not corrupt:
        with attach("a", socket_dir=svc.socket_dir, fallback=False, timeout=60) as w:
            compare_bytes(w.tensors, read_checkpoint(cks["a"]))
        assert "promoted model=a" in svc.log() and "copied=yes" in svc.log()
        return
    with pytest.raises(ModelLoadFailed) as e:
        attach("a", socket_dir=svc.socket_dir, fallback=False, timeout=60)
    assert (e.value.code, e.value.details["cause"]) == ("model_load_failed", "digest_mismatch"), (
        json.dumps(e.value.details))
    assert "promoted model=a" not in svc.log()
