"""``wall_clock_breakdown`` timers with DeepSpeed's names and log lines.

Off (the default), ``start``/``stop`` return at once: no accelerator sync, no clock read. On,
each phase is bracketed by an accelerator sync and the host clock, so a phase's time is its
kernels' time, as DeepSpeed's ``SynchronizedWallClockTimer`` reports it.

With something offloaded, ``copies`` (monitor/copy_timers.py) also times the offload copies;
their totals join the step's times and the optimizer-step line, after DeepSpeed's fields.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

from .copy_timers import COPY_TIMERS, OffloadCopyTimer

#: DeepSpeed's global timer names, in its log order
GLOBAL_TIMERS = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
#: DeepSpeed's micro timer names (same phases, per micro step)
MICRO_TIMERS = tuple(f"{name}_microstep" for name in GLOBAL_TIMERS)


class EngineTimers:
    """Accumulates each phase's milliseconds; ``take_step()`` returns (and restarts) the current
    optimizer step's times, ``take_window(...)`` the log lines of the print window."""

    def __init__(self, enabled: bool, synchronize: Callable[[], None],
                 offload: bool = False) -> None:
        self.enabled = enabled
        self.copies: Optional[OffloadCopyTimer] = OffloadCopyTimer() if enabled and offload else None
        """The offload copy timer handed to the offload objects (None: breakdown off or
        nothing offloaded, and then nothing is recorded)."""
        self._sync = synchronize
        self._start: Dict[str, float] = {}
        self._step_ms: Dict[str, float] = {}
        self._window_ms: Dict[str, float] = {}

    def start(self, name: str) -> None:
        if self.enabled:
            self._sync()
            self._start[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.enabled and name in self._start:
            self._sync()
            ms = 1000.0 * (time.perf_counter() - self._start.pop(name))
            self._step_ms[name] = self._step_ms.get(name, 0.0) + ms

    def take_step(self) -> Dict[str, float]:
        """Milliseconds per phase since the last call (one optimizer step: all its micro steps)."""
        step = {name: self._step_ms.get(name, 0.0) for name in GLOBAL_TIMERS}
        if self.copies is not None:
            step.update(self.copies.take())
        for name, ms in step.items():
            self._window_ms[name] = self._window_ms.get(name, 0.0) + ms
        self._step_ms.clear()
        return step

    def take_window(self, steps: int, micro_steps: int, rank: int) -> List[str]:
        """DeepSpeed's two lines, averaged over the window: per micro step, then per optimizer
        step (a micro step's ``step_microstep`` is the step time shared by its micro steps)."""
        window, self._window_ms = self._window_ms, {}
        micro = " | ".join(f"{m}: {window.get(g, 0.0) / max(micro_steps, 1):.2f}"
                           for g, m in zip(GLOBAL_TIMERS, MICRO_TIMERS))
        names = GLOBAL_TIMERS + (COPY_TIMERS if self.copies is not None else ())
        whole = " | ".join(f"{g}: {window.get(g, 0.0) / max(steps, 1):.2f}" for g in names)
        return [f"[Rank {rank}] time (ms) | {micro}", f"[Rank {rank}] time (ms) | {whole}"]
