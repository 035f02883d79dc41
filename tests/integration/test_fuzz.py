"""Protocol fuzzing: hypothesis against ``protocol.Connection`` and against a live service.

Hostile input (random bytes, a huge length prefix, invalid JSON, deep nesting,
wrong field types, out-of-range integers, unknown ops, fds nobody announced,
a connection flood past the fd limit) must get an ``error`` reply or a closed
connection, never take the service down, and leave its fds and RSS where they
were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import struct
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from service_harness import poll_until, record_figures  # noqa: E402
from wire_helpers import HELLO, frame, raw_connect  # noqa: E402
from checkpoints import compare_bytes, llama_checkpoint, read_checkpoint  # noqa: E402
from weightcache import attach, protocol  # noqa: E402
from weightcache.errors import RemoteProtocolError  # noqa: E402

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20
REPLY_TAGS = {c.tag() for c in protocol.replies()}
REQUESTS = protocol.requests()
KNOWN_TAGS = sorted(protocol.TAGS)
FIGURES: dict[str, int] = {"connection_examples": 0, "live_frames": 0}
FIRST: dict[str, dict] = {}
RSS_GROWTH_LIMIT_BYTES = 64 * MiB

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    st.text(max_size=8), kids, max_size=4), max_leaves=12)


def _hello_frame() -> bytes:
    return protocol.encode(protocol.Hello(protocol.PROTOCOL_VERSION, "fuzz"))


def _wrong_value(f: dataclasses.Field):
    spec = str(f.type).replace(" ", "")
    base = spec.removesuffix("|None").split("[")[0]
    return {"int": "7", "str": 7, "bool": 1, "dict": [], "list": {}, "float": "x"}[base]


# --- protocol.Connection directly ----------------------------------------------------


def _drain(conn: protocol.Connection) -> tuple[list, list[int], bool]:
    msgs, fds = [], []
    try:
        while True:
            ev = conn.next_message()
            if ev is protocol.NEED_DATA:
                return msgs, fds, False
            msgs.append(ev[0])
            fds += ev[1]
    except RemoteProtocolError as e:
        assert e.code == "protocol_violation"
        assert conn.state == protocol.CLOSED
        return msgs, fds, True


@settings(max_examples=400, deadline=None)
@given(hello=st.booleans(),
       chunks=st.lists(st.tuples(st.binary(max_size=48), st.lists(st.integers(3, 10_000), max_size=3)), max_size=8))
def test_connection_random_bytes_and_fds(hello, chunks):
    """Random bytes with random fds, in random reads: a message, NEED_DATA or protocol_violation,
    nothing else; every fd handed in comes back out (with a message or from take_all_fds)."""
    FIGURES["connection_examples"] += 1
    conn = protocol.Connection(protocol.SERVER)
    given_fds: list[int] = []
    out_fds: list[int] = []
    if hello:
        conn.receive(_hello_frame())
    for data, fds in chunks:
        if not data and not fds:
            continue
        conn.receive(data, fds)
        given_fds += fds
        _, got, failed = _drain(conn)
        out_fds += got
        if failed:
            break
    out_fds += conn.take_all_fds()
    assert sorted(out_fds) == sorted(given_fds)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(protocol.MAX_FRAME_BYTES + 1, 2**32 - 1))
def test_connection_huge_length_prefix_rejected_at_once(n):
    """The length alone is enough to refuse: no byte of the body is awaited or buffered."""
    FIGURES["connection_examples"] += 1
    conn = protocol.Connection(protocol.SERVER)
    conn.receive(struct.pack(">I", n))
    with pytest.raises(RemoteProtocolError) as ei:
        conn.next_message()
    assert ei.value.code == "protocol_violation" and ei.value.details["size_bytes"] == n
    assert conn.state == protocol.CLOSED


@settings(max_examples=250, deadline=None)
@given(tag=st.sampled_from(KNOWN_TAGS) | st.text(max_size=12), fields=st.dictionaries(
    st.sampled_from(["model", "tp_size", "tp_rank", "wait_ms", "lease_id", "force", "client", "protocol_version",
                     "dtype", "naming", "mode", "fd_count", "status", "code"]) | st.text(max_size=8),
    json_values, max_size=5))
def test_decode_json_objects(tag, fields):
    """Any JSON object either decodes to a message that encodes back to the same fields, or is
    refused with protocol_violation."""
    FIGURES["connection_examples"] += 1
    obj = {**fields, "type": tag}
    try:
        body = json.dumps(obj, allow_nan=False).encode()
    except ValueError:
        return
    try:
        msg, fd_count = protocol.decode(body)
    except RemoteProtocolError as e:
        assert e.code == "protocol_violation"
        return
    back = msg.to_json()
    back.pop("fd_count", None)
    obj.pop("fd_count", None)
    assert {k: back[k] for k in obj} == obj
    assert fd_count == msg.FD_COUNT


@pytest.mark.parametrize("cls", REQUESTS, ids=lambda c: c.tag())
def test_every_wrong_field_type_is_named(cls):
    """For every request field, a value of the wrong type is refused naming that field."""
    for f in dataclasses.fields(cls):
        FIGURES["connection_examples"] += 1
        good = {"protocol_version": 3, "model": "m", "lease_id": 1}
        obj = {"type": cls.tag(), **{k: v for k, v in good.items() if k in {x.name for x in dataclasses.fields(cls)}}}
        obj[f.name] = _wrong_value(f)
        with pytest.raises(RemoteProtocolError) as ei:
            protocol.decode(json.dumps(obj).encode())
        assert ei.value.details.get("field") == f.name


# --- a live service ----------------------------------------------------------------


@pytest.fixture(scope="module")
def live(module_daemon, tmp_path_factory):
    ck = llama_checkpoint(tmp_path_factory.mktemp("fuzz") / "m", seed=31)
    svc = module_daemon({"m": ck})
    svc.wait_settled()
    FIRST["snapshot"] = svc.snapshot()
    return svc, ck


def _exchange(svc, payload: bytes, fds: list[int] = (), with_hello: bool = True) -> list[dict]:
    """Sends ``payload`` (after hello), half-closes, reads every reply frame until EOF."""
    s = raw_connect(svc.socket_path, timeout=30)
    replies = []
    try:
        if with_hello:
            s.sendall(frame(HELLO))
            r, _ = _read_frame(s)
            assert r["type"] == "hello_reply"
        if payload or fds:
            s.sendmsg([payload or b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
                      if fds else [])
        with contextlib.suppress(OSError):  # the service may have closed already
            s.shutdown(socket.SHUT_WR)
        while True:
            r, got = _read_frame(s)
            for fd in got:
                os.close(fd)
            if r is None:
                return replies
            replies.append(r)
    finally:
        s.close()


def _read_frame(s):
    head = b""
    fds: list[int] = []
    try:
        while len(head) < 4:
            data, anc, _, _ = s.recvmsg(4 - len(head), socket.CMSG_SPACE(8 * 4), socket.MSG_CMSG_CLOEXEC)
            fds += _fds(anc)
            if not data:
                return None, fds
            head += data
        (n,) = struct.unpack(">I", head)
        body = b""
        while len(body) < n:
            data, anc, _, _ = s.recvmsg(n - len(body), socket.CMSG_SPACE(8 * 4), socket.MSG_CMSG_CLOEXEC)
            fds += _fds(anc)
            if not data:
                raise AssertionError("service sent a truncated frame")
            body += data
    except ConnectionResetError:
        return None, fds
    body, nul, payload = body.partition(b"\x00")  # attach_reply: JSON, NUL, packed manifest payload
    obj = json.loads(body)
    if nul:
        obj["payload"] = payload
    return obj, fds


def _fds(anc) -> list[int]:
    out = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            out += list(struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) // 4 * 4]))
    return out


def _check_replies(replies: list[dict]) -> None:
    for r in replies:
        assert r["type"] in REPLY_TAGS, r
        if r["type"] == "error":
            assert isinstance(r["code"], str) and r["code"] and isinstance(r["message"], str)


def _mutated_request():
    def build(args):
        cls, field_name, value, drop_type = args
        # evict is a legitimate (group-trusted) request: aim it at a model the service does not hold
        obj = {"type": cls.tag(), "protocol_version": 3, "model": "not-m" if cls is protocol.Evict else "m"}
        obj = {k: v for k, v in obj.items() if k == "type" or k in {f.name for f in dataclasses.fields(cls)}}
        if field_name is not None:
            obj[field_name] = value
        if drop_type:
            obj.pop("type")
        return json.dumps(obj).encode()

    return st.tuples(st.sampled_from(REQUESTS), st.none() | st.sampled_from(
        ["model", "tp_size", "tp_rank", "wait_ms", "lease_id", "force", "mode", "dtype", "naming", "bogus", "fd_count"]),
        json_values, st.booleans()).map(build)


live_payloads = st.one_of(
    st.binary(max_size=256),  # random bytes
    st.binary(max_size=200).map(frame),  # a well-framed random body
    json_values.map(lambda v: frame(json.dumps(v).encode())),  # valid JSON, not a message
    _mutated_request().map(frame),  # a request with a wrong/unknown field, or no type
    st.text(max_size=16).map(lambda t: frame({"type": t, "model": "m"})),  # unknown ops
    st.integers(protocol.MAX_FRAME_BYTES + 1, 2**32 - 1).map(lambda n: struct.pack(">I", n) + b"{}"),  # huge prefix
    st.lists(st.sampled_from([frame({"type": "status"}), frame({"type": "list"}), frame({"type": "hello",
             "protocol_version": 3})]), max_size=4).map(b"".join),  # valid, or hello twice
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(payload=live_payloads, with_hello=st.booleans())
@example(payload=frame(b"[" * 200_000), with_hello=True)  # nesting past the recursion limit
@example(payload=frame({"type": "attach", "model": "m", "wait_ms": 10**30}), with_hello=True)
@example(payload=frame({"type": "attach", "model": "/m\0x"}), with_hello=True)
@example(payload=frame(b'{"type": "attach", "model": "\\ud800"}'), with_hello=True)
@example(payload=frame(b'{"type": "status", "x": NaN}'), with_hello=True)
@example(payload=frame(b"\xff\xfe not utf-8"), with_hello=True)
@example(payload=frame({"type": "release", "lease_id": 99}), with_hello=True)
@example(payload=frame({"type": "attach_reply", "lease_id": 1, "manifest": {}, "checkpoint_path": "/", "backend": "x",
                        "fd_count": 1}), with_hello=True)
def test_live_service_survives_hostile_frames(live, payload, with_hello):
    """Each hostile payload gets error replies or a closed connection; the service keeps answering."""
    svc, _ = live
    FIGURES["live_frames"] += 1
    _check_replies(_exchange(svc, payload, with_hello=with_hello))
    assert svc.alive()


def test_live_unexpected_fds_are_closed(live):
    """fds on frames that declare none (1, 8, and 20 > the per-frame cap, with and without a complete
    frame) end the connection with protocol_violation; the service closes every fd it received
    (a pipe whose read end it got reports EPIPE)."""
    svc, _ = live
    base = svc.snapshot()
    cases = 0
    for nfds, payload in ((1, frame({"type": "status"})), (8, frame({"type": "status"})),
                          (20, frame({"type": "status"})), (3, frame({"type": "status"})[:5]),
                          (2, frame(HELLO)), (1, b"\0")):
        pipes = [os.pipe() for _ in range(nfds)]
        replies = _exchange(svc, payload, [r for r, _ in pipes], with_hello=payload != frame(HELLO))
        for r, _ in pipes:
            os.close(r)
        _check_replies(replies)
        if payload.startswith(frame({"type": "status"})) and nfds <= 8:
            assert replies and replies[-1]["type"] == "error" and replies[-1]["code"] == "protocol_violation"
        svc.snapshot()  # the service has processed the close
        for _, w in pipes:
            with pytest.raises(BrokenPipeError):
                os.write(w, b"x")  # no reader left anywhere: the service closed its copy
            os.close(w)
        cases += 1
    after = svc.snapshot()
    assert after["fds"] == base["fds"]
    FIGURES["fd_cases"] = cases


def test_live_connection_flood_past_fd_limit(daemon, tmp_path):
    """With RLIMIT_NOFILE 64, 120 idle connections: the service pauses accept instead of dying,
    answers again once they go, and serves identical bytes."""
    ck = llama_checkpoint(tmp_path / "m", seed=32)
    svc = daemon({"m": ck}, nofile=64)
    svc.wait_settled()
    base = svc.snapshot()
    flood = []
    for _ in range(120):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.setblocking(False)
        try:
            s.connect(svc.socket_path)
        except (BlockingIOError, ConnectionRefusedError, OSError):
            s.close()
            break
        flood.append(s)
    assert len(flood) > 64
    def paused() -> bool:
        assert svc.alive(), svc.log()[-2000:]
        return "accept paused" in svc.log()

    poll_until(paused, "the service to pause accepting", 30, 0.05, detail=lambda: svc.log()[-2000:])
    for s in flood:
        s.close()
    w = attach(str(ck), socket_dir=svc.socket_dir, fallback=False, timeout=60)
    assert w.source == "daemon"
    n = compare_bytes(w.tensors, read_checkpoint(ck))
    w.close()
    after = svc.snapshot()
    assert after["fds"] == base["fds"]
    FIGURES["flood_connections"] = len(flood)
    FIGURES["flood_bytes_compared"] = n


def test_live_service_bounded_after_fuzzing(live):
    """Runs last in this module: after all the hostile frames, fds equal the first snapshot's and
    RSS grew less than 64 MiB; a normal attach returns identical bytes."""
    svc, ck = live
    snap = svc.snapshot()
    first = FIRST["snapshot"]
    assert snap["fds"] == first["fds"]
    assert snap["rss_bytes"] - first["rss_bytes"] < RSS_GROWTH_LIMIT_BYTES
    w = attach(str(ck), socket_dir=svc.socket_dir, fallback=False)
    n = compare_bytes(w.tensors, read_checkpoint(ck))
    w.close()
    after = svc.snapshot()
    assert after["fds"] == snap["fds"]
    assert svc.alive()
    record_figures(
        "fuzz.protocol", "Protocol fuzzing (hypothesis): sans-I/O Connection and a live service",
        "Connection: only messages, NEED_DATA or protocol_violation, fds conserved, wrong field types named; "
        "live: error replies or closed connections, service stays up, fds equal, RSS bounded; unexpected fds "
        "closed by the service (EPIPE); flood past RLIMIT_NOFILE=64 pauses accept, then serves",
        frames_tried=FIGURES["live_frames"] + FIGURES.get("fd_cases", 0),
        connection_examples=FIGURES["connection_examples"], faults_injected=FIGURES["live_frames"] +
        FIGURES.get("fd_cases", 0) + FIGURES.get("flood_connections", 0),
        flood_connections=FIGURES.get("flood_connections", 0), rss_bytes=after["rss_bytes"],
        rss_growth_bytes=snap["rss_bytes"] - first["rss_bytes"], service_fds=sum(after["fds"].values()),
        bytes_compared=n + FIGURES.get("flood_bytes_compared", 0))
