"""The Windows keys of the seed article, and what each one does on this platform.

The article invents ``windows_specific``, ``aio.windows_io_optimization``,
``checkpoint.windows_path_optimization``, ``tensor_parallel.windows_tp_optimization`` and
``inference.windows_kernel_optimization``. DeepSpeed has none of them. shardwise accepts
them so the article's configs load, gives ``windows_specific.memory_optimization`` a
real effect (``ShardwiseConfig.empty_cache_after_step``), and says plainly that the others
change nothing and why. All texts live here so tests can assert them.
"""
from __future__ import annotations

import platform
from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:
    from .shardwise_config import ShardwiseConfig


def platform_name(system: Optional[str] = None) -> str:
    """A human name for the OS: "Windows", "Linux", "macOS", or whatever platform.system() says."""
    system = system or platform.system()
    return {"Darwin": "macOS"}.get(system, system or "this platform")


def _section_flag(section: object, key: str) -> bool:
    return isinstance(section, dict) and bool(section.get(key))


def platform_key_notes(cfg: "ShardwiseConfig", system: Optional[str] = None) -> List[str]:
    """Warning texts for the seed's Windows keys that ``cfg`` sets (empty when none are set).

    ``system`` overrides ``platform.system()`` (tests use it to check both platforms).
    """
    name = platform_name(system)
    on_windows = name == "Windows"
    notes: List[str] = []
    ws = cfg.windows_specific
    if ws is not None:
        if ws.enable:
            if on_windows:
                notes.append("windows_specific.enable: shardwise's Windows support is always on "
                             "(spawn start method, gloo backend, pathlib paths without ':'); this "
                             "flag changes nothing by itself.")
            else:
                notes.append(f"windows_specific.enable: no effect on {name} (shardwise applies "
                             f"Windows-specific behaviour only on Windows, and always does there).")
        if ws.memory_optimization == "aggressive":
            notes.append("windows_specific.memory_optimization=\"aggressive\": the engine empties "
                         "the device allocator cache after every optimizer step (lower peak "
                         "reserved memory, e.g. under Windows' WDDM driver, at some speed cost); "
                         f"this applies on {name} too.")
        elif ws.memory_optimization == "normal":
            notes.append("windows_specific.memory_optimization=\"normal\": no effect (same as "
                         "\"none\"): PyTorch's caching allocator is left as it is.")
    if cfg.aio.windows_io_optimization:
        if on_windows:
            how = ("on Windows the IO layer always reads and writes through one file handle per "
                   "IO thread (seek + readinto/write; Windows has no pread and no O_DIRECT)")
        else:
            how = (f"on {name} the IO layer uses pread/pwrite from its threads (O_DIRECT where "
                   "the filesystem allows it); it picks the Windows path by itself on Windows")
        notes.append(f"aio.windows_io_optimization: no effect: {how}. Tune aio.block_size, "
                     "aio.queue_depth and aio.intra_op_parallelism instead (`shardwise "
                     "nvme-tune --path DIR` prints the best values for a disk).")
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
