"""The values both ends of the wire share (weightcache.wire): one definition, parsed at the edges, rendered everywhere.

Every slab state reaches the operator: one ``weightcache_slab_state`` series per
state with value 1 for the slab's own, and a line in ``weightcache status``
that starts with the state's name. ``Attach.mode`` and the records' states are
checked once, when a message or record is built or decoded.
"""

from __future__ import annotations

import contextlib
import io
import json
import struct

import pytest
from prometheus_client.parser import text_string_to_metric_families

from weightcache import metrics, protocol
from weightcache.wire import AttachMode, SlotState
from weightcache.errors import LocalProtocolError, RemoteProtocolError


def _slab(state: SlotState, model: str) -> protocol.SlabInfo:
    # the state as the wire carries it (a string): records parse it into the member
    return protocol.SlabInfo(model=model, path=f"/ck/{model}", tp_size=1, tp_rank=0, state=state.value,
                             done_bytes=0, total_bytes=0, rate_bytes_per_s=0, resident_bytes=0, adopted=False,
                             dtype="auto", naming="hf", tensors=0)


def _status() -> protocol.ServiceStatus:
    """One service holding a slab in each state, the slab named after its state."""
    return protocol.ServiceStatus(gpu=0, pid=4242, backend="host", device=protocol.DeviceInfo("host"), free_bytes=1,
                                  total_bytes=2, slabs=tuple(_slab(s, f"m-{s.value}") for s in SlotState),
                                  clients=0, status_line="ready")


def test_every_slot_state_has_its_metrics_series(monkeypatch):
    """Each slab gets one ``weightcache_slab_state`` series per state, 1 for its own (``retired`` once had none)."""
    inst = metrics.Instance(0, True, "active", _status(), protocol.ServiceCounters("0", 0.0))
    monkeypatch.setattr(metrics, "collect", lambda *a, **k: [inst])
    text = metrics.exposition(metrics.registry("/nonexistent")).decode()
    (fam,) = [f for f in text_string_to_metric_families(text) if f.name == "weightcache_slab_state"]
    series = {(s.labels["model"], s.labels["state"]): s.value for s in fam.samples}
    states = [s.value for s in SlotState]
    for slab_state in SlotState:
        model = f"m-{slab_state.value}"
        assert {st: series.get((model, st)) for st in states} == {st: float(st == slab_state.value) for st in states}


def test_every_slot_state_is_rendered_by_status():
    """``weightcache status`` prints each slab's state name first on its line."""
    from weightcache.cli.status import print_status

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_status(_status(), now=1.7e9)
    lines = {line.split()[0]: line for line in out.getvalue().splitlines() if line.strip().startswith("m-")}
    for s in SlotState:
        line = lines[f"m-{s.value}"]
        assert line.split("rank=0", 1)[1].split()[0].rstrip(":") == s.value, line


def test_records_parse_states_and_modes_into_members():
    sl = protocol.SlabInfo.from_json(_slab(SlotState.RETIRED, "m").to_json())
    assert sl.state is SlotState.RETIRED and sl.to_json()["state"] == "retired"
    le = protocol.LeaseInfo.from_json({"lease_id": 1, "pid": 2, "uid": 3, "gid": 4, "since": 0.0, "mode": "copy"})
    assert le.mode is AttachMode.COPY
    vr = protocol.VerifyResult.from_json({"model": "m", "tp_size": 1, "tp_rank": 0, "state": "ready", "mismatched": []})
    assert vr.state is SlotState.READY


@pytest.mark.parametrize("record,field", [
    (dict(_slab(SlotState.READY, "m").to_json(), state="resident"), "state"),
])
def test_a_state_no_service_has_is_a_remote_protocol_violation(record, field):
    with pytest.raises(RemoteProtocolError) as e:
        protocol.SlabInfo.from_json(record)
    assert (e.value.code, e.value.details["field"]) == ("protocol_violation", field)
    with pytest.raises(LocalProtocolError) as e:
        protocol.SlabInfo(**{**record, "leases": ()})
    assert (e.value.code, e.value.details["field"]) == ("local_protocol_violation", field)


def test_attach_mode_is_checked_once_when_built_or_decoded():
    assert protocol.Attach("m", mode="copy").mode is AttachMode.COPY
    assert protocol.Attach("m").mode is AttachMode.ZERO_COPY
    with pytest.raises(LocalProtocolError) as e:
        protocol.Attach("m", mode="mmap")
    assert (e.value.code, e.value.details["field"]) == ("local_protocol_violation", "mode")
    with pytest.raises(RemoteProtocolError) as e:
        protocol.decode(json.dumps({"type": "attach", "model": "m", "mode": "mmap"}).encode())
    assert (e.value.code, e.value.details["field"]) == ("protocol_violation", "mode")


def test_attach_frame_bytes_unchanged_by_the_mode_enum():
    frame = protocol.encode(protocol.Attach("m", mode=AttachMode.COPY))
    body = (b'{"model":"m","tp_size":1,"tp_rank":0,"wait_ms":0,"dtype":null,"naming":null,"mode":"copy",'
            b'"type":"attach"}')
    assert frame == struct.pack(">I", len(body)) + body


def test_the_written_out_state_table_names_every_message():
    assert protocol.REQUEST_TYPES == tuple(c.tag() for c in protocol.requests()[1:])
    assert protocol.REPLY_TYPES == tuple(c.tag() for c in protocol.replies())
    assert protocol.requests()[0] is protocol.Hello
    assert tuple(protocol.TAGS) == ("hello",) + protocol.REQUEST_TYPES + protocol.REPLY_TYPES


def test_one_definition_of_namings_and_request_defaults():
    from weightcache import sharding, spec, wire
    from weightcache.client import _request
    from weightcache.config import _config

    assert _config.NAMINGS is sharding.NAMINGS is _request.NAMINGS is wire.NAMINGS
    req = spec.LoadRequest("m", "/m")
    assert (req.dtype, req.naming, req.kernel) == (wire.DEFAULT_DTYPE, wire.DEFAULT_NAMING, wire.DEFAULT_KERNEL)


def test_loading_reply_state_is_a_member():
    assert protocol.Loading("m", 1, 2, "pending").state is SlotState.PENDING
    assert protocol.Loading("m", 1, 2).state is SlotState.LOADING
    with pytest.raises(RemoteProtocolError) as e:
        protocol.decode(b'{"type":"loading","model":"m","done_bytes":1,"total_bytes":2,"state":"warming"}')
    assert (e.value.code, e.value.details["field"]) == ("protocol_violation", "state")
