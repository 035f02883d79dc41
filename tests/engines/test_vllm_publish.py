"""``--load-format weightcache_publish`` against vLLM's CPU build (issue 35, part 1): vLLM's own load is published,
and the next engine start attaches it by its engine key.

Run by the ``.venv-vllm`` interpreter, like test_vllm.py (each engine in its own subprocess, float32, greedy),
with a real host-backend service. The model is a tiny Qwen3 (q/k norms, an architecture without weightcache's
own layout rules): the first start loads with vLLM's default loader, publishes (its log says so) and gives the
default loader's tokens with its parameters moved onto the service's slab; the second start attaches the
publication (``weightcache attached published``), every parameter inside the service's memfd mapping, the same
tokens; the service lists the publication. ``weightcache publish`` does the first start's part on its own.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this interpreter; `make test` runs these under .venv-vllm next")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import engine_checkpoints  # noqa: E402
from test_vllm import harness, log_lines, run_engine, tokens_of  # noqa: E402

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def workdir():
    d = Path(tempfile.mkdtemp(prefix="wc-vpub-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def qwen3(workdir: Path) -> Path:
    """Tiny Qwen3ForCausalLM (engine_checkpoints.py), float32, tied embeddings, q/k norms; head_dim 32."""
    return engine_checkpoints.build(workdir / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def service(workdir: Path, qwen3: Path):
    svc = harness.start_service(workdir / "up", {"qwen3": {"path": qwen3, "dtype": "float32"}})
    try:
        svc.wait_settled()
        yield svc
    finally:
        svc.kill()


@pytest.fixture(scope="module")
def reference(qwen3: Path) -> list[list[int]]:
    """vLLM's default loader's greedy tokens."""
    return tokens_of(*run_engine(qwen3))


def test_first_start_publishes_second_attaches_the_publication(service, qwen3, reference):
    extra = {"socket_dir": service.socket_dir}
    first, out1 = run_engine(qwen3, load_format="weightcache_publish", extra=extra, probe=True)
    assert tokens_of(first, out1) == reference
    assert len(log_lines(out1, "weightcache published")) == 1, out1[-6000:]
    assert " created=True " in log_lines(out1, "weightcache published")[0]
    (probe1,) = first["probe"]
    assert probe1["params"] > 0 and probe1["outside"] == [], probe1  # the publisher moved onto the slab
    pubs = [s for s in harness_status(service)["slabs"] if s["tensors"] and s["state"] == "ready"
            and s["model"] == "qwen3" and s.get("adopted") is False]
    assert len(pubs) == 2, pubs  # the service's own slab of the checkpoint, and the publication
    second, out2 = run_engine(qwen3, load_format="weightcache_publish", extra=extra, probe=True)
    assert tokens_of(second, out2) == reference
    assert len(log_lines(out2, "weightcache attached published")) == 1, out2[-6000:]
    assert not log_lines(out2, "weightcache published ")
    (probe2,) = second["probe"]
    assert probe2["params"] == probe1["params"] and probe2["outside"] == [], probe2


def test_a_publication_survives_a_stop_through_its_image(workdir, qwen3, reference):
    """Issue 36: the first engine publishes, the service writes the publication's image and is stopped (no fd
    store: the slab is gone), a new service brings it back from the image before any engine asks, and the
    next engine attaches it by its key (``weightcache attached published``, no load and no publish of its own)
    with the default loader's tokens."""
    images = workdir / "images-stop"
    cfg = {"qwen3": {"path": qwen3, "dtype": "float32"}}
    first_svc = harness.start_service(workdir / "img1", cfg, image_dir=str(images))
    try:
        first_svc.wait_settled()
        first, out1 = run_engine(qwen3, load_format="weightcache_publish",
                                 extra={"socket_dir": first_svc.socket_dir})
        assert tokens_of(first, out1) == reference
        assert len(log_lines(out1, "weightcache published")) == 1, out1[-6000:]
        harness.poll_until(lambda: any(".pub-" in p.name and not p.name.startswith(".") and
                                       p.name.endswith(".safetensors") for p in images.iterdir()),
                           "the publication's image", 120, detail=first_svc.log)
    finally:
        first_svc.stop()
    second_svc = harness.start_service(workdir / "img2", cfg, image_dir=str(images))
    try:
        slabs = second_svc.wait_settled()["slabs"]
        pubs = [s for s in slabs if s.get("publication")]
        assert [(s["state"], s["source"]) for s in pubs] == [("ready", "image")], second_svc.log()
        second, out2 = run_engine(qwen3, load_format="weightcache_publish", extra={"socket_dir": second_svc.socket_dir},
                                  probe=True)
        assert tokens_of(second, out2) == reference
        assert len(log_lines(out2, "weightcache attached published")) == 1, out2[-6000:]
        assert not log_lines(out2, "weightcache published ")
        (probe,) = second["probe"]
        assert probe["params"] > 0 and probe["outside"] == [], probe  # every parameter in the service's slab
    finally:
        second_svc.kill()


def test_no_service_is_vllms_default_load(workdir, qwen3, reference):
    """The loader never stops an engine the default loader starts: no service, the reason logged, same tokens."""
    result, out = run_engine(qwen3, load_format="weightcache_publish", extra={"socket_dir": str(workdir / "none")})
    assert tokens_of(result, out) == reference
    assert log_lines(out, "daemon_unavailable"), out[-4000:]


def test_cli_publish_then_an_engine_attaches(workdir, qwen3, reference):
    """``weightcache publish MODEL --tp 1`` (the engine's interpreter, the plugin's code path) publishes; an engine
    started afterwards attaches the publication and gives the default loader's tokens."""
    import os
    import subprocess

    svc = harness.start_service(workdir / "cli", {"qwen3": {"path": qwen3, "dtype": "float32"}})
    try:
        svc.wait_settled()
        env = harness.service_env({"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                   "VLLM_RPC_BASE_PATH": tempfile.mkdtemp(prefix="wc-vllm-rpc-")})
        p = subprocess.run([sys.executable, "-m", "weightcache", "publish", str(qwen3), "--tp", "1", "--dtype",
                            "float32", "--socket-dir", svc.socket_dir], capture_output=True, text=True, env=env,
                           timeout=600, stdin=subprocess.DEVNULL, cwd=os.getcwd())
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-6000:]
        assert "qwen3 tp=1 rank=0 published:" in p.stdout, p.stdout[-2000:]
        assert log_lines(p.stdout + p.stderr, "weightcache published")
        result, out = run_engine(qwen3, load_format="weightcache_publish", extra={"socket_dir": svc.socket_dir})
        assert tokens_of(result, out) == reference
        assert len(log_lines(out, "weightcache attached published")) == 1, out[-6000:]
    finally:
        svc.kill()


def harness_status(svc) -> dict:
    from weightcache import protocol

    return svc.request(protocol.Status()).status


@pytest.mark.slow
def test_tp2_every_rank_publishes_its_own_slab_and_attaches_it(workdir, qwen3):
    """TP 2 (two CPU workers, both ranks on instance 0): each rank publishes its own slab under its own engine key
    (tp_rank differs); the second start attaches both, the default loader's tokens at TP 2."""
    svc = harness.start_service(workdir / "tp2", {"qwen3": {"path": qwen3, "dtype": "float32"}})
    try:
        svc.wait_settled()
        expected = tokens_of(*run_engine(qwen3, multiprocess=True, tp=2))
        extra = {"socket_dir": svc.socket_dir}
        first, out1 = run_engine(qwen3, load_format="weightcache_publish", multiprocess=True, tp=2, extra=extra)
        assert tokens_of(first, out1) == expected
        assert len(log_lines(out1, "weightcache published")) == 2, out1[-6000:]
        pubs = [s for s in harness_status(svc)["slabs"] if s.get("publication")]
        assert sorted((s["tp_size"], s["tp_rank"]) for s in pubs) == [(2, 0), (2, 1)], pubs
        assert len({s["publication"]["engine_key_blake2b"] for s in pubs}) == 2
        second, out2 = run_engine(qwen3, load_format="weightcache_publish", multiprocess=True, tp=2, extra=extra,
                                  probe=True)
        assert tokens_of(second, out2) == expected
        attached = log_lines(out2, "weightcache attached published")
        assert sorted("tp_rank=1" in ln for ln in attached) == [False, True], out2[-6000:]
        assert len(second["probe"]) == 2 and all(p["params"] > 0 and p["outside"] == [] for p in second["probe"])
    finally:
        svc.kill()


#: Architectures weightcache has no layout rules for (tests/engines/engine_checkpoints.py): MoE (Qwen3-MoE; OLMoE, with
#: q/k norms; DeepSeek-V3, with MLA), a checkpoint that stores fused tensors (Phi-3: qkv_proj, gate_up_proj), Gemma 2
#: (soft-capping, sliding window), Granite (scaled residuals).
OTHERS = {f: engine_checkpoints.CONFIGS[f] for f in ("qwen3_moe", "phi3", "olmoe", "deepseek_v3", "gemma2", "granite")}


def _tiny(dest: Path, family: str) -> Path:
    """engine_checkpoints.build (the bytes test_vllm_waiting_for_engine.py builds too, so one default-loader run
    serves both); DeepSeek-V3 as it was first written here (seed 5, transformers' own norms)."""
    if family != "deepseek_v3":
        return engine_checkpoints.build(dest, family)
    import torch
    import transformers

    cls, fields = OTHERS[family]
    config = getattr(transformers, cls)(initializer_range=0.1, **fields)
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(dest)
    return dest


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(OTHERS))
def test_other_architectures_publish_then_attach(workdir, family):
    ck = _tiny(workdir / family, family)
    dtype = "bfloat16" if family == "deepseek_v3" else "float32"  # vLLM CPU's MLA MoE kernel takes bf16 weights
    svc = harness.start_service(workdir / f"s-{family}", {family: {"path": ck, "dtype": dtype}})
    try:
        svc.wait_settled()
        expected = tokens_of(*run_engine(ck, dtype=dtype))
        extra = {"socket_dir": svc.socket_dir}
        first, out1 = run_engine(ck, dtype=dtype, load_format="weightcache_publish", extra=extra)
        assert tokens_of(first, out1) == expected
        assert len(log_lines(out1, "weightcache published")) == 1, out1[-6000:]
        second, out2 = run_engine(ck, dtype=dtype, load_format="weightcache_publish", extra=extra, probe=True)
        assert tokens_of(second, out2) == expected
        if family == "deepseek_v3":  # vLLM 0.32's MLA processing cannot take them pre-processed: its own load, moved
            assert log_lines(out2, "weightcache publication not usable"), out2[-6000:]
            assert " created=False " in log_lines(out2, "weightcache published")[0]
        else:
            assert len(log_lines(out2, "weightcache attached published")) == 1, out2[-6000:]
        (probe,) = second["probe"]
        # vLLM's MLA processing empties kv_b_proj.weight (its absorbed matrices replace it): no bytes to share
        emptied = [n for n in probe["outside"] if family == "deepseek_v3" and n.endswith("kv_b_proj.weight")]
        assert probe["params"] > 0 and probe["outside"] == emptied, probe
    finally:
        svc.kill()


@pytest.mark.slow
def test_modelopt_fp8_publishes_and_the_next_start_moves_onto_it(workdir):
    """ModelOpt FP8 per-channel (vLLM 0.32's method cannot take pre-processed weights): the first start publishes;
    the second hears why the publication cannot be registered before processing, loads with vLLM's own loader
    (same tokens), finds its publication already held (created=False) and moves onto it."""
    from test_vllm import _fp8_config, fp8_fixtures

    mp = pytest.MonkeyPatch()
    mp.setattr(fp8_fixtures, "tiny_llama_config", _fp8_config)
    try:
        ck = fp8_fixtures.write_fp8_per_channel(workdir / "fp8pc")
    finally:
        mp.undo()
    svc = harness.start_service(workdir / "s-fp8", {"fp8pc": {"path": ck, "dtype": "bfloat16"}})
    try:
        svc.wait_settled()
        expected = tokens_of(*run_engine(ck, dtype="bfloat16"))
        extra = {"socket_dir": svc.socket_dir}
        first, out1 = run_engine(ck, dtype="bfloat16", load_format="weightcache_publish", extra=extra)
        assert tokens_of(first, out1) == expected
        assert " created=True " in log_lines(out1, "weightcache published")[0]
        second, out2 = run_engine(ck, dtype="bfloat16", load_format="weightcache_publish", extra=extra, probe=True)
        assert tokens_of(second, out2) == expected
        assert log_lines(out2, "weightcache publication not usable"), out2[-6000:]
        assert " created=False " in log_lines(out2, "weightcache published")[0]
        (probe,) = second["probe"]
        assert probe["params"] > 0 and probe["outside"] == [], probe
    finally:
        svc.kill()


@pytest.mark.slow
def test_modelopt_fp8_at_tp2_every_rank_publishes_and_moves_onto_it(workdir):
    """ModelOpt FP8 per-channel at TP 2 (both ranks on instance 0) with the README's recipe: ``naming = "vllm"`` and
    ``--load-format weightcache``, ``fallback`` left at its default (true). The service's own FP8 slabs serve TP 1
    only, and vLLM 0.32's method lacks ``supports_pre_processed_weights``: each rank takes the publication path
    (``reason=config_invalid: tensor parallelism``) and publishes its own slab (the default loader's tokens at
    TP 2); the second start cannot register them before vLLM 0.32's processing, loads with vLLM's own loader, finds
    each rank's publication held (``created=False``) and moves onto it: every parameter of both ranks inside the
    service's mapping. Nothing falls back to vLLM's default loader unpublished."""
    from test_vllm import _fp8_config, fp8_fixtures

    mp = pytest.MonkeyPatch()
    mp.setattr(fp8_fixtures, "tiny_llama_config", _fp8_config)
    try:
        ck = fp8_fixtures.write_fp8_per_channel(workdir / "fp8pc-tp2")
    finally:
        mp.undo()
    svc = harness.start_service(workdir / "s-fp8tp2", {"fp8pc": {"path": ck, "dtype": "bfloat16", "naming": "vllm",
                                                                 "layouts": [{"tp": 2, "gpus": [0, 0]}]}})
    try:
        svc.wait_settled()
        expected = tokens_of(*run_engine(ck, dtype="bfloat16", multiprocess=True, tp=2))
        extra = {"socket_dir": svc.socket_dir}
        first, out1 = run_engine(ck, dtype="bfloat16", load_format="weightcache", multiprocess=True, tp=2,
                                 extra=extra)
        assert tokens_of(first, out1) == expected
        why = log_lines(out1, "weightcache takes the publication path")
        assert len(why) == 2 and all("reason=config_invalid: tensor parallelism (tp_size=2)" in ln for ln in why), \
            out1[-6000:]
        lines = log_lines(out1, "weightcache published")
        assert sorted("tp_rank=1" in ln for ln in lines) == [False, True] and all(" created=True " in ln
                                                                                 for ln in lines), out1[-6000:]
        assert not log_lines(out1, "weightcache cannot serve")
        pubs = [s for s in harness_status(svc)["slabs"] if s.get("publication")]
        assert sorted((s["tp_size"], s["tp_rank"]) for s in pubs) == [(2, 0), (2, 1)], pubs
        second, out2 = run_engine(ck, dtype="bfloat16", load_format="weightcache", multiprocess=True, tp=2,
                                  extra=extra, probe=True)
        assert tokens_of(second, out2) == expected
        lines = log_lines(out2, "weightcache published")
        assert len(lines) == 2 and all(" created=False " in ln for ln in lines), out2[-6000:]
        assert len(second["probe"]) == 2 and all(p["params"] > 0 and p["outside"] == [] for p in second["probe"])
    finally:
        svc.kill()


# --- the loader's helpers (in this process) -------------------------------------------------


def test_parse_extra_config_defaults_and_rejections():
    from weightcache.errors import ConfigError
    from weightcache.integrations.vllm_publish import parse_extra_config

    assert parse_extra_config(None) == {"socket_dir": None, "gpu": None, "timeout_s": 60.0}
    for bad in ({"fallback": True}, {"gpu": "0"}, {"timeout_s": True}):
        with pytest.raises(ConfigError) as e:
            parse_extra_config(bad)
        assert e.value.code == "config_invalid" and e.value.details["key"] == next(iter(bad))


def test_collect_keeps_json_attributes_and_slots_leaves_computed_buffers_alone():
    """What is published: every parameter and buffer, tied names each, JSON-able attributes only; what an attach
    registers: every parameter, and only the buffers still on meta (vLLM writes the ones it computed)."""
    import torch
    from torch import nn

    from weightcache.integrations.vllm_publish import _slots, collect

    m = nn.Module()
    m.w = nn.Parameter(torch.ones(2, 2), requires_grad=False)
    m.w.output_dim, m.w.weight_loader, m.w.nan = 0, print, float("nan")
    m.register_buffer("cache", torch.arange(3.0))
    m.register_buffer("empty", torch.empty(2, device="meta"))
    m.tied = m.w
    tensors, attrs = collect(m)
    assert sorted(tensors) == ["cache", "empty", "tied", "w"] and attrs == {"w": {"output_dim": 0},
                                                                         "tied": {"output_dim": 0}}
    assert sorted(_slots(m, tensors)) == ["empty", "tied", "w"]
    assert sorted(_slots(m, tensors, buffers=False)) == ["tied", "w"]


def test_leaving_the_home_copies_out_its_buffers_and_names_parameters_left_there(monkeypatch):
    """After the engine moved onto the published slab, what is still in its publication home (the allocation the
    built model was moved into, docs/engines.md): buffers (vLLM's own, e.g. rotary caches) are copied out with
    their values, so the home can be freed; a parameter still there is named in a warning."""
    import types

    import torch
    from torch import nn

    from weightcache.client import pack
    from weightcache.integrations import vllm_publish
    from weightcache.integrations.params import move_storages
    from weightcache.integrations.vllm_publish import _leave_home, collect

    warned: list[str] = []
    monkeypatch.setattr(vllm_publish.log, "warning", lambda msg, *args, **kw: warned.append(msg % args))

    m = nn.Module()
    m.w = nn.Parameter(torch.randn(64, 64), requires_grad=False)
    m.v = nn.Parameter(torch.randn(64, 64), requires_grad=False)
    m.register_buffer("rope", torch.arange(128.0))
    tensors, _ = collect(m)
    _, slab_bytes, copies = pack(tensors)
    dest = torch.zeros(slab_bytes, dtype=torch.uint8)
    move_storages(m, dest, copies)
    m.w.data = m.w.data.clone()  # as if registered onto the published slab
    _leave_home(m, types.SimpleNamespace(ptr=dest.data_ptr()))
    assert m.rope.untyped_storage().data_ptr() != dest.data_ptr()
    assert torch.equal(m.rope, torch.arange(128.0))
    assert warned == ["weightcache publication home kept alive by parameters not on the slab: v"]


def test_leaving_the_home_reaches_buffers_and_parameters_of_submodules(monkeypatch):
    """vLLM keeps its rotary caches in submodules (``model.layers.0.self_attn.rotary_emb``): leaving the home
    copies those buffers out with their values too, and names a parameter left there by its full name."""
    import types

    import torch
    from torch import nn

    from weightcache.client import pack
    from weightcache.integrations import vllm_publish
    from weightcache.integrations.params import move_storages
    from weightcache.integrations.vllm_publish import _leave_home, collect

    warned: list[str] = []
    monkeypatch.setattr(vllm_publish.log, "warning", lambda msg, *args, **kw: warned.append(msg % args))

    m = nn.Module()
    m.layers = nn.ModuleList([nn.Module() for _ in range(2)])
    for i, layer in enumerate(m.layers):
        layer.w = nn.Parameter(torch.full((32, 32), float(i)), requires_grad=False)
        layer.rotary = nn.Module()
        layer.rotary.register_buffer("cos_sin", torch.arange(64.0) + 100 * i, persistent=False)
    tensors, _ = collect(m)
    _, slab_bytes, copies = pack(tensors)
    dest = torch.zeros(slab_bytes, dtype=torch.uint8)
    move_storages(m, dest, copies)
    assert all(b.untyped_storage().data_ptr() == dest.data_ptr() for b in m.buffers())
    m.layers[0].w.data = m.layers[0].w.data.clone()  # as if registered onto the published slab
    _leave_home(m, types.SimpleNamespace(ptr=dest.data_ptr()))
    for i, layer in enumerate(m.layers):
        assert layer.rotary.cos_sin.untyped_storage().data_ptr() != dest.data_ptr(), i
        assert torch.equal(layer.rotary.cos_sin, torch.arange(64.0) + 100 * i), i
    dest.zero_()  # the home's bytes are no longer what the buffers read
    assert torch.equal(m.layers[1].rotary.cos_sin, torch.arange(64.0) + 100)
    assert warned == ["weightcache publication home kept alive by parameters not on the slab: layers.1.w"]


def test_publishes_after_only_when_none_is_held_for_this_engine(qwen3, tmp_path):
    """After which ``attach_published`` answers an engine loads and publishes (none held for its key, or another
    key held) and after which it only loads (no service, the model not configured there, refused); and which
    checkpoints ``--load-format weightcache`` sends down that path (no vLLM naming rules)."""
    from weightcache import errors
    from weightcache.integrations.vllm import engine_lays_out
    from weightcache.integrations.vllm_publish import publishes_after

    assert publishes_after(errors.ModelNotFound("none yet", publication="none"))
    assert publishes_after(errors.CacheKeyMismatch("other key", fields=["engine_version"]))
    assert not publishes_after(errors.ModelNotFound("not configured here", model="x"))
    assert not publishes_after(errors.DaemonUnavailable("no service"))
    assert not publishes_after(errors.AccessDenied("not on the allow lists"))
    assert engine_lays_out(str(qwen3))  # Qwen3: no vLLM naming rules in weightcache
    import checkpoints

    assert not engine_lays_out(str(checkpoints.llama_checkpoint(tmp_path / "llama")))  # the service lays it out


def test_external_weight_memory_is_the_held_publications_size_else_zero():
    """What ``get_external_weight_memory`` answers on the publication path, from what ``attach_published``
    answered: a held publication (attached, or moved onto) is resident before vLLM's memory snapshot, outside its
    allocator: its size. None held (this start publishes: the service allocates it after the snapshot, which
    counts it) or no service to take part: 0, never the checkpoint's or the publication's bytes twice."""
    from weightcache import errors
    from weightcache.integrations.vllm_publish import EXTERNAL_BYTES, Plan, external_bytes, plan_after

    assert set(EXTERNAL_BYTES) == set(Plan)
    assert plan_after(None) is Plan.ATTACH
    assert plan_after(errors.ModelNotFound("none yet", publication="none")) is Plan.PUBLISH
    assert plan_after(errors.CacheKeyMismatch("other key", fields=["engine_version"])) is Plan.PUBLISH
    for refused in (errors.DaemonUnavailable("no service"), errors.AccessDenied("not on the allow lists"),
                    errors.ModelNotFound("not configured here", model="x")):
        assert plan_after(refused) is Plan.DEFAULT, refused
    assert external_bytes(Plan.ATTACH, 17 << 20) == 17 << 20
    assert external_bytes(Plan.PUBLISH, 0) == external_bytes(Plan.DEFAULT, 0) == 0
    assert external_bytes(Plan.PUBLISH, 17 << 20) == 0  # never counted twice, whatever is passed


def test_profilers_attachment_is_taken_once_and_only_under_its_key():
    """The attachment ``get_external_weight_memory`` made is the load's (one attach per engine start), taken once,
    and only when the load works out the same engine key; one of another key is closed, not used."""
    from weightcache.integrations import vllm_publish as vp

    slot = vp._Slot("/srv/models/qwen3", 0, "cpu", 1, 0)

    class Lease:  # an Attachment's close(), which is all the profiler's table uses of it
        closed = False

        def close(self):
            self.closed = True

    key = {"engine": "vllm", "parallel": {"tp_size": 1, "tp_rank": 0}}
    kept = Lease()
    vp._PROFILED[slot] = (key, kept)
    assert vp._take_profiled(slot, dict(key)) is kept and not kept.closed
    assert vp._take_profiled(slot, key) is None  # taken once
    other = Lease()
    vp._PROFILED[slot] = (key, other)
    assert vp._take_profiled(slot, {**key, "engine_version": "0.0"}) is None and other.closed
    assert slot not in vp._PROFILED
