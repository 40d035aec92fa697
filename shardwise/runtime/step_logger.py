"""The engine's periodic log line and ``wall_clock_breakdown`` timers."""
from __future__ import annotations

import time
from typing import Dict, List, Optional

import psutil
import torch

from ..accelerator import get_accelerator
from ..utils.logging import log_dist


class Timers:
    """Wall-clock timers for forward/backward/step; synchronises only when enabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.totals: Dict[str, float] = {}
        self._start: Dict[str, float] = {}

    def start(self, name: str) -> None:
        if self.enabled:
            get_accelerator().synchronize()
            self._start[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.enabled and name in self._start:
            get_accelerator().synchronize()
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - self._start.pop(name)

    def report_and_reset(self, steps: int) -> str:
        parts = [f"{k}={1000 * v / max(steps, 1):.1f}ms" for k, v in sorted(self.totals.items())]
        self.totals.clear()
        return " ".join(parts)


class StepLogger:
    """Every ``steps_per_print`` optimizer steps, rank 0 logs step, loss, lr, scale,
    samples/s and memory. Losses stay on the device until a line is printed (no per-step sync)."""

    def __init__(self, steps_per_print: int, samples_per_step: int, timers: Timers) -> None:
        self.every = max(int(steps_per_print or 0), 0)
        self.samples_per_step = samples_per_step
        self.timers = timers
        self._losses: List[torch.Tensor] = []
        self._t0 = time.perf_counter()
        self._steps = 0

    def record_loss(self, loss: torch.Tensor) -> None:
        if self.every:
            self._losses.append(loss.detach().float())

    def on_step(self, global_step: int, lrs: List[float], scale: Optional[float],
                skipped: int) -> None:
        self._steps += 1
        if not self.every or global_step % self.every != 0:
            return
        elapsed = time.perf_counter() - self._t0
        loss = torch.stack(self._losses).mean().item() if self._losses else float("nan")
        acc = get_accelerator()
        mem = acc.max_memory_allocated() / 2**30
        line = (f"step={global_step} loss={loss:.4f} lr={[f'{x:.3e}' for x in lrs]} "
                f"samples/s={self.samples_per_step * self._steps / max(elapsed, 1e-9):.1f} "
                f"skipped={skipped}")
        if scale is not None:
            line += f" loss_scale={scale:g}"
        if acc.kind != "cpu":
            line += f" peak_mem={mem:.2f}GiB"
        line += f" host_rss={psutil.Process().memory_info().rss / 2**30:.2f}GiB"
        if self.timers.enabled:
            line += " " + self.timers.report_and_reset(self._steps)
        log_dist(line, ranks=[0])
        self._losses.clear()
        self._steps = 0
        self._t0 = time.perf_counter()
