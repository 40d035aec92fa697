"""``wall_clock_breakdown`` times of the offload copies: device-to-host gradient copies and
host-to-device parameter copies (optimizer offload, stage-3 ``offload_param`` fetches).

The engine's :class:`~shardwise.monitor.timers.EngineTimers` owns one
:class:`OffloadCopyTimer` when the breakdown is on and something is offloaded; the offload
objects receive it (``None`` otherwise: :func:`copy_span` is then a no-op context, so a run
without the breakdown records no event and syncs nothing).

On an accelerator the copies run on side streams: a pair of timing events is recorded on
the copy stream around each batch of copies (no host sync when recording), and the pairs'
``elapsed_time`` is summed when the engine takes the step's times (the device is already
synchronized there). Without streams (CPU) the copy is timed with the host clock.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Tuple

from ..accelerator import get_accelerator

D2H = "offload_d2h"
"""Device-to-host gradient copies."""
H2D = "offload_h2d"
"""Host-to-device parameter copies."""
COPY_TIMERS = (D2H, H2D)


class OffloadCopyTimer:
    """Milliseconds of the offload copies since the last :meth:`take`, per direction.

    Thread-safe: CPU workers (stage-3 gradient accumulation) record spans too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ms: Dict[str, float] = {name: 0.0 for name in COPY_TIMERS}
        self._pending: List[Tuple[str, Any, Any]] = []
        """(direction, start event, end event) pairs not yet read."""

    @contextlib.contextmanager
    def span(self, kind: str, stream: Any = None) -> Iterator[None]:
        """Time the block's copies: with ``stream``, by events recorded on it (the copies
        must be queued on that stream inside the block); without, by the host clock."""
        if stream is None:
            t0 = time.perf_counter()
            yield
            self.add(kind, 1000.0 * (time.perf_counter() - t0))
            return
        acc = get_accelerator()
        start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        with self._lock:
            self._pending.append((kind, start, end))

    def add(self, kind: str, ms: float) -> None:
        with self._lock:
            self._ms[kind] += ms

    def take(self) -> Dict[str, float]:
        """The milliseconds per direction since the last call (reads the recorded events)."""
        with self._lock:
            pending, self._pending = self._pending, []
            ms, self._ms = self._ms, {name: 0.0 for name in COPY_TIMERS}
        for kind, start, end in pending:
            end.synchronize()  # already done when the engine synchronized for its timers
            ms[kind] += float(start.elapsed_time(end))
        return ms


def copy_span(timer: Optional[OffloadCopyTimer], kind: str, stream: Any = None) -> ContextManager:
    """``timer.span(kind, stream)``, or a no-op context when the breakdown is off."""
    return timer.span(kind, stream) if timer is not None else contextlib.nullcontext()
