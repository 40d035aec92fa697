"""What the engine reports about training: the ``steps_per_print`` log lines (DeepSpeed's
formats), the ``wall_clock_breakdown`` lines, and the monitor events of every optimizer step.

Nothing here reads a device value between log steps: losses are summed on the device, events
keep device tensors, and the host reads them all once per ``steps_per_print`` window.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import psutil
import torch

from ..accelerator import get_accelerator
from ..monitor import events as ev
from ..monitor.events import DeviceScalar, Event
from ..monitor.master import MonitorMaster
from ..monitor.throughput import FlopsModel, batch_tokens, peak_flops
from ..monitor.timers import EngineTimers
from ..utils.logging import log_dist

GIB = 2**30


@dataclass(frozen=True)
class StepInfo:
    """The engine's state right after an optimizer step (or a skipped one)."""

    global_steps: int
    global_samples: int
    micro_steps: int
    lrs: List[float]
    moms: List[Any]
    loss_scale: Optional[float]
    """The fp16 loss scale (None without fp16)."""
    skipped: int
    grad_norm: Optional[DeviceScalar]
    """The global gradient norm (None on a skipped step)."""


def momentum_of(param_groups: Sequence[Dict[str, Any]]) -> List[Any]:
    """DeepSpeed's ``get_mom()``: each group's ``betas`` (Adam family) or ``momentum``."""
    return [tuple(g["betas"]) if "betas" in g else g.get("momentum") for g in param_groups]


@dataclass
class _Window:
    """Counters of one ``steps_per_print`` window."""

    start: float
    steps: int = 0
    micro_steps: int = 0
    tokens: int = 0
    seq_len: int = 0
    loss_sum: Optional[torch.Tensor] = None
    loss_count: int = 0


class StepLogger:
    """Every ``steps_per_print`` optimizer steps, rank 0 logs DeepSpeed's lines; after every
    optimizer step the monitor gets DeepSpeed's events (plus ours), flushed at log steps."""

    def __init__(self, *, steps_per_print: int, samples_per_step: int, world_size: int,
                 timers: EngineTimers, monitor: MonitorMaster, rank: int,
                 flops: Optional[FlopsModel], device: torch.device) -> None:
        self.every = max(int(steps_per_print or 0), 0)
        self.samples_per_step = samples_per_step
        self.world_size = world_size
        self.timers = timers
        self.monitor = monitor
        self.rank = rank
        self.flops = flops
        self.peak = peak_flops(device)
        self._window = _Window(start=time.perf_counter())
        self._acc_loss: Optional[torch.Tensor] = None
        self._acc_count = 0

    # --- per micro step ---------------------------------------------------------------------
    def record_batch(self, args: tuple, kwargs: Dict[str, Any]) -> None:
        """Count the tokens of a training forward (no device access: shapes only)."""
        if not torch.is_grad_enabled():
            return
        found = batch_tokens(args, kwargs)
        if found is not None:
            self._window.tokens += found[0]
            self._window.seq_len = found[1]

    def record_loss(self, loss: torch.Tensor) -> None:
        """Sum the losses of the accumulation window on the device."""
        value = loss.detach().float().reshape(())
        self._acc_loss = value.clone() if self._acc_loss is None else self._acc_loss.add_(value)
        self._acc_count += 1

    # --- per optimizer step -----------------------------------------------------------------
    def on_step(self, info: StepInfo) -> None:
        w = self._window
        w.steps += 1
        w.micro_steps += max(self._acc_count, 1)
        step_loss = self._take_window_loss()
        step_ms = self.timers.take_step() if self.timers.enabled else None
        if self.monitor.enabled:
            self.monitor.write_events(self._step_events(info, step_loss, step_ms))
        if not self.every or info.global_steps % self.every != 0:
            return
        self._log_window(info)
        self.monitor.flush()
        self._window = _Window(start=time.perf_counter())

    def _take_window_loss(self) -> Optional[torch.Tensor]:
        """The mean loss of this accumulation window (a device tensor), added to the print
        window's sum; None when backward() saw no loss."""
        if self._acc_loss is None:
            return None
        total, count = self._acc_loss, self._acc_count
        self._acc_loss, self._acc_count = None, 0
        w = self._window
        w.loss_sum = total.clone() if w.loss_sum is None else w.loss_sum.add_(total)
        w.loss_count += count
        return total / count

    def _step_events(self, info: StepInfo, loss: Optional[torch.Tensor],
                     step_ms: Optional[Dict[str, float]]) -> List[Event]:
        x = info.global_samples
        events: List[Event] = []
        if loss is not None:
            events.append((ev.TRAIN_LOSS, loss, x))
        if info.lrs:
            events.append((ev.LR, info.lrs[0], x))
        if info.loss_scale is not None:
            events.append((ev.LOSS_SCALE, info.loss_scale, x))
        if info.grad_norm is not None:
            events.append((ev.GRAD_NORM, info.grad_norm, x))
        if step_ms is not None:
            events += [(ev.ELAPSED_PREFIX + ev.ELAPSED_TAGS[name], ms, x)
                       for name, ms in step_ms.items()]
        return events

    # --- per log step -----------------------------------------------------------------------
    def _rates(self, elapsed: float) -> Dict[str, float]:
        w = self._window
        rates = {"samples_per_sec": self.samples_per_step * w.steps / elapsed}
        if w.tokens:
            tokens_per_sec = w.tokens * self.world_size / elapsed
            rates["tokens_per_sec"] = tokens_per_sec
            if self.flops is not None and self.peak:
                per_device = tokens_per_sec / self.world_size
                rates["mfu"] = self.flops.per_token(w.seq_len) * per_device / self.peak
        return rates

    def _log_window(self, info: StepInfo) -> None:
        w = self._window
        elapsed = max(time.perf_counter() - w.start, 1e-9)
        rates = self._rates(elapsed)
        acc = get_accelerator()
        peak_gib = acc.max_memory_allocated() / GIB if acc.kind != "cpu" else None
        rss_gib = psutil.Process().memory_info().rss / GIB
        if self.monitor.enabled:
            x = info.global_samples
            extra: List[Event] = [(getattr(ev, name.upper()), value, x)
                                  for name, value in rates.items()]
            if peak_gib is not None:
                extra.append((ev.GPU_PEAK_MEMORY, peak_gib, x))
            extra.append((ev.HOST_RSS, rss_gib, x))
            self.monitor.write_events(extra)
        if self.rank != 0:
            if self.timers.enabled:
                self.timers.take_window(w.steps, w.micro_steps, self.rank)
            return
        loss = float(w.loss_sum) / w.loss_count if w.loss_sum is not None else float("nan")
        line = (f"step={info.global_steps}, skipped={info.skipped}, lr={info.lrs}, "
                f"mom={info.moms}, loss={loss:.4f}")
        if info.loss_scale is not None:
            line += f", loss_scale={info.loss_scale:g}"
        log_dist(line, ranks=[0])
        speed = (f"micro_step={info.micro_steps}/global_step={info.global_steps}, "
                 f"SamplesPerSec={rates['samples_per_sec']:.3f}")
        if "tokens_per_sec" in rates:
            speed += f", TokensPerSec={rates['tokens_per_sec']:.1f}"
        if "mfu" in rates:
            speed += f", MFU={100 * rates['mfu']:.1f}%"
        if peak_gib is not None:
            speed += (f", MemAllocated={acc.memory_allocated() / GIB:.2f}GB, "
                      f"MaxMemAllocated={peak_gib:.2f}GB")
        log_dist(speed + f", HostRSS={rss_gib:.2f}GB", ranks=[0])
        if self.timers.enabled:
            # DeepSpeed prints these (not through the logger), so the log level cannot hide them
            for timer_line in self.timers.take_window(w.steps, w.micro_steps, self.rank):
                print(timer_line, flush=True)
