"""``weightcache wait --gpu N`` where no instance will ever serve GPU N.

It polled for the socket until ``--wait-timeout`` (an hour by default) for a GPU that the configuration
does not place any model on and whose socket does not exist: a typo in an engine unit's
``ExecStartPre=weightcache wait --gpu 3`` held the engine for an hour. It now says at once which GPUs are
configured and which sockets listen; a GPU that is configured but whose instance has not started yet is
still waited for (that is what ``wait`` is for).
"""

from __future__ import annotations

import pytest

import weightcache.cli.wait
from weightcache.cli import main


class _Polled(Exception):
    """``wait`` went to sleep to poll again: it is waiting for the instance."""


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A socket directory with 0.sock, a config placing a model on GPUs 0, 1 and 2 (2 in disabled_gpus),
    and a ``wait`` whose first poll pause raises :class:`_Polled`."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "0.sock").touch()  # a name in the directory is what is listed; connecting to it is refused
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(f'[service]\nsocket_dir = "{run}"\ndisabled_gpus = [2]\n\n'
                   f'[models.m]\npath = "{tmp_path / "m"}"\nlayouts = [ {{ tp = 3, gpus = [0, 1, 2] }} ]\n')
    monkeypatch.setenv("WEIGHTCACHE_CONFIG", str(cfg))
    monkeypatch.delenv("WEIGHTCACHE_SOCKET_DIR", raising=False)

    def sleep(seconds):
        raise _Polled()

    monkeypatch.setattr(weightcache.cli.wait.time, "sleep", sleep)
    return run, cfg


def test_a_gpu_the_config_does_not_place_anything_on_fails_at_once(node, capsys):
    run, cfg = node
    capsys.readouterr()
    assert main(["wait", "--gpu", "3", "--timeout", "1"]) == 3  # no _Polled: it did not wait
    err = capsys.readouterr().err
    assert err == (f"no instance will serve GPU 3: {run}/3.sock does not exist and GPU 3 has no model placed on it "
                   f"in {cfg}, which places models on GPUs [0, 1]; {run} has the sockets of instances [0]\n")


def test_a_disabled_gpu_without_a_socket_fails_at_once_naming_the_switch(node, capsys):
    run, cfg = node
    capsys.readouterr()
    assert main(["wait", "--gpu", "2", "--timeout", "1"]) == 3
    err = capsys.readouterr().err
    assert "GPU 2 is in [service] disabled_gpus" in err and "systemctl start weightcache@2.socket" in err, err


def test_a_configured_gpu_whose_instance_has_not_started_is_waited_for(node):
    with pytest.raises(_Polled):
        main(["wait", "--gpu", "1", "--timeout", "1"])


def test_without_a_configuration_for_the_directory_it_waits(node, monkeypatch, tmp_path):
    """Nothing says which GPUs will come (a client-only node, or a config for another socket directory)."""
    run, _ = node
    monkeypatch.setenv("WEIGHTCACHE_CONFIG", str(tmp_path / "absent.toml"))
    with pytest.raises(_Polled):
        main(["wait", "--gpu", "3", "--socket-dir", str(run), "--timeout", "1"])
    monkeypatch.setenv("WEIGHTCACHE_CONFIG", str(node[1]))
    with pytest.raises(_Polled):
        main(["wait", "--gpu", "3", "--socket-dir", str(tmp_path), "--timeout", "1"])


def test_a_config_that_places_no_model_at_all_says_nothing_of_the_gpus_and_it_waits(node):
    """The shipped example file (no models), as in an engine container with the package installed and the
    host's /run/weightcache mounted: it describes no instance, so ``wait --gpu 0`` waits for the host's."""
    run, cfg = node
    cfg.write_text(f'[service]\nsocket_dir = "{run}"\n')
    with pytest.raises(_Polled):
        main(["wait", "--gpu", "3", "--timeout", "1"])
