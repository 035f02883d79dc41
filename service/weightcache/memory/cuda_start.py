"""The CUDA driver's start-up, begun on a background thread as ``weightcache serve`` starts.

Before its first allocation a service on an H200 waits about 0.3 s for the
driver: ``cuInit`` (0.1–0.2 s) and the retain of the GPU's primary context
(``cuDevicePrimaryCtxRetain``, 0.12–0.15 s), after importing
``cuda.bindings.driver`` (0.03–0.05 s). Those calls release the GIL, so
:class:`CudaStart` makes them on a thread of its own, begun as soon as the
configuration says the backend may be ``cuda``, while the main thread imports
the daemon's modules:

1. the probe, :func:`weightcache.memory.probe_cuda` (import, ``cuInit``, device
   count), whose answer :meth:`CudaStart.probe` hands to
   :func:`weightcache.memory.select_backend` (same reasons, same errors);
2. when the driver is usable: the GPU's :class:`~weightcache.memory.cuda_driver._Device`
   (``cuDeviceGet``, the primary context retained, the VMM granularity), which
   :meth:`CudaStart.device` hands to :class:`~weightcache.memory.cuda.CudaBackend`,
   or the driver error it raised, raised again in the caller's thread.

Each step is done once: what the thread did is what the backend uses. The
thread does nothing else: more Python work beside the main thread's imports
would only share the GIL with them (numpy's import, the other long one, is
begun once the daemon's modules are in: :func:`weightcache.daemon.bootstrap.serve`).
The ``host`` backend never starts it.

Forbidden imports: torch, daemon, client, protocol, cli.
"""

from __future__ import annotations

import threading
from typing import Any


class CudaStart:
    """The driver's start-up for GPU ``gpu``, running on the thread ``weightcache-cuda-start``.

    Args:
        gpu (`int`): CUDA ordinal as torch counts it (the instance's GPU).

    Example:
        >>> start = CudaStart(0).begin()            # returns at once
        >>> name, reason = select_backend("auto", probe=start.probe)
        >>> backend = CudaBackend(0, device=start.device())
    """

    def __init__(self, gpu: int) -> None:
        self.gpu = int(gpu)
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
