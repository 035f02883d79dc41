"""The CUDA driver's start-up, begun on a background thread as ``weightcache serve`` starts.

Before its first allocation a service on an H200 spends about 0.4 s in the
driver: importing ``cuda.bindings.driver`` (0.03–0.05 s), ``cuInit`` (0.1–0.2 s)
and retaining the GPU's primary context (``cuDevicePrimaryCtxRetain``, 0.12–0.15 s),
then its first load imports NVRTC and compiles the kernels
(:mod:`weightcache.memory.kernels`, 0.15–0.25 s). The driver calls release the
GIL, so :class:`CudaStart` runs them on a thread of their own while the
service's main thread imports the daemon (0.2–0.3 s) and a second thread
imports numpy (:func:`weightcache.checkpoint_header.warm_validation`):

1. the probe, :func:`weightcache.memory.probe_cuda` (import, ``cuInit``, device
   count), whose answer :meth:`CudaStart.probe` hands to
   :func:`weightcache.memory.select_backend` (same reasons, same errors);
2. when the driver is usable: the GPU's :class:`~weightcache.memory.cuda_driver._Device`
   (``cuDeviceGet``, the primary context retained, the VMM granularity), which
   :meth:`CudaStart.device` hands to :class:`~weightcache.memory.cuda.CudaBackend`,
   or the driver error it raised, raised again in the caller's thread;
3. the import of the rest of the backend (:mod:`weightcache.memory.cuda`) and,
   when the configuration places a model on this GPU, the kernels' compile
   (:func:`weightcache.memory.kernels.prepare`, on its own thread; the first
   load waits for it, or compiles itself when it failed).

Each step is done once: what the thread did is what the backend uses. The
``host`` backend never starts it.

Forbidden imports: torch, daemon, client, protocol, cli.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)


class CudaStart:
    """The driver's start-up for GPU ``gpu``, running on the thread ``weightcache-cuda-start``.

    Args:
        gpu (`int`): CUDA ordinal as torch counts it (the instance's GPU).
        kernels (`bool`, *optional*): also compile the load's GPU kernels once the context is retained
            (a model is placed on this GPU); defaults to False.

    Example:
        >>> start = CudaStart(0).begin()            # returns at once
        >>> name, reason = select_backend("auto", probe=start.probe)
        >>> backend = CudaBackend(0, device=start.device())
    """

    def __init__(self, gpu: int, kernels: bool = False) -> None:
        self.gpu = int(gpu)
        self._kernels = kernels
        self._probed = threading.Event()
        self._done = threading.Event()
        self._probe: Any = None
        self._probe_error: BaseException | None = None
        self._device: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="weightcache-cuda-start", daemon=True)

    def begin(self) -> "CudaStart":
        """Starts the thread; returns ``self``."""
        self._thread.start()
        return self

    def probe(self) -> Any:
        """The driver's answer (:class:`~weightcache.memory.CudaProbe`), waiting for it; raises only what
        :func:`~weightcache.memory.probe_cuda` raised (it never does)."""
        self._probed.wait()
        if self._probe_error is not None:
            raise self._probe_error
        return self._probe

    def device(self) -> Any:
        """The GPU's ``_Device`` with its primary context retained, waiting for it; None when the probe found
        no usable driver.

        Raises:
            CudaDriverError: what ``_Device(gpu)`` raised on the thread (no GPU ``gpu``, a context that
                cannot be created), the same exception object.
        """
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._device

    def _run(self) -> None:
        from . import probe_cuda  # looked up now: the package's current function

        try:
            self._probe = probe_cuda()
        except BaseException as e:  # noqa: BLE001 - raised again by probe() in the caller's thread
            self._probe_error = e
        finally:
            self._probed.set()
        try:
            if self._probe is not None and self._probe.usable:
                from .cuda_driver import _Device

                self._device = _Device(self.gpu)
        except BaseException as e:  # noqa: BLE001 - raised again by device() in the caller's thread
            self._error = e
        finally:
            self._done.set()
        if self._device is None:
            return
        try:
            from . import cuda  # noqa: F401 - the rest of the backend's modules, off the main thread

            if self._kernels:
                from . import kernels

                kernels.prepare(self._device)
        except Exception as e:  # noqa: BLE001 - the backend and the first load do both again, and report
            log.debug("cuda start-up: warming the backend failed gpu=%d error=%r", self.gpu, e)
