"""Config parsing: schema, drop-ins, placements, errors naming file and key."""

from pathlib import Path

import pytest

from as_user import as_nobody
from weightcache.config import MAX_GPU_INDEX, load_config
from weightcache.errors import ConfigError


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
        ("[service]\nload_timeout_s = -1\n", "service.load_timeout_s"),
        ("[service]\nload_timeout_s = 0\n", "service.load_timeout_s"),
        ("[service]\nload_timeout_s = nan\n", "service.load_timeout_s"),
        ("[service]\nload_timeout_s = inf\n", "service.load_timeout_s"),
        ("[service]\nread_threads = 0\n", "service.read_threads"),
        ("[service]\nread_threads = 100000\n", "service.read_threads"),
        ("[service]\nstaging_bytes = 0\n", "service.staging_bytes"),
        ('[service]\nsocket_dir = "run/weightcache"\n', "service.socket_dir"),
        ('[models.a]\npath = "models/a"\n', "models.a.path"),
        ("[service]\nmax_unread_replies = 0\n", "service.max_unread_replies"),
        ("[service]\nmax_queued_bytes = 1024\n", "service.max_queued_bytes"),
        ("[service]\nmax_held_fds = 100000\n", "service.max_held_fds"),
        ("[service]\nmax_buffered_bytes = 1000\n", "service.max_buffered_bytes"),
        ("[service]\nmax_connections_per_uid = 0\n", "service.max_connections_per_uid"),
        ("[service]\npartial_frame_timeout_s = 0\n", "service.partial_frame_timeout_s"),
        ("[service]\npartial_frame_timeout_s = nan\n", "service.partial_frame_timeout_s"),
        ('[service]\noperator_groups = "wheel"\n', "service.operator_groups"),
        ('[service]\noperator_groups = ["wheel", 3]\n', "service.operator_groups"),
        ("[metrics]\nport = 0\n", "metrics.port"),
        ("[metrics]\nport = 65536\n", "metrics.port"),
        ('[metrics]\nport = "9661"\n', "metrics.port"),
        ('[metrics]\naddress = "localhost"\n', "metrics.address"),
        ('[metrics]\naddress = "127.0.0.1:9661"\n', "metrics.address"),
        ("[metrics]\nlisten = 1\n", "metrics.listen"),
        ("metrics = 3\n", "metrics"),
        ('[models.a]\npath = "/srv/a\\u0000b"\n', "models.a.path"),
    ],
)
def test_errors_name_file_and_key(tmp_path, text, key):
    p = _write(tmp_path, text)
    with pytest.raises(Exception) as e:
        load_config(p)
    assert e.value.code == "config_invalid"
    assert e.value.details["key"] == key
    assert str(p) in e.value.message and key in e.value.message


@pytest.mark.parametrize("bad", ["99999999999999", "1024", "-1"])
def test_gpu_index_outside_0_to_1023_names_file_line_key_and_range(tmp_path, bad):
    """The trial's ``gpus = [99999999999999]`` passed and made ``weightcache@99999999999999.socket``."""
    p = _write(tmp_path, f'[models.a]\npath = "/x"\n\n[models.b]\npath = "/y"\n'
                         f'layouts = [{{ tp = 1, gpus = [0] }}, {{ tp = 2, gpus = [1, {bad}] }}]\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert e.value.code == "config_invalid"
    assert (e.value.details["file"], e.value.details["key"], e.value.details["line"]) == (
        str(p), "models.b.layouts[1].gpus", 6)
    assert f"GPU index {bad} is out of range: expected 0..{MAX_GPU_INDEX}" in e.value.message


def test_highest_gpu_index_is_accepted(tmp_path):
    p = _write(tmp_path, f'[models.a]\npath = "/x"\nlayouts = [{{ tp = 2, gpus = [0, {MAX_GPU_INDEX}] }}]\n')
    assert load_config(p).gpus() == [0, 1023] and MAX_GPU_INDEX == 1023


def test_malformed_toml_names_file(tmp_path):
    p = _write(tmp_path, "[models.a\npath=")
    with pytest.raises(Exception) as e:
        load_config(p)
    assert e.value.code == "config_invalid" and str(p) in e.value.message


def test_missing_file(tmp_path):
    with pytest.raises(Exception) as e:
        load_config(tmp_path / "nope.toml")
    assert e.value.code == "config_invalid"


def test_numbers_in_range_are_accepted(tmp_path):
    p = _write(tmp_path, "[service]\nload_timeout_s = 0.5\nread_threads = 1\nstaging_bytes = 2097152\n")
    svc = load_config(p).service
    assert (svc.load_timeout_s, svc.read_threads, svc.staging_bytes) == (0.5, 1, 2097152)


def test_caps_and_operators_in_range_are_accepted(tmp_path):
    p = _write(tmp_path, '[service]\nmax_unread_replies = 1\nmax_queued_bytes = 1048576\nmax_held_fds = 65536\n'
                         'max_buffered_bytes = 65536\nmax_connections_per_uid = 1\npartial_frame_timeout_s = 0.5\n'
                         'operator_groups = ["wheel", "4242"]\n')
    svc = load_config(p).service
    assert (svc.max_unread_replies, svc.max_queued_bytes, svc.max_held_fds, svc.max_buffered_bytes,
            svc.max_connections_per_uid, svc.partial_frame_timeout_s, svc.operator_groups) == (
        1, 1048576, 65536, 65536, 1, 0.5, ("wheel", "4242"))


def test_metrics_address_and_port(tmp_path):
    assert load_config(_write(tmp_path, "")).metrics.listen == "127.0.0.1:9661"  # loopback by default
    p = _write(tmp_path, '[metrics]\naddress = "::1"\nport = 9100\n')
    _write(tmp_path, "[metrics]\nport = 19661\n", "conf.d/10-port.toml")  # a drop-in overrides one key
    m = load_config(p).metrics
    assert (m.address, m.port, m.listen) == ("::1", 19661, "[::1]:19661")


def test_utf16_file_is_config_invalid(tmp_path):
    p = tmp_path / "weightcache.toml"
    p.write_text('[service]\nbackend = "host"\n', encoding="utf-16")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert (e.value.details["file"], e.value.details["cause"]) == (str(p), "not_utf8")


def test_utf8_bom_is_named(tmp_path):
    """A file saved as 'UTF-8 with BOM' (EF BB BF, invisible in the editor) was 'invalid TOML: Invalid
    statement (at line 1, column 1)' under a first line that reads [service]; the error now says it is the BOM."""
    p = tmp_path / "weightcache.toml"
    p.write_bytes(b'\xef\xbb\xbf[service]\r\nbackend = "host"\r\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert e.value.code == "config_invalid"
    d = e.value.details
    assert (d["file"], d["cause"], d["line"], d.get("utf8_bom")) == (str(p), "toml_syntax", 1, True)
    p.write_bytes(b'[service]\r\nbackend = "host"\r\n')  # the same file without it (CRLF is fine)
    assert load_config(p).service.backend == "host"


def test_directory_is_config_invalid(tmp_path):
    (tmp_path / "weightcache.toml").mkdir()
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "weightcache.toml")
    assert (e.value.details["file"], e.value.details["cause"]) == (str(tmp_path / "weightcache.toml"), "is_a_directory")


def test_unreadable_file_is_config_invalid(tmp_path):
    p = _write(tmp_path, "[service]\n")
    p.chmod(0)
    with as_nobody(), pytest.raises(ConfigError) as e:
        load_config(p)
    assert (e.value.details["file"], e.value.details["cause"]) == (str(p), "permission_denied")


def test_key_under_commented_service_header_says_so(tmp_path):
    """The shipped example with only `backend = "host"` uncommented: the error names the commented header."""
    example = (Path(__file__).parents[2] / "examples" / "weightcache.toml").read_text()
    assert '# backend = "auto"' in example
    p = _write(tmp_path, example.replace('# backend = "auto"', 'backend = "host"'))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert e.value.details["key"] == "backend"
    header = example.splitlines().index("# [service]") + 1
    assert e.value.details["line"] == example.splitlines().index('# backend = "auto"') + 1
    assert e.value.details["commented_header_line"] == header


def test_shipped_example_shows_every_key_commented_out_and_loads_uncommented(tmp_path):
    """The shipped /etc/weightcache/weightcache.toml says every key is shown commented out: each field of
    [service], [metrics], [models.NAME] and its layouts is there, and uncommenting every key and header
    gives a file that loads (12 [service] keys, operator_groups and the client limits among them, were
    missing)."""
    import dataclasses
    import re

    from weightcache import config

    example = (Path(__file__).parents[2] / "examples" / "weightcache.toml").read_text()
    shown = re.findall(r"^# ([a-z_]+) = ", example, re.M) + list(re.findall(r"\{ (tp) = \d+, (gpus) = ", example)[0])
    for cls in (config.ServiceConfig, config.MetricsConfig, config.ModelConfig, config.Layout):
        for f in dataclasses.fields(cls):
            if f.name not in ("name", "source"):  # the table's NAME and the file it came from
                assert f.name in shown, (cls.__name__, f.name)
    text = re.sub(r"^# (\[[a-z.]+\]|[a-z_]+ = .*)$", r"\1", example, flags=re.M)
    cfg = load_config(_write(tmp_path, text))
    assert list(cfg.service.operator_groups) == [] and cfg.service.max_connections == 4096
    assert [(lay.tp, list(lay.gpus)) for lay in cfg.models["qwen"].layouts] == [(1, [0]), (2, [2, 3])]


def test_key_outside_a_table_without_a_commented_header(tmp_path):
    p = _write(tmp_path, 'read_threads = 4\n[service]\nbackend = "host"\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert (e.value.details["key"], e.value.details["line"], e.value.details["commented_header_line"]) == (
        "read_threads", 1, None)


def test_range_error_writes_bounds_as_integers(tmp_path):
    """The bounds are what one writes in TOML (2097152), not %g's 2.09715e+06."""
    p = _write(tmp_path, "[service]\nstaging_bytes = 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert e.value.message.endswith("expected at least 2097152 and at most 1099511627776")


def test_budget_host_tier_pin_priority_preload(tmp_path):
    p = _write(tmp_path, '[service]\nmemory_budget_bytes = 1048576\nhost_tier_bytes = 0\n'
                         '[models.a]\npath = "/m/a"\npin = true\npriority = -1000\npreload = "disk"\n'
                         '[models.b]\npath = "/m/b"\n')
    cfg = load_config(p)
    assert (cfg.service.memory_budget_bytes, cfg.service.host_tier_bytes) == (1048576, 0)
    a, b = cfg.models["a"], cfg.models["b"]
    assert (a.pin, a.priority, a.preload) == (True, -1000, "disk")
    assert (b.pin, b.priority, b.preload) == (False, 0, "gpu")  # the defaults
    assert cfg.service.budget_bytes(10 << 40) == 1048576
    p.write_text('[models.a]\npath = "/m/a"\npin = true\npriority = 3\n')
    pl = load_config(p).placements()[0]
    from weightcache.config import Placement
    assert Placement.from_json(pl.to_json()) == pl  # the fd store's copy keeps them


def test_max_slab_bytes_bounds_a_model_slab_naming_the_model_and_the_field(tmp_path):
    p = _write(tmp_path, '[models.a]\npath = "/m/a"\nmax_slab_bytes = 4096\n[models.b]\npath = "/m/b"\n')
    cfg = load_config(p)
    a, b = cfg.models["a"], cfg.models["b"]
    assert (a.max_slab_bytes, b.max_slab_bytes) == (4096, 0)  # 0: no cap, the default
    assert a.slab_over_cap(4096, "a/tp1/rank0") is None and b.slab_over_cap(1 << 50, "b/tp1/rank0") is None
    why = a.slab_over_cap(4097, "a/tp1/rank0")
    assert why == (f"model a (a/tp1/rank0) needs a slab of 4097 bytes, more than its models.a.max_slab_bytes = 4096 "
                   f"(set in {p}); raise it (and reload) if the checkpoint is meant to be this large"), why
    from weightcache.config import Placement
    pl = cfg.placements()[0]
    assert Placement.from_json(pl.to_json()) == pl  # the fd store's copy keeps it
    older = pl.to_json()
    del older["model"]["max_slab_bytes"]  # a manifest file of an earlier release
    assert Placement.from_json(older).model.max_slab_bytes == 0


def test_default_budget_is_device_memory_less_a_reserve():
    from weightcache.config import ServiceConfig, default_budget_bytes
    assert default_budget_bytes(150_000_000_000) == 135_000_000_000  # 10 %
    assert default_budget_bytes(16 << 30) == 12 << 30  # at least 4 GiB
    assert default_budget_bytes(6 << 30) == 3 << 30  # at most half
    assert ServiceConfig().budget_bytes(150_000_000_000) == 135_000_000_000


@pytest.mark.parametrize("text,key,line", [
    ('[service]\nbackend = "host"\nmemory_budget_bytes = 1000\n', "service.memory_budget_bytes", 3),
    ('[service]\nmemory_budget_bytes = "10G"\n', "service.memory_budget_bytes", 2),
    ('[service]\nhost_tier_bytes = -1\n', "service.host_tier_bytes", 2),
    ('[models.a]\npath = "/x"\npin = "yes"\n', "models.a.pin", 3),
    ('[models.a]\npath = "/x"\npriority = 1001\n', "models.a.priority", 3),
    ('[models.a]\npath = "/x"\npriority = true\n', "models.a.priority", 3),
    ('[models.a]\npath = "/x"\npreload = "ram"\n', "models.a.preload", 3),
    ('[models.a]\npath = "/x"\nmax_slab_bytes = -1\n', "models.a.max_slab_bytes", 3),
    ('[models.a]\npath = "/x"\nmax_slab_bytes = "10G"\n', "models.a.max_slab_bytes", 3),
    ('[models.a]\npath = "/x"\nmax_slab_bytes = 1125899906842625\n', "models.a.max_slab_bytes", 3),
    ('[service]\nhost_tier_bytes = 0\n[models.a]\npath = "/x"\n\npreload = "host"\n', "models.a.preload", 6),
])
def test_tier_keys_are_validated_naming_file_line_key(tmp_path, text, key, line):
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert e.value.code == "config_invalid"
    assert (e.value.details["file"], e.value.details["key"], e.value.details["line"]) == (str(p), key, line)


def test_preload_host_with_a_host_tier_from_a_drop_in(tmp_path):
    p = _write(tmp_path, '[models.a]\npath = "/x"\npreload = "host"\n')
    _write(tmp_path, '[service]\nhost_tier_bytes = 1048576\n', "conf.d/10-tier.toml")
    assert load_config(p).models["a"].preload == "host"


def test_the_tiers_example_loads():
    cfg = load_config(Path(__file__).parents[2] / "examples" / "weightcache-tiers.toml")
    assert cfg.service.memory_budget_bytes == 95_000_000_000 and cfg.service.host_tier_bytes == 64_000_000_000
    m = cfg.models
    assert (m["chat"].pin, m["coder"].priority, m["lastweek"].preload, m["archive"].preload) == (
        True, 10, "host", "disk")


@pytest.mark.parametrize("text,key,line,says", [
    ('[models.a]\npath = "/x"\nrevision = 3\n', "models.a.revision", 3, "expected str, got int 3"),
    ('models = 3\n', "models", 1, "must be a table of [models.NAME] tables"),
    ('[models]\nm = "x"\n', "models.m", 2, "must be a table"),
    ('[models]\n\n"m" = 1\n', "models.m", 3, "must be a table"),
])
def test_a_value_where_a_table_or_string_belongs_names_its_line(tmp_path, text, key, line, says):
    """New-user walk: ``revision = 3`` passed (it was str()-ed), and two errors had no line number."""
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert e.value.code == "config_invalid" and says in e.value.message, e.value.message
    assert (e.value.details["file"], e.value.details["key"], e.value.details["line"]) == (str(p), key, line)


def test_a_string_revision_is_kept(tmp_path):
    assert load_config(_write(tmp_path, '[models.a]\npath = "/x"\nrevision = "r2"\n')).models["a"].revision == "r2"


@pytest.mark.parametrize("value, suggested", [
    ("srv/models/all-MiniLM-L6-v2", "/srv/models/all-MiniLM-L6-v2"),  # a leading "/" forgotten
    ("./models/qwen", "/models/qwen"),
    ("qwen", "/srv/models/qwen"),  # a bare name: an example directory for it
])
def test_a_relative_checkpoint_path_names_an_absolute_one_that_makes_sense(tmp_path, value, suggested):
    """A relative ``path`` is refused with an example of the absolute path to write: the value with its
    leading "/" (it suggested '/srv/models/srv/models/...' for 'srv/models/...'), /srv/models/NAME for a
    bare name."""
    p = _write(tmp_path, f'[models.m]\npath = "{value}"\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "models.m.path" in e.value.message and "is a relative path" in e.value.message
    assert f"(e.g. {suggested!r})" in e.value.message, e.value.message
