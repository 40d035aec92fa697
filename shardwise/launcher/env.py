"""Environment that the launcher hands to workers: forwarded variables, env files, seed flags.

Remote nodes (ssh, pdsh, slurm, openmpi) do not inherit the launcher's environment, so the
variables a run depends on are exported explicitly:

* every variable whose name starts with one of ``EXPORT_PREFIXES`` (PYTHON*, NCCL_*, UCX_*, ...);
* every ``KEY=VALUE`` line of ``.shardwise_env`` and ``.deepspeed_env`` (looked up in the
  current directory, then the home directory; ``SHARDWISE_ENV_FILE`` / ``DS_ENV_FILE`` name an
  explicit file);
* what the seed's launcher flags mean (``SHARDWISE_PIN_MEMORY=1`` and friends), which
  ``shardwise.add_config_arguments`` / ``apply_script_args`` read back in the worker.
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional

from ..errors import LaunchError

EXPORT_PREFIXES = ("PYTHON", "NCCL_", "UCX_", "SHARDWISE_", "TORCH_", "GLOO_", "CUDA_VISIBLE",
                   "PYTORCH_", "OMP_NUM_THREADS")
ENV_FILE_NAMES = (".shardwise_env", ".deepspeed_env")


def parse_env_file(text: str, source: str) -> Dict[str, str]:
    """``KEY=VALUE`` lines (``#`` comments, blank lines, optional ``export`` prefix)."""
    env: Dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].strip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key or not (key[0].isalpha() or key[0] == "_") or \
                not all(c.isalnum() or c == "_" for c in key):
            raise LaunchError(f"{source} line {number}: {raw.strip()!r} is not 'NAME=VALUE'; "
                              f"fix or comment out the line")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        env[key] = value
    return env


def env_file_paths(cwd: Optional[Path] = None, home: Optional[Path] = None) -> List[Path]:
    """The env files that apply, lowest priority first (a later file overrides an earlier one)."""
    explicit = os.environ.get("SHARDWISE_ENV_FILE") or os.environ.get("DS_ENV_FILE")
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise LaunchError(f"SHARDWISE_ENV_FILE/DS_ENV_FILE names {explicit!r}, which does not "
                              f"exist; fix the path or unset the variable")
        return [path]
    found: List[Path] = []
    # Home first, then the working directory: the project's own file wins. Within a
    # directory, .deepspeed_env first so that .shardwise_env wins when both exist.
    for folder in (home or Path.home(), cwd or Path.cwd()):
        for name in reversed(ENV_FILE_NAMES):
            path = folder / name
            if path.is_file() and path not in found:
                found.append(path)
    return found


def load_env_files(paths: Iterable[Path]) -> Dict[str, str]:
    env: Dict[str, str] = {}
    for path in paths:
        env.update(parse_env_file(path.read_text(encoding="utf-8"), f"env file {str(path)!r}"))
    return env


def forwarded_env(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Variables of the launcher's environment that remote nodes need."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES)}


def seed_flags_env(args) -> Dict[str, str]:
    """What the seed's launcher flags mean, as worker environment variables.

    * ``--dataloader_num_workers N`` → ``SHARDWISE_DATALOADER_NUM_WORKERS=N`` (the engine's
      ``deepspeed_io`` data loader and ``ScriptArgEffects.dataloader_num_workers``).
    * ``--pin_memory`` → ``SHARDWISE_PIN_MEMORY=1`` (pinned host buffers for the data loader).
    * ``--disable_numa_awareness`` → ``SHARDWISE_NUMA_BINDING=0`` (no core binding; it also
      overrides ``--bind_cores_to_rank``).
    * ``--windows_memory_allocator pytorch`` → ``SHARDWISE_MEMORY_ALLOCATOR=pytorch``: the worker
      sets ``PYTORCH_CUDA_ALLOC_CONF`` to PyTorch's native caching allocator before CUDA starts.
    * ``--windows_optimization true`` → ``SHARDWISE_WINDOWS_OPTIMIZATION=1`` and ``USE_LIBUV=0``
      (the TCPStore without libuv, which Windows builds of torch lack) and no core binding.
    """
    env: Dict[str, str] = {}
    if getattr(args, "dataloader_num_workers", None) is not None:
        env["SHARDWISE_DATALOADER_NUM_WORKERS"] = str(args.dataloader_num_workers)
    if getattr(args, "pin_memory", False):
        env["SHARDWISE_PIN_MEMORY"] = "1"
    windows_opt = getattr(args, "windows_optimization", None)
    if getattr(args, "disable_numa_awareness", False) or windows_opt:
        env["SHARDWISE_NUMA_BINDING"] = "0"
    allocator = getattr(args, "windows_memory_allocator", None)
    if allocator:
        env["SHARDWISE_MEMORY_ALLOCATOR"] = allocator
    if windows_opt is not None:
        env["SHARDWISE_WINDOWS_OPTIMIZATION"] = "1" if windows_opt else "0"
        if windows_opt:
            env["USE_LIBUV"] = "0"
    return env


def platform_worker_env(platform: str = sys.platform) -> Dict[str, str]:
    """Settings every worker on this platform needs."""
    if platform.startswith("win"):
        # Windows wheels of torch are built without libuv; env:// rendezvous fails with
        # "PyTorch was built without libuv support" unless the classic TCPStore is chosen.
        return {"USE_LIBUV": "0"}
    return {}


def shell_exports(env: Mapping[str, str]) -> str:
    """``export A='1'; export B='2';`` for a POSIX remote shell (ssh, pdsh)."""
    return "".join(f"export {k}={shlex.quote(v)}; " for k, v in sorted(env.items()))
