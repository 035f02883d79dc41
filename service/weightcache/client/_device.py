"""Which service instance and which local backend serve a torch device string (``cpu``, ``cuda``, ``cuda:N``).

Instances are numbered by physical GPU (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, nothing
hidden), the engine's devices by ``CUDA_VISIBLE_DEVICES``: :func:`physical_gpu`
maps one to the other. :func:`local_backend` is the slab backend that maps an
attached slab onto the engine's device (imported when first asked).

Forbidden imports: torch at module level, weightcache.memory at module level, weightcache.pipeline,
weightcache.daemon, weightcache.config.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


def physical_gpu(index: int, visible: str | None) -> int:
    """The physical GPU index (the service instance) of in-process CUDA device ``index``.

    Instances are numbered as ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` counts GPUs with
    nothing hidden; set that order in the engine too, so that the entries of
    ``CUDA_VISIBLE_DEVICES`` mean the same GPUs.

    Args:
        index (`int`): the torch device index.
        visible (`str`, *optional*): ``$CUDA_VISIBLE_DEVICES``.

    Raises:
        ConfigError (`config_invalid`): ``CUDA_VISIBLE_DEVICES`` names devices
            by UUID or MIG id; pass ``gpu`` to :func:`attach` (vLLM: set ``gpu`` in
            the extra config) instead.

    Example:
        >>> physical_gpu(1, "4,5")
        5
    """
    if not visible:
        return index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries) or not entries[index].isdigit():
        raise ConfigError(
            f"cannot map CUDA device {index} to a weightcache instance through CUDA_VISIBLE_DEVICES={visible!r}; "
            f"pass gpu= to attach() (vLLM: set \"gpu\" in --model-loader-extra-config)", key="gpu")
    return int(entries[index])


_BACKENDS: dict[str, Any] = {}


def local_backend(device: str):
    """The backend that maps slabs onto ``device`` (``cpu``: host memfd; ``cuda:N``: VMM on GPU N).

    One per device string for the life of the process: a CUDA backend retains
    the GPU's primary context and queries its granularity and UUID once, not
    on every attach.
    """
    backend = _BACKENDS.get(device)
    if backend is None:
        from ..memory import get_backend

        if device.startswith("cuda"):
            backend = get_backend("cuda", int(device.split(":", 1)[1]) if ":" in device else 0)
        else:
            backend = get_backend("host")
        _BACKENDS[device] = backend
    return backend


def device_info(device: str) -> dict[str, Any]:
    """Cache-key device fields for a torch device string (``cpu``, ``cuda:1``)."""
    return local_backend(device).device_info()
