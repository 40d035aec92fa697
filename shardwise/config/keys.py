"""One pass over the raw config dict before pydantic sees it.

The walk, guided by the section models' fields:
* renames alternative spellings (``stage3_max_live_parameters`` -> ``max_live_parameters``,
  ``bfloat16`` -> ``bf16``) and rejects two spellings of one key with different values;
* removes every ``"auto"`` value and records its dotted path, so the field takes its
  default now and ``resolve_auto`` can refine it later (the batch keys, bucket sizes, lr);
* records unknown keys with their full dotted path and the nearest valid key; an unknown
  key within a few edits of a key of its own section (``stag``, ``zero_optimisation``) is
  recorded as a typo, which the loader turns into an error: a misspelt key must not
  silently leave its setting at the default;
* drops DeepSpeed keys that shardwise has no field for (``deepspeed_only``) with a note;
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
    typos: List[Tuple[str, str, int]] = field(default_factory=list)
    """(dotted key, the known dotted key it is a misspelling of, edit distance)."""
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


def edit_distance(a: str, b: str) -> int:
    """Edits (insert, delete, substitute, swap two neighbours) that turn ``a`` into ``b``."""
    prev2: List[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cost = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, prev2[j - 2] + 1)
            cur.append(cost)
        prev2, prev = prev, cur
    return prev[-1]


def typo_limit(key: str) -> int:
    """Edits a key may be away from a known key to count as its misspelling: 2, or 1 for
    keys of 5 characters or fewer (two edits turn any short word into many others)."""
    return 1 if len(key) <= 5 else 2


def misspelling_of(key: str, model: Type[ConfigModel]) -> Optional[Tuple[str, int]]:
    """The known key of ``model``'s section that ``key`` is a misspelling of, with the
    distance; None when no key is within ``typo_limit``. Case alone counts as one edit."""
    known = list(model.model_fields) + list(model.aliases) + list(model.deepspeed_only)
    limit = typo_limit(key)
    # letters compared without case; a key that differs only in case is one edit away
    best = min(((max(edit_distance(key.lower(), k.lower()), 1), k) for k in known), default=None)
    if best is None or best[0] > limit:
        return None
    return best[1], best[0]


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
            _unknown_key(key, path, model, root, report)
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


def _unknown_key(key: str, path: str, model: Type[ConfigModel], root: Type[ConfigModel],
                 report: WalkReport) -> None:
    """Record a key ``model`` has no field for: a DeepSpeed key we do not use, a typo of a
    key of this section, or a key unknown here (maybe known in another section)."""
    dotted = _join(path, key)
    if key in model.deepspeed_only:
        report.notes.append(f"Config key '{dotted}' is a DeepSpeed key with no effect in "
                            f"shardwise: {model.deepspeed_only[key]}.")
        return
    typo = misspelling_of(key, model)
    if typo is not None:
        report.typos.append((dotted, _join(path, typo[0]), typo[1]))
        return
    report.unknown.append((dotted, suggest(key, path, model, root)))
