"""The ``shardwise`` logger: quiet by default, level from SHARDWISE_LOG_LEVEL (or DS_LOG_LEVEL)."""
from __future__ import annotations

import logging
import os
import sys
from typing import Iterable, Optional

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "warn": logging.WARNING, "error": logging.ERROR, "critical": logging.CRITICAL}


def _level_from_env() -> int:
    raw = os.environ.get("SHARDWISE_LOG_LEVEL") or os.environ.get("DS_LOG_LEVEL") or "info"
    return _LEVELS.get(raw.strip().lower(), logging.INFO)


def _make_logger() -> logging.Logger:
    log = logging.getLogger("shardwise")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [shardwise] %(message)s",
                                               "%Y-%m-%d %H:%M:%S"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(_level_from_env())
    return log


logger = _make_logger()


def _rank() -> int:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def log_dist(message: str, ranks: Optional[Iterable[int]] = (0,), level: int = logging.INFO) -> None:
    """Log ``message`` on the given ranks only (``ranks=None`` or containing -1: every rank)."""
    rank = _rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


def warn_once(message: str, _seen: set = set()) -> None:
    """Warn the first time a given message is seen in this process (rank 0 only)."""
    if message in _seen:
        return
    _seen.add(message)
    if _rank() == 0:
        logger.warning(message)


def info_once(message: str, _seen: set = set()) -> None:
    """Log at info level the first time a given message is seen in this process (rank 0 only)."""
    if message in _seen:
        return
    _seen.add(message)
    if _rank() == 0:
        logger.info(message)
