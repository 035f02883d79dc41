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
