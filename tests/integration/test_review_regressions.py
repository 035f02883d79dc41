"""Regressions from a review of the service: each of these once stopped the service or broke a contract."""

from __future__ import annotations

import array
import os
import socket
import struct

import pytest
from checkpoints import minilm_path  # noqa: E402
from wire_helpers import frame  # noqa: E402
from service_harness import make_config, proc_fds
from wire_helpers import raw_connect, read_reply
from checkpoints import big_checkpoint

from weightcache import attach, errors


def test_symlink_loop_in_attach_path_is_an_error_not_a_crash(daemon, tmp_path):
    """os.path.realpath raised RecursionError on a long symlink chain, out of the serving loop."""
    svc = daemon(make_config({"m": minilm_path()}))
    chain = tmp_path / "chain"
    chain.mkdir()
    for i in range(1200):
        os.symlink(chain / f"l{i + 1}", chain / f"l{i}")
    s = raw_connect(svc.socket_path)
    s.sendall(frame({"type": "hello", "protocol_version": 3}) + frame({"type": "attach", "model": str(chain / "l0")}))
    read_reply(s)
    reply, _ = read_reply(s)
    assert reply["type"] == "error"
    s.close()
    with attach("m", socket_dir=svc.socket_dir, fallback=False) as w:  # still serving
        assert w.source == "daemon"


def test_fds_sent_to_the_service_are_refused_and_closed(daemon):
    """A client trickling SCM_RIGHTS fds inside one frame made the service hoard them."""
    svc = daemon(make_config({"m": minilm_path()}))
    svc.wait_settled()  # the load's checkpoint fds are closed: counts compare like with like
    before = sum(proc_fds(svc.pid).values())
    r, w = os.pipe()
    s = raw_connect(svc.socket_path)
    s.sendall(struct.pack(">I", 1_000_000))  # the header of a frame that never completes
    try:
        for _ in range(200):
            s.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r, w]))])
    except (BrokenPipeError, ConnectionResetError):
        pass  # dropped at the first fds: what we want
    s.close()
    os.close(r)
    os.close(w)
    svc.status()
    assert sum(proc_fds(svc.pid).values()) <= before + 1


def test_waiting_attach_survives_its_path_changing(daemon, tmp_path):
    """A waiting attach was looked up again each loop pass; a repointed symlink raised out of the loop."""
    slow = big_checkpoint(32 * 1024 * 1024, tensors=32, base=str(tmp_path))
    link = tmp_path / "current"
    os.symlink(slow, link)
    svc = daemon(make_config({"slow": slow}))
    svc.wait_settled()
    s = raw_connect(svc.socket_path, timeout=120.0)  # the reload may be slow on a loaded CI machine
    s.sendall(frame({"type": "hello", "protocol_version": 3}) + frame({"type": "evict", "model": "slow"})
              + frame({"type": "preload", "model": "slow"})
              + frame({"type": "attach", "model": str(link), "wait_ms": 30000}))
    for _ in range(3):
        read_reply(s)
    os.unlink(link)
    os.symlink(tmp_path, link)
    reply, fds = read_reply(s)
    for fd in fds:
        os.close(fd)
    assert reply["type"] in ("attach_reply", "error", "loading")
    s.close()
    assert svc.alive()
    assert {x["model"]: x["state"] for x in svc.wait_settled()["slabs"]} == {"slow": "ready"}


def test_unsupported_kernel_raises_whatever_fallback_says(tmp_path):
    from fp8_fixtures import PER_CHANNEL, write_fp8_checkpoint

    ck = write_fp8_checkpoint(tmp_path / "fp8", PER_CHANNEL)
    for fb in (False, True):
        with pytest.raises(errors.UnsupportedQuantization):
            attach(str(ck), kernel="marlin", socket_dir=str(tmp_path / "none"), fallback=fb)


def test_attach_timeout_is_the_whole_budget(tmp_path):
    """A service that accepts and never answers: DaemonUnavailable, not a hang past the timeout + 5 s."""
    path = str(tmp_path / "0.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    import time

    t0 = time.monotonic()
    with pytest.raises(errors.DaemonUnavailable):
        attach(str(minilm_path()), socket_dir=str(tmp_path), fallback=False, timeout=1.0)
    assert time.monotonic() - t0 < 4.0  # generous: the old code took 6 s
    srv.close()


def test_a_broken_checkpoint_is_reported_as_such_whatever_the_service_says(daemon, tmp_path):
    """The engine's own checkpoint problems beat the service's answer (absent, unknown path, other key)."""
    from checkpoints import llama_checkpoint

    ck = llama_checkpoint(tmp_path / "m")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    # No service at all.
    for fb in (False, True):
        with pytest.raises(errors.CheckpointNotFound, match="no \\*.safetensors files"):
            attach(str(empty), socket_dir=str(tmp_path / "none"), fallback=fb, timeout=2)
    svc = daemon(make_config({"m": ck}))
    svc.wait_settled()
    # A path the service does not hold.
    with pytest.raises(errors.CheckpointNotFound):
        attach(str(empty), socket_dir=svc.socket_dir, fallback=False, timeout=5)
    # The served checkpoint's index broken after the load: by path and by name.
    (ck / "model.safetensors.index.json").write_text("{garbage")
    for model in (str(ck), "m"):
        with pytest.raises(errors.CheckpointCorrupt, match="index .* is invalid"):
            attach(model, socket_dir=svc.socket_dir, fallback=False, timeout=5)
    assert svc.alive()


def test_a_tensor_name_with_a_nul_is_served(daemon, tmp_path):
    """safetensors accepts any name; the packed manifest once refused NUL and left the slot loading forever."""
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "nul"
    d.mkdir()
    save_file({"a\x00b": torch.ones(4), "c": torch.zeros(3)}, str(d / "model.safetensors"))
    svc = daemon(make_config({"nul": d}))
    assert {x["model"]: x["state"] for x in svc.wait_settled()["slabs"]} == {"nul": "ready"}
    with attach(str(d), socket_dir=svc.socket_dir, fallback=False, timeout=10) as w:
        assert w.source == "daemon"
        assert torch.equal(w.tensors["a\x00b"], torch.ones(4)) and torch.equal(w.tensors["c"], torch.zeros(3))


def test_a_client_of_another_protocol_version_is_told_so(daemon):
    """Version 1 clients expected JSON manifests: the hello answer names both versions, then the service closes."""
    svc = daemon(make_config({"m": minilm_path()}))
    s = raw_connect(svc.socket_path)
    s.sendall(frame({"type": "hello", "protocol_version": 1}))
    reply, _ = read_reply(s)
    assert reply["type"] == "error" and reply["code"] == "protocol_violation"
    assert "protocol version 1 is not supported; this service speaks 3" in reply["message"]
    assert read_reply(s) == (None, [])
    s.close()
    with attach(str(minilm_path()), socket_dir=svc.socket_dir, fallback=False, timeout=30) as w:
        assert w.source == "daemon"
