"""``cuda_driver.load_driver``: the driver library loaded ahead with ``cuDriverGetVersion``, never ``cuInit``.

A fake ``cuda.bindings.driver`` module records the calls (no CUDA on this
machine); what is checked is which driver calls are made and what comes
back on each way the driver can be missing.
"""

from __future__ import annotations

import enum

import pytest

from weightcache.memory import cuda_driver


class _Result(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_NO_DEVICE = 100


class _FakeDriver:
    """The part of ``cuda.bindings.driver`` that load_driver may touch; any other call is recorded and fails."""

    CUresult = _Result

    def __init__(self, answer):
        self.answer = answer
        self.calls: list[str] = []

    def cuDriverGetVersion(self):  # noqa: N802 - the driver's name
        self.calls.append("cuDriverGetVersion")
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    def __getattr__(self, name):
        def call(*a, **kw):
            self.calls.append(name)
            raise AssertionError(f"load_driver called {name}")
        return call


@pytest.mark.parametrize("answer,want", [
    ((_Result.CUDA_SUCCESS, 13000), 13000),
    ((_Result.CUDA_ERROR_NO_DEVICE, 0), None),
    (RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search'), None),
    (OSError("libcuda.so.1: cannot open shared object file"), None),
])
def test_load_driver_asks_the_version_and_nothing_else(monkeypatch, answer, want):
    fake = _FakeDriver(answer)
    monkeypatch.setattr(cuda_driver, "cu", fake)
    assert cuda_driver.load_driver() == want
    assert fake.calls == ["cuDriverGetVersion"]  # no cuInit: a process that forks later keeps working CUDA children


def test_load_driver_without_cuda_bindings_is_none(monkeypatch):
    monkeypatch.setattr(cuda_driver, "cu", None)
    assert cuda_driver.load_driver() is None


def test_init_driver_still_raises_where_load_driver_stayed_silent(monkeypatch):
    """The library missing: load_driver answers None; the attach's own cuInit raises CudaDriverError as before."""
    class Missing(_FakeDriver):
        def cuInit(self, flags):  # noqa: N802
            self.calls.append("cuInit")
            raise RuntimeError("libcuda.so.1 not found")

    fake = Missing(RuntimeError("libcuda.so.1 not found"))
    monkeypatch.setattr(cuda_driver, "cu", fake)
    assert cuda_driver.load_driver() is None
    with pytest.raises(cuda_driver.CudaDriverError) as e:
        cuda_driver._init_driver()
    assert e.value.call == "cuInit" and "libcuda.so.1 not found" in str(e.value)
    assert fake.calls[:2] == ["cuDriverGetVersion", "cuInit"]  # then cuGetErrorString for the message
