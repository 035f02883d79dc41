"""Which service instance ``attach()`` asks: the physical GPU index, through ``CUDA_VISIBLE_DEVICES``.

No CUDA needed: with no service listening, ``attach(..., fallback=False)`` by
model name raises ``DaemonUnavailable`` naming the socket it tried, before
touching any device.
"""

from __future__ import annotations

import pytest

from weightcache import attach
from weightcache.client import physical_gpu
from weightcache.errors import ConfigError, DaemonUnavailable


@pytest.mark.parametrize("index, visible, expected", [(0, None, 0), (3, "", 3), (0, "1", 1), (1, "4,5", 5),
                                                      (1, " 2 , 7 ", 7)])
def test_physical_gpu(index, visible, expected):
    assert physical_gpu(index, visible) == expected


@pytest.mark.parametrize("index, visible", [(0, "GPU-8c1e1f5a-0000"), (0, "MIG-1"), (2, "0,1")])
def test_physical_gpu_unmappable_names_the_fix(index, visible):
    with pytest.raises(ConfigError) as e:
        physical_gpu(index, visible)
    assert e.value.code == "config_invalid" and e.value.details["key"] == "gpu"
    assert visible in e.value.message and "gpu=" in e.value.message


@pytest.mark.parametrize("visible, device, gpu, socket", [
    ("1", "cuda:0", None, "1.sock"), (None, "cuda:1", None, "1.sock"), ("3,2", "cuda:1", None, "2.sock"),
    ("1", "cuda:0", 0, "0.sock"), ("1", "cpu", None, "0.sock"), ("3", "cuda", None, "3.sock")])
def test_attach_asks_the_physical_instance(tmp_path, monkeypatch, visible, device, gpu, socket):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(DaemonUnavailable) as e:
        attach("some-model", tp_size=2, tp_rank=1, device=device, gpu=gpu, fallback=False, socket_dir=str(tmp_path))
    assert e.value.details["socket"] == str(tmp_path / socket)
