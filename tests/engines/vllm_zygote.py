"""A fork server (zygote) for the engine tests: imports torch and vLLM once, forks a fresh process per engine start.

Every engine start of the engine tests is a fresh process running ``vllm_runner.py JOB`` (vLLM keeps process-wide
state: the distributed group, registered plugins, the in-process engine core). A fresh interpreter pays the import
of torch and vLLM first (about 6 s of CPU, more than the engine start itself on a tiny model). The zygote is one
``.venv-vllm`` process per test session that does that import once, exactly as the runner does before its clock's
``import_s`` (the runner's environment defaults, vLLM's model loader, CPU model runner and ``LLM``) and nothing
more: no engine built, no plugin loaded, no thread of its own, no torch parallel region run (so vLLM's state is that
of a fresh process that has only imported); then it freezes the garbage collector's view of what it imported
(``gc.freeze``: a child's collections do not walk the inherited heap; objects made at import are never collected as
cyclic garbage in a child, which lives for one engine start). For each job it forks a child that:

- takes the job's stdin (``/dev/null``), stdout and stderr (files the client reads back);
- takes the job's environment (the variables that differ from the zygote's, see below) and working directory;
- runs ``vllm_runner.py`` as ``__main__`` with the job's ``argv`` (``runpy.run_path``), so that vLLM's spawned
  processes (multi-process engine, TP workers) re-import the runner as a fresh process's children would, and the
  ``RESULT`` protocol, exit status (a signal included: ``-11`` for ``SIGSEGV``) and output are the runner's;
- ends as the interpreter's exit would (threads joined, ``atexit`` handlers and vLLM's shutdown run, streams
  flushed), less the teardown of the interpreter's own objects, which nothing outside the process sees (:func:`_exit`).

The zygote relays the child's exit status (the child is its child, not the client's).

Environment. A job runs in the zygote only where its environment differs from the zygote's start-up environment
in variables that are read after import (:data:`LATE_KEYS`: vLLM reads its ``VLLM_*`` variables lazily through
``vllm.envs``; weightcache's plugin is not imported by the zygote). The zygote checks this itself: the environment
variables that Python code reads while it imports are recorded, and a variable of :data:`LATE_KEYS` read then is
taken out of the set. Any other difference (or ``WEIGHTCACHE_TEST_ZYGOTE=0``) runs the job as a plain
subprocess, as before. vLLM's own spawned processes (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, tensor parallelism)
are plain spawned interpreters either way: only the runner's own import is saved there.

``python tests/engines/vllm_runner.py JOB`` works as before (the benchmarks run it); this module is only the tests'
way of starting it. Usage::

    import vllm_zygote
    proc = vllm_zygote.run([RUNNER, job_json], env=env, timeout=300)  # subprocess.CompletedProcess, text output
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "vllm_runner.py"

#: Variables a job may set differently from the zygote's start-up environment: each is read after import (vLLM's
#: ``vllm.envs`` reads lazily; ``WEIGHTCACHE_*``: the plugin, which the zygote does not import).
LATE_KEYS = frozenset({"VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_RPC_BASE_PATH", "VLLM_CPU_OMP_THREADS_BIND",
                       "WEIGHTCACHE_SOCKET_DIR"})


# --- the server (runs under the .venv-vllm interpreter) -----------------------------------------------------------


def _record_env_reads(into: set[str]):
    """Patches ``os.environ``'s reads to add each key asked for to ``into``; returns the undo."""
    cls = type(os.environ)
    getitem, contains = cls.__getitem__, cls.__contains__

    def recording_getitem(self, key):
        into.add(key)
        return getitem(self, key)

    def recording_contains(self, key):
        into.add(key)
        return contains(self, key)

    cls.__getitem__, cls.__contains__ = recording_getitem, recording_contains

    def undo():
        cls.__getitem__, cls.__contains__ = getitem, contains

    return undo


def _preload() -> set[str]:
    """What a fresh ``vllm_runner.py`` process does before its ``import_s`` clock stops; returns the environment
    variables read meanwhile."""
    import vllm_runner  # noqa: F401 - its environment defaults, as the runner sets them first

    read: set[str] = set()
    undo = _record_env_reads(read)
    try:  # in the runner's order
        from vllm.model_executor.model_loader import get_model_loader  # noqa: F401, I001 - vllm_runner._time_model_load
        from vllm.v1.worker import cpu_model_runner  # noqa: F401
        from vllm import LLM, SamplingParams  # noqa: F401 - vllm_runner.main
        from vllm.inputs import TokensPrompt  # noqa: F401
    finally:
        undo()
    return read


def _run_job(req: dict) -> int:
    """In the forked child: the job's files, environment and directory, then the runner as ``__main__``; returns
    its exit status."""
    import runpy
    import traceback

    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(req["stdout"], os.O_WRONLY | os.O_TRUNC)
    err = os.open(req["stderr"], os.O_WRONLY | os.O_TRUNC)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    for key, value in req["env"].items():  # the late keys: set, or unset (None)
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    sys.argv = list(req["argv"])
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - as an uncaught exception in a fresh process: traceback, status 1
        traceback.print_exc()
        return 1


def _exit(code: int) -> None:
    """Ends the forked child as the interpreter's exit would, less its last step: non-daemon threads joined
    (``threading._shutdown``), ``atexit`` handlers run (vLLM's engine shutdown, weakref finalizers), standard streams
    flushed; then ``os._exit``. The interpreter's own teardown of modules and objects, which nothing outside the
    process sees (the kernel closes the fds), is skipped: in a child of the zygote it took 4 to 10 s (every page of
    the inherited heap copied as its objects were freed), more than the engine start."""
    import atexit as _atexit
    import threading as _threading

    try:
        _threading._shutdown()
        _atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001,S110 - a closed stream: nothing left to flush
                pass
        os._exit(code)


def serve(fd: int) -> int:
    """The zygote's loop on the socket ``fd``: one JSON line per job, answered ``{"pid"}`` then ``{"status"}``.

    Returns:
        `int`: 0 once the client closes the socket (a forked child never returns: :func:`_exit`).
    """
    before = dict(os.environ)
    read = _preload()
    # The imported objects go to the collector's permanent generation: a child's collections no longer walk (and so
    # copy-on-write) the inherited heap. Halved a tiny engine's start in a child (1.7 s to 0.8 s; load_s 0.7 to 0.1).
    gc.freeze()
    start_env = dict(os.environ)
    # Late keys are those nothing read nor set while importing.
    late = sorted(k for k in LATE_KEYS - read if before.get(k) == start_env.get(k))
    sock = socket.socket(fileno=fd)
    f = sock.makefile("rwb", buffering=0)
    f.write((json.dumps({"ready": True, "late_keys": late, "env": start_env}) + "\n").encode())
    for line in f:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            f.close()
            sock.close()
            _exit(_run_job(req))
        f.write((json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        f.write((json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n").encode())
    return 0


# --- the client (the test process) ----------------------------------------------------------------------------------


class Zygote:
    """One zygote process, started by :func:`run` on first use and ended when the test process exits.

    Args:
        env (`dict`): the zygote's start-up environment (a job whose environment differs from it outside the late
            keys runs as a plain subprocess).
        python (`str`): the interpreter (``.venv-vllm``'s).

    Raises:
        RuntimeError: the zygote did not come up (its log in the message).
    """

    def __init__(self, env: dict[str, str], python: str = sys.executable) -> None:
        self.env = dict(env)
        self.lock = threading.Lock()
        ours, theirs = socket.socketpair()
        self.log = tempfile.NamedTemporaryFile(prefix="wc-zygote-", suffix=".log", delete=False)
        # As a script, like the runner: sys.path[0] is this directory, nothing else added.
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), "serve", str(theirs.fileno())], env=self.env, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),), cwd=os.getcwd())
        theirs.close()
        self.sock, self.buf = ours, b""
        hello = self._read(timeout=300)
        if not hello.get("ready"):
            raise RuntimeError(f"vllm_zygote did not start: {hello}\n{self.log_text()}")
        self.late_keys = frozenset(hello["late_keys"])
        self.start_env = hello["env"]
        self.cwd = os.getcwd()

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-8000:]

    def _read(self, timeout: float | None) -> dict:
        """The zygote's next JSON line; ``TimeoutError`` after ``timeout`` seconds without one."""
        self.sock.settimeout(timeout)
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise RuntimeError(f"vllm_zygote exited (rc={self.proc.poll()}):\n{self.log_text()}")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    def takes(self, env: dict[str, str], cwd: str) -> bool:
        """Whether a job with ``env`` may be forked here: it differs from the zygote's environment only in late
        keys (the runner's own defaults, which the zygote set, count as set)."""
        if cwd != self.cwd or self.proc.poll() is not None:
            return False
        keys = set(env) | set(self.env)
        return all(env.get(k) == self.env.get(k) for k in keys - self.late_keys)

    def run(self, argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """Runs ``argv`` (``[vllm_runner.py, JOB]``) in a forked child; as ``subprocess.run(..., capture_output=True,
        text=True, timeout=timeout)`` would (``subprocess.TimeoutExpired`` after killing the child)."""
        with self.lock, tempfile.TemporaryDirectory(prefix="wc-zygote-job-") as d:
            out, err = Path(d, "stdout"), Path(d, "stderr")
            out.touch()
            err.touch()
            req = {"argv": [str(a) for a in argv], "env": {k: env.get(k) for k in self.late_keys},
                   "cwd": os.getcwd(), "stdout": str(out), "stderr": str(err)}
            self.sock.settimeout(60)
            self.sock.sendall((json.dumps(req) + "\n").encode())
            pid = self._read(timeout=60)["pid"]
            try:
                status = self._read(timeout=timeout)["status"]
            except TimeoutError:
                self._kill(pid)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(errors="replace"),
                                                err.read_text(errors="replace")) from None
            except BaseException:  # e.g. pytest-timeout's signal: the child goes, the zygote takes the next job
                self._kill(pid)
                raise
            return subprocess.CompletedProcess(argv, status, out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))

    def _kill(self, pid: int) -> None:
        """Kills the job's child (``SIGKILL``) and reads its status, so that the zygote is free for the next job."""
        try:
            os.kill(pid, 9)
            self._read(timeout=60)
        except (OSError, RuntimeError):  # already gone, or the zygote with it
            pass

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.unlink(self.log.name)


_ZYGOTE: Zygote | None = None


def run(argv: list[str], *, env: dict[str, str], timeout: float, base_env: dict[str, str]) -> subprocess.CompletedProcess:
    """Runs ``python argv...`` (``argv[0]`` is vllm_runner.py) with ``env``, as ``subprocess.run`` with captured text
    output and ``stdin`` from ``/dev/null`` would: forked from the session's zygote (started with ``base_env`` on
    first use) where the zygote may take it (:meth:`Zygote.takes`), else a plain subprocess.

    Raises:
        subprocess.TimeoutExpired: the job ran past ``timeout`` seconds (it was killed).
    """
    global _ZYGOTE
    if os.environ.get("WEIGHTCACHE_TEST_ZYGOTE", "1") != "0" and Path(argv[0]).resolve() == RUNNER:
        if _ZYGOTE is None:
            _ZYGOTE = Zygote(base_env)
            atexit.register(_ZYGOTE.close)
        if _ZYGOTE.takes(env, os.getcwd()):
            return _ZYGOTE.run(argv, env, timeout)
    return subprocess.run([sys.executable, *map(str, argv)], check=False, capture_output=True, text=True, env=env,
                          timeout=timeout, stdin=subprocess.DEVNULL)


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"] or len(sys.argv) != 3:
        sys.exit("usage: vllm_zygote.py serve FD (started by the engine tests, see the module's docstring)")
    sys.exit(serve(int(sys.argv[2])))
