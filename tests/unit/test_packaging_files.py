"""Files the packages ship besides the code: the bash completion follows the command's parser and completes
model names from the configuration; debian/control suggests the NVIDIA driver."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from weightcache.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
COMPLETION = REPO / "packaging" / "weightcache.bash-completion"
BASH_COMPLETION = Path("/usr/share/bash-completion/bash_completion")


def _subcommands() -> dict[str, set[str]]:
    p = build_parser()
    sub = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction")
    return {name: {o for a in sp._actions for o in a.option_strings if o != "-h"} for name, sp in sub.choices.items()}


def test_completion_knows_every_command_and_option():
    text = COMPLETION.read_text()
    commands = re.search(r'local commands="([^"]+)"', text).group(1).split()
    cases = {}
    for pattern, opts in re.findall(r"^\s+([a-z| -]+)\) opts=\"([^\"]+)\" ;;$", text, re.M):
        for name in pattern.split("|"):
            cases[name.strip()] = set(opts.split())
    want = _subcommands()
    assert sorted(commands) == sorted(want)
    assert cases == want


#: bash-completion's helpers, minimal, where the package is not installed.
STUB = ('_init_completion() { cur=${COMP_WORDS[COMP_CWORD]}; prev=${COMP_WORDS[COMP_CWORD-1]}; '
        'words=("${COMP_WORDS[@]}"); cword=$COMP_CWORD; }; _filedir() { :; }')


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_completion_offers_models_from_the_config(tmp_path):
    conf = tmp_path / "weightcache.toml"
    conf.write_text('[models.qwen]\npath = "/srv/q"\n[models.llama-3]\npath = "/srv/l"\n')
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "10.toml").write_text('[models.mistral]\npath = "/srv/m"\n')

    def complete(*words: str) -> list[str]:
        line = " ".join(["weightcache", *words])
        lib = f"source {BASH_COMPLETION}" if BASH_COMPLETION.exists() else STUB
        script = (f"{lib}; source {COMPLETION}; COMP_LINE='{line}'; COMP_POINT=${{#COMP_LINE}}; "
                  f"COMP_WORDS=(weightcache {' '.join(repr(w) for w in words)}); COMP_CWORD={len(words)}; "
                  "_weightcache; printf '%s\\n' \"${COMPREPLY[@]}\"")
        r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                           env={"PATH": "/usr/bin:/bin", "WEIGHTCACHE_CONFIG": str(conf)})
        return sorted(x for x in r.stdout.split("\n") if x)

    assert complete("ev") == ["evict"]
    assert complete("evict", "") == ["llama-3", "mistral", "qwen"]
    assert complete("evict", "--f") == ["--force"]
    assert complete("reload", "--") == ["--gpu", "--help", "--running", "--socket-dir", "--timeout"]


def test_control_suggests_the_nvidia_driver():
    control = (REPO / "debian" / "control").read_text()
    assert re.search(r"^Suggests:.*\bnvidia-driver\b", control, re.M), control
