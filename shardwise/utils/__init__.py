"""Utilities: logging and diagnostics (memory, IO and platform statistics)."""
from .logging import log_dist, logger

__all__ = ["logger", "log_dist"]
try:  # diagnostics arrive with the launcher/report work; keep the package importable without it
    from .diagnostics import (get_io_stats, get_memory_info, get_platform_stats,  # noqa: F401
                              get_windows_specific_stats, see_memory_usage)
    __all__ += ["get_memory_info", "get_io_stats", "get_platform_stats",
                "get_windows_specific_stats", "see_memory_usage"]
except ImportError:
    pass
