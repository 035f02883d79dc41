"""``attach()`` checks its own arguments before it connects: typed errors that name the argument."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from weightcache import attach  # noqa: E402
from weightcache.errors import ConfigError, DaemonUnavailable  # noqa: E402


@pytest.mark.parametrize("kwargs,key", [
    ({"tp_size": 0}, "tp_size"),
    ({"tp_size": "2"}, "tp_size"),
    ({"tp_size": True}, "tp_size"),
    ({"tp_rank": 1}, "tp_rank"),
    ({"tp_rank": -1}, "tp_rank"),
    ({"tp_size": 2, "tp_rank": 2}, "tp_rank"),
    ({"device": "gpu0"}, "device"),
    ({"device": "cuda:x"}, "device"),
    ({"timeout": -1}, "timeout"),
    ({"timeout": math.nan}, "timeout"),
    ({"timeout": 1e12}, "timeout"),  # was OverflowError from the socket's timeout, no fallback
    ({"timeout": math.inf}, "timeout"),
    ({"gpu": -1}, "gpu"),
    ({"dtype": "fp8"}, "dtype"),
    ({"naming": "vLLM"}, "naming"),
])
def test_bad_argument_is_config_invalid_before_connecting(tmp_path, kwargs, key):
    """No service listens in ``tmp_path``: an argument error must win over ``daemon_unavailable``."""
    with pytest.raises(ConfigError) as e:
        attach("/srv/models/anything", socket_dir=str(tmp_path), fallback=False, **kwargs)
    assert e.value.code == "config_invalid" and e.value.details["key"] == key
    assert key in e.value.message


def test_empty_model_is_config_invalid(tmp_path):
    with pytest.raises(ConfigError) as e:
        attach("", socket_dir=str(tmp_path))
    assert e.value.details["key"] == "model"


def test_torch_device_is_accepted_like_its_string(tmp_path):
    with pytest.raises(DaemonUnavailable):  # got as far as connecting: the device was understood
        attach("/srv/models/anything", device=torch.device("cpu"), socket_dir=str(tmp_path), fallback=False)


def test_torch_dtype_is_accepted_like_its_name(tmp_path):
    """What a transformers user passes (``dtype=torch.bfloat16``) is that dtype's name; it was ``config_invalid``."""
    from weightcache.client import AttachOptions, AttachRequest

    assert AttachRequest.of("/m", 1, 0, AttachOptions(dtype=torch.bfloat16)).dtype == "bfloat16"
    with pytest.raises(DaemonUnavailable):  # got as far as connecting: the dtype was understood
        attach("/srv/models/anything", dtype=torch.float16, socket_dir=str(tmp_path), fallback=False)
    with pytest.raises(ConfigError) as e:  # a torch dtype the service cannot hold names itself
        attach("/srv/models/anything", dtype=torch.float64, socket_dir=str(tmp_path), fallback=False)
    assert e.value.details["key"] == "dtype" and "'float64'" in e.value.message


def test_fallback_impossible_for_a_model_that_is_not_a_local_directory(tmp_path):
    """``fallback=True`` cannot load a name or a missing path from disk: the error says so."""
    for model in ("minilm", str(tmp_path / "absent")):
        with pytest.raises(DaemonUnavailable) as e:
            attach(model, socket_dir=str(tmp_path), fallback=True)
        assert f"no disk fallback: {model!r} is not a checkpoint directory" in e.value.message
        assert e.value.details["socket"] == str(tmp_path / "0.sock")


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:12", "cuda:00", "cuda:", "cuda:x", "CUDA", "cpu ",
                                    " cuda", "cuda:0\n", "cuda:\u0663", "cuda:\u00b2", "cuda:-1", "cuda:+1",
                                    "cuda: 1", "cuda0", "gpu0", "", "cpu:0", None, 3])
def test_device_check_accepts_what_the_documented_pattern_accepts(device):
    """The device check (no pattern compiled in a process's first attach) accepts exactly what
    ``re.fullmatch(r"cpu|cuda(:[0-9]+)?", device)`` accepts: ASCII digits only."""
    import re

    from weightcache.client._request import _is_device

    want = isinstance(device, str) and re.fullmatch(r"cpu|cuda(:[0-9]+)?", device) is not None
    assert _is_device(device) is want


@pytest.mark.parametrize("device", ["cuda:\u0663", "cuda:\u00b2", "cuda:"])
def test_a_non_ascii_or_missing_device_index_is_config_invalid(tmp_path, device):
    with pytest.raises(ConfigError) as e:
        attach("/srv/models/anything", device=device, socket_dir=str(tmp_path), fallback=False)
    assert e.value.details["key"] == "device"


def test_no_socket_names_the_instances_that_listen(tmp_path):
    """A model placed on instance 1 of a CPU node: the engine asks 0 (its device's); the error says what is there."""
    (tmp_path / "1.sock").touch()  # a name in the directory is what is listed
    (tmp_path / "x.sock").touch()
    with pytest.raises(DaemonUnavailable) as e:
        attach("/srv/models/anything", socket_dir=str(tmp_path), fallback=False)
    assert e.value.details == {"socket": str(tmp_path / "0.sock"), "listening": [1]}
    with pytest.raises(DaemonUnavailable) as e:
        attach("/srv/models/anything", socket_dir=str(tmp_path / "absent"), fallback=False)
    assert e.value.details["listening"] == []
