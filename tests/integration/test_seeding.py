"""Peer seeding (issue 37): two services on this machine, each with its own NIXL agent on loopback.

The first loads the checkpoint; the second, whose checkpoint directory holds the same ``config.json`` and
safetensors headers but **no tensor data** (the files are sparse: every data byte reads as zero), becomes
READY from the first with bytes equal to the real checkpoint's, so nothing of its own data was read; an
engine attaches to it with tensors equal to the disk load. Then the refusals: a wrong secret, a peer sending
a wrong digest, a peer that disconnects mid-transfer, a peer offering another checkpoint's slab under the
same model name: each ends in the receiver's own load, the reason logged, bytes equal to the disk load, no
NIXL registration left, no extra memfd held.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import compare_bytes, headers_only_copy, llama_checkpoint, minilm_path, read_checkpoint
from service_harness import poll_until, service_env

pytest.importorskip("nixl_cu12", reason="NIXL (weightcache[seeding]) is not installed")

from weightcache import attach

TESTS = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def secret_file(d: Path, text: str) -> Path:
    p = d / "seed.secret"
    p.write_text(text + "\n")
    p.chmod(0o600)
    return p


def data_is_holes(d: Path) -> bool:
    """Every safetensors file of ``d`` is zeros after its header."""
    for f in d.glob("*.safetensors"):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        if raw[8 + n:].strip(b"\0"):
            return False
    return True


class Svc:
    """One ``weightcache serve`` (host backend, GPU 0) in its own socket directory."""

    def __init__(self, base: Path, name: str, models: dict, **service) -> None:
        self.dir = base / name
        self.dir.mkdir(parents=True)
        lines = ["[service]", 'backend = "host"']
        lines += [f"{k} = {json.dumps(v)}" for k, v in service.items()]
        for m, table in models.items():
            lines.append(f"[models.{m}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
        self.config = self.dir / "weightcache.toml"
        self.config.write_text("\n".join(lines) + "\n")
        self.log_path = self.dir / "service.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightcache", "serve", "--gpu", "0", "--config", str(self.config),
                 "--listen", str(self.dir / "0.sock"), "--backend", "host"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=service_env(), cwd=self.dir)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict:
        from weightcache import protocol
        from weightcache.session import Session

        s = Session(str(self.dir / "0.sock"), timeout=10, client="tests")
        try:
            return s.request(protocol.Status()).status
        finally:
            s.close()

    def seeds(self) -> dict:
        """The ``metrics`` reply's peer seeding counters: ``(role, model, outcome, reason) -> (count, bytes)``."""
        from weightcache import protocol
        from weightcache.session import Session

        s = Session(str(self.dir / "0.sock"), timeout=10, client="tests")
        try:
            _, counters = s.request(protocol.Metrics()).typed()
        finally:
            s.close()
        return {(c.role, c.model, c.outcome, c.reason): (c.count, c.bytes) for c in counters.seeds}

    def ready(self, timeout: float = 240) -> dict:
        def settled():
            if self.proc.poll() is not None:
                raise AssertionError(f"service exited {self.proc.returncode}\n{self.log()}")
            try:
                st = self.status()
            except Exception:  # noqa: BLE001 - not up yet
                return None
            if all(s["state"] == "ready" for s in st["slabs"]):
                return st
            bad = [s for s in st["slabs"] if s["state"] == "failed"]
            assert not bad, (bad, self.log())
            return None
        return poll_until(settled, "every slab ready", timeout, 0.1, detail=self.log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def fleet():
    base = Path(os.environ.get("TMPDIR", "/tmp")) / f"wcseed-{os.getpid()}-{free_port()}"
    base.mkdir(parents=True)
    started: list = []

    def make(name: str, models: dict, **service) -> Svc:
        svc = Svc(base, name, models, **service)
        started.append(svc)
        return svc

    make.base = base
    yield make
    for s in started:
        s.stop()
    shutil.rmtree(base, ignore_errors=True)


def attach_tensors(svc: Svc, path: Path) -> dict:
    with attach(str(path), socket_dir=str(svc.dir), fallback=False, timeout=60, mode="copy") as w:
        assert w.source == "daemon"
        return dict(w.tensors)


def assert_released(svc: Svc, slabs: int) -> None:
    """No NIXL registration or remote agent left, and only the slabs' own memfds (slab + manifest each): no
    partial slab of a refused offer, no mapping a transfer kept."""
    held = re.findall(r"nixl_registrations=(\d+) remote_agents=(\d+)", svc.log())
    assert held and held[-1] == ("0", "0"), held
    base = f"/proc/{svc.proc.pid}/fd"
    targets = []
    for n in os.listdir(base):
        try:
            targets.append(os.readlink(f"{base}/{n}"))
        except FileNotFoundError:  # closed while we looked (a socket of a status request)
            pass
    memfds = sorted(t for t in targets if t.startswith("/memfd:"))
    # As many as a service that read its checkpoint holds (measured: the slab's memfd twice, its manifest once).
    assert len([t for t in memfds if t.startswith("/memfd:weightcache:")]) == 2 * slabs, memfds
    assert len([t for t in memfds if t.startswith("/memfd:weightcache-manifest:")]) == slabs, memfds


def test_second_service_becomes_ready_from_the_first_without_reading_its_data(fleet, tmp_path, capsys):
    secret = secret_file(tmp_path, "a" * 64)
    port = free_port()
    src_ck = minilm_path()
    llama = llama_checkpoint(tmp_path / "llama", files=3, hidden=256, inter=512, vocab=512, layers=4)
    a = fleet("a", {"minilm": {"path": str(src_ck), "serve_to_peers": True},
                    "llama": {"path": str(llama), "serve_to_peers": True}},
              seed_listen=f"127.0.0.1:{port}", seed_secret_file=str(secret))
    a.ready()
    bare_minilm = headers_only_copy(src_ck, tmp_path / "b-minilm")
    bare_llama = headers_only_copy(llama, tmp_path / "b-llama")
    assert data_is_holes(bare_minilm) and data_is_holes(bare_llama)
    # seed_samples = 0: equal headers are trusted (no sample of the tensor data is read here: see
    # test_another_checkpoint_under_the_same_name_is_refused for what the samples catch).
    b = fleet("b", {"minilm": {"path": str(bare_minilm)}, "llama": {"path": str(bare_llama)}},
              peers=[f"127.0.0.1:{port}"], seed_secret_file=str(secret), seed_samples=0)
    st = b.ready()
    assert_released(b, 2)  # before any attach (an attach's fds stay duplicated until the engine reads them)
    assert {s["model"]: s.get("peer") for s in st["slabs"]} == {"minilm": f"127.0.0.1:{port}",
                                                              "llama": f"127.0.0.1:{port}"}
    from weightcache.cli import main

    capsys.readouterr()
    assert main(["status", "--socket-dir", str(b.dir)]) == 0
    out = capsys.readouterr().out
    assert out.count(f"source: peer 127.0.0.1:{port}") == 2 and ", source peer" not in out, out  # said once
    # Bytes equal to the real checkpoints (the receiver's own files hold zeros: nothing of them was read).
    for bare, real in ((bare_minilm, src_ck), (bare_llama, llama)):
        got = attach_tensors(b, bare)
        assert compare_bytes(got, read_checkpoint(real)) > 0
        assert data_is_holes(bare)
    assert compare_bytes(attach_tensors(b, bare_minilm), attach_tensors(a, src_ck)) > 0
    assert "seeding: served model=minilm" in a.log() and "seeding: served model=llama" in a.log()
    got, served = b.seeds(), a.seeds()
    for m in ("minilm", "llama"):
        n, nbytes = got[("received", m, "seeded", "")]
        assert n == 1 and nbytes > 0 and served[("served", m, "served", "")][0] == 1


@pytest.mark.slow
def test_a_one_gigabyte_multi_file_llama_with_the_default_samples(fleet, tmp_path):
    """1 GB, 4 files, float32 Llama shapes; the receiver's directory holds the same files (hard links: another
    node's copy) and the default ``seed_samples`` (8 random 4 KiB ranges of its own data compared with the
    peer's): seeded, bytes equal to the disk load through an engine's attach."""
    secret = secret_file(tmp_path, "a" * 64)
    port = free_port()
    llama = llama_checkpoint(tmp_path / "big", files=4, hidden=1024, heads=8, kv_heads=2, inter=4096, vocab=8192,
                             layers=16)
    assert sum(f.stat().st_size for f in llama.glob("*.safetensors")) > 10**9
    there = tmp_path / "b-big"
    there.mkdir()
    for f in llama.iterdir():  # before the source loads: a link moves the file's ctime, and a source whose
        os.link(f, there / f.name)  # files changed since its slab was made offers nothing (not_held)
    a = fleet("a", {"m": {"path": str(llama), "serve_to_peers": True}}, seed_listen=f"127.0.0.1:{port}",
              seed_secret_file=str(secret))
    a.ready()
    b = fleet("b", {"m": {"path": str(there)}}, peers=[f"127.0.0.1:{port}"], seed_secret_file=str(secret))
    st = b.ready()
    assert st["slabs"][0].get("peer") == f"127.0.0.1:{port}", b.log()
    assert_released(b, 1)
    got = attach_tensors(b, there)
    assert compare_bytes(got, read_checkpoint(llama)) > 10**9


def test_a_source_is_bounded_and_releases_a_peer_that_goes_away(fleet, tmp_path):
    """seed_max_transfers = 1: while one peer holds a transfer open (offer received, no ``done``), the next is
    answered ``busy`` and loads its checkpoint; once that peer hangs up the source releases its registration,
    and the next receiver is seeded."""
    import socket as sk

    from weightcache.seeding import Channel, load_secret

    secret = secret_file(tmp_path, "a" * 64)
    port = free_port()
    src = llama_checkpoint(tmp_path / "a-llama", seed=0)
    a = fleet("a", {"m": {"path": str(src), "serve_to_peers": True}}, seed_listen=f"127.0.0.1:{port}",
              seed_secret_file=str(secret), seed_max_transfers=1)
    a.ready()
    hold = sk.create_connection(("127.0.0.1", port), timeout=10)
    ch = Channel(hold, load_secret(str(secret)), server=False)
    ch.open()
    ch.send("request", {"model": "m", "tp_size": 1, "tp_rank": 0, "samples": []})
    assert ch.recv("reply")["ok"] is True  # registered for us, held until done or hang-up
    b, ck = _receiver(fleet, tmp_path, port, secret)
    _own_load(b, ck, "busy")
    hold.close()
    poll_until(lambda: re.search(r"released model=m for peer=\S+ nixl_registrations=0", a.log()),
               "the source to release the registration of the peer that hung up", 30, 0.05, detail=a.log)
    c = fleet("c", {"m": {"path": str(llama_checkpoint(tmp_path / "c-llama", seed=0))}},
              peers=[f"127.0.0.1:{port}"], seed_secret_file=str(secret))
    assert c.ready()["slabs"][0].get("peer") == f"127.0.0.1:{port}", c.log()


def hub_snapshot(src: Path, cache: Path, headers_only: bool = False) -> Path:
    """``src`` as a Hugging Face hub cache's snapshot: every file a link to ``../../blobs/<sha256>`` (the sha256
    of the real file); with ``headers_only`` the blobs hold only the JSON and the headers (holes after them)
    under the real files' names, so that a load that read their data would get zeros."""
    import hashlib

    repo = cache / "models--org--m"
    snap = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    bare = headers_only_copy(src, cache / "bare") if headers_only else src
    for f in sorted(src.iterdir()):
        if f.suffix not in (".json", ".safetensors"):
            continue
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(bare / f.name, repo / "blobs" / sha)
        (snap / f.name).symlink_to(f"../../blobs/{sha}")
    return snap


def test_hub_snapshots_are_compared_by_their_blob_names_without_reading_data(fleet, tmp_path):
    """Both ends hold hub snapshots: equal blob names (sha256 of the contents) decide, the default samples are
    neither read nor compared (the receiver's blobs hold no data: samples would differ), and it is seeded."""
    secret = secret_file(tmp_path, "a" * 64)
    port = free_port()
    llama = llama_checkpoint(tmp_path / "llama", files=2)
    src = hub_snapshot(llama, tmp_path / "hub-a")
    a = fleet("a", {"m": {"path": str(src), "serve_to_peers": True}}, seed_listen=f"127.0.0.1:{port}",
              seed_secret_file=str(secret))
    a.ready()
    there = hub_snapshot(llama, tmp_path / "hub-b", headers_only=True)
    assert data_is_holes(there)
    b = fleet("b", {"m": {"path": str(there)}}, peers=[f"127.0.0.1:{port}"], seed_secret_file=str(secret))
    st = b.ready()
    assert st["slabs"][0].get("peer") == f"127.0.0.1:{port}", b.log()
    assert compare_bytes(attach_tensors(b, there), read_checkpoint(llama)) > 0


def test_hub_snapshots_of_another_checkpoint_are_refused_by_their_blob_names(fleet, tmp_path):
    secret = secret_file(tmp_path, "a" * 64)
    port = free_port()
    src = hub_snapshot(llama_checkpoint(tmp_path / "llama-1", seed=1), tmp_path / "hub-a")
    a = fleet("a", {"m": {"path": str(src), "serve_to_peers": True}}, seed_listen=f"127.0.0.1:{port}",
              seed_secret_file=str(secret))
    a.ready()
    ck = hub_snapshot(llama_checkpoint(tmp_path / "llama-0", seed=0), tmp_path / "hub-b")
    b = fleet("recv", {"m": {"path": str(ck)}}, peers=[f"127.0.0.1:{port}"], seed_secret_file=str(secret))
    b.ready()
    _own_load(b, ck, "wrong_checkpoint")
    assert "other hub blobs (sha256) than ours" in b.log()


def _receiver(fleet, tmp_path: Path, peer_port: int, secret: Path) -> tuple[Svc, Path]:
    ck = llama_checkpoint(tmp_path / "recv-llama", seed=0)
    b = fleet("recv", {"m": {"path": str(ck)}}, peers=[f"127.0.0.1:{peer_port}"], seed_secret_file=str(secret),
              seed_timeout_s=20)
    b.ready()
    return b, ck


def _own_load(b: Svc, ck: Path, reason: str) -> None:
    """The receiver read its own checkpoint: the reason logged, the slab not from a peer, bytes equal to disk."""
    log = b.log()
    assert re.search(rf"did not seed model=m tp_size=1 rank=0 reason={reason}\b", log), log
    assert "not seeded by any peer" in log and "source=checkpoint" in log
    assert b.status()["slabs"][0].get("peer") in (None, "")
    assert [k[3] for k in b.seeds() if k[:3] == ("received", "m", "fallback")] != []
    assert_released(b, 1)
    got = attach_tensors(b, ck)
    assert compare_bytes(got, read_checkpoint(ck)) > 0


def test_a_wrong_secret_gets_nothing(fleet, tmp_path):
    port = free_port()
    a = fleet("a", {"m": {"path": str(llama_checkpoint(tmp_path / "a-llama", seed=0)), "serve_to_peers": True}},
              seed_listen=f"127.0.0.1:{port}", seed_secret_file=str(secret_file(tmp_path, "a" * 64)))
    a.ready()
    other = tmp_path / "other"
    other.mkdir()
    b, ck = _receiver(fleet, tmp_path, port, secret_file(other, "b" * 64))
    _own_load(b, ck, "auth")
    assert "seeding: refused peer=" in a.log() and "reason=auth" in a.log()


def test_check_config_reads_the_secret_and_reaches_the_peers(fleet, tmp_path, capsys):
    from weightcache.cli import main

    secret = secret_file(tmp_path, "a" * 64 + "\n# the previous one, during a rotation\n" + "c" * 64)
    port, nobody = free_port(), free_port()
    a = fleet("a", {"m": {"path": str(llama_checkpoint(tmp_path / "a-llama")), "serve_to_peers": True}},
              seed_listen=f"127.0.0.1:{port}", seed_secret_file=str(secret))
    a.ready()
    cfg = tmp_path / "check.toml"
    cfg.write_text(f'[service]\nbackend = "host"\npeers = ["127.0.0.1:{port}", "127.0.0.1:{nobody}"]\n'
                   f'seed_secret_file = "{secret}"\n')
    capsys.readouterr()
    rc = main(["check-config", "--config", str(cfg)])
    out, err = capsys.readouterr()
    assert rc == 0, (out, err)
    assert f"seeding: secret {secret} readable (2 secrets" in out
    assert f"seeding: peer 127.0.0.1:{port} reachable, the secret is shared" in out
    assert f"warning: seeding: peer 127.0.0.1:{nobody} is not reachable" in err
    assert not [k for k in a.seeds() if k[0] == "served"]  # the probe asked for nothing and is not counted
    other = tmp_path / "other"  # another fleet's secret: found before any load, as an error
    other.mkdir()
    wrong = secret_file(other, "b" * 64)
    cfg.write_text(f'[service]\nbackend = "host"\npeers = ["127.0.0.1:{port}"]\nseed_secret_file = "{wrong}"\n')
    rc = main(["check-config", "--config", str(cfg)])
    out, err = capsys.readouterr()
    assert rc == 1, (out, err)
    assert (f"error: seeding: peer 127.0.0.1:{port}: the peer refused this node's signature: the two nodes share no "
            f"secret ({wrong}); every transfer between the two is refused (auth)") in err
    assert "reachable" not in out
    half = tmp_path / "half"  # a rotation's step 1 done on the peer only: it accepts this node, not the reverse
    half.mkdir()
    cfg.write_text(f'[service]\nbackend = "host"\npeers = ["127.0.0.1:{port}"]\n'
                   f'seed_secret_file = "{secret_file(half, "c" * 64)}"\n')
    rc = main(["check-config", "--config", str(cfg)])
    out, err = capsys.readouterr()
    assert rc == 1 and "the peer's reply is not signed with this fleet's secret" in err, (out, err)
    cfg.write_text(f'[service]\nbackend = "host"\npeers = ["127.0.0.1:{port}"]\nseed_secret_file = "{secret}"\n')
    secret.chmod(0o644)
    rc = main(["check-config", "--config", str(cfg)])
    out, err = capsys.readouterr()
    assert rc != 0 and f"error: seeding secret {secret}: mode 0644 lets group or others read or write it" in err


def test_another_checkpoint_under_the_same_name_is_refused(fleet, tmp_path):
    secret = secret_file(tmp_path, "a" * 64)
    port = free_port()
    a = fleet("a", {"m": {"path": str(llama_checkpoint(tmp_path / "a-llama", seed=1)), "serve_to_peers": True}},
              seed_listen=f"127.0.0.1:{port}", seed_secret_file=str(secret))
    a.ready()
    b, ck = _receiver(fleet, tmp_path, port, secret)
    _own_load(b, ck, "wrong_checkpoint")


def test_a_model_not_served_to_peers_by_default(fleet, tmp_path):
    secret = secret_file(tmp_path, "a" * 64)
    port = free_port()
    a = fleet("a", {"m": {"path": str(llama_checkpoint(tmp_path / "a-llama", seed=0))}},
              seed_listen=f"127.0.0.1:{port}", seed_secret_file=str(secret))
    a.ready()
    b, ck = _receiver(fleet, tmp_path, port, secret)
    _own_load(b, ck, "not_allowed")


@pytest.mark.parametrize("mode,reason", [("wrong_digest", "digest_mismatch"), ("disconnect", "disconnected"),
                                         ("disconnect_mid", "disconnected"),
                                         ("wrong_offer_digest", "digest_mismatch"),
                                         ("swapped_records", "manifest_mismatch")])
def test_a_misbehaving_peer_ends_in_the_own_load(fleet, tmp_path, mode, reason):
    secret = secret_file(tmp_path, "a" * 64)
    port = free_port()
    # disconnect_mid: a slab of 3 READ requests (64 MiB each) at 32 MiB/s, the peer gone after 0.5 s
    dims = ({"hidden": 1024, "heads": 8, "kv_heads": 2, "inter": 4096, "vocab": 8192, "layers": 2}
            if mode == "disconnect_mid" else {})
    peer_ck = llama_checkpoint(tmp_path / "peer-llama", seed=0, **dims)
    cfg = tmp_path / "peer.toml"
    cfg.write_text(f'[service]\nbackend = "host"\n[models.m]\npath = "{peer_ck}"\n')
    peer = subprocess.Popen([sys.executable, str(TESTS / "seed_test_peer.py"), str(cfg), str(port), str(secret), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=service_env())
    try:
        poll_until(lambda: peer.stdout.readline().strip() == "listening", "the test peer to listen", 120, 0)
        ck = llama_checkpoint(tmp_path / "recv-llama", seed=0, **dims)
        b = fleet("recv", {"m": {"path": str(ck)}}, peers=[f"127.0.0.1:{port}"], seed_secret_file=str(secret),
                  seed_timeout_s=20, seed_bandwidth_bytes_per_s=32 << 20)
        b.ready()
        _own_load(b, ck, reason)
        if mode == "disconnect_mid":  # the first request was read before the peer went away
            assert re.search(r"reason=disconnected: NIXL (failed|reported ERR for) the READ", b.log()), b.log()
    finally:
        peer.kill()
        peer.wait()


def test_setup_runtime_installs_nixl_when_the_config_names_peers(tmp_path):
    root = TESTS.parent
    script = ["sh", str(root / "packaging" / "weightcache-setup-runtime"), "--dry-run", "--cpu",
              "--requirements", str(root / "packaging" / "runtime-requirements.txt"), "--prefix", "/nonexistent/v"]
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text('[service]\nbackend = "host"\n')
    (tmp_path / "conf.d").mkdir()

    def dry_run() -> str:
        r = subprocess.run(script, check=False, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "WEIGHTCACHE_CONFIG": str(cfg)})
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert "nixl" not in dry_run()
    (tmp_path / "conf.d" / "60-fleet.toml").write_text('[service]\npeers = ["10.0.0.2:9670"]\n')
    out = dry_run()
    assert "peer seeding:" in out and "  nixl==1.5.1" in out
