"""Guard: a typo in a layout table is config_invalid naming the key, never a silent default (issue 40).

``{ tp = 2, gpu = [2, 3] }`` (``gpu`` for ``gpus``) would otherwise place the
ranks on GPUs 0 and 1, since ``gpus`` defaults to ``range(tp)``: the weights
would sit on the wrong GPUs and the engines on 2 and 3 would find nothing.
"""

from __future__ import annotations

import pytest

from weightcache.cli import main
from weightcache.config import load_config
from weightcache.errors import ConfigError

TYPOS = [
    ("{ tp = 2, gpu = [2, 3] }", "gpu"),
    ("{ tp = 2, GPUs = [2, 3] }", "GPUs"),
    ("{ tp_size = 2, gpus = [0, 1] }", "tp_size"),
    ("{ tp = 1, gpus = [1], rank = 0 }", "rank"),
]


@pytest.mark.parametrize("layout, bad", TYPOS)
@pytest.mark.parametrize("index", [0, 1])
def test_an_unknown_key_in_a_layout_table_is_config_invalid_naming_it(tmp_path, layout, bad, index):
    """Invariant: a layout table holds ``tp`` and ``gpus`` only; any other key, in any of the model's layout
    tables, is config_invalid naming file and key (``models.m.layouts[i].<key>``), not ignored."""
    layouts = [layout, "{ tp = 1, gpus = [4] }"][:: 1 if index == 0 else -1]
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(f'[models.m]\npath = "/srv/m"\nlayouts = [ {", ".join(layouts)} ]\n')
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert (e.value.code, e.value.details["key"], e.value.details["file"]) == (
        "config_invalid", f"models.m.layouts[{index}].{bad}", str(cfg))


def test_a_layout_typo_in_a_drop_in_is_refused_by_check_config(tmp_path, capsys):
    """Invariant: the same through ``weightcache check-config`` on a drop-in file: exit 2, the drop-in and the
    key named, so that the typo is found before the service places ranks on the default GPUs."""
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text('[models.m]\npath = "/srv/m"\n')
    (tmp_path / "conf.d").mkdir()
    dropin = tmp_path / "conf.d" / "50-m.toml"
    dropin.write_text('[models.m]\npath = "/srv/m"\nlayouts = [ { tp = 2, gpu = [2, 3] } ]\n')
    rc = main(["check-config", "--config", str(cfg)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"weightcache: {dropin}: models.m.layouts[0].gpu: "), err


def test_a_layout_without_typo_places_the_ranks_on_the_gpus_it_names(tmp_path):
    """The counterpart: ``gpus`` spelt right places rank i on ``gpus[i]``; left out, on GPUs 0..tp-1."""
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text('[models.m]\npath = "/srv/m"\nlayouts = [ { tp = 2, gpus = [2, 3] }, { tp = 2 } ]\n')
    c = load_config(cfg)
    assert sorted((p.tp_rank, p.gpu) for p in c.placements() if p.model.name == "m") == [(0, 0), (0, 2), (1, 1),
                                                                                          (1, 3)]
