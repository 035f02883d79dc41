"""Reading configuration files: bounded, non-blocking reads of TOML files, drop-ins, and a key's line.

Owns what :func:`weightcache.config.load_config` needs from the file system:
``_read_bytes`` (regular files only, opened ``O_NONBLOCK``, at most
:data:`MAX_CONFIG_BYTES`), ``_read_toml`` (UTF-8, ``tomllib``, at most
:data:`MAX_CONFIG_DEPTH` levels of nesting), ``_drop_ins`` (``conf.d/*.toml`` in
lexical order) and the line lookups error messages quote (``_line_of``,
``_commented_header``, ``_locate``), and ``resolve_paths`` (each checkpoint
path's ``os.path.realpath``, done where the files are read: never on the
service's serving loop). Every failure is a
:class:`~weightcache.errors.ConfigError` naming the file and its cause.

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import Any

import tomllib

from ..errors import ConfigError

#: Largest configuration file read (bytes): a drop-in linked to /dev/zero or a huge file is refused, not read.
MAX_CONFIG_BYTES = 4 * 1024 * 1024
#: Deepest nesting of arrays and tables accepted in a configuration file (the schema needs 4).
MAX_CONFIG_DEPTH = 32


def resolve_paths(paths: Any) -> dict[str, str]:
    """``{path: os.path.realpath(path)}`` for each configured checkpoint path (strings).

    Called where the configuration is read (at start, before serving; on the
    reload worker thread), so that the serving loop only looks the result up:
    ``realpath`` lstat-s every component, and a hung mount would freeze it. A
    path that cannot be resolved (``OSError``, a long symlink chain) is left out; its slot then has no
    recorded resolution and the loader resolves it off the loop.
    """
    out: dict[str, str] = {}
    for p in paths:
        try:
            out[p] = os.path.realpath(p)
        except (OSError, ValueError, RecursionError):  # RecursionError: a long symlink chain
            continue
    return out


def _read_bytes(path: Path) -> bytes:
    """The file's bytes; every way it cannot be read is a :class:`ConfigError` naming the cause.

    Opened with ``O_NONBLOCK`` and checked with ``fstat``: a FIFO, a device or a
    socket is refused (``cause=not_regular``) before any read, so that neither
    the service's start nor a reload can block on one; at most
    :data:`MAX_CONFIG_BYTES` are read (``cause=too_large``).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory")
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{path}: not a regular file (a FIFO, a device or a socket); configuration files "
                                  f"must be regular files, which a read cannot block on", file=str(path), key="",
                                  cause="not_regular")
            if st.st_size > MAX_CONFIG_BYTES:
                raise ConfigError(f"{path}: {st.st_size} bytes; a configuration file is at most {MAX_CONFIG_BYTES} "
                                  f"bytes", file=str(path), key="", cause="too_large")
            chunks, got = [], 0
            while True:
                b = os.read(fd, MAX_CONFIG_BYTES + 1 - got)
                if not b:
                    return b"".join(chunks)
                chunks.append(b)
                got += len(b)
                if got > MAX_CONFIG_BYTES:
                    raise ConfigError(f"{path}: grew past {MAX_CONFIG_BYTES} bytes while read", file=str(path),
                                      key="", cause="too_large")
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise ConfigError(f"{path}: configuration file does not exist", file=str(path), key="",
                          cause="not_found") from None
    except PermissionError:
        raise ConfigError(f"{path}: permission denied reading the configuration file as uid {os.geteuid()}; "
                          f"make it readable by the service user (chmod 0644 or chgrp weightcache)",
                          file=str(path), key="", cause="permission_denied") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a configuration file; --config and $WEIGHTCACHE_CONFIG "
                          f"name the main TOML file (drop-ins go in conf.d/ beside it)", file=str(path), key="",
                          cause="is_a_directory") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the configuration file: {e.strerror}", file=str(path),
                          key="", cause="unreadable") from None


def _read_toml(path: Path) -> tuple[dict[str, Any], str]:
    """Parses one file; returns the tables and the text (for messages that quote a line)."""
    raw = _read_bytes(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        utf16 = raw[:2] in (b"\xff\xfe", b"\xfe\xff")
        how = ("it starts with a UTF-16 byte order mark: convert it with iconv -f UTF-16 -t UTF-8" if utf16
               else "save it as UTF-8")
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start} is invalid); TOML files are UTF-8: {how}",
                          file=str(path), key="", cause="not_utf8") from None
    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise ConfigError(f"{path}: arrays or tables nested too deeply to parse (at most {MAX_CONFIG_DEPTH} levels)",
                          file=str(path), key="", cause="too_deep") from None
    except tomllib.TOMLDecodeError as e:
        if text.startswith("\ufeff"):  # Notepad and some editors' "UTF-8 with BOM": invisible, and not TOML
            raise ConfigError(f"{path}: invalid TOML: the file starts with a UTF-8 byte order mark (bytes EF BB BF, "
                              f"invisible in most editors), which TOML does not allow: save it as UTF-8 without a "
                              f"BOM, or remove it with sed -i '1s/^\\xEF\\xBB\\xBF//' {path}", file=str(path), key="",
                              cause="toml_syntax", line=1, utf8_bom=True) from None
        at = re.search(r"at line (\d+)", str(e))
        raise ConfigError(f"{path}: invalid TOML: {e}", file=str(path), key="", cause="toml_syntax",
                          line=int(at.group(1)) if at else None) from None
    if _depth(data) > MAX_CONFIG_DEPTH:
        raise ConfigError(f"{path}: arrays or tables nested deeper than {MAX_CONFIG_DEPTH} levels", file=str(path),
                          key="", cause="too_deep")
    return data, text


def _depth(obj: Any) -> int:
    """How deeply tables and arrays nest in parsed TOML ``obj`` (iterative: no recursion limit)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            values = o.values()
        elif isinstance(o, list):
            values = o
        else:
            continue
        deepest = max(deepest, d)
        if d <= MAX_CONFIG_DEPTH:
            stack.extend((v, d + 1) for v in values)
    return deepest


def _line_of(text: str, key: str) -> int | None:
    """1-based line of the first ``key = ...`` or ``[key...`` in ``text``."""
    pat = re.compile(rf"^\s*(?:{re.escape(key)}\s*=|\[\s*{re.escape(key)}\b)")
    for i, line in enumerate(text.splitlines(), 1):
        if pat.match(line):
            return i
    return None


def _commented_header(text: str, table: str, before: int | None) -> int | None:
    """1-based line of the last ``# [table...`` header above line ``before``."""
    pat = re.compile(rf"^\s*#\s*\[\s*{re.escape(table)}\b")
    lines = text.splitlines()[: (before or 0) - 1 if before else None]
    return next((i for i in range(len(lines), 0, -1) if pat.match(lines[i - 1])), None)


def _drop_ins(d: Path) -> list[Path]:
    """``d/*.toml`` in lexical order (none when ``d`` does not exist)."""
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except PermissionError:
        raise ConfigError(f"{d}: permission denied listing the drop-in directory as uid {os.geteuid()}; make it "
                          f"readable and searchable by the service user (chmod 0755)", file=str(d), key="",
                          cause="permission_denied") from None
    return [d / n for n in sorted(names) if n.endswith(".toml") and not n.startswith(".")]


def _assigned(lines: list[str], parent: list[str], leaf: str) -> int | None:
    """1-based line of ``leaf = ...`` directly in table ``parent`` (``[]``: the top level, before any header;
    ``["models"]``: below ``[models]``), for a key that is a value where a table belongs (``models = 3``,
    ``[models]`` then ``m = 'x'``); None when not found."""
    assign = re.compile(rf"^\s*(?:{re.escape(leaf)}|\"{re.escape(leaf)}\")\s*=")
    if parent:
        header = re.compile(rf"^\s*\[\s*{re.escape('.'.join(parent))}\s*\]")
        start = next((i + 1 for i, ln in enumerate(lines) if header.match(ln)), None)
        if start is None:
            return None
    else:
        start = 0
    for i in range(start, len(lines)):
        if lines[i].lstrip().startswith("["):
            return None
        if assign.match(lines[i]):
            return i + 1
    return None


def _locate(text: str, key: str) -> int | None:
    """1-based line of dotted ``key`` (``models.x.layouts[0].gpus``) in ``text``: its table's header,
    then the first ``leaf =`` below it (inline tables included); None when not found."""
    parts = key.split(".")
    table = parts[:2] if parts[0] == "models" else parts[:1]
    names = "|".join(re.escape(n) for n in (".".join(table), ".".join(table[:1] + [f'"{p}"' for p in table[1:]])))
    header = re.compile(rf"^\s*\[\s*(?:{names})\s*\]")
    name = re.escape(re.sub(r"\[\d+\]$", "", parts[-1]))
    leaf = re.compile(rf"(?:^|[{{,\s]){name}\s*=")
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if header.match(ln)), None)
    if start is None:
        return _assigned(lines, parts[:-1], parts[-1])
    for i in range(start, len(lines)):
        if i > start and lines[i].lstrip().startswith("["):
            break
        if len(parts) > len(table) and leaf.search(lines[i].split("#", 1)[0]):
            return i + 1
    return start + 1
