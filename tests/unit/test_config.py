"""Config parsing: schema, drop-ins, placements, errors naming file and key."""

import pytest

from weightcache.config import load_config


def _write(tmp_path, text, name="weightcache.toml"):
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_layouts_and_placements(tmp_path):
    p = _write(tmp_path, """
[service]
backend = "host"
[models.a]
path = "/m/a"
layouts = [{ tp = 1, gpus = [0] }, { tp = 2, gpus = [2, 3] }]
[models.b]
path = "/m/b"
dtype = "bfloat16"
naming = "vllm"
layouts = [{ tp = 2, gpus = [0, 2] }]
""")
    cfg = load_config(p)
    assert cfg.service.backend == "host"
    assert [(x.model.name, x.tp_size, x.tp_rank) for x in cfg.placements(2)] == [("a", 2, 0), ("b", 2, 1)]
    assert [(x.model.name, x.tp_rank) for x in cfg.placements(0)] == [("a", 0), ("b", 0)]
    assert cfg.gpus() == [0, 2, 3]


def test_drop_in_replaces_model_and_overrides_service(tmp_path):
    p = _write(tmp_path, '[models.a]\npath = "/m/a"\n')
    _write(tmp_path, '[service]\nsocket_dir = "/tmp/x"\n[models.a]\npath = "/m/other"\n', "conf.d/10-a.toml")
    cfg = load_config(p)
    assert cfg.models["a"].path == "/m/other"
    assert cfg.service.socket_dir == "/tmp/x"
    assert cfg.files[-1].endswith("conf.d/10-a.toml")


def test_env_var_selects_file(tmp_path, monkeypatch):
    p = _write(tmp_path, '[models.z]\npath = "/z"\n')
    monkeypatch.setenv("WEIGHTCACHE_CONFIG", str(p))
    assert list(load_config().models) == ["z"]


@pytest.mark.parametrize(
    "text,key",
    [
        ('[models.a]\npath = "/x"\nlayouts = [{ tp = 2, gpus = [0] }]\n', "models.a.layouts[0].gpus"),
        ('[models.a]\npath = 3\n', "models.a.path"),
        ('[models.a]\ndtype = "float16"\n', "models.a.path"),
        ('[models.a]\npath = "/x"\ndtype = "int4"\n', "models.a.dtype"),
        ('[models.a]\npath = "/x"\nbogus = 1\n', "models.a.bogus"),
        ('[service]\nbackend = "tpu"\n', "service.backend"),
        ('[service]\nread_threads = "8"\n', "service.read_threads"),
        ('[servise]\n', "servise"),
        ('[models.a]\npath = "/x"\nlayouts = [{ tp = 0, gpus = [] }]\n', "models.a.layouts[0].tp"),
    ],
)
def test_errors_name_file_and_key(tmp_path, text, key):
    p = _write(tmp_path, text)
    with pytest.raises(Exception) as e:
        load_config(p)
    assert e.value.code == "config_invalid"
    assert e.value.details["key"] == key
    assert str(p) in e.value.message and key in e.value.message


def test_malformed_toml_names_file(tmp_path):
    p = _write(tmp_path, "[models.a\npath=")
    with pytest.raises(Exception) as e:
        load_config(p)
    assert e.value.code == "config_invalid" and str(p) in e.value.message


def test_missing_file(tmp_path):
    with pytest.raises(Exception) as e:
        load_config(tmp_path / "nope.toml")
    assert e.value.code == "config_invalid"
