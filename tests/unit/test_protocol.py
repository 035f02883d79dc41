"""Sans-I/O protocol: golden frames, round trips, fd matching, the state table."""

import dataclasses
import struct

import pytest
from wire_helpers import frame  # noqa: E402
from hypothesis import given, settings
from hypothesis import strategies as st

from weightcache import errors, protocol
from weightcache.protocol import CLIENT, NEED_DATA, SERVER, Connection


def test_golden_hello_frame():
    data, fds = Connection(CLIENT).send(protocol.Hello(1, "engine"))
    assert data == b'\x00\x00\x007{"protocol_version":1,"client":"engine","type":"hello"}'
    assert fds == []


def test_golden_attach_reply_frame_declares_its_fds():
    """Protocol 3: the slab's fd, then the manifest file's; the frame holds no manifest."""
    srv = Connection(SERVER)
    srv.receive(Connection(CLIENT).send(protocol.Hello(1))[0])
    srv.next_message()
    data, fds = srv.send(protocol.AttachReply(7, "/ck", "host", 1234), [42, 43])
    assert data == (b'\x00\x00\x00u{"lease_id":7,"checkpoint_path":"/ck","backend":"host",'
                    b'"manifest_size_bytes":1234,"type":"attach_reply","fd_count":2}')
    assert fds == [42, 43]


@pytest.mark.parametrize("cls", protocol.requests() + protocol.replies())
def test_tag_is_snake_case_of_class_name(cls):
    import re

    assert cls.tag() == re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()
    assert protocol.message_class(cls.tag()) is cls
    assert protocol.TAGS[cls.tag()][1] == cls.__name__


@pytest.mark.parametrize("name", ["AttachReply", "Hello", "ABC", "XMLReply", "A1B2", "aB", "Ab_Cd", "\u00c9t\u00e9X",
                                  "Z", "", "GPUInfoReply"])
def test_snake_case_is_the_documented_pattern(name):
    """``snake_case`` (no pattern compiled when a process first tags a message) is ``re.sub(r"(?<!^)(?=[A-Z])", "_",
    name).lower()``: an underscore before every ASCII capital but the first character."""
    import re

    from weightcache.protocol._messages import snake_case

    assert snake_case(name) == re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _example(cls):
    vals = {}
    for f in dataclasses.fields(cls):
        t = str(f.type)
        vals[f.name] = {"int": 3, "str": "x", "bool": True, "dict": {"a": [1]}, "list": [1, "b"], "bytes": b"\x00pay\nload"}[
            t.split("|")[0].strip().split("[")[0]]
    if cls in (protocol.Attach, protocol.AttachPublished):  # fields with a closed set of values (weightcache.wire)
        vals["mode"] = "copy"
    if cls is protocol.Loading:
        vals["state"] = "pending"
    return cls(**vals)


@pytest.mark.parametrize("cls", protocol.requests() + protocol.replies())
def test_round_trip_every_message(cls):
    msg = _example(cls)
    frame = protocol.encode(msg)
    back, fd_count = protocol.decode(frame[4:])
    assert back == msg and fd_count == cls.FD_COUNT


def test_frames_split_across_reads_and_fds_matched_by_count():
    cli, srv = Connection(CLIENT), Connection(SERVER)
    srv.receive(Connection(CLIENT).send(protocol.Hello(1))[0])
    assert srv.next_message()[0] == protocol.Hello(1)
    cli.send(protocol.Hello(1))
    a, _ = srv.send(protocol.AttachReply(1, "/a", "host", 100), [10, 20])
    b, _ = srv.send(protocol.AttachReply(2, "/b", "host", 200), [11, 21])
    stream = a + b
    # fds arrive with the first byte of the first frame, data split at odd places
    cli.receive(stream[:3], [10, 20, 11, 21])
    assert cli.next_message() is NEED_DATA
    cli.receive(stream[3 : len(a) + 5])
    m1, f1 = cli.next_message()
    assert (m1.lease_id, f1) == (1, [10, 20])
    assert cli.next_message() is NEED_DATA
    cli.receive(stream[len(a) + 5 :])
    m2, f2 = cli.next_message()
    assert (m2.lease_id, f2) == (2, [11, 21])


def test_fewer_fds_than_declared_is_remote_violation():
    cli = Connection(CLIENT)
    cli.send(protocol.Hello(1))
    cli.receive(frame({"type": "attach_reply", "lease_id": 1, "checkpoint_path": "/", "backend": "host",
                        "manifest_size_bytes": 1, "fd_count": 2}), [7])
    with pytest.raises(errors.RemoteProtocolError) as e:
        cli.next_message()
    assert e.value.code == "protocol_violation"
    assert cli.state == protocol.CLOSED


def test_unexpected_fds_are_a_violation_and_handed_back():
    srv = Connection(SERVER)
    srv.receive(frame({"type": "hello", "protocol_version": 1}), [5, 6])
    with pytest.raises(errors.RemoteProtocolError):
        srv.next_message()
    assert sorted(srv.take_all_fds()) == [5, 6]


@pytest.mark.parametrize(
    "obj",
    [
        {"type": "hello"},  # missing field
        {"type": "hello", "protocol_version": "1"},  # wrong type
        {"type": "hello", "protocol_version": True},  # bool is not int
        {"type": "hello", "protocol_version": 1, "extra": 2},  # unknown field
        {"type": "launch_missiles"},  # unknown op
        {"protocol_version": 1},  # no type
        [1, 2],  # not an object
        {"type": "hello", "protocol_version": 1, "fd_count": 99},
    ],
)
def test_invalid_messages_rejected_with_code(obj):
    srv = Connection(SERVER)
    srv.receive(frame(obj))
    with pytest.raises(errors.RemoteProtocolError) as e:
        srv.next_message()
    assert e.value.code == "protocol_violation"


def test_nan_and_invalid_utf8_rejected():
    for body in (b'{"type":"hello","protocol_version":NaN}', b"\xff\xfe"):
        srv = Connection(SERVER)
        srv.receive(struct.pack(">I", len(body)) + body)
        with pytest.raises(errors.RemoteProtocolError):
            srv.next_message()


def test_oversize_length_prefix_rejected_before_buffering():
    srv = Connection(SERVER)
    srv.receive(struct.pack(">I", protocol.MAX_FRAME_BYTES + 1))
    with pytest.raises(errors.RemoteProtocolError) as e:
        srv.next_message()
    assert e.value.details["size_bytes"] == protocol.MAX_FRAME_BYTES + 1


def test_incomplete_bytes_is_what_follows_the_whole_frames():
    """The bytes of the incomplete frame after the whole ones (the transport counts them against
    max_buffered_bytes while a connection's whole requests wait for their turn)."""
    hello = frame({"type": "hello", "protocol_version": protocol.PROTOCOL_VERSION})
    status = frame({"type": "status"})
    srv = Connection(SERVER, max_frame_bytes=100)
    assert srv.incomplete_bytes == 0
    srv.receive(hello + status)
    assert (srv.buffered_bytes, srv.incomplete_bytes) == (len(hello + status), 0)
    srv.receive(status[:3])  # not even a whole length prefix
    assert srv.incomplete_bytes == 3
    srv.receive(status[3:] + status[:7])
    assert srv.incomplete_bytes == 7
    srv.next_message()  # taking whole frames from the front leaves the tail as it is
    assert (srv.buffered_bytes, srv.incomplete_bytes) == (len(status) * 2 + 7, 7)
    srv = Connection(SERVER, max_frame_bytes=100)
    srv.receive(hello + struct.pack(">I", 101) + b"x" * 200)  # a length over max_frame_bytes: no frame follows
    assert srv.incomplete_bytes == 204


def test_state_machine_hello_first_and_only_once():
    srv = Connection(SERVER)
    srv.receive(frame({"type": "status"}))
    with pytest.raises(errors.RemoteProtocolError):
        srv.next_message()
    srv = Connection(SERVER)
    srv.receive(frame({"type": "hello", "protocol_version": 1}) * 2)
    srv.next_message()
    with pytest.raises(errors.RemoteProtocolError):
        srv.next_message()


def test_transition_table_exhaustive():
    """Every (role, state, direction, type) is either in the table or refused."""
    tags = list(protocol.TAGS)
    for role in (CLIENT, SERVER):
        for state in (protocol.START, protocol.READY, protocol.CLOSED):
            for direction in ("in", "out"):
                for tag in tags:
                    key = (role, state, direction, tag)
                    allowed = key in protocol.TRANSITIONS
                    requests = {c.tag() for c in protocol.requests()}
                    incoming_request = (role == SERVER) == (direction == "in")
                    if state == protocol.CLOSED:
                        assert not allowed
                    elif tag in requests and not incoming_request:
                        assert not allowed, key
                    elif tag not in requests and incoming_request:
                        assert not allowed, key
                    elif state == protocol.START:
                        assert allowed == (tag in ("hello", "error")), key
                    else:
                        assert allowed == (tag != "hello"), key


def test_send_checks_fd_count_locally():
    srv = Connection(SERVER)
    srv.receive(frame({"type": "hello", "protocol_version": 1}))
    srv.next_message()
    with pytest.raises(errors.LocalProtocolError) as e:
        srv.send(protocol.AttachReply(1, "/", "host", 1), [3])
    assert e.value.code == "local_protocol_violation"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_decoder_fuzz_never_raises_anything_but_protocol_errors(data):
    srv = Connection(SERVER)
    srv.receive(data)
    seen = 0
    try:
        while srv.next_message() is not NEED_DATA:
            seen += 1
    except errors.RemoteProtocolError as e:
        assert e.code == "protocol_violation" and srv.state == protocol.CLOSED
    assert seen <= len(data) // 4


@pytest.mark.parametrize("body", [
    b'{"type":"hello","protocol_version":1}\x00junk',  # protocol 2's NUL + payload is gone
    b'{"type":"hello","protocol_version":1\x00}',
    b'{"type":"attach_reply","lease_id":1,"checkpoint_path":"/","backend":"host","manifest_size_bytes":1,'
    b'"fd_count":2,"payload":"x"}',
    b'{"type":"attach_reply","lease_id":1,"checkpoint_path":"/","backend":"host","manifest_size_bytes":1,'
    b'"fd_count":1}',
])
def test_nul_payload_or_an_old_attach_reply_is_a_protocol_violation(body):
    with pytest.raises(errors.RemoteProtocolError) as e:
        protocol.decode(body)
    assert e.value.code == "protocol_violation"


def test_golden_publish_frame_declares_its_fds():
    """``publish`` carries two fds (the slab memfd, the publisher's manifest file) and the engine's key."""
    cli = Connection(CLIENT)
    cli.send(protocol.Hello(3))
    data, fds = cli.send(protocol.Publish("m", 1, 0, {"engine": "vllm"}, 4096, 512), [42, 43])
    assert data == frame(b'{"model":"m","tp_size":1,"tp_rank":0,"engine_key":{"engine":"vllm"},'
                           b'"size_bytes":4096,"manifest_size_bytes":512,"type":"publish","fd_count":2}')
    assert fds == [42, 43]
    srv = Connection(SERVER)
    srv.receive(Connection(CLIENT).send(protocol.Hello(3))[0] + data, [42, 43])
    srv.next_message()
    msg, got = srv.next_message()
    assert type(msg) is protocol.Publish and msg.engine_key == {"engine": "vllm"} and got == [42, 43]


def test_golden_publish_reply_and_attach_published_frames():
    srv = Connection(SERVER)
    srv.receive(Connection(CLIENT).send(protocol.Hello(3))[0])
    srv.next_message()
    data, fds = srv.send(protocol.PublishReply("m/tp1/rank0+pub:0123abcd", True, 4096, "0123abcd"))
    assert data == frame(b'{"label":"m/tp1/rank0+pub:0123abcd","created":true,"size_bytes":4096,'
                           b'"engine_key_blake2b":"0123abcd","type":"publish_reply"}') and fds == []
    cli = Connection(CLIENT)
    cli.send(protocol.Hello(3))
    data, _ = cli.send(protocol.AttachPublished("m", 2, 1, {"engine": "vllm"}))
    assert data == frame(b'{"model":"m","tp_size":2,"tp_rank":1,"engine_key":{"engine":"vllm"},'
                           b'"mode":"zero_copy","type":"attach_published"}')


def test_publish_without_its_fds_is_a_violation():
    body = frame({"type": "publish", "model": "m", "tp_size": 1, "tp_rank": 0, "engine_key": {},
                  "size_bytes": 1, "manifest_size_bytes": 1})[4:]
    with pytest.raises(errors.RemoteProtocolError):
        protocol.decode(body)
