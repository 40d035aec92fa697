"""Reading ds_config.json files that carry comments and trailing commas.

DeepSpeed reads config files with hjson, so real-world configs contain ``//`` and
``/* */`` comments and trailing commas. We blank those out (comments become spaces,
newlines are kept) and hand the text to the standard ``json`` module, so a syntax error's
line and column still point into the user's file. Duplicate keys are an error, as in
DeepSpeed: the second value would silently win otherwise.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

from shardwise.errors import ConfigError


def _blank(text: str) -> str:
    """Replace comments with spaces, keeping every newline and string literal in place."""
    out: List[str] = []
    i, n = 0, len(text)
    in_string = False
    while i < n:
        ch = text[i]
        if in_string:
            out.append(ch)
            if ch == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 2
                continue
            if ch == '"':
                in_string = False
            i += 1
        elif ch == '"':
            in_string = True
            out.append(ch)
            i += 1
        elif text.startswith("//", i) or ch == "#":
            end = text.find("\n", i)
            end = n if end == -1 else end
            out.append(" " * (end - i))
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end == -1 else end + 2
            out.append("".join(c if c == "\n" else " " for c in text[i:end]))
            i = end
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _drop_trailing_commas(text: str) -> str:
    """Blank a ',' whose next non-space character closes an object or array (outside strings)."""
    chars = list(text)
    in_string = False
    i = 0
    while i < len(chars):
        ch = chars[i]
        if in_string:
            if ch == "\\":
                i += 2
                continue
            in_string = ch != '"'
        elif ch == '"':
            in_string = True
        elif ch == ",":
            j = i + 1
            while j < len(chars) and chars[j] in " \t\r\n":
                j += 1
            if j < len(chars) and chars[j] in "}]":
                chars[i] = " "
        i += 1
    return "".join(chars)


def _no_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    result: Dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ConfigError(f"Duplicate key '{key}' in the config (values {result[key]!r} and "
                              f"{value!r}); keep only one.")
        result[key] = value
    return result


def loads(text: str, source: str = "<string>") -> Dict[str, Any]:
    """Parse JSON-with-comments text into a dict; ConfigError with file, line and column on error."""
    cleaned = _drop_trailing_commas(_blank(text))
    try:
        data = json.loads(cleaned, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        lines = text.splitlines()
        shown = lines[exc.lineno - 1] if 0 < exc.lineno <= len(lines) else ""
        raise ConfigError(
            f"Invalid JSON in {source}, line {exc.lineno}, column {exc.colno}: {exc.msg}.\n"
            f"    {shown}\n    {' ' * (exc.colno - 1)}^\n"
            f"Fix the syntax there (comments // and /* */ and trailing commas are allowed).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"The config in {source} must be a JSON object {{...}}, got "
                          f"{type(data).__name__}.")
    return data


def load_file(path: Path) -> Dict[str, Any]:
    """Read and parse a config file; a missing file names its absolute path."""
    path = Path(path).expanduser()
    absolute = path.resolve()
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"Config file {absolute} {what}. Pass the path of a ds_config.json "
                          f"(relative paths are read from the working directory {Path.cwd()}), "
                          f"or a dict.")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"Cannot read config file {absolute}: {exc}") from None
    return loads(text, str(absolute))
