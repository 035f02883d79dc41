"""The engine side: :func:`attach`, what it returns, and the disk fallback.

The face of the package. Its rooms:

- :mod:`._request`: :class:`AttachOptions`, :class:`Retry` and the validated :class:`AttachRequest`;
- :mod:`._device`: which service instance and which local backend serve a torch device string;
- :mod:`._attachment`: :class:`Attachment`;
- :mod:`._attach`: :func:`attach`, its exchange with the service and the cache key check;
- :mod:`._fallback`: the disk fallback, the only room that imports the load pipeline (when it runs);
- :mod:`._publish`: :func:`publish` (the engine hands the service what it processed) and
  :func:`attach_published` (attach it again by the engine's key);
- :mod:`._imports`: the CUDA attach path's imports, begun on a thread when this package is imported.

Forbidden imports: weightcache.config, weightcache.daemon, asyncio, weightcache.pipeline at module level,
weightcache.quant at module level, weightcache.sharding at module level, weightcache.reader at module level,
numpy at module level, torch at module level.
"""

from __future__ import annotations

from ._attach import RUNTIME_HINT, attach, read_manifest_file
from ._attachment import Attachment
from ._device import device_info, local_backend, physical_gpu
from ._fallback import load_from_disk
from ._imports import wait as wait_for_imports
from ._publish import Published, allocate_home, attach_published, pack, publish
from ._request import MAX_TIMEOUT_S, AttachOptions, AttachRequest, Retry, load_request

__all__ = ["Attachment", "AttachOptions", "AttachRequest", "MAX_TIMEOUT_S", "Published", "RUNTIME_HINT", "Retry",
           "allocate_home", "attach", "attach_published", "device_info", "load_from_disk", "load_request",
           "local_backend", "pack", "physical_gpu", "publish", "read_manifest_file", "wait_for_imports"]
