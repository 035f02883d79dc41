"""The client against a hand-written service that sends packed manifests, good and broken.

The service side is a few lines of socket code speaking docs/protocol.md, so
these tests pin the wire format (protocol 3: a JSON frame and two fds, the slab
memfd and the manifest file: JSON, NUL, packed payload) rather than the
reference service's behaviour.
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import socket
import threading

import pytest
from checkpoints import minilm_path  # noqa: E402
from wire_helpers import frame  # noqa: E402
import torch

from weightcache import attach, errors, pipeline
from weightcache.checkpoint import Checkpoint
from weightcache.client import load_request
from weightcache.manifest import Manifest
from weightcache.memory import get_backend
from weightcache.spec import RankRequest


def _serve_once(path: str, header: dict, payload: bytes, slab_bytes: int) -> threading.Thread:
    """Answers one connection's hello + attach with ``header``/``payload`` and a zeroed memfd."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        with conn:
            buf = b""
            while buf.count(b'"type"') < 2:  # hello + attach, pipelined by the client
                buf += conn.recv(65536)
            fd = os.memfd_create("fake-slab", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, slab_bytes)
            # A client maps only a sealed memfd (issue 38): F_SEAL_SEAL | SHRINK | GROW | WRITE.
            fcntl.fcntl(fd, 1033, 0x1 | 0x2 | 0x4 | 0x8)  # F_ADD_SEALS
            mfd = os.memfd_create("fake-manifest", os.MFD_CLOEXEC)
            manifest_file = json.dumps({"format": "weightcache-manifest-1", "manifest": header}).encode()
            os.write(mfd, manifest_file + b"\x00" + payload)
            conn.sendall(frame({"type": "hello_reply", "protocol_version": 3, "gpu": 0, "gpu_uuid": "",
                                 "backend": "host", "capabilities": []}))
            reply = frame({"type": "attach_reply", "fd_count": 2, "lease_id": 1, "checkpoint_path": str(minilm_path()),
                            "backend": "host", "manifest_size_bytes": len(manifest_file) + 1 + len(payload)})
            conn.sendmsg([reply], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd, mfd]))])
            os.close(fd)
            os.close(mfd)
            conn.recv(1)  # hold the lease until the client closes
        srv.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _packed(break_it=None) -> tuple[dict, bytes, int]:
    ck = minilm_path()
    pl = pipeline.plan(RankRequest(load_request(str(ck), "auto", "hf", "cutlass"), 1, 0),
                       get_backend("host").device_info())
    header, payload = Manifest("minilm", 1, 0, pl.key, pl.slab_size_bytes, tuple(pl.records)).to_wire()
    if break_it is not None:
        header, payload = break_it(header, payload)
    return header, payload, pl.slab_size_bytes


def test_a_hand_written_service_is_understood(tmp_path):
    """Names, shapes and bytes of the views come from the payload exactly as docs/protocol.md says."""
    header, payload, size = _packed()
    t = _serve_once(str(tmp_path / "0.sock"), header, payload, size)
    with attach(str(minilm_path()), socket_dir=str(tmp_path), fallback=False, timeout=10) as w:
        assert w.source == "daemon"
        ck = Checkpoint(minilm_path())
        assert set(w.tensors) == set(ck.tensors)
        for name, info in ck.tensors.items():
            assert tuple(w.tensors[name].shape) == info.shape
            assert not torch.any(w.tensors[name])  # the fake slab is zeros
        assert dict(w.layouts) == {r.name: r.layout for r in Manifest.from_wire(header, payload).tensors}
    t.join(10)


@pytest.mark.parametrize("break_it,section", [
    (lambda h, p: (h, p[: len(p) // 2]), "table"),
    (lambda h, p: ({**h, "tensors": {**h["tensors"], "format": "columnar"}}, p), "header"),
    (lambda h, p: ({**h, "tensors": {k: v for k, v in h["tensors"].items() if k != "table"}}, p), "table"),
    (lambda h, p: ({**h, "tensors": {**h["tensors"], "runs": h["tensors"]["runs"] + h["tensors"]["runs"][:1]}}, p),
     "runs"),
    (lambda h, p: ({**h, "tensors": {**h["tensors"], "dtypes": ["XX"]}}, p), "dtypes"),
])
def test_a_broken_manifest_is_a_protocol_error_or_a_disk_load(tmp_path, break_it, section):
    header, payload, size = _packed(break_it)
    t = _serve_once(str(tmp_path / "0.sock"), header, payload, size)
    with pytest.raises(errors.ManifestInvalid) as ei:
        attach(str(minilm_path()), socket_dir=str(tmp_path), fallback=False, timeout=10)
    assert isinstance(ei.value, errors.RemoteProtocolError)  # the peer sent invalid data
    assert (ei.value.code, ei.value.details["section"]) == ("manifest_invalid", section)
    t.join(10)
    os.unlink(tmp_path / "0.sock")
    t = _serve_once(str(tmp_path / "0.sock"), header, payload, size)
    w = attach(str(minilm_path()), socket_dir=str(tmp_path), fallback=True, timeout=10)
    assert w.source == "disk" and w.fallback_reason.startswith("manifest_invalid: ")
    from safetensors.torch import load_file

    ref = load_file(str(minilm_path() / "model.safetensors"))
    assert set(w.tensors) == set(ref) and all(torch.equal(w.tensors[k], ref[k]) for k in ref)
    w.close()
    t.join(10)


def test_a_slab_smaller_than_its_manifest_is_refused(tmp_path):
    """Views past the end of the received mapping are never built (torch's storage bounds)."""
    header, payload, _ = _packed()
    t = _serve_once(str(tmp_path / "0.sock"), header, payload, 4096)
    with pytest.raises(errors.ManifestSlabMismatch) as ei:
        attach(str(minilm_path()), socket_dir=str(tmp_path), fallback=False, timeout=10)
    assert ei.value.code == "manifest_slab_mismatch" and isinstance(ei.value, errors.RemoteProtocolError)
    t.join(10)


@pytest.mark.parametrize("break_it,code", [
    (lambda h, p: ({**h, "tensors": None}, p), "manifest_invalid"),
    (lambda h, p: ({**h, "tensors": []}, p), "manifest_invalid"),
    (lambda h, p: ({k: v for k, v in h.items() if k != "tp_rank"}, p), "manifest_invalid"),
    (lambda h, p: ({**h, "key": {**h["key"], "checkpoint": {**h["key"]["checkpoint"],
                                                           "files": {"model.safetensors": 7}}}}, p),
     "protocol_violation"),
])
def test_a_malformed_reply_is_a_protocol_error_not_a_crash(tmp_path, break_it, code):
    header, payload, size = _packed(break_it)
    t = _serve_once(str(tmp_path / "0.sock"), header, payload, size)
    with pytest.raises(errors.RemoteProtocolError) as ei:
        attach(str(minilm_path()), socket_dir=str(tmp_path), fallback=False, timeout=10)
    assert ei.value.code == code
    t.join(10)
