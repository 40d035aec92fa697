"""``load_config``: from whatever the user passed to a validated ``ShardwiseConfig``.

Accepted inputs, as in ``deepspeed.initialize``: a dict, a path to a JSON file (comments
and trailing commas allowed), a JSON or base64-encoded JSON string, or an argparse
``args`` whose ``deepspeed_config`` / ``shardwise_config`` holds a path or a dict.
Every problem becomes a ``ConfigError`` that names the key, the value and the fix.
"""
from __future__ import annotations

import base64
import binascii
import copy
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Type

from pydantic import ValidationError

from shardwise.errors import ConfigError
from shardwise.utils.logging import info_once, warn_once

from .auto import fill_peak_lr
from .base import ConfigModel
from .batch import resolve_batch
from .ignored import ignored_section_notes
from .jsonc import load_file, loads
from .keys import WalkReport, nested_model, normalize
from .platform_keys import on_windows, platform_key_notes
from .shardwise_config import ShardwiseConfig

STRICT_ENV = "SHARDWISE_STRICT_CONFIG"
TYPOS_ENV = "SHARDWISE_ALLOW_CONFIG_TYPOS"
"""Set to 1 to only warn about misspelt keys (by default they are an error)."""
_HOW_TO_PASS = ("Pass a config: shardwise.initialize(..., config=\"ds_config.json\") or config={...}, "
                "or on the command line --deepspeed_config ds_config.json (with "
                "shardwise.add_config_arguments(parser)).")
_BASE64 = re.compile(r"^[A-Za-z0-9_\-+/]+={0,2}$")
_TRUE = ("1", "true", "yes", "on")


def _args_config(args: Any) -> Any:
    """The config carried by an argparse Namespace, or None."""
    if args is None:
        return None
    found = {name: getattr(args, name) for name in ("shardwise_config", "deepspeed_config",
                                                    "deepscale_config")
             if getattr(args, name, None) is not None}
    if "deepscale_config" in found:
        warn_once("args.deepscale_config is deprecated (DeepSpeed too); use --deepspeed_config.")
    values = list(found.values())
    if any(v != values[0] for v in values[1:]):
        raise ConfigError(f"args carries different configs in {sorted(found)} ({found}); set only "
                          f"one of --shardwise_config / --deepspeed_config.")
    return values[0] if values else None


def _pick_source(config: Any, args: Any, config_params: Any) -> Any:
    if config is not None and config_params is not None:
        raise ConfigError("Both config and config_params were given; config_params is DeepSpeed's "
                          "old name for config. Pass only config=...")
    config = config if config is not None else config_params
    from_args = _args_config(args)
    if config is not None and from_args is not None:
        raise ConfigError(
            "Not sure how to proceed, we were given deepspeed configs in the deepspeed arguments "
            f"(args.deepspeed_config={from_args!r}) and the initialize() call (config=...). "
            "Remove one of them.")
    chosen = config if config is not None else from_args
    if chosen is None:
        raise ConfigError(f"No config was given. {_HOW_TO_PASS}")
    return chosen


def _from_string(text: str) -> Dict[str, Any]:
    """A path, a JSON object literal, or base64-encoded JSON (DeepSpeed's launcher passes that)."""
    if Path(text).expanduser().is_file():
        return load_file(Path(text))
    stripped = text.strip()
    if stripped.startswith("{"):
        return loads(stripped, "<config string>")
    if _BASE64.match(stripped) and len(stripped) % 4 == 0 and not stripped.endswith("json"):
        try:
            decoded = base64.urlsafe_b64decode(stripped).decode("utf-8")
            data = json.loads(decoded)
            if isinstance(data, dict):
                return data
        except (binascii.Error, UnicodeDecodeError, ValueError):
            pass
    return load_file(Path(text))  # raises the "does not exist" error with the absolute path


def _to_dict(source: Any) -> Dict[str, Any]:
    if isinstance(source, ShardwiseConfig):
        return source.to_dict()
    if isinstance(source, dict):
        return copy.deepcopy(source)  # the walk must not change the user's dict
    if isinstance(source, str):
        return _from_string(source)
    if isinstance(source, os.PathLike):
        return load_file(Path(source))
    raise ConfigError(f"config must be a dict, a path or a JSON string, got "
                      f"{type(source).__name__}: {source!r}. {_HOW_TO_PASS}")


def _strict_mode(strict: Optional[bool], raw: Dict[str, Any]) -> bool:
    """strict=True/False decides; None: the config's strict_config, else $SHARDWISE_STRICT_CONFIG."""
    if strict is not None:
        return bool(strict)
    in_config = raw.get("strict_config", False)
    if isinstance(in_config, str):
        in_config = in_config.strip().lower() in _TRUE
    return bool(in_config) or os.environ.get(STRICT_ENV, "").strip().lower() in _TRUE


# --- pydantic errors -> one ConfigError --------------------------------------------------
_EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
    "bool_parsing": "true or false", "string_type": "a string", "dict_type": "an object {...}",
    "model_type": "an object {...}", "model_attributes_type": "an object {...}",
    "list_type": "a list [...]", "missing": "a value (this key is required)",
}
_EXAMPLES = {"optimizer.type": "AdamW", "scheduler.type": "WarmupLR",
             "optimizer.params": {"lr": 0.0001}, "scheduler.params": {"warmup_num_steps": 100}}
_TYPE_EXAMPLES = {int: 1, float: 1.0, bool: True, str: "value", dict: {}, list: []}


def _field_for(loc: Tuple[Any, ...]) -> Any:
    model: Optional[Type[ConfigModel]] = ShardwiseConfig
    info = None
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return info
        info = model.model_fields[part]
        model = nested_model(info.annotation)
    return info


def _example(key: str, loc: Tuple[Any, ...], err: Dict[str, Any]) -> str:
    if key in _EXAMPLES:
        return json.dumps(_EXAMPLES[key])
    if err["type"] == "literal_error":
        first = str(err.get("ctx", {}).get("expected", "")).split(",")[0].split(" or ")[0]
        return first.strip().replace("'", '"')
    for bound in ("ge", "gt", "le", "lt"):
        if bound in err.get("ctx", {}):
            return json.dumps(err["ctx"][bound])
    info = _field_for(loc)
    if info is not None and nested_model(info.annotation) is not None:
        return "{}"
    if info is not None and info.default is not None and not callable(info.default) \
            and isinstance(info.default, (int, float, bool, str)):
        return json.dumps(info.default)
    for kind, sample in _TYPE_EXAMPLES.items():
        if info is not None and kind in getattr(info.annotation, "__args__", (info.annotation,)):
            return json.dumps(sample)
    return "..."


def _expected(err: Dict[str, Any]) -> str:
    ctx = err.get("ctx", {})
    if err["type"] == "literal_error":
        return f"one of {ctx.get('expected')}"
    for bound, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if bound in ctx:
            return f"a number {word} {ctx[bound]}"
    return _EXPECTED.get(err["type"], err["msg"])


def _convert(exc: ValidationError) -> ConfigError:
    errors = exc.errors()
    for err in errors:  # our own ConfigError raised inside a validator: keep its message
        inner = err.get("ctx", {}).get("error")
        if isinstance(inner, ConfigError):
            return inner
    lines: List[str] = []
    for err in errors:
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc) or "<config>"
        leaf = str(loc[-1]) if loc else key
        shown = "(missing)" if err["type"] == "missing" else f"{err.get('input')!r}"
        if err["type"] != "missing" and err.get("input") is not None:
            shown += f" ({type(err['input']).__name__})"
        lines.append(f"{key} = {shown}: expected {_expected(err)}; e.g. \"{leaf}\": "
                     f"{_example(key, loc, err)}  [{err['msg']}]")
    return ConfigError("Invalid config value" + ("s" if len(lines) > 1 else "") + ":\n  "
                       + "\n  ".join(lines))


# --- the rules that need context (world size, strict mode) -------------------------------
def _unknown_key_notes(report: WalkReport, strict: bool) -> List[str]:
    notes = []
    for dotted, suggestion in report.unknown:
        hint = f" Did you mean '{suggestion}'?" if suggestion else ""
        notes.append(f"Unknown config key '{dotted}'{'' if strict else ' (ignored)'}.{hint}")
    return notes


def _typo_notes(report: WalkReport) -> List[str]:
    """Misspelt keys: an error (every one listed) unless $SHARDWISE_ALLOW_CONFIG_TYPOS is set,
    then one warning each. Either way the misspelt key is not used."""
    if not report.typos:
        return []
    lines = [f"'{key}' is not a config key; it is {dist} edit{'s' if dist > 1 else ''} from "
             f"'{known}'" for key, known, dist in report.typos]
    if os.environ.get(TYPOS_ENV, "").strip().lower() in _TRUE:
        return [f"Misspelt config key (ignored): {line}." for line in lines]
    raise ConfigError(
        "Misspelt config key" + ("s" if len(lines) > 1 else "") + ": " + "; ".join(lines)
        + ". A misspelt key would silently leave its setting at the default, so this is an "
        f"error: fix the spelling (or set {TYPOS_ENV}=1 to ignore such keys with a warning).")


def _check_offload_param_stage(cfg: ShardwiseConfig, strict: bool, notes: List[str]) -> None:
    zero = cfg.zero_optimization
    if zero.offload_param is None or zero.stage == 3:
        return
    text = (f"zero_optimization.offload_param (device \"{zero.offload_param.device}\") needs ZeRO "
            f"stage 3, but zero_optimization.stage = {zero.stage}: only stage 3 partitions "
            f"parameters, so there is nothing to offload. Set \"stage\": 3 to offload parameters, "
            f"or remove offload_param (offload_optimizer works with stages 1-3).")
    if strict:
        raise ConfigError(text)
    # DeepSpeed silently ignores it below stage 3; configs written for it must still load.
    notes.append(text + " Ignoring offload_param (strict_config makes this an error).")
    zero.offload_param = None


def load_config(config: Any = None, *, args: Any = None, config_params: Any = None,
                world_size: int = 1, strict: Optional[bool] = None) -> ShardwiseConfig:
    """Load, validate and resolve a DeepSpeed-compatible config.

    ``config``: dict | path | JSON string | ShardwiseConfig; ``config_params``: DeepSpeed's
    legacy name for it; ``args``: argparse Namespace with ``deepspeed_config`` or
    ``shardwise_config``; ``world_size``: data-parallel ranks, used for the batch triple;
    ``strict``: unknown keys raise (None: the config's ``strict_config`` or
    ``$SHARDWISE_STRICT_CONFIG``). A key a few edits from a key of its section is a typo
    and raises whatever ``strict`` says (``$SHARDWISE_ALLOW_CONFIG_TYPOS=1``: a warning). Warnings go to the "shardwise" logger and
    ``cfg.warnings``.
    """
    raw = _to_dict(_pick_source(config, args, config_params))
    report = WalkReport()
    clean = normalize(raw, ShardwiseConfig, report)
    strict_on = _strict_mode(strict, clean)
    typos = _typo_notes(report)
    unknown = _unknown_key_notes(report, strict_on)
    if strict_on and unknown:
        raise ConfigError("Strict config: " + " ".join(unknown) + " Fix or remove these keys "
                          f"(or drop strict_config / {STRICT_ENV} to only warn).")
    try:
        cfg = ShardwiseConfig.model_validate(clean)
    except ValidationError as exc:
        raise _convert(exc) from None
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = \
        resolve_batch(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                      cfg.gradient_accumulation_steps, world_size)
    notes = typos + unknown + report.notes
    _check_offload_param_stage(cfg, strict_on, notes)
    notes += ignored_section_notes(clean)
    cfg._world_size = world_size
    cfg._auto_paths = frozenset(report.auto_paths)
    fill_peak_lr(cfg)
    infos: List[str] = []
    (notes if on_windows() else infos).extend(platform_key_notes(cfg))
    cfg._notes, cfg._infos = notes, infos
    for note in notes:
        warn_once(note)
    for info in infos:
        info_once(info)
    return cfg
