"""Doc check: the commands, TOML, YAML and Python in docs/ and the man pages still work.

- Every ``$ weightcache ...`` line in a fenced ``console`` block of any
  ``docs/*.md`` parses with the real argument parser; those in
  docs/quickstart.md and docs/configuration.md also run, in document order,
  against a live service (host backend) configured from the quickstart's TOML,
  with the documented paths mapped to a temporary directory and the real
  all-MiniLM-L6-v2 checkpoint. They must exit 0 (or the status given by a
  ``<!-- doc-check: exit=N -->`` line before the block), and every ``name=``
  field shown in the documented output must appear in the real output.
- The quickstart's Python example runs and prints exactly the ``text`` block
  that follows it; every other Python block compiles.
- Every ``toml`` block loads with :func:`weightcache.config.load_config`
  (``<!-- doc-check: invalid key=K -->`` blocks must fail with
  ``config_invalid`` on key K); the blocks headed ``# /etc/weightcache/...``
  of one page, written to those paths, load together as main file + drop-ins.
- Every ``yaml`` block parses.
- docs/errors.md's table lists exactly the codes, classes and retryable flags
  of weightcache/errors.py, and docs/troubleshooting.md has a section per code.
- weightcache(1) names every command and option; weightcache.toml(5) and
  docs/configuration.md name every configuration key.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

from weightcache.config import _config as wc_config
from weightcache import errors
from weightcache.cli import build_parser, main

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cli import Services, minilm_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MAN = ROOT / "man"
MY_DOCS = ["quickstart.md", "configuration.md", "deployment.md", "troubleshooting.md", "errors.md"]
LIVE_DOCS = ["quickstart.md", "configuration.md"]

pytestmark = pytest.mark.timeout(120)

_FENCE = re.compile(r"(?:<!-- doc-check: (?P<mark>[^>]*) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```\n"
                    r"(?:\n```text\n(?P<after>.*?)```)?", re.S)


def blocks(page: str, lang: str) -> list[tuple[str, str, str | None]]:
    """``(body, doc-check mark, following text block)`` of each ``lang`` fenced block of docs/PAGE."""
    text = (DOCS / page).read_text()
    return [(m["body"], m["mark"] or "", m["after"]) for m in _FENCE.finditer(text) if m["lang"] == lang]


def console_commands(page: str) -> list[tuple[list[str], str, int]]:
    """``(argv after 'weightcache', documented output, expected exit status)`` per ``$ weightcache`` line."""
    out = []
    for body, mark, _ in blocks(page, "console"):
        m = re.search(r"exit=(\d+)", mark)
        status = int(m.group(1)) if m else 0
        cmd: list[str] | None = None
        shown: list[str] = []
        for line in body.splitlines() + ["$"]:
            if line.startswith("$"):
                if cmd is not None:
                    out.append((cmd, "\n".join(shown), status))
                cmd, shown = None, []
                words = shlex.split(line[1:], comments=True)
                if words and words[-1] == "&":
                    words = words[:-1]
                if words[:1] == ["weightcache"]:
                    cmd = words[1:]
            else:
                shown.append(line)
    return out


def test_doc_pages_exist_and_hold_commands():
    for page in MY_DOCS:
        assert (DOCS / page).is_file(), page
    assert len(console_commands("quickstart.md")) >= 6


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_every_documented_command_parses(page):
    parser = build_parser()
    for argv, _, _ in console_commands(page):
        try:
            parser.parse_args(argv)
        except SystemExit as e:  # argparse exits on an unknown command or option
            pytest.fail(f"docs/{page}: `weightcache {shlex.join(argv)}` does not parse (exit {e.code})")


def _subst(text: str, mapping: dict[str, str]) -> str:
    for a, b in mapping.items():
        text = text.replace(a, b)
    return text


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A service for GPU 0 configured with the quickstart's TOML; yields the path mapping."""
    root = tmp_path_factory.mktemp("docs")
    cfg = root / "etc" / "weightcache.toml"
    cfg.parent.mkdir()
    mapping = {
        "/etc/weightcache/weightcache.toml": str(cfg),
        "/run/weightcache": str(root / "run"),
        "/srv/models/all-MiniLM-L6-v2": str(minilm_path()),
    }
    (qs_toml, _, _), *_ = blocks("quickstart.md", "toml")
    cfg.write_text(_subst(qs_toml, mapping))
    with Services(cfg, root / "run", [0]):
        yield mapping


def test_live_commands_of_quickstart_and_configuration(live, monkeypatch, capsys):
    monkeypatch.setenv("WEIGHTCACHE_CONFIG", live["/etc/weightcache/weightcache.toml"])
    monkeypatch.setenv("WEIGHTCACHE_SOCKET_DIR", live["/run/weightcache"])
    ran = 0
    for page in LIVE_DOCS:
        for argv, shown, status in console_commands(page):
            if argv[:1] == ["serve"]:
                continue  # the fixture runs the service
            argv = [_subst(a, live) for a in argv]
            capsys.readouterr()
            rc = main(argv)
            out, err = capsys.readouterr()
            where = f"docs/{page}: `weightcache {shlex.join(argv)}`"
            assert rc == status, f"{where} exited {rc}, documented {status}\n{out}{err}"
            for field in sorted(set(re.findall(r"\b([a-z_]+)=", shown))):
                assert f"{field}=" in out, f"{where}: documented field {field}= is not in the output:\n{out}"
            if argv == ["status"] and shown.strip():  # every kind of line it prints is in the sample
                first = {ln.split()[0] for ln in shown.splitlines() if ln.strip()}
                missing = [ln for ln in out.splitlines() if ln.strip() and ln.split()[0] not in first]
                assert not missing, f"{where}: the documented output lacks these lines:\n" + "\n".join(missing)
            ran += 1
    assert ran >= 7


def test_quickstart_python_example_prints_what_the_doc_shows(live, monkeypatch):
    monkeypatch.setenv("WEIGHTCACHE_SOCKET_DIR", live["/run/weightcache"])
    (code, _, shown), = blocks("quickstart.md", "python")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(_subst(code, live), "docs/quickstart.md", "exec"), {})
    assert buf.getvalue() == shown


@pytest.mark.parametrize("page", MY_DOCS)
def test_python_blocks_compile(page):
    for code, _, _ in blocks(page, "python"):
        compile(code, f"docs/{page}", "exec")


@pytest.mark.parametrize("page", MY_DOCS)
def test_toml_examples_load(page, tmp_path):
    for i, (body, mark, _) in enumerate(blocks(page, "toml")):
        f = tmp_path / f"{i}" / "weightcache.toml"
        f.parent.mkdir()
        f.write_text(body)
        if mark.startswith("invalid"):
            with pytest.raises(errors.ConfigError) as ei:
                wc_config.load_config(f)
            assert ei.value.code == "config_invalid"
            assert ei.value.details["key"] == re.search(r"key=(\S+)", mark).group(1)
        else:
            cfg = wc_config.load_config(f)
            assert cfg.models or "[service]" in body, f"docs/{page} block {i} defines nothing"


def test_main_file_and_drop_in_examples_merge(tmp_path):
    """configuration.md's blocks headed with their /etc/weightcache/... path load together."""
    written = {}
    for body, _, _ in blocks("configuration.md", "toml"):
        first = body.splitlines()[0]
        if first.startswith("# /etc/weightcache/"):
            rel = first[len("# /etc/weightcache/"):].strip()
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(body)
            written[rel] = body
    assert {"weightcache.toml", "conf.d/50-qwen.toml", "conf.d/90-host.toml"} <= set(written)
    cfg = wc_config.load_config(tmp_path / "weightcache.toml")
    # as the page says: the drop-in's qwen replaces the main file's, [service] keys override one by one
    assert cfg.models["qwen"].layouts == (wc_config.Layout(2, (0, 1)),)
    assert cfg.models["qwen"].allow_groups == ()
    assert cfg.service.backend == "host" and cfg.service.socket_dir == "/run/weightcache"
    assert "llama-fp8" in cfg.models


@pytest.mark.parametrize("page", MY_DOCS)
def test_yaml_blocks_parse(page):
    yaml = pytest.importorskip("yaml")
    for body, _, _ in blocks(page, "yaml"):
        docs = list(yaml.safe_load_all(body))
        assert all(isinstance(d, dict) and "kind" in d for d in docs)


def _error_classes() -> dict[str, type]:
    out, todo = {}, list(errors.WeightcacheError.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        # errors.py's own classes (backends subclass them with the same code);
        # ProtocolError is abstract and shares RemoteProtocolError's code.
        if cls.__module__ == errors.__name__ and cls is not errors.ProtocolError:
            out[cls.code] = cls
    return out


def test_errors_md_lists_every_code_with_class_and_retryable():
    rows = {}
    for line in (DOCS / "errors.md").read_text().splitlines():
        m = re.match(r"\| `([a-z_]+)` \| `(\w+)` \| (yes|no) \| (.+) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3) == "yes")
    expected = {code: (cls.__name__, cls.retryable) for code, cls in _error_classes().items()}
    assert rows == expected


def test_troubleshooting_has_a_section_per_code():
    text = (DOCS / "troubleshooting.md").read_text()
    sections = set(re.findall(r"^### `([a-z_]+)`$", text, re.M))
    assert sections == set(_error_classes())


def _man_text(name: str) -> str:
    raw = (MAN / name).read_text()
    return raw.replace("\\-", "-").replace("\\(dq", '"')


def test_weightcache_1_names_every_command_and_option():
    text = _man_text("weightcache.1")
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sp in sub.choices.items():
        assert re.search(rf"^\.B(?:R)? (weightcache )?{re.escape(name)}\b", text, re.M), f"command {name}"
        for action in sp._actions:
            for opt in action.option_strings:
                if opt not in ("-h", "--help"):
                    assert opt in text, f"weightcache {name} {opt} is not in man/weightcache.1"


def test_every_config_key_is_documented():
    keys = set(wc_config._SERVICE_KEYS) | set(wc_config._MODEL_KEYS) | set(wc_config._METRICS_KEYS) | {"tp", "gpus"}
    man = _man_text("weightcache.toml.5")
    conf = (DOCS / "configuration.md").read_text()
    for key in sorted(keys):
        term = rf"\b{key}\b" if key in ("tp", "gpus") else rf"^\.BR? {key}\b"
        assert re.search(term, man, re.M), f"{key} is not described in man/weightcache.toml.5"
        assert f"| `{key}` |" in conf, f"{key} has no row in docs/configuration.md"


def test_systemd_7_lists_every_journal_event():
    from weightcache.journal import MESSAGE_IDS

    text = _man_text("weightcache.systemd.7")
    for kind, message_id in MESSAGE_IDS.items():
        assert re.search(rf"^{kind}\t{message_id}\t", text, re.M), f"{kind} {message_id} not in weightcache.systemd(7)"
    assert "weightcache (1)" in text and "weightcache (8)" not in text


def test_quickstart_checkpoint_step_says_save_pretrained_files_need_chmod(tmp_path):
    """transformers' ``save_pretrained`` writes its ``*.safetensors`` at mode 0600, which the service user cannot
    read (a checkpoint the reader built itself failed with ``checkpoint_unreadable``; only ``check-config``
    named it). The quickstart's checkpoint step says so, and its ``chmod`` makes such a checkpoint readable."""
    import os
    import subprocess

    import transformers

    text = (DOCS / "quickstart.md").read_text()
    step = text[text.index("## 2. "):text.index("## 3. ")]
    m = re.search(r"`(chmod -R o\+rX) /srv/models/[^`]+`", step)
    assert "save_pretrained" in step and "0600" in step and m, "quickstart step 2 does not say it"
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=64)
    ck = tmp_path / "ck"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(ck)
    shards = sorted(ck.glob("*.safetensors"))
    assert shards  # 0600 with transformers 5.24 (not asserted: another release may differ)
    subprocess.run([*m.group(1).split(), str(ck)], check=True)
    assert all(os.stat(f).st_mode & 0o004 for f in shards)
