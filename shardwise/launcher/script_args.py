"""The script side of the command line: ``add_config_arguments`` and ``apply_script_args``.

A DeepSpeed script calls ``deepspeed.add_config_arguments(parser)`` so that ``--deepspeed``,
``--deepspeed_config`` and ``--local_rank`` parse. ``shardwise.add_config_arguments`` adds the
same options and the seed article's flags (``--windows_optimization true``, ``--pin_memory``,
...), so the seed's command line, with every flag written after the script, parses too.
``apply_script_args(args)`` then says what those flags mean; ``initialize(args=args)`` calls it.

Values the launcher was given before the script arrive as environment variables
(``SHARDWISE_DATALOADER_NUM_WORKERS``, ``SHARDWISE_PIN_MEMORY``, ``SHARDWISE_NUMA_BINDING``,
``SHARDWISE_MEMORY_ALLOCATOR``, ``SHARDWISE_WINDOWS_OPTIMIZATION``); flags on the script's
own command line win over them.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any, List, Optional

from ..errors import ConfigError

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _bool_value(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _default_local_rank() -> int:
    try:
        return int(os.environ.get("LOCAL_RANK", "-1"))
    except ValueError:
        return -1


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's and the seed's script flags to ``parser`` and return it.

    Options the parser already defines (e.g. the script's own ``--local_rank``) are left as
    they are, so calling this never raises "conflicting option string".
    """
    group = parser.add_argument_group("shardwise", "shardwise / DeepSpeed configuration")
    existing = parser._option_string_actions

    def add(*names: str, **kwargs: Any) -> None:
        free = [n for n in names if n not in existing]
        if len(free) == len(names):
            group.add_argument(*names, **kwargs)

    add("--deepspeed", action="store_true",
        help="enable the engine (kept for DeepSpeed scripts; shardwise is always on)")
    add("--deepspeed_config", type=str, default=None, help="path of the ds_config.json")
    add("--shardwise", action="store_true", help="same as --deepspeed")
    add("--shardwise_config", type=str, default=None,
        help="path of the config JSON (wins over --deepspeed_config)")
    add("--local_rank", type=int, default=_default_local_rank(),
        help="local rank, passed by the launcher (default: $LOCAL_RANK or -1)")
    add("--windows_optimization", type=_bool_value, nargs="?", const=True, default=None,
        metavar="{true,false}",
        help="Windows-safe settings on any OS: USE_LIBUV=0 and no core binding")
    add("--disable_numa_awareness", action="store_true",
        help="no NUMA/core binding (numa_binding=False)")
    add("--windows_memory_allocator", choices=("pytorch", "default"), default=None,
        help="pytorch: PyTorch's native CUDA caching allocator via PYTORCH_CUDA_ALLOC_CONF")
    add("--dataloader_num_workers", type=int, default=None, metavar="N",
        help="worker processes of the engine's data loader")
    add("--pin_memory", action="store_true", default=None,
        help="pinned memory in the engine's data loader")
    add("--num_gpus", "--num_accelerators", type=int, default=None,
        help="ignored here: the launcher's flag (write it before the script)")
    return parser


@dataclass(frozen=True)
class ScriptArgEffects:
    """What the script-side flags mean for the engine."""

    config_path: Optional[str] = None
    """``--shardwise_config`` or else ``--deepspeed_config``; None when neither was given."""
    dataloader_num_workers: Optional[int] = None
    """Worker processes for the engine's data loader (None: the engine's default)."""
    pin_memory: Optional[bool] = None
    """Pinned memory for the engine's data loader (None: the engine's default)."""
    numa_binding: bool = True
    """False when NUMA/core binding was turned off (--disable_numa_awareness, Windows mode)."""
    allocator: Optional[str] = None
    """``"pytorch"`` or ``"default"`` (--windows_memory_allocator), None when not given."""
    windows_optimization: bool = False
    """--windows_optimization was switched on."""
    notes: List[str] = field(default_factory=list)
    """One line per effect, for the engine to log."""


def _env_bool(name: str) -> Optional[bool]:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return _bool_value(raw)
    except argparse.ArgumentTypeError:
        raise ConfigError(f"environment variable {name}={raw!r} must be true/false or 1/0; "
                          f"fix or unset it") from None


def _env_int(name: str) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} must be an integer; "
                          f"fix or unset it") from None


def apply_allocator(allocator: Optional[str], notes: List[str]) -> None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` for ``--windows_memory_allocator pytorch``.

    It only takes effect before CUDA's caching allocator starts, which is why this runs at
    argument time. A user's own PYTORCH_CUDA_ALLOC_CONF is never overwritten.
    """
    if allocator != "pytorch":
        return
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        notes.append("allocator: PYTORCH_CUDA_ALLOC_CONF already set by the user; kept as is")
        return
    # PyTorch's own caching allocator ("native", not cudaMallocAsync). Expandable segments
    # cut fragmentation but exist on Linux only.
    conf = "backend:native,expandable_segments:True" if sys.platform.startswith("linux") \
        else "backend:native"
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        notes.append("allocator: CUDA already initialised; PYTORCH_CUDA_ALLOC_CONF not changed "
                     "(call add_config_arguments/initialize before any CUDA work)")
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    notes.append(f"allocator: PYTORCH_CUDA_ALLOC_CONF={conf} (PyTorch's caching allocator)")


def apply_script_args(args: Any) -> ScriptArgEffects:
    """Read the flags ``add_config_arguments`` defines (when present on ``args``).

    Launcher-provided environment variables are the defaults; explicit script flags win.
    """
    notes: List[str] = []
    config_path = getattr(args, "shardwise_config", None) or getattr(args, "deepspeed_config", None)
    if config_path is not None:
        notes.append(f"config: {config_path}")

    workers = getattr(args, "dataloader_num_workers", None)
    if workers is None:
        workers = _env_int("SHARDWISE_DATALOADER_NUM_WORKERS")
    if workers is not None:
        if workers < 0:
            raise ConfigError(f"--dataloader_num_workers {workers} must be >= 0 (0 loads data in "
                              f"the training process)")
        notes.append(f"data loader: num_workers={workers}")

    pin = getattr(args, "pin_memory", None)
    if not pin:  # store_true flags read False when absent; the env may still switch it on
        env_pin = _env_bool("SHARDWISE_PIN_MEMORY")
        pin = env_pin if env_pin is not None else (pin if pin else None)
    if pin is not None:
        notes.append(f"data loader: pin_memory={bool(pin)}")

    windows_opt = getattr(args, "windows_optimization", None)
    if windows_opt is None:
        windows_opt = _env_bool("SHARDWISE_WINDOWS_OPTIMIZATION")
    windows_opt = bool(windows_opt)
    if windows_opt:
        os.environ.setdefault("USE_LIBUV", "0")
        notes.append("windows optimization: USE_LIBUV=0 (TCPStore without libuv), no core binding")

    numa_env = _env_bool("SHARDWISE_NUMA_BINDING")
    numa_binding = not (getattr(args, "disable_numa_awareness", False) or windows_opt
                        or numa_env is False)
    if not numa_binding:
        notes.append("NUMA awareness off: no core binding")

    allocator = getattr(args, "windows_memory_allocator", None) or \
        os.environ.get("SHARDWISE_MEMORY_ALLOCATOR") or None
    if allocator not in (None, "pytorch", "default"):
        raise ConfigError(f"memory allocator {allocator!r} is unknown; use 'pytorch' or 'default'")
    apply_allocator(allocator, notes)

    if getattr(args, "num_gpus", None) is not None:
        notes.append("--num_gpus after the script is the launcher's flag; ignored by the engine")
    return ScriptArgEffects(config_path=config_path, dataloader_num_workers=workers,
                            pin_memory=None if pin is None else bool(pin),
                            numa_binding=numa_binding, allocator=allocator,
                            windows_optimization=windows_opt, notes=notes)
