"""``status`` and ``reload`` name models placed on GPUs without an instance (issue 26: they said nothing)."""

from __future__ import annotations

from weightcache.cli.unwired import gpus_without_instance, warnings

CONFIG = """\
[models.a]
path = "/srv/a"
layouts = [{ tp = 1, gpus = [0] }, { tp = 2, gpus = [2, 3] }]

[models.b]
path = "/srv/b"
layouts = [{ tp = 1, gpus = [2] }]
"""


def test_gpus_of_the_config_without_a_socket_and_their_models(tmp_path):
    (tmp_path / "weightcache.toml").write_text(CONFIG)
    config = str(tmp_path / "weightcache.toml")
    assert gpus_without_instance([0, 3], config) == {2: ["a", "b"]}
    assert gpus_without_instance([0, 2, 3], config) == {}
    (line,) = warnings("/run/weightcache", [0, 3], config)
    assert line.startswith("GPU 2: models a, b placed here, but no instance listens (/run/weightcache/2.sock "
                           "does not exist): run `systemctl daemon-reload && systemctl start weightcache@2.socket`")


def test_a_config_that_does_not_load_warns_about_nothing(tmp_path):
    (tmp_path / "weightcache.toml").write_text("[models.a]\npath = 1\n")
    assert gpus_without_instance([], str(tmp_path / "weightcache.toml")) == {}


def test_disabled_gpus_and_their_models_are_named(tmp_path, monkeypatch, capsys):
    """Issue 39: [service] disabled_gpus was invisible to status (and check-config); status names each disabled
    GPU with its models, in text and JSON, even with no instance running."""
    import json

    from weightcache.cli import main
    from weightcache.cli.unwired import disabled_gpus, disabled_lines

    run = tmp_path / "run"
    run.mkdir()
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(f'[service]\nsocket_dir = "{run}"\ndisabled_gpus = [2, 5]\n\n' + CONFIG)
    assert disabled_gpus(str(cfg)) == {2: ["a", "b"], 5: []}
    assert disabled_lines({2: ["a", "b"]}) == [
        "GPU 2: disabled ([service] disabled_gpus): weightcache.target does not start its instance; models a, b "
        "placed here (by hand: systemctl start weightcache@2.socket)"]
    monkeypatch.setenv("WEIGHTCACHE_CONFIG", str(cfg))
    monkeypatch.delenv("WEIGHTCACHE_SOCKET_DIR", raising=False)
    capsys.readouterr()
    assert main(["status"]) == 3  # no instance answers
    out = capsys.readouterr().out
    assert "GPU 2: disabled ([service] disabled_gpus)" in out and "GPU 5: disabled" in out, out
    main(["status", "--json"])
    assert json.loads(capsys.readouterr().out)["disabled"] == [{"gpu": 2, "models": ["a", "b"]},
                                                               {"gpu": 5, "models": []}]
