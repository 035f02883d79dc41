"""The CUDA driver seen by the cuda backend: the ``cuda.bindings.driver`` import, error mapping, one GPU's context.

Owns :class:`CudaDriverError` (a failed ``CUresult`` with the call's name),
:func:`_check` (every driver call of :mod:`weightcache.memory` goes through
it), :func:`load_driver` (the driver library loaded ahead, no ``cuInit``),
:func:`gpu_uuid`, and :class:`_Device`: one GPU's ``CUdevice``, its
retained *primary* context (``cuDevicePrimaryCtxRetain``, the one PyTorch's
runtime uses, pushed for the duration of each call) and its VMM allocation
properties and granularity (``cuMemGetAllocationGranularity``, 2 MiB on H200).

``cuda-bindings`` is optional (extra ``weightcache[cuda]``): without it
``cu`` is ``None`` and :func:`_require_driver` raises ``ConfigError``.

Forbidden imports: torch, daemon, client, protocol, cli.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..errors import ConfigError, DeviceError

try:  # cuda-bindings is an optional dependency (extra "cuda").
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - exercised on machines without it
    cu = None

__all__ = ["CudaDriverError", "gpu_uuid", "load_driver"]


class CudaDriverError(DeviceError):
    """A CUDA driver call failed with something other than out-of-memory.

    Attributes:
        call (`str`): the driver function, e.g. ``cuMemMap``.
        result (`str`): the ``CUresult`` name, e.g. ``CUDA_ERROR_INVALID_VALUE``.
        result_code (`int`): the numeric ``CUresult``.
    """

    def __init__(self, call: str, result: Any, context: str = "") -> None:
        self.call = call
        self.result_code = int(result)
        self.result = getattr(result, "name", str(result))
        text = _error_string(result)
        msg = f"{call} failed with {self.result} ({self.result_code}): {text}"
        if context:
            msg += f"; {context}"
        super().__init__(msg, call=call, result=self.result)


def _require_driver() -> None:
    if cu is None:
        raise ConfigError(
            "memory backend 'cuda' needs NVIDIA's cuda-bindings package, which is not installed; "
            "fix: pip install 'weightcache[cuda]' or use backend 'host'",
            key="service.backend",
        )


def _error_string(result: Any) -> str:
    try:
        err, text = cu.cuGetErrorString(result)
    except Exception:  # noqa: BLE001 - best effort text for an error message
        return "(no description)"
    if err != cu.CUresult.CUDA_SUCCESS or not text:
        return "(no description)"
    return text.decode() if isinstance(text, bytes) else str(text)


def _check(call: str, ret: tuple, context: str = "") -> Any:
    """Returns the outputs of a ``cuda.bindings.driver`` call or raises.

    Raises:
        CudaDriverError: the call's ``CUresult`` is not ``CUDA_SUCCESS``.
    """
    err = ret[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaDriverError(call, err, context)
    if len(ret) == 1:
        return None
    if len(ret) == 2:
        return ret[1]
    return ret[1:]


def load_driver() -> int | None:
    """Loads the driver library and resolves cuda-bindings' driver entry points, without initialising the driver.

    cuda-bindings resolves every ``cu*`` entry point on the first driver call
    of a process: ``dlopen("libcuda.so.1")`` (through ``cuda.pathfinder``) and
    several hundred ``cuGetProcAddress`` lookups, the GIL held throughout.
    This makes that first call ``cuDriverGetVersion``, which the driver
    answers from the library alone: no ``cuInit`` (which starts the driver's
    threads, may run ``nvidia-modprobe``, and leaves a process that forks
    afterwards with children whose CUDA is broken), no context, no device.
    :mod:`weightcache.client._imports` calls it on its thread, so that an
    engine's first attach finds the entry points resolved. What cuda-bindings
    reads when it resolves them (``$CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM``)
    is read then, not at the first attach; the client uses no default stream.

    Returns:
        `int | None`: the CUDA version the driver supports (``13000`` for 13.0),
        or ``None`` when cuda-bindings is not installed, the library cannot be
        loaded, or the call fails. Never raises: the first real driver call
        (``cuInit``, :func:`_init_driver`) meets the same cause and raises as it
        would have without this.
    """
    if cu is None:
        return None
    try:
        err, version = cu.cuDriverGetVersion()
    except Exception:  # noqa: BLE001 - cuda.pathfinder raises when libcuda.so.1 is absent; cuInit reports it
        return None
    return int(version) if err == cu.CUresult.CUDA_SUCCESS else None


def _init_driver() -> None:
    _require_driver()
    try:
        ret = cu.cuInit(0)
    except Exception as e:  # cuda.pathfinder raises when libcuda.so is absent
        raise CudaDriverError("cuInit", cu.CUresult.CUDA_ERROR_NO_DEVICE, f"driver library not loadable: {e}") from e
    _check("cuInit", ret, "is an NVIDIA driver installed and a GPU visible (CUDA_VISIBLE_DEVICES)?")


def _format_uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _uuid_bytes(uuid_struct: Any) -> bytes:
    raw = uuid_struct.bytes
    if isinstance(raw, str):
        raw = raw.encode("latin-1")
    return bytes(raw)[:16]


def gpu_uuid(index: int) -> str:
    """Returns the UUID of GPU ``index`` as ``nvidia-smi -L`` prints it.

    Args:
        index (`int`): CUDA ordinal as torch counts it (after ``CUDA_VISIBLE_DEVICES``).

    Returns:
        `str`: ``"GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"`` (from ``cuDeviceGetUuid``).

    Raises:
        CudaDriverError: no such device, or the driver is unusable.
    """
    _init_driver()
    dev = _check("cuDeviceGet", cu.cuDeviceGet(index), f"GPU index {index}")
    return _format_uuid(_uuid_bytes(_check("cuDeviceGetUuid", cu.cuDeviceGetUuid(dev))))


class _Device:
    """One GPU: its ``CUdevice``, retained primary context and VMM granularity."""

    def __init__(self, index: int) -> None:
        _init_driver()
        self.index = index
        self.dev = _check("cuDeviceGet", cu.cuDeviceGet(index), f"GPU index {index}")
        self.ctx = _check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self.dev), f"GPU index {index}")
        self.prop = cu.CUmemAllocationProp()
        self.prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = index
        self.prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.granularity = int(
            _check(
                "cuMemGetAllocationGranularity",
                cu.cuMemGetAllocationGranularity(
                    self.prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
            )
        )

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Makes the primary context current on this thread for the block."""
        _check("cuCtxPushCurrent", cu.cuCtxPushCurrent(self.ctx))
        try:
            yield
        finally:
            cu.cuCtxPopCurrent()

    def access_desc(self, read_only: bool) -> Any:
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.index
        desc.flags = (
            cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
            if read_only
            else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        )
        return desc

    def mem_info(self) -> tuple[int, int]:
        """Returns ``(free_bytes, total_bytes)`` of the GPU (``cuMemGetInfo``)."""
        with self.current():
            free, total = _check("cuMemGetInfo", cu.cuMemGetInfo())
        return int(free), int(total)

