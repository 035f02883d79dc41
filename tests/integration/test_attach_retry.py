"""``attach(..., retry=Retry(...))``: an attach caught in a restart of its service asks again instead of
falling back to disk; off by default; only retryable errors; every retry logged at WARNING.

The restart is real: the service's socket is absent, or a stand-in that
accepts the request and closes the connection without a reply, as a stopping service does,
and then the real service (``weightcache serve``, host backend) starts on the
same socket. The test waits for the client's first retry line before it starts
the service, so the retry path is the one exercised.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from service_harness import ServiceProcess, make_config, poll_until
from checkpoints import read_checkpoint
from tiny_models import tiny_llama  # noqa: F401 (fixture)
from weightcache import AttachOptions, Retry, attach, errors


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def client_log():
    h = _Lines()
    lg = logging.getLogger("weightcache.client")
    lg.addHandler(h)
    yield h.lines
    lg.removeHandler(h)


@pytest.fixture
def stopped(tiny_llama):
    """A service configured for the tiny Llama, not started yet (its socket does not exist)."""
    work = Path(tempfile.mkdtemp(prefix="wcr-", dir="/tmp"))
    svc = ServiceProcess(work, make_config({"llama": str(tiny_llama)}))
    yield svc
    svc.kill()


def _attach_in_thread(path: str, **kw) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["w"] = attach(path, **kw)
        except BaseException as e:  # noqa: BLE001 - asserted by the test
            out["e"] = e

    th = threading.Thread(target=run)
    th.start()
    return th, out


def test_without_a_policy_an_absent_service_falls_back_at_once(stopped, tiny_llama, client_log):
    with attach(str(tiny_llama), socket_dir=stopped.socket_dir) as w:
        assert w.source == "disk" and w.fallback_reason.startswith("daemon_unavailable: ")
    assert not [m for m in client_log if m.startswith("attach retry")]


def test_a_retry_reaches_the_service_that_starts_after_the_first_attempt(stopped, tiny_llama, client_log):
    th, out = _attach_in_thread(str(tiny_llama), socket_dir=stopped.socket_dir, fallback=False, timeout=120,
                                retry=Retry(retries=1000, backoff_s=0.02, max_backoff_s=0.2))
    poll_until(lambda: any(m.startswith("attach retry") for m in client_log), "the client's first retry")
    stopped.start()
    th.join(120)
    assert "e" not in out, out.get("e")
    with out["w"] as w:
        assert w.source == "daemon" and w.fallback_reason is None
        expected = read_checkpoint(tiny_llama)
        assert all(torch.equal(w.tensors[n], t) for n, t in expected.items())
    first = next(m for m in client_log if m.startswith("attach retry"))
    assert f"checkpoint={tiny_llama} tp_size=1 tp_rank=0 attempt=2 attempts=1001" in first
    assert "reason=daemon_unavailable: " in first


def test_a_service_that_goes_away_with_the_request_is_asked_again(stopped, tiny_llama, client_log):
    """A stopping service: the connection is accepted, the request read, and closed without a reply; then the
    real service binds the socket."""
    os.makedirs(stopped.socket_dir, exist_ok=True)
    ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ls.bind(stopped.socket_path)
    ls.listen(8)
    th, out = _attach_in_thread(str(tiny_llama), socket_dir=stopped.socket_dir, fallback=False, timeout=120,
                                retry=Retry(retries=1000, backoff_s=0.02, max_backoff_s=0.2))
    conn, _ = ls.accept()
    conn.settimeout(10)
    assert conn.recv(65536)  # the hello and the attach
    conn.close()
    ls.close()
    os.unlink(stopped.socket_path)
    poll_until(lambda: client_log, "the retry after the service went away")
    stopped.start()
    th.join(120)
    assert "e" not in out, out.get("e")
    with out["w"] as w:
        assert w.source == "daemon"
    assert client_log[0].startswith("attach retry") and client_log[0].endswith(
        f"reason=daemon_unavailable: weightcache service at {stopped.socket_path} closed the connection"), client_log[0]


def test_the_retries_spent_it_falls_back_with_the_last_reason(stopped, tiny_llama, client_log):
    opts = AttachOptions(socket_dir=stopped.socket_dir, retry=Retry(retries=2, backoff_s=0.01))
    with attach(str(tiny_llama), options=opts) as w:
        assert w.source == "disk" and w.fallback_reason.startswith("daemon_unavailable: ")
    retries = [m for m in client_log if m.startswith("attach retry")]
    assert [m.split(" attempts=")[0].rsplit("attempt=", 1)[1] for m in retries] == ["2", "3"], retries


def test_an_error_that_is_not_retryable_is_not_retried(stopped, tiny_llama, client_log):
    stopped.start()
    with pytest.raises(errors.ModelNotFound):  # by name, a name the service does not hold
        attach("no-such-model", socket_dir=stopped.socket_dir, retry=Retry(retries=5, backoff_s=0.01))
    assert not [m for m in client_log if m.startswith("attach retry")]


@pytest.mark.parametrize("retry, problem", [
    (Retry(retries=0), "retry.retries 0 must be an integer from 1 to 1000"),
    (Retry(backoff_s=float("nan")), "retry.backoff_s nan must be a finite number of seconds from 0 to 60"),
    (Retry(backoff_s=2.0, max_backoff_s=1.0), "retry.max_backoff_s 1.0 must be at least retry.backoff_s 2.0"),
    (3, "retry 3 must be a weightcache.Retry policy or None"),
])
def test_a_policy_no_attach_could_use_is_config_invalid(tiny_llama, retry, problem):
    with pytest.raises(errors.ConfigError) as e:
        attach(str(tiny_llama), retry=retry)
    assert e.value.details["key"] == "retry" and problem in e.value.message
