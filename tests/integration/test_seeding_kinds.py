"""Peer seeding across memory and digest kinds (issue 37, the cuda backend's part), on CPU.

A receiver checks a peer's digests where the bytes land (docs/design.md, "Peer seeding"): in host memory
``xxh3_128``, ``xxh3c`` and ``sum64`` (numpy: what a CUDA peer's GPU slab or its host-tier copy carries);
in GPU memory ``sum64`` only. Here a host receiver and the test peer (tests/seed_test_peer.py, a real
control channel and NIXL agent): a right ``sum64`` manifest is taken (bytes equal to the disk load); a
wrong byte under ``sum64`` digests is caught by the numpy check (``digest_mismatch``); digests of a family
no receiver checks are refused before the READ (``digest_kind``); an offer naming a memory kind NIXL has
not is ``protocol``. Each refusal ends in the receiver's own load, nothing left registered.
The GPU side (``VRAM`` both ways, ``digest_kind`` for xxh3 into GPU memory) is tests/gpu/test_seeding_gpu.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from checkpoints import compare_bytes, llama_checkpoint, read_checkpoint
from service_harness import poll_until, service_env
from test_seeding import (
    TESTS,
    _own_load,
    assert_released,
    attach_tensors,
    fleet,
    free_port,
    secret_file,
)

pytest.importorskip("nixl_cu12", reason="NIXL (weightcache[seeding]) is not installed")

__all__ = ["fleet"]  # the fixture, used by name


def _peer(tmp_path, port: int, secret, mode: str) -> subprocess.Popen:
    peer_ck = llama_checkpoint(tmp_path / "peer-llama", seed=0)
    cfg = tmp_path / "peer.toml"
    cfg.write_text(f'[service]\nbackend = "host"\n[models.m]\npath = "{peer_ck}"\n')
    peer = subprocess.Popen([sys.executable, str(TESTS / "seed_test_peer.py"), str(cfg), str(port), str(secret), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=service_env())
    poll_until(lambda: peer.stdout.readline().strip() == "listening", "the test peer to listen", 120, 0)
    return peer


def test_a_peer_with_gpu_digests_seeds_a_host_receiver_checked_by_numpy(fleet, tmp_path):
    secret = secret_file(tmp_path, "a" * 64)
    port = free_port()
    peer = _peer(tmp_path, port, secret, "sum64")
    try:
        ck = llama_checkpoint(tmp_path / "recv-llama", seed=0)
        b = fleet("recv", {"m": {"path": str(ck)}}, peers=[f"127.0.0.1:{port}"], seed_secret_file=str(secret),
                  seed_timeout_s=20)
        st = b.ready()
        assert st["slabs"][0].get("peer") == f"127.0.0.1:{port}", b.log()
        assert "seeding: seeded model=m" in b.log()
        assert_released(b, 1)
        assert compare_bytes(attach_tensors(b, ck), read_checkpoint(ck)) > 0
    finally:
        peer.kill()
        peer.wait()


@pytest.mark.parametrize("mode,reason", [("sum64_wrong", "digest_mismatch"), ("unknown_kind", "digest_kind"),
                                         ("bad_mem", "protocol")])
def test_a_digest_or_memory_kind_the_receiver_cannot_take_ends_in_its_own_load(fleet, tmp_path, mode, reason):
    secret = secret_file(tmp_path, "a" * 64)
    port = free_port()
    peer = _peer(tmp_path, port, secret, mode)
    try:
        ck = llama_checkpoint(tmp_path / "recv-llama", seed=0)
        b = fleet("recv", {"m": {"path": str(ck)}}, peers=[f"127.0.0.1:{port}"], seed_secret_file=str(secret),
                  seed_timeout_s=20)
        b.ready()
        _own_load(b, ck, reason)
        if mode == "unknown_kind":
            assert "the peer's digests are blake3, which this node cannot check in host memory" in b.log()
    finally:
        peer.kill()
        peer.wait()
