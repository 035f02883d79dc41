"""docs/protocol.md, "Compatibility": within a protocol version a client ignores reply fields it does not know, and
reads a field an older service's reply lacks as its default; the service still refuses unknown request fields.

Follow-up of issue 38: ``reload_reply`` gained ``moved``, and a CLI of the release before refused the new service's
reply as a ``protocol_violation`` (``message 'reload_reply' has unknown field 'moved'``), so ``systemctl reload``
failed across an upgrade; a new CLI against an old service needs ``moved`` to default.
"""

from __future__ import annotations

import json
import socket
import threading

import pytest

from weightcache import protocol
from weightcache.errors import RemoteProtocolError


def _frame(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return len(body).to_bytes(4, "big") + body


def _as_json(msg: protocol.Message) -> dict:
    return json.loads(protocol.encode(msg)[4:])


def test_a_client_drops_reply_fields_it_does_not_know_and_defaults_missing_ones():
    newer = {**_as_json(protocol.ReloadReply(["a/tp1/rank0"], [], [], ["b/tp1/rank0"], [], ["/etc/w.toml"],
                                             ["c/tp1/rank0 -> host"])), "surprise": {"x": 1}}
    older = {"type": "reload_reply", "added": [], "dropped": [], "retired": [], "kept": ["b/tp1/rank0"]}
    conn = protocol.Connection(protocol.CLIENT)
    conn.send(protocol.Hello(protocol.PROTOCOL_VERSION, "test"))
    conn.receive(_frame({**_as_json(protocol.HelloReply(protocol.PROTOCOL_VERSION, 0, "", "host", ["metrics"])),
                         "new_capability_field": True}))
    assert conn.next_message()[0] == protocol.HelloReply(protocol.PROTOCOL_VERSION, 0, "", "host", ["metrics"])
    for reply, want in ((newer, protocol.ReloadReply(["a/tp1/rank0"], [], [], ["b/tp1/rank0"], [], ["/etc/w.toml"],
                                                     ["c/tp1/rank0 -> host"])),
                        (older, protocol.ReloadReply([], [], [], ["b/tp1/rank0"]))):
        conn.send(protocol.Reload())
        conn.receive(_frame(reply))
        got, fds = conn.next_message()
        assert (got, fds) == (want, [])
    assert want.moved == [] and want.files == []


def test_the_service_still_refuses_unknown_request_fields():
    conn = protocol.Connection(protocol.SERVER)
    conn.receive(_frame({"type": "hello", "protocol_version": protocol.PROTOCOL_VERSION, "client": "t", "extra": 2}))
    with pytest.raises(RemoteProtocolError) as e:
        conn.next_message()
    assert e.value.message == "message 'hello' has unknown field 'extra'"


def test_a_reply_field_of_the_wrong_type_is_still_a_violation():
    conn = protocol.Connection(protocol.CLIENT)
    conn.send(protocol.Hello(protocol.PROTOCOL_VERSION, "test"))
    conn.receive(_frame({"type": "hello_reply", "protocol_version": protocol.PROTOCOL_VERSION, "gpu": "0",
                         "gpu_uuid": "", "backend": "host"}))
    with pytest.raises(RemoteProtocolError):
        conn.next_message()


@pytest.mark.parametrize("reply", [
    # a newer service: fields this CLI does not know, at the top and inside nothing else
    {"type": "reload_reply", "added": [], "dropped": [], "retired": [], "kept": ["m/tp1/rank0"], "restart_keys": [],
     "files": ["/etc/weightcache/weightcache.toml"], "moved": ["x/tp1/rank0 -> disk"], "surprise": [1, 2]},
    # an older service: no restart_keys, files or moved
    {"type": "reload_reply", "added": [], "dropped": [], "retired": [], "kept": ["m/tp1/rank0"]},
], ids=["newer-service", "older-service"])
def test_weightcache_reload_against_a_service_of_another_release(tmp_path, capsys, reply):
    """The CLI end to end against a socket answering as a service of another release would."""
    from weightcache.cli import main

    path = tmp_path / "0.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    seen: list = []

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            server = protocol.Connection(protocol.SERVER)
            answers = [{**_as_json(protocol.HelloReply(protocol.PROTOCOL_VERSION, 0, "", "host", ["metrics"])),
                        "later": "a field of a later release"}, reply]
            while answers:
                data = conn.recv(65536)
                if not data:
                    return
                server.receive(data)
                while answers:
                    got = server.next_message()
                    if got is protocol.NEED_DATA:
                        break
                    seen.append(got[0])
                    conn.sendall(_frame(answers.pop(0)))
            conn.recv(1)  # until the CLI closes

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        capsys.readouterr()
        rc = main(["reload", "--socket-dir", str(tmp_path), "--gpu", "0"])
        out, err = capsys.readouterr()
        assert rc == 0, (out, err)
        assert [type(m).__name__ for m in seen] == ["Hello", "Reload"]
        assert "protocol_violation" not in out + err and "unknown field" not in out + err, (out, err)
        if "moved" in reply:
            assert "x/tp1/rank0 -> disk" in out, out
    finally:
        t.join(10)
        srv.close()
