"""The parallel reader: checkpoint byte ranges straight to their slab offsets, with no torch.

The face of the package. Its rooms, lowest first:

- :mod:`._task`: :class:`ReadTask`, one read (contiguous or strided rows);
- :mod:`._cpus`: the CPUs this process may use, and the default thread count;
- :mod:`._rows`: a TP rank's row-parallel pieces, copied out of the checkpoint file;
- :mod:`._loader`: the reader threads (:func:`read_direct`, :func:`read_into_slab`).

Forbidden imports: torch at module level, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

from ._cpus import default_threads
from ._loader import DirectRead, LoaderOptions, direct_task, read_direct, read_into_slab
from ._rows import compact_rows, copy_mapped_rows, in_page_cache, mapped, read_rows_by_spans
from ._task import DIRECT_ALIGN, ReadTask

__all__ = ["DIRECT_ALIGN", "DirectRead", "LoaderOptions", "ReadTask", "compact_rows", "copy_mapped_rows",
           "default_threads", "direct_task", "in_page_cache", "mapped", "read_direct", "read_into_slab",
           "read_rows_by_spans"]
