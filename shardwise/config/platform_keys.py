"""The Windows keys of the seed article, and what each one does on this platform.

The article invents ``windows_specific``, ``aio.windows_io_optimization``,
``checkpoint.windows_path_optimization``, ``tensor_parallel.windows_tp_optimization`` and
``inference.windows_kernel_optimization``. DeepSpeed has none of them. shardwise accepts
them so the article's configs load. On Windows, ``windows_specific.memory_optimization:
"aggressive"`` has a real effect (``ShardwiseConfig.empty_cache_after_step``) and each
other key says plainly, as a warning, that it changes nothing and why. On every other
platform they are Windows-only settings: all of them have no effect, and one info line
says so (an example config written for Windows must not warn on every Linux run). All
texts live here so tests can assert them.
"""
from __future__ import annotations

import platform
from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:
    from .shardwise_config import ShardwiseConfig


def current_system() -> str:
    """``platform.system()``: the one place the config asks which OS this is (tests patch it)."""
    return platform.system()


def platform_name(system: Optional[str] = None) -> str:
    """A human name for the OS: "Windows", "Linux", "macOS", or whatever platform.system() says."""
    system = system or current_system()
    return {"Darwin": "macOS"}.get(system, system or "this platform")


def on_windows(system: Optional[str] = None) -> bool:
    """True when running on (or, with ``system``, asking about) Windows."""
    return platform_name(system) == "Windows"


def _section_flag(section: object, key: str) -> bool:
    return isinstance(section, dict) and bool(section.get(key))


def windows_keys_set(cfg: "ShardwiseConfig") -> List[str]:
    """The seed's Windows keys that ``cfg`` sets to something other than their default."""
    ws = cfg.windows_specific
    found = []
    if ws.enable:
        found.append("windows_specific.enable")
    if ws.memory_optimization != "none":
        found.append(f"windows_specific.memory_optimization=\"{ws.memory_optimization}\"")
    if cfg.aio.windows_io_optimization:
        found.append("aio.windows_io_optimization")
    if cfg.checkpoint.windows_path_optimization:
        found.append("checkpoint.windows_path_optimization")
    if _section_flag(cfg.tensor_parallel, "windows_tp_optimization"):
        found.append("tensor_parallel.windows_tp_optimization")
    if _section_flag(cfg.inference, "windows_kernel_optimization"):
        found.append("inference.windows_kernel_optimization")
    return found


def platform_key_notes(cfg: "ShardwiseConfig", system: Optional[str] = None) -> List[str]:
    """Texts about the seed's Windows keys that ``cfg`` sets (empty when none are set).

    On Windows one warning text per key; elsewhere a single info text naming them all.
    ``system`` overrides ``platform.system()`` (tests use it to check both platforms).
    """
    if not on_windows(system):
        keys = windows_keys_set(cfg)
        if not keys:
            return []
        return [f"Windows-only config keys ignored on {platform_name(system)} (no effect here; "
                f"they apply on Windows only): {', '.join(keys)}."]
    return _windows_notes(cfg)


def _windows_notes(cfg: "ShardwiseConfig") -> List[str]:
    notes: List[str] = []
    ws = cfg.windows_specific
    if ws.enable:
        notes.append("windows_specific.enable: shardwise's Windows support is always on "
                     "(spawn start method, gloo backend, pathlib paths without ':'); this "
                     "flag changes nothing by itself.")
    if ws.memory_optimization == "aggressive":
        notes.append("windows_specific.memory_optimization=\"aggressive\": the engine empties "
                     "the device allocator cache after every optimizer step (lower peak "
                     "reserved memory under Windows' WDDM driver, at some speed cost).")
    elif ws.memory_optimization == "normal":
        notes.append("windows_specific.memory_optimization=\"normal\": no effect (same as "
                     "\"none\"): PyTorch's caching allocator is left as it is.")
    if cfg.aio.windows_io_optimization:
        notes.append("aio.windows_io_optimization: no effect: on Windows the IO layer always "
                     "reads and writes through one file handle per IO thread (seek + "
                     "readinto/write; Windows has no pread and no O_DIRECT). Tune "
                     "aio.block_size, aio.queue_depth and aio.intra_op_parallelism instead "
                     "(`shardwise nvme-tune --path DIR` prints the best values for a disk).")
    if cfg.checkpoint.windows_path_optimization:
        notes.append("checkpoint.windows_path_optimization: no effect: shardwise always builds "
                     "checkpoint paths with pathlib, uses ':'-free file names and os.replace for "
                     "atomic renames, on every platform.")
    if _section_flag(cfg.tensor_parallel, "windows_tp_optimization"):
        notes.append("tensor_parallel.windows_tp_optimization: no effect: shardwise has no tensor "
                     "parallelism (each rank holds the whole model, sharded by ZeRO).")
    if _section_flag(cfg.inference, "windows_kernel_optimization"):
        notes.append("inference.windows_kernel_optimization: no effect: shardwise compiles and "
                     "injects no kernels; PyTorch's own kernels are used on every platform.")
    return notes
