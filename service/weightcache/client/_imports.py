"""The CUDA attach path's imports, done ahead of the first ``attach()`` on a background thread.

An engine's first :func:`weightcache.attach` to a CUDA slab imports what only
that path needs: :mod:`weightcache.memory.cuda` with NVIDIA's
``cuda.bindings.driver`` (which imports ``cuda.pathfinder``; about 30 ms on
the H200 host, 45-55 ms on a small CPU machine, ten times the rest of the
attach) and :mod:`weightcache.identity`. An engine imports the client seconds
before it attaches: vLLM loads the weightcache plugin (which imports the
client) when each of its processes starts, then builds the model; a script
imports weightcache at its top, then imports torch and initialises CUDA. So
:func:`start`, called when :mod:`weightcache.client` is imported, runs those
imports on a thread meanwhile. The attach imports them as it always did:
Python's per-module import locks make it wait for an import still under way
on the thread, never import twice; if the thread's import failed, the
attach's own import raises the error where it did before.

Started in the client, not in the integrations: the client is what every
engine imports first (the vLLM and transformers integrations import it at
their module level, a script through ``weightcache.attach``), and whether a
CUDA attach is plausible is known there as well as anywhere.

When (:func:`plausible`): an NVIDIA device node exists (``/dev/nvidiactl``)
and ``CUDA_VISIBLE_DEVICES`` does not hide every GPU; a CPU machine (CI, the
host backend) pays one ``stat()`` and starts nothing. ``$WEIGHTCACHE_IMPORT_AHEAD``
overrides: ``0`` never, ``1`` always (even without a device node); ``false``/``no``/``off``
and ``true``/``yes``/``on`` (any case) are read as ``0`` and ``1``, anything else is
ignored with a warning (the device node decides).

Then the thread works out the wire tags and field specs of the attach's
messages (:func:`weightcache.protocol.prepare`), and loads the
driver library ahead too (:func:`weightcache.memory.cuda_driver.load_driver`: ``cuDriverGetVersion`` as
the process's first driver call, so cuda-bindings ``dlopen``s ``libcuda.so.1``
and resolves its several hundred entry points there, not in the first attach).
That call needs no ``cuInit``, and the thread makes no other driver call:
``cuInit`` in a process that forks its workers afterwards would break CUDA
in the children, and a context, a device or the GPU's UUID depend on the
device the attach names. No torch.

Fork: a child forked while the thread holds a module's import lock (or the
dynamic loader's lock, in ``dlopen``) would wait for that lock forever (the
thread does not exist in the child). The thread registers an
``os.register_at_fork`` hook that waits, before any ``os.fork()``, up to
:data:`FORK_WAIT_S` for its work to finish (vLLM's
``fork`` workers start seconds later: the wait is normally zero).

GIL: the imports are mostly Python code (module bodies, Cython type set-up)
and hold the GIL in the interpreter's switch-interval slices (the driver's
entry points are resolved with the GIL held throughout): Python work on
the main thread meanwhile runs up to their cost (the figures above) slower;
what the thread saves is its overlap with work that releases the GIL (file
and socket I/O, waiting for other ranks or the service, native calls that
release it). Given that time, the first attach finds them done; called at
once, it waits for them, as long as it would have taken to import them (and
for the driver's entry points on cuda-bindings' own lock).

Forbidden imports: torch, weightcache.memory at module level, weightcache.identity at module level,
weightcache.pipeline, weightcache.daemon.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping

log = logging.getLogger("weightcache.client")

#: What the first attach to a CUDA slab imports beyond the client, in the thread's order
#: (``weightcache.memory.cuda`` imports ``cuda.bindings.driver``).
MODULES = ("weightcache.memory.cuda", "weightcache.identity")

#: Imported by :data:`MODULES`' first; its :func:`~weightcache.memory.cuda_driver.load_driver` runs on the thread
#: after the imports (the driver library loaded and its entry points resolved, no ``cuInit``).
DRIVER_MODULE = "weightcache.memory.cuda_driver"

#: The override: ``0`` never imports ahead, ``1`` always does; unset or anything else: :func:`plausible` decides.
ENV = "WEIGHTCACHE_IMPORT_AHEAD"

#: ``$WEIGHTCACHE_IMPORT_AHEAD`` spellings, lower-cased: off, on.
OFF = ("0", "false", "no", "off")
ON = ("1", "true", "yes", "on")

#: The NVIDIA driver's control node: present on every machine whose driver could serve a CUDA attach.
DEVICE_NODE = "/dev/nvidiactl"

#: Seconds an ``os.fork()`` waits for the imports to finish before forking anyway.
FORK_WAIT_S = 10.0

_thread: threading.Thread | None = None
_hooked = False  # the os.register_at_fork hook is registered (once per process)
_start_lock = threading.Lock()


def plausible(environ: Mapping[str, str] = os.environ, device_node: str = DEVICE_NODE) -> bool:
    """Whether this process may attach a CUDA slab, judged without importing or calling anything CUDA.

    Args:
        environ (`Mapping[str, str]`, *optional*): the environment (``os.environ``).
        device_node (`str`, *optional*): the NVIDIA control device node (:data:`DEVICE_NODE`).

    Returns:
        `bool`: ``$WEIGHTCACHE_IMPORT_AHEAD`` is ``1`` (or ``true``, ``yes``, ``on``); or it is not ``0``
        (``false``, ``no``, ``off``), ``device_node`` exists and ``CUDA_VISIBLE_DEVICES`` is unset or names a
        device (not empty, not ``-1``). Another non-empty value is logged as a warning and ignored.

    Example:
        >>> plausible({"CUDA_VISIBLE_DEVICES": ""}, "/dev/null")
        False
    """
    override = environ.get(ENV, "").strip().lower()
    if override in OFF or override in ON:
        return override in ON
    if override:
        log.warning("%s=%r is not one of %s (off) or %s (on); ignored: the import ahead runs where a CUDA attach "
                    "is plausible", ENV, environ[ENV], "/".join(OFF), "/".join(ON))
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (not visible.strip() or visible.strip().startswith("-")):
        return False
    return os.path.exists(device_node)


def start() -> bool:
    """Starts importing :data:`MODULES` on a daemon thread when :func:`plausible`; once per process.

    Never raises: a module that fails to import is logged at DEBUG and left
    for the attach to import (and raise from) itself; so is a thread that
    cannot start (``RuntimeError``: a thread limit, or the interpreter's
    shutdown, as when the client is first imported by an ``atexit`` handler).

    Returns:
        `bool`: whether the imports run (or ran) on the thread.
    """
    global _thread, _hooked
    with _start_lock:
        if _thread is not None:
            return True
        if not plausible() or all(m in sys.modules for m in MODULES):
            return False
        _thread = threading.Thread(target=_run, name="weightcache-import-ahead", daemon=True)
        if not _hooked:
            os.register_at_fork(before=_before_fork)
            _hooked = True
        try:
            _thread.start()
        except RuntimeError as e:  # the attach imports the CUDA path itself, as without the thread
            _thread = None
            log.debug("import ahead of %s not started: %s", ", ".join(MODULES), e)
            return False
        return True


def wait(timeout: float | None = None) -> bool:
    """Waits until the thread's imports are done.

    Args:
        timeout (`float | None`, *optional*): seconds; ``None`` waits for as long as they take.

    Returns:
        `bool`: ``True`` when no import of the thread is under way (done, or never started).
    """
    t = _thread
    if t is None or t is threading.current_thread() or t.ident is None:  # none, itself, or not started yet
        return True
    t.join(timeout)
    return not t.is_alive()


def _run() -> None:
    for name in MODULES:
        try:
            __import__(name)
        except Exception as e:  # noqa: BLE001 - the attach imports it again and raises there
            log.debug("import ahead of %s failed (the attach imports it itself): %s: %s", name, type(e).__name__, e)
    from .. import protocol  # imported by the client already

    protocol.prepare(protocol.ATTACH_EXCHANGE)
    driver = sys.modules.get(DRIVER_MODULE)
    if driver is None:  # its import failed (or was refused): left to the attach as above
        return
    try:
        version = driver.load_driver()
    except Exception as e:  # noqa: BLE001 - load_driver does not raise; a thread's traceback must not reach stderr
        log.debug("driver library not loaded ahead: %s: %s", type(e).__name__, e)
        return
    log.debug("driver library loaded ahead: CUDA %s", version if version is not None else "unavailable "
              "(the attach's cuInit reports why)")


def _before_fork() -> None:
    if not wait(FORK_WAIT_S):
        log.warning("forking while weightcache's import ahead of %s still runs after %.0f s; the child may block "
                    "on its import locks", ", ".join(MODULES), FORK_WAIT_S)
