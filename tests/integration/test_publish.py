"""Publication (issue 35, part 1): an engine hands the service the tensors it processed, and attaches them by key.

Against a real service (host backend) over its socket, with real memfds:

- publish, then attach by the engine key: every name's bytes, dtype, shape and strides equal the published
  tensors (a fused tensor, a transposed view, views of one storage, an unaligned view, a tied alias), tied names
  are one tensor, the attrs come back, and the service's slab is sealed (a writable mapping fails);
- the slab is a slab like any other: ``status`` shows it with its label, ``verify`` checks its digests;
- a memfd still mapped writable is refused (``slab_still_mapped``) and nothing is kept;
- another engine key is ``cache_key_mismatch`` naming the differing fields; none published is
  ``model_not_found`` with ``publication = "none"``;
- two identical publications end with one slab; ``evict`` frees it;
- trust: an untrusted uid's publication is private to it (another uid never attaches it), and with
  ``publishers`` set it is refused (``access_denied``) and changes nothing;
- the fd store keeps a publication across a restart: publish, restart, attach, bytes equal.
"""

from __future__ import annotations

import contextlib
import copy
import json
import mmap
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from checkpoints import write_checkpoint  # noqa: E402
from service_harness import FdStoreStandIn, make_config, poll_until, service_env, to_toml  # noqa: E402
from weightcache import errors, protocol  # noqa: E402
from weightcache.client import attach_published, publish  # noqa: E402
from weightcache.client._publish import pack  # noqa: E402
from weightcache.session import Session  # noqa: E402

pytestmark = pytest.mark.timeout(180)

NOBODY = 65534


def _key(**over) -> dict:
    key = {"engine": "test-engine", "engine_version": "1.0", "architecture": "TinyForCausalLM", "dtype": "float32",
           "quantization": {"method": "", "config_blake2b": ""},
           "parallel": {"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "dp_size": 1, "dp_rank": 0,
                        "ep_size": 1, "ep_rank": 0},
           "draft": "", "kernels": {"attention": "torch_sdpa"}, "compute_capability": ""}
    key.update(over)
    return key


def _ckpt(dest: Path) -> Path:
    g = torch.Generator().manual_seed(7)
    return write_checkpoint(dest, {"q.weight": torch.randn(4, 8, generator=g), "k.weight": torch.randn(4, 8, generator=g),
                                   "embed.weight": torch.randn(16, 8, generator=g)},
                            config={"architectures": ["TinyForCausalLM"], "model_type": "tiny"})


def _processed(ck: Path) -> dict:
    """What an engine's processing might leave: a fused tensor, its transposed view, views of one storage, an
    unaligned view, a tied alias, an int buffer."""
    from safetensors.torch import load_file

    raw = load_file(str(ck / "model.safetensors"))
    qk = torch.cat([raw["q.weight"], raw["k.weight"]])  # [8, 8] fused
    embed = raw["embed.weight"].clone()
    return {"qk_proj.weight": qk, "qk_proj.weight_t": qk.t(), "q_part": qk[:4], "k_part": qk[4:],
            "odd_view": qk.reshape(-1)[3:11], "embed.weight": embed, "lm_head.weight": embed,
            "positions": torch.arange(5, dtype=torch.int64)}


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape) and tuple(g.stride()) == tuple(w.stride()), name
        assert torch.equal(g, w), f"bytes of {name} differ"


def _status(svc_or_path) -> dict:
    s = Session(getattr(svc_or_path, "socket_path", str(svc_or_path)), timeout=10)
    try:
        return s.request(protocol.Status()).status
    finally:
        s.close()


@pytest.fixture
def served(daemon, tmp_path):
    ck = _ckpt(tmp_path / "ck")
    svc = daemon({"m": str(ck)})
    svc.wait_settled()
    return svc, ck


def _fd_target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own fd, closed
        return ""


def test_publish_then_attach_by_key_gives_the_published_bytes_zero_copy(served):
    svc, ck = served
    tensors = _processed(ck)
    before = {f for f in os.listdir("/proc/self/fd") if "weightcache:publish" in _fd_target(f)}  # others' leftovers
    got = publish(str(ck), _key(), tensors, attrs={"qk_proj.weight": {"output_dim": 0}},
                  socket_dir=svc.socket_dir)
    assert got.created and got.label.startswith("m/tp1/rank0+pub:")
    held = [f for f in os.listdir("/proc/self/fd") if "weightcache:publish" in _fd_target(f)]
    assert set(held) <= before, "the publisher keeps no fd of what it sent (the slab's memfd, the manifest file)"
    with attach_published(str(ck), _key(), socket_dir=svc.socket_dir) as w:
        assert w.source == "daemon" and w.resident_bytes > 0
        _same(w.tensors, tensors)
        assert w.tensors["lm_head.weight"] is w.tensors["embed.weight"]  # a tied weight stays one tensor
        assert w.layouts["qk_proj.weight"]["attrs"] == {"output_dim": 0}
        # views of one storage share the slab's bytes: q_part is the first half of qk_proj.weight
        assert w.tensors["q_part"].data_ptr() == w.tensors["qk_proj.weight"].data_ptr()
        assert w.tensors["qk_proj.weight_t"].data_ptr() == w.tensors["qk_proj.weight"].data_ptr()
    # the slab is a slab like any other: status lists it, verify checks the digests recorded at commit
    st = _status(svc)
    (pub,) = [s for s in st["slabs"] if s.get("publication")]
    assert pub["resident_bytes"] > 0 and pub["state"] == "ready" and pub["tensors"] == 8
    assert pub["publication"]["engine"] == "test-engine" and pub["publication"]["shared"] is True
    assert pub["publication"]["engine_key_blake2b"] == got.engine_key_blake2b
    # the operator's view: weightcache status names the publication
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "weightcache", "status", "--socket-dir", svc.socket_dir, "--gpu", "0"],
                         capture_output=True, text=True, timeout=60, env=service_env(), check=False).stdout
    assert f"m tp=1 rank=0 published:{got.engine_key_blake2b[:8]}" in out and "published by test-engine 1.0" in out, out
    s = Session(svc.socket_path, timeout=30)
    try:
        res = s.request(protocol.Verify("m")).results
    finally:
        s.close()
    checked = [r for r in res if r["tensors"] == 8]
    assert checked and checked[0]["mismatched"] == []
    # metrics: the attach by key is counted as an attach served by the service
    s = Session(svc.socket_path, timeout=10)
    try:
        counters = s.request(protocol.Metrics()).counters
    finally:
        s.close()
    assert {"model": "m", "outcome": "daemon", "code": "", "count": 1} in counters["attaches"]


def test_the_service_owns_the_bytes_sealed(served):
    """After publish no process can write them: a writable mapping of the slab fd an attach gets fails."""
    svc, ck = served
    publish(str(ck), _key(), _processed(ck), socket_dir=svc.socket_dir)
    s = Session(svc.socket_path, timeout=10)
    try:
        s.request(protocol.AttachPublished(os.path.realpath(ck), 1, 0, _key()))
        fd, mfd = s.last_fds
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
            os.close(mfd)
    finally:
        s.close()


def _raw_publish(svc, ck, slab_fd: int, key: dict | None = None) -> protocol.Message:
    """Sends ``publish`` with ``slab_fd`` and a manifest of one 16-byte tensor; returns the reply (or raises)."""
    from weightcache.manifest import Manifest, TensorRecord, pack_file
    from weightcache.memory.host import sealed_memfd

    data = pack_file(Manifest("m", 1, 0, {}, 256, [TensorRecord("t", "F32", (4,), (1,), 0, 16)]))
    mfd = sealed_memfd(data, "test-manifest")
    s = Session(svc.socket_path, timeout=10)
    try:
        s.send_with_fds(protocol.Publish(os.path.realpath(ck), 1, 0, key or _key(), os.fstat(slab_fd).st_size,
                                         len(data)), [slab_fd, mfd])
        return s.replies(1)[0]
    finally:
        s.close()
        os.close(mfd)


def test_a_memfd_still_mapped_writable_is_refused_and_nothing_is_kept(served):
    svc, ck = served
    before = len(_status(svc)["slabs"])
    fd = os.memfd_create("pub", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    mm = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        with pytest.raises(errors.SlabStillMapped) as e:
            _raw_publish(svc, ck, fd)
        assert e.value.code == "slab_still_mapped"
    finally:
        mm.close()
    assert len(_status(svc)["slabs"]) == before
    # a memfd made without MFD_ALLOW_SEALING cannot be sealed; a plain file is no memfd
    nosl = os.memfd_create("pub", os.MFD_CLOEXEC)
    os.ftruncate(nosl, 4096)
    with pytest.raises(errors.PublicationInvalid) as e:
        _raw_publish(svc, ck, nosl)
    assert e.value.details["reason"] == "not_sealable"
    os.close(nosl)
    # once unmapped, the same memfd is taken
    assert _raw_publish(svc, ck, fd).created
    os.close(fd)
    assert len(_status(svc)["slabs"]) == before + 1


def test_cuda_ipc_to_the_host_backend_is_refused_and_the_default_publish_still_works(served):
    from weightcache.manifest import Manifest, TensorRecord, pack_file
    from weightcache.memory.host import sealed_memfd

    svc, ck = served
    before = len(_status(svc)["slabs"])
    data = pack_file(Manifest("m", 1, 0, {}, 256, [TensorRecord("t", "F32", (4,), (1,), 0, 16)]))
    mfd = sealed_memfd(data, "test-manifest")
    table = b'{"segments":["' + b"00" * 64 + b'"],"copies":[[0,0,0,16]]}'
    tfd = sealed_memfd(table, "test-ipc-table")
    s = Session(svc.socket_path, timeout=10)
    try:
        caps = s.hello.capabilities
        s.send_with_fds(protocol.PublishCudaIpc(os.path.realpath(ck), 1, 0, _key(), 2 << 20, len(data), len(table)),
                        [tfd, mfd])
        with pytest.raises(errors.PublicationInvalid) as e:
            s.replies(1)
    finally:
        s.close()
        os.close(mfd)
        os.close(tfd)
    assert e.value.details == {"reason": "backend", "backend": "host"}
    assert "takes no CUDA IPC publication" in str(e.value)
    assert "publish" in caps and "publish_cuda_ipc" not in caps  # a host service offers no CUDA IPC
    assert len(_status(svc)["slabs"]) == before
    got = publish(str(ck), _key(), _processed(ck), socket_dir=svc.socket_dir)  # the host path is untouched
    assert got.created


def test_another_engine_key_is_a_mismatch_naming_the_fields_and_none_is_model_not_found(served):
    svc, ck = served
    with pytest.raises(errors.ModelNotFound) as e:
        attach_published(str(ck), _key(), socket_dir=svc.socket_dir)
    assert e.value.details["publication"] == "none"
    publish(str(ck), _key(), _processed(ck), socket_dir=svc.socket_dir)
    other = _key(engine_version="1.1", kernels={"attention": "flash"})
    with pytest.raises(errors.CacheKeyMismatch) as e:
        attach_published(str(ck), other, socket_dir=svc.socket_dir)
    assert sorted(e.value.details["fields"]) == ["engine_version", "kernels.attention"]
    # a key missing a field is refused before anything is looked up
    bad = _key()
    del bad["parallel"]["ep_rank"]
    with pytest.raises(errors.PublicationInvalid) as e:
        attach_published(str(ck), bad, socket_dir=svc.socket_dir)
    assert e.value.details["field"] == "parallel.ep_rank"


def test_identical_publications_end_with_one_slab_and_evict_frees_it(served):
    svc, ck = served
    before = len(_status(svc)["slabs"])
    tensors = _processed(ck)
    first = publish(str(ck), _key(), tensors, socket_dir=svc.socket_dir)
    # the second arrives while the first is held (the serving loop takes one request at a time: a race is this)
    second = publish(str(ck), copy.deepcopy(_key()), tensors, socket_dir=svc.socket_dir)
    assert first.created and not second.created and first.label == second.label
    assert len(_status(svc)["slabs"]) == before + 1
    s = Session(svc.socket_path, timeout=10)
    try:
        counters = s.request(protocol.Metrics()).counters
    finally:
        s.close()
    assert sorted((p["outcome"], p["count"]) for p in counters["publishes"]) == [("held", 1), ("published", 1)]
    # and `weightcache metrics` exposes them (where no systemd runs: it asks only running units there)
    if not os.path.isdir("/run/systemd/system"):
        import subprocess
        import sys

        text = subprocess.run([sys.executable, "-m", "weightcache", "metrics", "--socket-dir", svc.socket_dir],
                              capture_output=True, text=True, timeout=60, env=service_env(), check=False).stdout
        assert ('weightcache_publishes_total{code="",gpu="0",gpu_uuid="",model="m",outcome="held",tp_rank="0",tp_size="1"} 1.0'
                in text), text[-3000:]
    s = Session(svc.socket_path, timeout=10)
    try:
        evicted = s.request(protocol.Evict("m", force=True)).evicted
    finally:
        s.close()
    assert first.label in evicted
    assert len(_status(svc)["slabs"]) == before
    with pytest.raises(errors.ModelNotFound):
        attach_published(str(ck), _key(), socket_dir=svc.socket_dir)


@pytest.fixture
def open_ck():
    """A checkpoint every uid may read (pytest's tmp_path is 0700 under root's): in a fresh /tmp directory."""
    d = Path(tempfile.mkdtemp(prefix="wcpub-", dir="/tmp"))
    os.chmod(d, 0o755)
    try:
        yield _ckpt(d / "ck")
    finally:
        shutil.rmtree(d)


@contextlib.contextmanager
def _as(uid: int):
    os.setegid(uid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def _open_to_all(svc) -> None:
    os.chmod(os.path.dirname(svc.socket_dir), 0o755)  # the fixture's mkdtemp base
    os.chmod(svc.socket_dir, 0o755)
    os.chmod(svc.socket_path, 0o777)


def test_an_untrusted_publication_is_private_to_its_uid(daemon, open_ck):
    """Without ``publishers``, a uid that may attach may publish, for its own engines only: root's engine (another
    uid) never attaches it, and nothing root would attach changed."""
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another uid")
    ck = open_ck
    svc = daemon({"m": str(ck)})
    svc.wait_settled()
    _open_to_all(svc)
    tensors = _processed(ck)
    with _as(NOBODY):
        got = publish(str(ck), _key(), tensors, socket_dir=svc.socket_dir)
        assert got.created and got.label.endswith(f":uid{NOBODY}")
        with attach_published(str(ck), _key(), socket_dir=svc.socket_dir) as w:
            _same(w.tensors, tensors)
    with pytest.raises(errors.ModelNotFound):  # root's engine: none published for it
        attach_published(str(ck), _key(), socket_dir=svc.socket_dir)
    # root (trusted) publishes the same key: a shared slab beside the private one
    assert publish(str(ck), _key(), tensors, socket_dir=svc.socket_dir).created


def test_with_publishers_set_an_untrusted_uid_is_refused_and_nothing_changes(daemon, open_ck):
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another uid")
    ck = open_ck
    svc = daemon({"m": {"path": str(ck), "publishers": ["root"]}})
    svc.wait_settled()
    _open_to_all(svc)
    before = _status(svc)["slabs"]
    tensors = _processed(ck)
    with _as(NOBODY):
        with pytest.raises(errors.AccessDenied) as e:
            publish(str(ck), _key(), tensors, socket_dir=svc.socket_dir)
        assert e.value.code == "access_denied"
    assert _status(svc)["slabs"] == before
    with pytest.raises(errors.ModelNotFound):
        attach_published(str(ck), _key(), socket_dir=svc.socket_dir)


def _metrics_counters(svc) -> dict:
    s = Session(svc.socket_path, timeout=10)
    try:
        return s.request(protocol.Metrics()).counters
    finally:
        s.close()


def test_publish_counts_of_a_model_one_may_not_attach_are_not_shown(daemon, open_ck):
    """``metrics`` of a socket-group member who may not attach a model shows none of its publish counts (nor its
    name), as its other per-model counts; an operator (root) sees them all."""
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another uid")
    locked_ck = _ckpt(open_ck.parent / "locked")
    svc = daemon({"m": str(open_ck), "locked": {"path": str(locked_ck), "allow_users": ["root"]}})
    svc.wait_settled()
    _open_to_all(svc)
    assert publish(str(open_ck), _key(), _processed(open_ck), socket_dir=svc.socket_dir).created
    assert publish(str(locked_ck), _key(), _processed(locked_ck), socket_dir=svc.socket_dir).created
    tensors = _processed(locked_ck)
    with pytest.raises(errors.AccessDenied), _as(NOBODY):  # a refused publication is counted too ("locked")
        publish(str(locked_ck), _key(), tensors, socket_dir=svc.socket_dir)
    assert sorted((p["model"], p["outcome"]) for p in _metrics_counters(svc)["publishes"]) == [
        ("locked", "published"), ("locked", "refused"), ("m", "published")]
    with _as(NOBODY):
        seen = _metrics_counters(svc)
    assert [(p["model"], p["outcome"]) for p in seen["publishes"]] == [("m", "published")], seen["publishes"]
    assert "locked" not in json.dumps(seen), seen


def test_the_fd_store_keeps_a_publication_across_a_restart(tmp_path):
    """Publish, restart the service (systemd's fd store stood in for), attach by key: the same bytes."""
    ck = _ckpt(tmp_path / "ck")
    tensors = _processed(ck)
    cfg, listen, log = tmp_path / "weightcache.toml", tmp_path / "0.sock", tmp_path / "serve.log"
    cfg.write_text(to_toml(make_config({"m": ck})))
    with FdStoreStandIn(tmp_path / "notify") as store:
        first = store.serve(cfg, listen, log)
        store.collect(2, log=log.read_text)  # the configured slab
        publish(str(ck), _key(), tensors, socket_dir=str(tmp_path))
        stored = store.collect(4, log=log.read_text)
        assert sum(n.startswith("slab-") for n in stored) == 2
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0, log.read_text()
        second = store.serve(cfg, listen, log)

        def adopted() -> dict | None:
            assert second.poll() is None, log.read_text()
            store.drain()
            try:
                st = _status(listen) if listen.exists() else None
            except errors.DaemonUnavailable:
                return None
            if st and len(st["slabs"]) == 2 and all(s["state"] == "ready" for s in st["slabs"]):
                return st
            return None

        st = poll_until(adopted, "the restarted service to adopt both slabs", 90, detail=log.read_text)
        assert all(s["adopted"] for s in st["slabs"]), log.read_text()
        with attach_published(str(ck), _key(), socket_dir=str(tmp_path)) as w:
            _same(w.tensors, tensors)


def test_pack_plans_aliases_shared_storages_and_unaligned_views():
    """The client's plan: a tied name is an alias, views of one storage at aligned offsets share one copy, an
    unaligned view gets its own, every offset is a multiple of 256."""
    base = torch.arange(256, dtype=torch.float32).reshape(16, 16)
    tensors = {"w": base, "w_t": base.t(), "half": base[8:], "odd": base.reshape(-1)[3:7], "tied": base}
    records, size, copies = pack(tensors)
    by = {r.name: r for r in records}
    assert by["tied"].alias_of == "w" and by["w_t"].offset_bytes == by["w"].offset_bytes
    assert by["half"].offset_bytes == by["w"].offset_bytes + 8 * 16 * 4  # byte 512 of the storage: shared
    assert by["w_t"].stride == (1, 16)
    assert by["odd"].offset_bytes % 256 == 0 and by["odd"].offset_bytes >= by["w"].offset_bytes + 1024
    assert len(copies) == 2 and size % 256 == 0


def test_a_publication_whose_checkpoint_changed_while_stopped_is_not_adopted(tmp_path):
    """The adoption recomputes the checkpoint identity from the files: a checkpoint rewritten while the service was
    stopped drops the kept publication (the engine loads and publishes again)."""
    ck = _ckpt(tmp_path / "ck")
    cfg, listen, log = tmp_path / "weightcache.toml", tmp_path / "0.sock", tmp_path / "serve.log"
    cfg.write_text(to_toml(make_config({"m": ck})))
    with FdStoreStandIn(tmp_path / "notify") as store:
        first = store.serve(cfg, listen, log)
        store.collect(2, log=log.read_text)
        publish(str(ck), _key(), _processed(ck), socket_dir=str(tmp_path))
        store.collect(4, log=log.read_text)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0, log.read_text()
        g = torch.Generator().manual_seed(8)  # same names, shapes and config; other values: another identity
        write_checkpoint(ck, {"q.weight": torch.randn(4, 8, generator=g), "k.weight": torch.randn(4, 8, generator=g),
                              "embed.weight": torch.randn(16, 8, generator=g)},
                         config={"architectures": ["TinyForCausalLM"], "model_type": "tiny"})
        second = store.serve(cfg, listen, log)

        def settled() -> dict | None:
            assert second.poll() is None, log.read_text()
            store.drain()  # this restart drops two stores' entries and stores one: more than the queue holds
            try:
                st = _status(listen) if listen.exists() else None
            except errors.DaemonUnavailable:
                return None
            return st if st and st["slabs"] and all(s["state"] == "ready" for s in st["slabs"]) else None

        st = poll_until(settled, "the restarted service to settle", 90, detail=log.read_text)
        assert [s.get("publication") for s in st["slabs"]] == [None], st["slabs"]
        with pytest.raises(errors.ModelNotFound) as e:
            attach_published(str(ck), _key(), socket_dir=str(tmp_path))
        assert e.value.details["publication"] == "none"
