"""``MonitorMaster``: what ``engine.monitor`` is. It buffers events (device values included, so
logging a loss costs no host sync) and hands them to the enabled writers at each flush: the
engine flushes every ``steps_per_print`` optimizer steps, and at exit."""
from __future__ import annotations

import atexit
from typing import Any, Iterable, List, Optional

from ..utils.logging import logger
from .events import Event, check_events, resolve
from .writers import Writer, build_writers

#: flush early when this many events are waiting (a huge steps_per_print must not hoard memory)
MAX_BUFFERED = 8192


class MonitorMaster:
    """DeepSpeed's ``engine.monitor``: ``enabled`` and ``write_events([(tag, value, step), ...])``.

    ``enabled`` is True on every rank when a monitor section is on (as in DeepSpeed), but only
    global rank 0 has writers; other ranks drop events at once."""

    def __init__(self, writers: List[Writer], enabled: bool) -> None:
        self.writers = writers
        self.enabled = enabled
        self._buffer: List[Event] = []
        self._closed = False
        if writers:
            # a strong reference: an engine dropped before exit still gets its last events out
            atexit.register(self.close)

    @classmethod
    def from_config(cls, config: Any, rank: int) -> "MonitorMaster":
        """Build from a ShardwiseConfig; a missing package raises ConfigError here."""
        sections = (config.tensorboard, config.csv_monitor, config.wandb, config.comet)
        enabled = any(s.enabled for s in sections)
        writers = build_writers(*sections, rank=rank) if enabled else []
        return cls(writers, enabled)

    def write_events(self, events: Iterable[Any], flush: bool = False) -> None:
        """Queue ``(tag, value, step)`` events; values may be floats or device tensors."""
        checked = check_events(events)
        if not self.writers or self._closed:
            return
        self._buffer.extend(checked)
        if flush or len(self._buffer) >= MAX_BUFFERED:
            self.flush()

    def flush(self) -> None:
        """Read the buffered values (one host copy per device) and write them everywhere."""
        if not self._buffer:
            return
        events, self._buffer = resolve(self._buffer), []
        for writer in self.writers:
            writer.write(events)
            writer.flush()

    def close(self) -> None:
        """Flush and close the writers (idempotent; also runs at interpreter exit)."""
        if self._closed:
            return
        atexit.unregister(self.close)
        try:
            self.flush()
        finally:
            self._closed = True
            for writer in self.writers:
                try:
                    writer.close()
                except Exception as err:  # one failing back end must not hide the others
                    logger.warning(f"monitor: closing {type(writer).__name__} failed: {err}")

    @property
    def pending(self) -> int:
        """Events waiting for the next flush."""
        return len(self._buffer)

    def log_dirs(self) -> List[Optional[str]]:
        """Where each writer puts its files (None for W&B/Comet)."""
        return [str(getattr(w, "log_dir", None)) if getattr(w, "log_dir", None) else None
                for w in self.writers]
