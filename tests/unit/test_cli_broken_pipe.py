"""A reader that closes stdout early (``weightcache status | head -1``) ends a command quietly:
exit 141, no BrokenPipeError traceback on stderr (new-user walk: every command crashed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _run_into_closed_pipe(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the command writes a byte
    try:
        return subprocess.run([sys.executable, "-m", "weightcache", *argv], stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=120, env=env)
    finally:
        os.close(w)


def test_help_into_a_closed_pipe_exits_without_a_traceback():
    done = _run_into_closed_pipe("--help")
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode in (0, 141)  # argparse itself drops the write error on some Pythons: then 0


@pytest.mark.parametrize("argv", [("check-config", "--as-user", "root")])
def test_a_command_into_a_closed_pipe_exits_141_without_a_traceback(tmp_path, argv):
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text('[service]\nbackend = "host"\n')
    done = _run_into_closed_pipe(*argv, "--config", str(cfg), env={**os.environ, "WEIGHTCACHE_CONFIG": str(cfg)})
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 141
