"""Peer seeding's parts without NIXL transfers (issue 37): the secret file and its rotation, the control
channel's authentication, the portable identity, the config keys, and seeding off without NIXL."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading

import pytest
from weightcache.config import load_config
from weightcache.errors import ConfigError
from weightcache.seeding import (
    Channel,
    ChannelError,
    SecretError,
    Seeder,
    SeedSettings,
    key_differences,
    load_secret,
    portable_identity,
)

OLD, NEW = "o" * 64, "n" * 64


def write_secret(tmp_path, text, mode=0o600, name="seed.secret"):
    p = tmp_path / name
    p.write_text(text)
    p.chmod(mode)
    return str(p)


def test_secret_file_must_be_private_and_long_enough(tmp_path):
    with pytest.raises(SecretError, match="mode 0640 lets group or others"):
        load_secret(write_secret(tmp_path, NEW, 0o640))
    with pytest.raises(SecretError, match="a line of 5 characters"):
        load_secret(write_secret(tmp_path, "short", name="s2"))
    with pytest.raises(SecretError, match="holds no secret"):
        load_secret(write_secret(tmp_path, "# nothing\n\n", name="s3"))
    with pytest.raises(SecretError, match="cannot open it"):
        load_secret(str(tmp_path / "missing"))
    s = load_secret(write_secret(tmp_path, f"# fleet\n{NEW}\n{OLD}\n", name="s4"))
    assert s.keys == (NEW.encode(), OLD.encode())


def test_a_secret_file_of_another_user_is_refused(tmp_path):
    """Another user could have written (or could rewrite) it: refused even at mode 0600; a symlink is not followed."""
    other = write_secret(tmp_path, NEW, name="theirs")
    if os.geteuid() == 0:
        os.chown(other, 65534, 65534)
        with pytest.raises(SecretError, match="owned by uid 65534; it must belong to root or the service user"):
            load_secret(other)
    mine = write_secret(tmp_path, NEW, name="mine")
    with pytest.raises(SecretError, match=f"owned by uid {os.getuid()}"):
        load_secret(mine, allowed_owners=frozenset({os.getuid() + 1}))
    assert load_secret(mine).keys == (NEW.encode(),)
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(SecretError, match="cannot open it"):
        load_secret(str(link))


def exchange(server_secret, client_secret):
    """One request/reply over a socketpair; returns (what the server got, what the client got) or errors."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    got: dict = {}

    def serve():
        ch = Channel(a, server_secret, server=True)
        ch.open()
        try:
            got["server"] = ch.recv("request")
            ch.send("reply", {"ok": True})
        except ChannelError as e:
            got["server"] = e.reason
            if e.reason == "auth":
                ch.refuse_auth()

    t = threading.Thread(target=serve)
    t.start()
    ch = Channel(b, client_secret, server=False)
    ch.open()
    ch.send("request", {"model": "m"})
    try:
        got["client"] = ch.recv("reply")
    except ChannelError as e:
        got["client"] = e.reason
    t.join()
    a.close()
    b.close()
    return got["server"], got["client"]


def test_channel_authenticates_both_ways_and_the_rotation_steps_never_refuse(tmp_path):
    step0 = load_secret(write_secret(tmp_path, OLD, name="a"))  # before the rotation
    step1 = load_secret(write_secret(tmp_path, f"{OLD}\n{NEW}\n", name="b"))  # the new one added second
    step2 = load_secret(write_secret(tmp_path, f"{NEW}\n{OLD}\n", name="c"))  # the new one moved first
    step3 = load_secret(write_secret(tmp_path, NEW, name="d"))  # the old one removed
    stranger = load_secret(write_secret(tmp_path, "s" * 64, name="e"))
    # Nodes one step apart (every node finishes a step before any starts the next) always agree, both ways.
    for x, y in ((step0, step1), (step1, step2), (step2, step3)):
        for server_secret, client_secret in ((x, y), (y, x)):
            server, client = exchange(server_secret, client_secret)
            assert server["model"] == "m" and client["ok"] is True
    assert exchange(stranger, step3) == ("auth", "auth")  # refused, and the client hears why
    server, client = exchange(step2, step0)  # two steps apart: the reply is signed with a secret step0 lacks
    assert server["model"] == "m" and client == "auth"


def test_a_recorded_request_is_refused_on_another_connection(tmp_path):
    secret = load_secret(write_secret(tmp_path, NEW))
    a, b = socket.socketpair()
    server = Channel(a, secret, server=True)
    server.open()
    client = Channel(b, secret, server=False)
    client.open()
    client.send("request", {"model": "m"})
    recorded = a.recv(1 << 16)
    a2, b2 = socket.socketpair()
    other = Channel(a2, secret, server=True)  # a new connection: a new nonce
    other.open()
    b2.recv(1 << 16)  # its hello
    b2.sendall(recorded)
    with pytest.raises(ChannelError) as e:
        other.recv("request")
    assert e.value.reason == "auth"
    for s in (a, b, a2, b2):
        s.close()


IDENTITY = {"files": {"model.safetensors": {"size": 100, "mtime_ns": 1, "ctime_ns": 2, "inode": 3,
                                            "header_blake2b": "h"}},
            "index": None, "config_json_blake2b": "c", "quant_config_blake2b": "q"}
KEY = {"checkpoint": IDENTITY, "dtype": "auto", "naming": "hf", "tp_size": 1, "tp_rank": 0,
       "device": {"backend": "host", "gpu_uuid": "", "compute_capability": ""}}


def test_portable_identity_ignores_what_differs_between_nodes_only():
    there = {**IDENTITY, "files": {"model.safetensors": {**IDENTITY["files"]["model.safetensors"], "inode": 99,
                                                           "mtime_ns": 7, "ctime_ns": 8}}}
    assert portable_identity(there) == portable_identity(IDENTITY)
    assert key_differences(KEY, {**KEY, "checkpoint": there,
                                 "device": {**KEY["device"], "gpu_uuid": "GPU-other"}}) == ("", [])
    other_header = {**IDENTITY, "files": {"model.safetensors": {**IDENTITY["files"]["model.safetensors"],
                                                                "header_blake2b": "x"}}}
    assert key_differences(KEY, {**KEY, "checkpoint": other_header}) == (
        "wrong_checkpoint", ["checkpoint.files.model.safetensors.header_blake2b"])
    assert key_differences(KEY, {**KEY, "checkpoint": {**IDENTITY, "config_json_blake2b": "d"}})[0] == "wrong_checkpoint"
    assert key_differences(KEY, {**KEY, "naming": "vllm"}) == ("key_mismatch", ["naming"])
    assert key_differences(KEY, {**KEY, "device": {**KEY["device"], "backend": "cuda"}}) == (
        "key_mismatch", ["device.backend"])


def test_config_keys_of_seeding(tmp_path):
    cfg = tmp_path / "w.toml"
    cfg.write_text('[service]\npeers = ["10.0.0.2:9670", "[fd00::3]:9670"]\npeers_file = "/run/wc/peers"\n'
                   'seed_listen = "0.0.0.0:9670"\nseed_transport = "LIBFABRIC"\nseed_devices = ["efa0"]\n'
                   'seed_bandwidth_bytes_per_s = 1000000000\n'
                   '[models.m]\npath = "/srv/m"\nserve_to_peers = true\n[models.n]\npath = "/srv/n"\n')
    c = load_config(cfg)
    assert c.service.peers == ("10.0.0.2:9670", "[fd00::3]:9670") and c.service.seed_transport == "LIBFABRIC"
    assert c.service.seed_secret_file == "/etc/weightcache/seed.secret" and c.service.seed_samples == 8
    assert c.models["m"].serve_to_peers is True and c.models["n"].serve_to_peers is False  # off by default
    for line, match in (('peers = ["10.0.0.2"]', "service.peers: '10.0.0.2' is not host:port"),
                        ('seed_transport = "TCP"', "'TCP' is not one of UCX, LIBFABRIC"),
                        ('seed_secret_file = "seed.secret"', "relative path"),
                        ('seed_samples = 100', "out of range")):
        cfg.write_text(f"[service]\n{line}\n")
        with pytest.raises(ConfigError, match=match):
            load_config(cfg)


def test_seeding_is_off_with_one_log_line_without_nixl(tmp_path, monkeypatch, caplog):
    for name in ("nixl_cu12", "nixl_cu12._api", "nixl_cu13", "nixl_cu13._api"):  # import raises ImportError,
        monkeypatch.setitem(sys.modules, name, None)                             # as without the package
    settings = SeedSettings(peers=("127.0.0.1:1",), secret_file=write_secret(tmp_path, NEW))
    with caplog.at_level(logging.WARNING):
        assert Seeder.create(settings, 0, lambda: None) is None
    (rec,) = [r for r in caplog.records if "seeding off" in r.getMessage()]
    assert "NIXL is not installed (pip install 'weightcache[seeding]'" in rec.getMessage()
    assert Seeder.create(SeedSettings(), 0, lambda: None) is None  # not configured: nothing said


def test_a_source_reads_no_large_frame_from_a_stranger(tmp_path):
    """The source reads at most MAX_REQUEST_BYTES before it can check a frame's HMAC."""
    import struct

    from weightcache.seeding._channel import MAX_REQUEST_BYTES

    secret = load_secret(write_secret(tmp_path, NEW))
    a, b = socket.socketpair()
    a.settimeout(10)  # a source that waits for the whole frame fails here at once, not at pytest's timeout
    server = Channel(a, secret, server=True)
    server.open()
    b.sendall(struct.pack(">I", MAX_REQUEST_BYTES + 1))
    with pytest.raises(ChannelError, match=f"a frame of {MAX_REQUEST_BYTES + 1} bytes") as e:
        server.recv("request")
    assert e.value.reason == "protocol"
    a.close()
    b.close()


def test_the_peers_file_is_read_at_each_call(tmp_path, caplog):
    f = tmp_path / "peers"
    st = SeedSettings(peers=("10.0.0.1:9670",), peers_file=str(f))
    with caplog.at_level(logging.WARNING):
        assert st.all_peers() == ["10.0.0.1:9670"]  # not written yet: the static peers, and a warning
    assert "peers file" in caplog.text
    f.write_text("# written by the fleet tool\n10.0.0.2:9670\n10.0.0.1:9670  # also static\n\n[fd00::3]:9670\n")
    assert st.all_peers() == ["10.0.0.1:9670", "10.0.0.2:9670", "[fd00::3]:9670"]
    assert SeedSettings(peers_file=str(f)).enabled and not SeedSettings().enabled
