"""The disk fallback when the engine's own device fails: the log says what happens.

The fallback loads onto the engine's device; when that device cannot be set up (``device_error``: the CUDA
driver's ``cuInit`` fails, the GPU fell off the bus), the attach raises that error. It used to log
``fallback to disk ... reason=device_error: ...`` first and then raise, so the engine's log claimed a disk
load that never happened. The device is now set up before the fallback is announced: either the log says
``fallback to disk`` and the weights come from disk, or it says ``no fallback to disk`` and the attach raises.
"""

from __future__ import annotations

import logging

import pytest
from service_harness import daemon  # noqa: F401 - daemon: pytest fixture (a host-backend service)
from checkpoints import toy_checkpoint  # noqa: F401 - daemon: pytest fixture (a host-backend service)

torch = pytest.importorskip("torch")

import weightcache.memory  # noqa: E402
from weightcache.client import _attach as client  # noqa: E402
from weightcache.errors import DeviceError  # noqa: E402

_BROKEN = "cuda:7"


@pytest.fixture
def broken_device(monkeypatch):
    """Setting up the backend of :data:`_BROKEN` fails as a dead GPU's driver call does; other devices work."""
    real = weightcache.memory.get_backend

    def get_backend(name, gpu=0, device=None):
        if name == "cuda" and gpu == 7:
            raise DeviceError("cuDevicePrimaryCtxRetain failed with CUDA_ERROR_NO_DEVICE (100): no CUDA-capable "
                              "device is detected", call="cuDevicePrimaryCtxRetain", result="CUDA_ERROR_NO_DEVICE")
        return real(name, gpu, device)

    monkeypatch.setattr(weightcache.memory, "get_backend", get_backend)


def _fallback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "weightcache.client" and "fallback" in r.getMessage()]


@pytest.mark.parametrize("service", [True, False], ids=["service_holds_it", "no_service"])
def test_a_failing_device_raises_without_claiming_a_fallback(daemon, tmp_path, broken_device, caplog,  # noqa: F811
                                                             service):
    ck = tmp_path / "ck"
    toy_checkpoint(ck)
    if service:
        svc = daemon({"toy": str(ck)})
        svc.wait_settled()
        socket_dir, reason = svc.socket_dir, "device_error"  # the attach's own backend call, after the reply
    else:
        socket_dir, reason = str(tmp_path / "run"), "daemon_unavailable"
    caplog.set_level(logging.INFO, logger="weightcache")
    with pytest.raises(DeviceError) as e:
        client.attach(str(ck), device=_BROKEN, gpu=0, socket_dir=socket_dir, fallback=True, timeout=60)
    assert e.value.code == "device_error" and e.value.details["call"] == "cuDevicePrimaryCtxRetain"
    (line,) = _fallback_lines(caplog)
    assert line.startswith(f"no fallback to disk, the device fails checkpoint={ck} tp_size=1 tp_rank=0 "
                           f"device={_BROKEN} code=device_error reason={reason}: "), line


def test_a_working_device_still_falls_back(tmp_path, caplog):
    ck = tmp_path / "ck"
    w = toy_checkpoint(ck)
    caplog.set_level(logging.INFO, logger="weightcache")
    with client.attach(str(ck), socket_dir=str(tmp_path / "run"), fallback=True, timeout=60) as a:
        assert a.source == "disk" and torch.equal(a.tensors["w"], w)
    (line,) = _fallback_lines(caplog)
    assert line.startswith(f"fallback to disk checkpoint={ck} tp_size=1 tp_rank=0 reason=daemon_unavailable: "), line


def test_a_failing_device_is_not_retried(tmp_path, broken_device, caplog):
    """With a retry policy and no service, a device that cannot be set up raises at once: every attempt (the
    attach maps the slab onto it) and the disk fallback need it. It retried until the policy or the timeout
    was spent, each retry logged, and then raised the same device_error."""
    ck = tmp_path / "ck"
    toy_checkpoint(ck)
    caplog.set_level(logging.INFO, logger="weightcache")
    with pytest.raises(DeviceError) as e:
        client.attach(str(ck), device=_BROKEN, gpu=0, socket_dir=str(tmp_path / "run"), fallback=True, timeout=60,
                      retry=client.Retry(retries=3, backoff_s=0.01))
    assert e.value.code == "device_error"
    assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith("attach retry")]
    (line,) = _fallback_lines(caplog)
    assert line.startswith(f"no fallback to disk, the device fails checkpoint={ck} "), line
