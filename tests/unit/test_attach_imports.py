"""The CUDA attach path imported ahead on a thread (``weightcache.client._imports``): when, what, fork-safety.

Each run is a fresh interpreter of the test venv with ``$WEIGHTCACHE_IMPORT_AHEAD``
set, so that the outcome does not depend on whether this machine has an
NVIDIA device node. Outcomes are module lists and exit statuses, never times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from weightcache.client import _imports as attach_imports
from weightcache.client._imports import ENV, MODULES, plausible


def _run(code: str, ahead: str) -> subprocess.CompletedProcess:
    env = {**os.environ, ENV: ahead}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("environ,node,want", [
    ({}, True, True),
    ({}, False, False),  # CI, a CPU host: one stat(), nothing started
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, True, True),
    ({"CUDA_VISIBLE_DEVICES": ""}, True, False),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, True, False),
    ({ENV: "0"}, True, False),
    ({ENV: "1"}, False, True),
    ({ENV: " Off "}, True, False),
    ({ENV: "false"}, True, False),
    ({ENV: "no"}, True, False),
    ({ENV: "TRUE"}, False, True),
    ({ENV: "yes"}, False, True),
    ({ENV: "maybe"}, False, False),  # not an override (a warning says so): the node decides
    ({ENV: "maybe"}, True, True),
])
def test_plausible(tmp_path, environ, node, want):
    path = tmp_path / "nvidiactl"
    if node:
        path.touch()
    assert plausible(environ, str(path)) is want


def test_an_unknown_override_is_named_in_a_warning(caplog):
    with caplog.at_level("WARNING", logger="weightcache.client"):
        assert plausible({ENV: "enabled"}, "/nonexistent") is False
    assert ENV in caplog.text and "'enabled'" in caplog.text and "ignored" in caplog.text


def test_off_imports_nothing_ahead():
    code = ("import sys, json, weightcache\nweightcache.attach\nfrom weightcache.client import _imports as a\n"
            "print(json.dumps([a._thread is None, a.start(), sorted(m for m in sys.modules if m.startswith("
            "('weightcache.memory', 'weightcache.identity', 'cuda.bindings.driver')))]))\n")
    r = _run(code, "0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [True, False, []]


def test_on_imports_the_cuda_attach_path_on_a_thread():
    """The client's import starts the thread; once it is done the attach path's modules are whole, the pipeline
    untouched."""
    code = ("import sys, json, threading, weightcache\nweightcache.attach\n"
            "from weightcache.client import _imports as a\n"
            "name = a._thread.name\nassert a.wait(120)\n"
            "print(json.dumps([name, sorted(m for m in sys.modules if m in a.MODULES or m == 'cuda.bindings.driver' "
            "or m.startswith(('weightcache.pipeline', 'weightcache.quant', 'torch')))]))\n")
    r = _run(code, "1")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    name, mods = json.loads(r.stdout.strip().splitlines()[-1])
    assert name == "weightcache-import-ahead"
    assert set(MODULES) <= set(mods), mods
    assert not any(m.startswith(("weightcache.pipeline", "weightcache.quant", "torch")) for m in mods), mods
    try:
        import cuda.bindings.driver  # noqa: F401
    except Exception:  # noqa: BLE001 - cuda-bindings absent here: nothing more to check
        return
    assert "cuda.bindings.driver" in mods


def test_fork_during_the_imports_waits_for_them():
    """A fork right after the client's import (the thread mid-import) waits for the imports: the child imports
    the same modules at once instead of blocking forever on a lock held by a thread it does not have."""
    code = ("import os, signal, sys, weightcache\nweightcache.attach\n"
            "from weightcache.client import _imports as a\nstarted = a._thread is not None\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    signal.alarm(20)  # a child stuck on an import lock dies of SIGALRM\n"
            "    import weightcache.memory.cuda, weightcache.identity\n"
            "    os._exit(0)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "print(started, os.waitstatus_to_exitcode(status))\n")
    r = _run(code, "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True", "0"]


def test_a_failing_import_is_left_to_the_attach():
    """The thread logs a failed import at DEBUG and goes on; the attach's own import raises as it did without it."""
    code = ("import sys\nsys.modules['weightcache.memory.cuda'] = None  # as if the import failed\n"
            "import weightcache\nweightcache.attach\nfrom weightcache.client import _imports as a\nassert a.wait(120)\n"
            "print('identity', 'weightcache.identity' in sys.modules)\n"
            "try:\n    import weightcache.memory.cuda\nexcept ImportError as e:\n    print('raised', e.name)\n")
    r = _run(code, "1")
    assert r.returncode == 0 and "Traceback" not in r.stderr and "Exception in thread" not in r.stderr, r.stderr
    assert r.stdout.split() == ["identity", "True", "raised", "weightcache.memory.cuda"]


def test_wait_without_a_thread_returns_at_once(monkeypatch):
    monkeypatch.setattr(attach_imports, "_thread", None)
    assert attach_imports.wait(0) is True


def test_a_thread_that_cannot_start_leaves_the_client_importable():
    """No thread to be had (a thread limit; the interpreter's shutdown on Python 3.12, when an atexit handler is
    the first to import the client): the client imports, nothing waits, a fork goes on, the attach path imports."""
    code = ("import os, sys, threading\n"
            "def refused(self):\n    raise RuntimeError(\"can't create new thread at interpreter shutdown\")\n"
            "threading.Thread.start = refused\n"
            "import weightcache\nweightcache.attach\nfrom weightcache.client import _imports as a\n"
            "pid = os.fork()\nif pid == 0:\n    os._exit(0)\n"
            "print(a._thread is None, a.wait(0), a.start(), os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
            "import weightcache.memory.cuda, weightcache.identity\n")
    r = _run(code, "1")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stdout.split() == ["True", "True", "False", "0"]


_RECORD_LOAD = (
    "import json, sys, threading\n"
    "from weightcache.memory import cuda_driver\n"
    "calls = []\n"
    "def load_driver():\n"
    "    calls.append(threading.current_thread().name)\n"
    "    return 13000\n"
    "cuda_driver.load_driver = load_driver\n"
    "import weightcache\nweightcache.attach\nfrom weightcache.client import _imports as a\nassert a.wait(120)\n")


def test_on_loads_the_driver_library_on_the_thread_after_the_imports():
    """Once the imports are done the thread makes the process's first driver call (``load_driver``: the library and
    its entry points, no ``cuInit``), so the first attach does not."""
    code = _RECORD_LOAD + "print(json.dumps([calls, 'weightcache.memory.cuda' in sys.modules]))\n"
    r = _run(code, "1")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [["weightcache-import-ahead"], True]


def test_off_loads_no_driver_library():
    r = _run(_RECORD_LOAD + "print(json.dumps(calls))\n", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


def test_a_driver_load_that_raises_stays_on_the_thread():
    """``load_driver`` never raises; if it did, the thread logs at DEBUG: no traceback on the engine's stderr."""
    code = ("from weightcache.memory import cuda_driver\n"
            "def load_driver():\n    raise RuntimeError('no libcuda')\n"
            "cuda_driver.load_driver = load_driver\n"
            "import weightcache\nweightcache.attach\nfrom weightcache.client import _imports as a\n"
            "print(a.wait(120))\n")
    r = _run(code, "1")
    assert r.returncode == 0 and "Traceback" not in r.stderr and "Exception in thread" not in r.stderr, r.stderr
    assert r.stdout.split() == ["True"]


def test_on_prepares_the_attach_messages_on_the_thread():
    """The tags and field specs of the attach's messages are worked out on the thread, none on the main thread."""
    code = ("import json, threading\n"
            "from weightcache.protocol import _messages as messages\n"
            "done = []\n"
            "real = messages.field_specs\n"
            "def specs(cls):\n"
            "    if cls not in messages._SPECS:\n"
            "        done.append([cls.__name__, threading.current_thread().name])\n"
            "    return real(cls)\n"
            "messages.field_specs = specs\n"
            "import weightcache\nweightcache.attach\nfrom weightcache.client import _imports as a\nassert a.wait(120)\n"
            "print(json.dumps([sorted(done), sorted(c.tag() for c in messages.ATTACH_EXCHANGE)]))\n")
    r = _run(code, "1")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    done, tags = json.loads(r.stdout.strip().splitlines()[-1])
    assert done == sorted([c, "weightcache-import-ahead"] for c in
                          ("Attach", "AttachReply", "Error", "Hello", "HelloReply", "Loading"))
    assert tags == ["attach", "attach_reply", "error", "hello", "hello_reply", "loading"]
