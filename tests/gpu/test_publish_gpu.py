"""Publication on the cuda backend (issue 35, DESIGN §6.3), against a real service on GPU 0 (scripts/gpu-check).

- An engine publishes CUDA tensors (a fused tensor, a transposed view, views of one storage, an unaligned view,
  a tied alias, an int buffer); a fresh engine process attaches them by key on ``cuda:0``: bytes, dtypes, shapes
  and strides equal, tied names one tensor, the attrs back, every tensor inside the service's mapping.
- The service owns the bytes: the publisher changing its own tensors after the reply changes nothing an engine
  attaches; the publisher's staging allocation is freed (the GPU's free memory comes back); ``verify`` checks
  the digests recorded at commit on the GPU.
- A memfd sent to the cuda service is ``publication_invalid`` (``reason = "not_vmm"``) and nothing is kept.
- systemd's fd store (stood in for) keeps a CUDA publication across a restart: bytes equal after it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from checkpoints import write_checkpoint  # noqa: E402
from service_harness import FdStoreStandIn, ServiceProcess, make_config, poll_until, to_toml  # noqa: E402
from weightcache import errors, protocol  # noqa: E402
from weightcache.client import publish  # noqa: E402
from weightcache.session import Session  # noqa: E402


def _key() -> dict:
    cap = torch.cuda.get_device_capability(0)
    return {"engine": "test-engine", "engine_version": "1.0", "architecture": "TinyForCausalLM", "dtype": "float32",
            "quantization": {"method": "", "config_blake2b": ""},
            "parallel": {"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "dp_size": 1, "dp_rank": 0,
                         "ep_size": 1, "ep_rank": 0},
            "draft": "", "kernels": {"attention": "flash"}, "compute_capability": f"{cap[0]}.{cap[1]}"}


def _ckpt(dest: Path) -> Path:
    g = torch.Generator().manual_seed(7)
    return write_checkpoint(dest, {"q.weight": torch.randn(64, 512, generator=g),
                                   "k.weight": torch.randn(64, 512, generator=g),
                                   "embed.weight": torch.randn(1024, 512, generator=g)},
                            config={"architectures": ["TinyForCausalLM"], "model_type": "tiny"})


def _processed(ck: Path) -> dict:
    from safetensors.torch import load_file

    raw = {k: v.to("cuda:0") for k, v in load_file(str(ck / "model.safetensors")).items()}
    qk = torch.cat([raw["q.weight"], raw["k.weight"]])
    embed = raw["embed.weight"].clone()
    return {"qk_proj.weight": qk, "qk_proj.weight_t": qk.t(), "q_part": qk[:64], "k_part": qk[64:],
            "odd_view": qk.reshape(-1)[3:11], "embed.weight": embed, "lm_head.weight": embed,
            "positions": torch.arange(5, dtype=torch.int64, device="cuda:0")}


def _status(sock: str) -> dict:
    s = Session(sock, timeout=10)
    try:
        return s.request(protocol.Status()).status
    finally:
        s.close()


_ENGINE = r"""
import json, sys, torch
from weightcache.client import attach_published
ck, sock, key, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
with attach_published(ck, key, socket_dir=sock, device="cuda:0") as w:
    torch.save({k: v.cpu() for k, v in w.tensors.items()}, out)
    base = int(w.tensors["qk_proj.weight"].untyped_storage().data_ptr())
    print(json.dumps({"source": w.source, "tied": w.tensors["lm_head.weight"] is w.tensors["embed.weight"],
                      "attrs": w.layouts["qk_proj.weight"].get("attrs"),
                      "cuda": all(t.is_cuda for t in w.tensors.values()),
                      "one_mapping": all(int(t.untyped_storage().data_ptr()) == base for t in w.tensors.values())}))
"""


def _engine(ck: Path, sock: str, out: Path) -> tuple[dict, dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "service"), str(ROOT / "tests")]))
    r = subprocess.run([sys.executable, "-c", _ENGINE, str(ck), sock, json.dumps(_key()), str(out)],
                       capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), torch.load(out)


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape), name
        assert torch.equal(g.cpu(), w.cpu()), f"bytes of {name} differ"


@pytest.mark.parametrize("cuda_path,via", [("auto", "staging"), ("auto-no-room", "ipc"), ("ipc", "ipc"),
                                           ("staging", "staging")])
def test_a_cuda_publication_is_the_services_own_copy_attached_zero_copy(tmp_path, monkeypatch, cuda_path, via):
    if cuda_path == "auto-no-room":  # the GPU cannot hold a staging copy beside the service's: auto takes IPC
        from weightcache.client import _publish

        monkeypatch.setattr(_publish, "STAGING_MARGIN_BYTES", 1 << 50)
        cuda_path = "auto"
    ck = _ckpt(tmp_path / "ck")
    svc = ServiceProcess(tmp_path / "svc", make_config({"m": ck}, backend="cuda"), gpu=0, backend="cuda").start()
    try:
        svc.wait_settled()
        tensors = _processed(ck)
        want = {k: v.clone() for k, v in tensors.items()}
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info(0)[0]
        got = publish(str(ck), _key(), tensors, attrs={"qk_proj.weight": {"output_dim": 0}}, device="cuda:0",
                      socket_dir=svc.socket_dir, cuda_path=cuda_path)
        assert got.created and got.label.startswith("m/tp1/rank0+pub:")
        # the default stages a copy where the GPU has room, else copies from the publisher's own allocations by
        # CUDA IPC; either way the digests are made by the service's copy
        assert f"via={via} fused_digests=True" in svc.log(), svc.log()[-3000:]
        assert got.size_bytes % (2 << 20) == 0  # the service's own VMM allocation
        # the publisher's staging allocation is gone: only the service's copy is new on the GPU
        free_after = torch.cuda.mem_get_info(0)[0]
        assert free_before - free_after <= got.size_bytes + (64 << 20), (free_before, free_after, got.size_bytes)
        # the publisher changes its own tensors: what engines attach does not change
        for t in tensors.values():
            t.zero_()
        torch.cuda.synchronize()
        info, attached = _engine(ck, svc.socket_dir, tmp_path / "a.pt")
        assert info == {"source": "daemon", "tied": True, "attrs": {"output_dim": 0}, "cuda": True,
                        "one_mapping": True}, info
        _same(attached, want)
        st = _status(svc.socket_path)
        (pub,) = [s for s in st["slabs"] if s.get("publication")]
        assert pub["state"] == "ready" and pub["tensors"] == 8 and pub["resident_bytes"] == got.size_bytes
        # verify: the digests recorded at commit, computed again on the GPU
        r = subprocess.run([sys.executable, "-m", "weightcache", "verify", "--socket-dir", svc.socket_dir,
                            "--gpu", "0", "m"], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT / "service")), timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        svc.stop()


@pytest.mark.parametrize("replaced,room", [(False, True), (True, True), (False, False)])
def test_a_model_moved_into_its_home_is_published_by_the_services_copy_alone(tmp_path, caplog, monkeypatch,
                                                                              replaced, room):
    """What vLLM's publishing load does on a GPU: the built model moved into a VMM allocation of its own laid out
    as the slab (``allocate_home``, ``move_storages``), the checkpoint read into it, then ``publish(home=...)``:
    the allocation goes to the service as it is (no staging copy), bytes equal, digests verified. A tensor the
    processing replaced sends it back to the staging copy, with the same bytes."""
    import logging

    from torch import nn

    from weightcache.client import allocate_home
    from weightcache.integrations.params import move_storages

    ck = _ckpt(tmp_path / "ck")
    svc = ServiceProcess(tmp_path / "svc", make_config({"m": ck}, backend="cuda"), gpu=0, backend="cuda").start()
    try:
        svc.wait_settled()
        model = nn.ParameterDict({f"w{i}": nn.Parameter(torch.empty(3 << 20, device="cuda:0"), requires_grad=False)
                                  for i in range(24)})  # 12 MiB each: one cudaMalloc each
        model.register_buffer("rope", torch.arange(4096, dtype=torch.float32, device="cuda:0"))
        home, copies = allocate_home({**{k: p for k, p in model.items()}, "rope": model.rope}, device="cuda:0")
        assert move_storages(model, home.tensor, copies) == 25
        g = torch.Generator(device="cuda").manual_seed(5)
        for p in model.values():  # the checkpoint read into the moved model
            p.data.normal_(generator=g)
        if not room:  # no room to stage beside it: the home in place all the same, not CUDA IPC
            from weightcache.client import _publish

            monkeypatch.setattr(_publish, "STAGING_MARGIN_BYTES", 1 << 50)
        if replaced:
            model["w3"].data = model["w3"].data * 2  # a tensor the processing made anew
        tensors = {**{k: p.detach() for k, p in model.items()}, "rope": model.rope}
        assert all(t.untyped_storage().data_ptr() == home.ptr for k, t in tensors.items() if k != "w3" or not replaced)
        want = {k: v.clone() for k, v in tensors.items()}
        with caplog.at_level(logging.INFO, logger="weightcache"):
            got = publish(str(ck), _key(), tensors, device="cuda:0", socket_dir=svc.socket_dir, home=home)
        assert got.created
        assert ("publish in place" in caplog.text) is not replaced, caplog.text
        assert "via=staging fused_digests=True" in svc.log(), svc.log()[-3000:]
        for t in tensors.values():  # the publisher's own memory changes: the service's copy does not
            t.zero_()
        torch.cuda.synchronize()
        r = subprocess.run([sys.executable, "-m", "weightcache", "verify", "--socket-dir", svc.socket_dir,
                            "--gpu", "0", "m"], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT / "service")), timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        from weightcache.client import attach_published

        w = attach_published(str(ck), _key(), device="cuda:0", socket_dir=svc.socket_dir)
        try:
            _same(dict(w.tensors), want)
        finally:
            w.close()
    finally:
        svc.stop()


_EXPANDABLE = r"""
import json, sys, torch
from weightcache.client import publish
ck, sock, key = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
w = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
p = publish(ck, key, {"w": w}, device="cuda:0", socket_dir=sock)
print(json.dumps({"created": p.created}))
"""


def test_expandable_segments_cannot_go_by_ipc_and_the_default_stages_a_copy(tmp_path):
    # torch's expandable_segments allocator maps VMM memory, which cuIpcGetMemHandle refuses
    ck = _ckpt(tmp_path / "ck")
    svc = ServiceProcess(tmp_path / "svc", make_config({"m": ck}, backend="cuda"), gpu=0, backend="cuda").start()
    try:
        svc.wait_settled()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "service"), str(ROOT / "tests")]),
                   PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
        r = subprocess.run([sys.executable, "-c", _EXPANDABLE, str(ck), svc.socket_dir, json.dumps(_key())],
                           capture_output=True, text=True, env=env, timeout=180)
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(r.stdout.strip().splitlines()[-1]) == {"created": True}
        assert "via=staging fused_digests=True" in svc.log(), svc.log()[-3000:]
    finally:
        svc.stop()


def test_ipc_copies_outside_their_allocation_are_refused_and_nothing_is_kept(tmp_path):
    from weightcache.client._device import local_backend
    from weightcache.manifest import Manifest, TensorRecord, pack_file
    from weightcache.memory.cuda_publish import IpcSource
    from weightcache.memory.host import sealed_memfd

    ck = _ckpt(tmp_path / "ck")
    svc = ServiceProcess(tmp_path / "svc", make_config({"m": ck}, backend="cuda"), gpu=0, backend="cuda").start()
    try:
        svc.wait_settled()
        w = torch.ones(1 << 20, dtype=torch.uint8, device="cuda:0")  # 1 MiB: a 2 MiB caching-allocator segment
        torch.cuda.synchronize()
        segments, ((seg, off),) = local_backend("cuda:0").ipc_export([w.data_ptr()])
        data = pack_file(Manifest(str(ck), 1, 0, {}, 64 << 20, [TensorRecord("w", "U8", (64 << 20,), (1,), 0,
                                                                               64 << 20)]))
        table = IpcSource(tuple(segments), ((seg, off, 0, 64 << 20),)).to_json()
        fd, tfd = sealed_memfd(data, "manifest"), sealed_memfd(table, "ipc-table")
        try:
            s = Session(svc.socket_path, timeout=30)
            try:
                s.send_with_fds(protocol.PublishCudaIpc(str(ck), 1, 0, _key(), 64 << 20, len(data), len(table)),
                                [tfd, fd])
                with pytest.raises(errors.PublicationInvalid) as e:
                    s.replies(1, 60)
            finally:
                s.close()
        finally:
            os.close(fd)
            os.close(tfd)
        assert e.value.details.get("reason") == "ipc" and "reaches past segment" in str(e.value), e.value.details
        assert not [s for s in _status(svc.socket_path)["slabs"] if s.get("publication")]
        assert svc.proc.poll() is None
    finally:
        svc.stop()


def test_a_memfd_sent_to_the_cuda_service_is_refused_and_nothing_is_kept(tmp_path):
    ck = _ckpt(tmp_path / "ck")
    svc = ServiceProcess(tmp_path / "svc", make_config({"m": ck}, backend="cuda"), gpu=0, backend="cuda").start()
    try:
        svc.wait_settled()
        tensors = {k: v.cpu() for k, v in _processed(ck).items()}
        with pytest.raises(errors.PublicationInvalid) as e:
            publish(str(ck), _key(), tensors, device="cpu", socket_dir=svc.socket_dir)
        assert e.value.details.get("reason") in ("not_vmm", "size"), e.value.details
        assert not [s for s in _status(svc.socket_path)["slabs"] if s.get("publication")]
    finally:
        svc.stop()


def test_the_fd_store_keeps_a_cuda_publication_across_a_restart(tmp_path):
    ck = _ckpt(tmp_path / "ck")
    want = {k: v.clone() for k, v in _processed(ck).items()}
    cfg, listen, log = tmp_path / "weightcache.toml", tmp_path / "0.sock", tmp_path / "serve.log"
    cfg.write_text(to_toml(make_config({"m": ck}, backend="cuda")))
    with FdStoreStandIn(tmp_path / "notify") as store:
        first = store.serve(cfg, listen, log, backend="cuda")
        store.collect(2, log=log.read_text)  # the configured slab
        publish(str(ck), _key(), _processed(ck), device="cuda:0", socket_dir=str(tmp_path))
        stored = store.collect(4, log=log.read_text)
        assert sum(n.startswith("slab-") for n in stored) == 2
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0, log.read_text()
        second = store.serve(cfg, listen, log, backend="cuda")

        def adopted() -> dict | None:
            assert second.poll() is None, log.read_text()
            store.drain()
            try:
                st = _status(str(listen)) if listen.exists() else None
            except errors.DaemonUnavailable:
                return None
            if st and len(st["slabs"]) == 2 and all(s["state"] == "ready" for s in st["slabs"]):
                return st
            return None

        st = poll_until(adopted, "the restarted service to adopt both slabs", 120, detail=log.read_text)
        assert all(s["adopted"] for s in st["slabs"]), log.read_text()
        _, attached = _engine(ck, str(tmp_path), tmp_path / "b.pt")
        _same(attached, want)
