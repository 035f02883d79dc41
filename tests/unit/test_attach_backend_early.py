"""The local backend is set up while the service answers the attach, its errors still raised where they were.

Against a real host-backend service (``service_harness.daemon``): what is
checked is the order of the client's calls and which error an attach raises,
never a time. The backend lookup is replaced by a recorder (or a failing one)
on the client module, the name both of the attach's calls use.
"""

from __future__ import annotations


import pytest
from service_harness import daemon, poll_until  # noqa: F401 - daemon: pytest fixture
from checkpoints import toy_checkpoint  # noqa: F401 - daemon: pytest fixture

torch = pytest.importorskip("torch")

from weightcache.client import _attach as client  # noqa: E402
from weightcache.errors import ConfigError, ModelNotFound  # noqa: E402


def test_backend_is_set_up_before_the_reply_is_read(daemon, tmp_path, monkeypatch):  # noqa: F811 - the fixture
    """The backend and torch's view operations are set up between sending the request and reading the reply."""
    ck = tmp_path / "ck"
    w = toy_checkpoint(ck)
    svc = daemon({"toy": str(ck)})
    events = []
    real_backend, real_replies, real_warm_up = client.local_backend, client.Session.replies, client.warm_up_views

    def local_backend(device):
        events.append(("local_backend", device))
        return real_backend(device)

    def warm_up_views():
        events.append(("warm_up_views", None))
        return real_warm_up()

    def replies(self, *a, **kw):
        events.append(("replies", None))
        return real_replies(self, *a, **kw)

    monkeypatch.setattr(client, "local_backend", local_backend)
    monkeypatch.setattr(client, "warm_up_views", warm_up_views)
    monkeypatch.setattr(client.Session, "replies", replies)
    with client.attach(str(ck), socket_dir=svc.socket_dir, fallback=False, timeout=60) as a:
        assert a.source == "daemon" and torch.equal(a.tensors["w"], w)
    assert events[:3] == [("local_backend", "cpu"), ("warm_up_views", None), ("replies", None)], events


class _Refused(ConfigError):
    pass


def _failing_backend(device):
    raise _Refused(f"no backend for {device}", key="device")


def _leases(svc) -> int:
    return sum(s.get("lease_count", len(s.get("leases", []))) for s in svc.status()["slabs"])


def test_a_backend_that_fails_raises_after_the_reply_and_leaves_no_lease(daemon, tmp_path, monkeypatch):  # noqa: F811
    """The early set-up's error is not raised early: the attach's own call after the reply raises it, and the
    session (the lease) is closed as before."""
    ck = tmp_path / "ck"
    toy_checkpoint(ck)
    svc = daemon({"toy": str(ck)})
    svc.wait_settled()
    calls = []
    monkeypatch.setattr(client, "local_backend", lambda d: (calls.append(d), _failing_backend(d)))
    with pytest.raises(_Refused):
        client.attach(str(ck), socket_dir=svc.socket_dir, fallback=False, timeout=60)
    assert calls == ["cpu", "cpu"]  # early (its error kept back), then the attach's own call, which raised it
    poll_until(lambda: _leases(svc) == 0, "the refused attach's lease to end", 10.0, 0.05)


def test_the_services_refusal_wins_over_a_failing_backend(daemon, tmp_path, monkeypatch):  # noqa: F811
    """A model the service does not hold: its ``model_not_found``, not the backend's error set up meanwhile."""
    ck = tmp_path / "ck"
    toy_checkpoint(ck)
    svc = daemon({"toy": str(ck)})
    monkeypatch.setattr(client, "local_backend", _failing_backend)
    with pytest.raises(ModelNotFound):
        client.attach("no-such-model", socket_dir=svc.socket_dir, fallback=False, timeout=60)
