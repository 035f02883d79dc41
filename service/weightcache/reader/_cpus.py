"""The CPUs this process may run on, and the default reader thread count they give.

A leaf that both :mod:`weightcache.config` (the default of
``service.read_threads``) and :mod:`weightcache.reader` (its reader threads)
import, so that reading the configuration does not import the loader.

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import os

#: Bounds of the default reader thread count (:func:`default_threads`).
MIN_DEFAULT_THREADS, MAX_DEFAULT_THREADS = 4, 32


def default_threads() -> int:
    """Reader threads when ``service.read_threads`` is not set: the CPUs this process may run on, 4 to 32.

    ``os.sched_getaffinity(0)`` (what systemd's ``CPUAffinity=`` and cgroup
    cpusets leave), else ``os.cpu_count()``. A copy from the page cache is
    bound by memory bandwidth per core: on a 16-core H200 host 8 threads read
    19.4 GB/s and 16 threads 33.8 GB/s.
    """
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or MIN_DEFAULT_THREADS
    return max(MIN_DEFAULT_THREADS, min(MAX_DEFAULT_THREADS, n))
