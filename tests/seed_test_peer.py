"""A misbehaving seeding source for the refusal tests of issue 37 (run as a subprocess).

``python seed_test_peer.py CONFIG PORT SECRET_FILE MODE``: loads the config's first placement through the
pipeline itself (as the disk fallback does), then answers seeding requests on ``127.0.0.1:PORT`` with the
real control channel and a real NIXL agent, misbehaving as ``MODE`` says:

- ``wrong_digest``: serves the slab with one byte flipped under the original manifest (digests);
- ``disconnect``: sends its offer, then exits at once (before the receiver's ``done``);
- ``disconnect_mid``: sends its offer, then exits 0.5 s later (the receiver, capped at 32 MiB/s, is then
  between its 64 MiB READ requests: a disconnect in the middle of the transfer);
- ``wrong_offer_digest``: the offer's ``digest`` is not its manifest's (bytes and manifest right);
- ``swapped_records``: two tensors of one shape swap names in the manifest (offsets and digests kept, so
  every digest matches the bytes at its offset: only the receiver's layout check sees it);
- ``good``: behaves (a sanity check of the peer itself);
- ``sum64``: the manifest carries ``sum64`` digests of the bytes (what a CUDA peer's GPU slab, or its host-tier
  copy, carries), right ones: a host receiver checks them with numpy and takes the slab;
- ``sum64_wrong``: as ``sum64``, one byte flipped: ``digest_mismatch`` from the numpy check;
- ``unknown_kind``: digests of a family no receiver checks (``blake3:``): ``digest_kind``, before the READ;
- ``bad_mem``: the offer names a memory kind NIXL has not (``HBM``): ``protocol``.

It prints ``listening`` once it accepts connections.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import select
import socket
import sys
import time

from weightcache import pipeline
from weightcache.config import load_config
from weightcache.manifest import pack_file
from weightcache.memory.host import HostBackend
from weightcache.seeding import Agent, Channel, load_secret, manifest_digest
from weightcache.seeding._agent import buffer_address
from weightcache.seeding._samples import source_samples


def main() -> None:
    cfg, port, secret_file, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    placement = load_config(cfg).placements(0)[0]
    backend = HostBackend()
    pl = pipeline.plan(placement, backend.device_info())
    writable = backend.allocate(pl.slab_size_bytes, "test-peer")
    filled = pipeline.fill(pl, writable)
    manifest = filled.manifest
    if mode == "swapped_records":
        stored = [r for r in manifest.tensors if r.alias_of is None and r.size_bytes]
        a, b = next((a, b) for i, a in enumerate(stored) for b in stored[i + 1:]
                    if (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)) and a.name != b.name)
        named = {a.name: b.name, b.name: a.name}
        manifest = dataclasses.replace(manifest, tensors=tuple(dataclasses.replace(r, name=named.get(r.name, r.name))
                                                               for r in manifest.tensors))
    if mode in ("sum64", "sum64_wrong", "unknown_kind"):
        from weightcache.digest import sum64_buffer

        def kind(r):
            if r.alias_of is not None:
                return r
            view = writable.buffer[r.offset_bytes:r.offset_bytes + r.size_bytes]
            d = sum64_buffer(view) if mode != "unknown_kind" else "blake3:" + "0" * 64
            return dataclasses.replace(r, digest=d)

        manifest = dataclasses.replace(manifest, tensors=tuple(kind(r) for r in manifest.tensors))
    raw = pack_file(manifest, backend="host", size_bytes=writable.size_bytes)
    if mode in ("wrong_digest", "sum64_wrong"):
        t = next(r for r in filled.manifest.tensors if r.alias_of is None and r.size_bytes)
        writable.buffer[t.offset_bytes] ^= 0xFF
    address, _keep = buffer_address(writable.buffer)  # the mapping stays exported while the peer serves
    secret = load_secret(secret_file)
    agent = Agent(f"test-peer-{os.getpid()}")
    agent.register(address, writable.size_bytes)  # held until the process ends
    srv = socket.create_server(("127.0.0.1", port))
    print("listening", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.settimeout(30)
        ch = Channel(conn, secret, server=True)
        ch.open()
        req = ch.recv("request")
        samples, blobs = source_samples(placement.model.path, pl.key["checkpoint"], req.get("samples") or [],
                                        req.get("blobs"))
        ch.send("reply", {"samples": [base64.b64encode(b).decode() for b in samples], "blobs": blobs,"ok": True, "agent": agent.name, "agent_md": base64.b64encode(agent.metadata()).decode(),
                          "descs": [[address, writable.size_bytes]],
                          "mem": "HBM" if mode == "bad_mem" else "DRAM", "dev": 0, "manifest": base64.b64encode(raw).decode(),
                          "key": pl.key,
                          "digest": manifest_digest(raw + b"x" if mode == "wrong_offer_digest" else raw)})
        if mode == "disconnect":
            os._exit(0)
        if mode == "disconnect_mid":
            end = time.monotonic() + 0.5
            while time.monotonic() < end:
                agent.progress()
                time.sleep(0.001)
            os._exit(0)
        try:
            while not select.select([conn], [], [], 0.001)[0]:  # the READ needs this agent's progress (TCP)
                agent.progress()
            ch.recv("done")
            ch.send("ack", {"ok": True})
        except Exception as e:  # noqa: BLE001 - the receiver may hang up on a refused offer
            print(f"exchange ended: {e!r}", file=sys.stderr)
        conn.close()


if __name__ == "__main__":
    main()
