"""The CUDA driver's start-up on its own thread (``weightcache.memory.cuda_start``) and how ``serve`` uses it.

The driver is faked where it would have to answer (this machine has none): ``probe_cuda`` is replaced
through the package attribute the thread looks up, ``_Device`` through ``weightcache.memory.cuda_driver``.
What is checked: the backend chosen, the journal line and the errors are those of the serial path
(``select_backend`` asking the driver itself), the device the thread made is the one the backend uses,
and ``host`` never starts the thread.
"""

from __future__ import annotations

import logging
import threading

import pytest

from weightcache import memory
from weightcache.config import Config, ServiceConfig
from weightcache.daemon import bootstrap
from weightcache.errors import ConfigError, DeviceError
from weightcache.memory import CudaProbe
from weightcache.memory.cuda_start import CudaStart

NO_DRIVER = CudaProbe(False, 0, "the CUDA driver library (libcuda.so.1) could not be loaded: OSError: not found")
ONE_GPU = CudaProbe(True, 1, "the CUDA driver reports 1 device(s)")


class FakeDevice:
    """Stands for ``cuda_driver._Device``: records the thread that made it; GPU 7 does not exist."""

    made: list[tuple[int, str]] = []

    def __init__(self, index: int) -> None:
        if index == 7:
            raise DeviceError("cuDeviceGet failed with CUDA_ERROR_INVALID_DEVICE (101): invalid device ordinal; "
                              "GPU index 7", call="cuDeviceGet", result="CUDA_ERROR_INVALID_DEVICE")
        self.index = index
        FakeDevice.made.append((index, threading.current_thread().name))


@pytest.fixture
def driver(monkeypatch):
    """``set(probe)`` makes the driver answer ``probe``; returns the list of probe calls' thread names."""
    calls: list[str] = []
    FakeDevice.made = []
    monkeypatch.setattr("weightcache.memory.cuda_driver._Device", FakeDevice)

    def use(probe: CudaProbe):
        def fake():
            calls.append(threading.current_thread().name)
            return probe

        monkeypatch.setattr("weightcache.memory.probe_cuda", fake)
        return calls

    return use


def _cfg(backend: str, models: dict | None = None) -> Config:
    return Config(service=ServiceConfig(backend=backend), models=models or {}, files=("/etc/weightcache/x.toml",))


def test_probe_and_device_come_from_the_start_thread(driver):
    calls = driver(ONE_GPU)
    start = CudaStart(0).begin()
    assert start.probe() == ONE_GPU
    dev = start.device()
    assert isinstance(dev, FakeDevice) and dev.index == 0
    start._thread.join(10)
    assert calls == ["weightcache-cuda-start"]
    assert FakeDevice.made == [(0, "weightcache-cuda-start")]


def test_no_usable_driver_retains_nothing(driver):
    driver(NO_DRIVER)
    start = CudaStart(0).begin()
    assert start.probe() == NO_DRIVER
    assert start.device() is None
    start._thread.join(10)
    assert FakeDevice.made == []


def test_a_device_error_is_raised_in_the_callers_thread_as_it_was_raised(driver):
    driver(ONE_GPU)
    start = CudaStart(7).begin()
    assert start.probe().usable
    with pytest.raises(DeviceError, match="GPU index 7") as first:
        start.device()
    with pytest.raises(DeviceError) as again:
        start.device()
    assert again.value is first.value


def test_the_backend_uses_the_device_the_thread_made(driver):
    pytest.importorskip("cuda.bindings.driver")
    driver(ONE_GPU)
    dev = CudaStart(0).begin().device()
    backend = memory.get_backend("cuda", 0, device=dev)
    assert backend.name == "cuda" and backend._device(0) is dev
    assert FakeDevice.made == [(0, "weightcache-cuda-start")]  # not retained a second time


@pytest.mark.parametrize("explicit, configured", [("host", "auto"), (None, "host"), ("host", "cuda")])
def test_host_never_starts_the_driver(driver, explicit, configured):
    calls = driver(ONE_GPU)
    assert bootstrap.start_cuda(_cfg(configured), explicit, 0) is None
    assert calls == []


@pytest.mark.parametrize("probe", [NO_DRIVER, ONE_GPU])
@pytest.mark.parametrize("configured", ["auto", "cuda"])
def test_backend_for_chooses_and_says_what_the_serial_path_says(driver, caplog, probe, configured):
    """Same backend, same journal line, same ConfigError as ``select_backend`` asking the driver itself."""
    driver(probe)
    try:
        serial = memory.select_backend(configured, memory.probe_cuda)  # the faked driver, asked serially
    except ConfigError as e:
        serial = e
    cfg = _cfg(configured)
    start = bootstrap.start_cuda(cfg, None, 0)
    assert start is not None
    caplog.set_level(logging.INFO, logger="weightcache")
    if isinstance(serial, ConfigError):
        with pytest.raises(ConfigError) as got:
            bootstrap.backend_for(cfg, None, 0, start=start)
        assert (got.value.code, got.value.message, got.value.details) == (serial.code, serial.message,
                                                                          serial.details)
        assert "backend selected" not in caplog.text
        return
    name, reason = serial
    if name == "cuda":
        pytest.importorskip("cuda.bindings.driver")
    backend = bootstrap.backend_for(cfg, None, 0, start=start)
    assert backend.name == name
    assert f"backend selected backend={name} gpu=0 reason={reason}" in caplog.text
    if name == "cuda":
        assert backend._device(0) is start.device()


def test_a_start_thread_that_cannot_start_leaves_the_driver_to_the_serial_path(driver, monkeypatch):
    """No thread to be had (a thread limit): ``serve`` asks the driver on its own thread, as before, instead of
    failing with the thread's RuntimeError."""
    calls = driver(NO_DRIVER)

    def refused(self):
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", refused)
        assert bootstrap.start_cuda(_cfg("auto"), None, 0) is None  # backend_for(start=None): the serial path
    assert calls == []
