"""``weightcache reload --running``: the umbrella ``weightcache.service``'s ``ExecReload=``.

``systemctl reload weightcache`` used to return before any instance had reloaded (the instances' propagated
reload jobs are ordered after the umbrella's, and systemctl waits for its own job only), so
``systemctl reload weightcache && weightcache wait`` saw the old configuration. The umbrella now runs the
reloads itself, synchronously, and only in instances that run: connecting to one that only listens would
socket-activate it and all its loads.
"""

from __future__ import annotations

import threading

import pytest

import weightcache.config
import weightcache.metrics
from weightcache.cli import slabs
from weightcache.cli import main


class _Reply:
    files = ("/etc/weightcache/weightcache.toml",)
    added, dropped, retired, kept, restart_keys, moved = (), (), (), ("m/tp1/rank0",), (), ()


@pytest.fixture
def node(tmp_path, monkeypatch):
    """Sockets 0..3 in a directory; their units' states as systemd would say; the GPUs asked, recorded."""
    for g in range(4):
        (tmp_path / f"{g}.sock").touch()
    states = {0: "active", 1: "inactive", 2: "activating", 3: "failed"}
    seen: dict[str, list[int]] = {}

    def service_states(gpus, socket_dir):
        seen["states_of"] = list(gpus)
        return {g: states[g] for g in gpus}

    def ask_each(args, where, gpus, make):
        seen["asked"] = list(gpus)
        for g in gpus:
            yield g, _Reply(), None

    monkeypatch.setattr(weightcache.metrics, "service_states", service_states)
    monkeypatch.setattr(slabs, "ask_each", ask_each)
    return tmp_path, states, seen


def test_running_asks_only_the_instances_that_run(node, capsys):
    where, _, seen = node
    assert main(["reload", "--running", "--socket-dir", str(where)]) == 0
    assert seen == {"states_of": [0, 1, 2, 3], "asked": [0, 2]}  # never the listening-only 1, nor the failed 3
    out = capsys.readouterr().out
    assert out.count("reloaded /etc/weightcache/weightcache.toml") == 2 and "GPU 1" not in out, out


def test_running_with_no_instance_running_reloads_nothing_and_succeeds(node, capsys):
    where, states, seen = node
    states.update({0: "inactive", 2: "inactive"})
    assert main(["reload", "--running", "--socket-dir", str(where)]) == 0
    assert "asked" not in seen
    assert capsys.readouterr().out.startswith("no instance runs: nothing to reload")


def test_running_with_no_socket_at_all_reloads_nothing_and_succeeds(tmp_path, capsys, monkeypatch):
    """No instance socket (no model configured, or every instance's socket stopped): no instance runs, so
    ``systemctl reload weightcache`` succeeds, as with sockets that only listen; it failed with exit 3 ("no
    weightcache sockets"). The reason is still printed. Without ``--running`` it stays an error."""
    monkeypatch.setenv("WEIGHTCACHE_CONFIG", str(tmp_path / "absent.toml"))
    assert main(["reload", "--running", "--socket-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no instance runs: nothing to reload (no weightcache sockets in " + str(tmp_path)), out
    assert main(["reload", "--socket-dir", str(tmp_path)]) == 3


def test_reload_waits_for_the_instances_reload_timeout(node, monkeypatch):
    """An instance answers a reload once it has read the files and checked its checkpoints, within its
    ``reload_timeout_s`` (30 s by default): the CLI waited 10 s per answer, so a slow read was reported as an
    instance not answering (exit 3; systemctl reload weightcache failed) while the reload went on and applied."""
    where, _, seen = node
    timeouts = []

    def ask_each(args, where, gpus, make):
        timeouts.append(args.timeout)
        yield from ()

    monkeypatch.setattr(slabs, "ask_each", ask_each)
    config = where / "weightcache.toml"
    monkeypatch.setenv("WEIGHTCACHE_CONFIG", str(config))
    config.write_text("[service]\nreload_timeout_s = 120\n")
    assert main(["reload", "--socket-dir", str(where)]) == 0
    config.write_text("[service]\nbakend = 1\n")  # invalid: the default reload_timeout_s
    assert main(["reload", "--socket-dir", str(where)]) == 0
    assert main(["reload", "--socket-dir", str(where), "--timeout", "3"]) == 0
    # A file whose read never returns (a hung mount; here a read held until the test ends): the default, not
    # a hang (the instance answers config_invalid, cause timeout, after its reload_timeout_s).
    gate = threading.Event()
    monkeypatch.setattr(weightcache.config, "load_config", lambda path=None: gate.wait(60))
    monkeypatch.setattr(slabs, "CONFIG_READ_S", 0.2)
    try:
        assert main(["reload", "--socket-dir", str(where)]) == 0
    finally:
        gate.set()  # the abandoned read returns; its thread ends
    assert timeouts == [130.0, 40.0, 3.0, 40.0]


def test_without_running_every_socket_is_asked(node):
    where, _, seen = node
    assert main(["reload", "--socket-dir", str(where)]) == 0
    assert seen == {"asked": [0, 1, 2, 3]}


def test_on_a_host_without_systemd_every_socket_is_asked(node, monkeypatch):
    """No systemd: nothing can be socket-activated, so every instance with a socket is asked."""
    where, states, seen = node
    states.update({g: "unknown" for g in states})
    assert main(["reload", "--running", "--socket-dir", str(where)]) == 0
    assert seen["asked"] == [0, 1, 2, 3]
