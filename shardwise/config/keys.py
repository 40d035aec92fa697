"""One pass over the raw config dict before pydantic sees it.

The walk, guided by the section models' fields:
* renames alternative spellings (``stage3_max_live_parameters`` -> ``max_live_parameters``,
  ``bfloat16`` -> ``bf16``) and rejects two spellings of one key with different values;
* removes every ``"auto"`` value and records its dotted path, so the field takes its
  default now and ``resolve_auto`` can refine it later (the batch keys, bucket sizes, lr);
* records unknown keys with their full dotted path and the nearest valid key;
* notes keys that are accepted but inert when set to a non-default value.

Doing this outside pydantic keeps the models plain and lets one walk report *every*
unknown key at once instead of failing on the first.
"""
from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple, Type

from shardwise.errors import ConfigError

from .base import ConfigModel

AUTO = "auto"


@dataclass
class WalkReport:
    """What the walk found, for the loader to act on."""

    unknown: List[Tuple[str, Optional[str]]] = field(default_factory=list)
    """(dotted key, suggested dotted key or None) for every key no section knows."""
    auto_paths: Set[str] = field(default_factory=set)
    """Dotted paths (canonical names) whose value was "auto"."""
    notes: List[str] = field(default_factory=list)
    """Warning texts (deprecated spellings, inert keys)."""


def is_auto(value: Any) -> bool:
    """True for "auto" (any case) and for lists holding it (e.g. "betas": ["auto", "auto"])."""
    if isinstance(value, str):
        return value.strip().lower() == AUTO
    if isinstance(value, (list, tuple)):
        return any(is_auto(v) for v in value)
    return False


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def nested_model(annotation: Any) -> Optional[Type[ConfigModel]]:
    """The ConfigModel inside ``annotation`` (``X``, ``Optional[X]``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, ConfigModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = nested_model(arg)
        if found is not None:
            return found
    return None


def strip_auto(value: Any, path: str, report: WalkReport) -> Any:
    """Remove "auto" values from a free-form dict (optimizer params, ignored sections)."""
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        dotted = _join(path, str(key))
        if is_auto(item):
            report.auto_paths.add(dotted)
        else:
            out[key] = strip_auto(item, dotted, report)
    return out


def known_paths(model: Type[ConfigModel], path: str = "") -> List[str]:
    """Every dotted key the schema accepts (canonical names and aliases), for suggestions."""
    paths = []
    for name, info in model.model_fields.items():
        dotted = _join(path, name)
        paths.append(dotted)
        child = nested_model(info.annotation)
        if child is not None:
            paths.extend(known_paths(child, dotted))
    paths.extend(_join(path, alias) for alias in model.aliases)
    return paths


def suggest(key: str, path: str, model: Type[ConfigModel], root: Type[ConfigModel]) -> Optional[str]:
    """Nearest valid key for an unknown ``key`` found under ``path``.

    A close spelling in the same section wins; otherwise the same name elsewhere in the
    schema (a key put in the wrong section); otherwise a close spelling anywhere.
    """
    local = list(model.model_fields) + list(model.aliases)
    close = difflib.get_close_matches(key, local, n=1, cutoff=0.6)
    if close:
        return _join(path, close[0])
    everywhere = known_paths(root)
    same_name = [p for p in everywhere if p.rsplit(".", 1)[-1] == key]
    if same_name:
        return same_name[0]
    leaves = {p.rsplit(".", 1)[-1]: p for p in everywhere}
    close = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.75)
    return leaves[close[0]] if close else None


def normalize(raw: Any, model: Type[ConfigModel], report: WalkReport, path: str = "",
              root: Optional[Type[ConfigModel]] = None) -> Any:
    """Return ``raw`` with canonical key names, no "auto" values and no unknown keys."""
    root = root or model
    raw = model.rewrite_raw(raw, path or "<config>", report.notes)
    if not isinstance(raw, dict):
        return raw  # pydantic reports the wrong type with the dotted key
    accepted: Dict[str, str] = {name: name for name in model.model_fields}
    accepted.update(model.aliases)
    out: Dict[str, Any] = {}
    spelled: Dict[str, str] = {}
    for key, value in raw.items():
        key = str(key)
        if key not in accepted:
            report.unknown.append((_join(path, key), suggest(key, path, model, root)))
            continue
        name = accepted[key]
        dotted = _join(path, name)
        if is_auto(value):
            report.auto_paths.add(dotted)
            continue
        info = model.model_fields[name]
        child = nested_model(info.annotation)
        if child is not None and value is not None:
            value = normalize(value, child, report, dotted, root)
        else:
            value = strip_auto(value, dotted, report)
        if name in out and out[name] != value:
            raise ConfigError(
                f"'{_join(path, spelled[name])}' and '{_join(path, key)}' are two spellings of "
                f"the same key with different values ({out[name]!r} vs {value!r}). Keep one, "
                f"e.g. \"{name}\": {value!r}.")
        if name in model.inert and value != info.default:
            report.notes.append(f"Config key '{dotted}' = {value!r} is accepted but has no effect "
                                f"in shardwise: {model.inert[name]}.")
        out[name] = value
        spelled[name] = key
    return out
