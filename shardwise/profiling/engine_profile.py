"""The ``flops_profiler`` config section at work: profile one training step of the engine.

As in DeepSpeed, global rank 0 profiles the forward passes of the step whose
``global_steps`` equals ``profile_step`` (each forward restarts the count, so with gradient
accumulation the last micro batch is reported) and prints or writes the report when that
step's optimizer update is done. The engine calls three hooks; with the section off they
return at once, so the profiler costs nothing on other steps or when disabled.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, Optional

from ..accelerator import get_accelerator
from ..utils.logging import log_dist
from .flops_profiler import FlopsProfiler
from .flops_report import ProfileTimes

_NOTHING = contextlib.nullcontext()


@dataclass
class ProfileResult:
    """The numbers of the profiled step (forward of one micro batch on this rank)."""

    step: int
    """``profile_step``."""
    flops: int
    """Forward FLOPs."""
    macs: int
    """Forward MACs."""
    params: int
    """Parameters of the model."""
    times: ProfileTimes
    """Engine-measured forward / backward / step seconds."""
    report: str
    """The report text."""


class EngineProfile:
    """Drives a ``FlopsProfiler`` over the engine's step at ``profile_step``."""

    def __init__(self, engine: Any) -> None:
        cfg = engine.config.flops_profiler
        self.engine = engine
        self.config = cfg
        self.enabled = bool(cfg.enabled) and engine.global_rank == 0
        self.profiler: Optional[FlopsProfiler] = (
            FlopsProfiler(engine.module, engine, cfg.recompute_fwd_factor) if cfg.enabled else None)
        self.done = False
        self._fwd = 0.0
        self._fwd_end = 0.0
        self._step_start = 0.0
        self.result: Optional[ProfileResult] = None
        """What the profiled step measured, once its report is written."""

    def _active(self) -> bool:
        return (self.enabled and not self.done
                and self.engine.global_steps == self.config.profile_step)

    def forward(self) -> ContextManager[None]:
        """Around the module's forward: count it at the profile step (else a no-op context)."""
        return self._profiled_forward() if self._active() else _NOTHING

    @contextlib.contextmanager
    def _profiled_forward(self) -> Iterator[None]:
        sync = get_accelerator().synchronize
        self.profiler.start_profile()
        sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync()
            self._fwd_end = time.perf_counter()
            self._fwd = self._fwd_end - t0
            self.profiler.stop_profile()

    def step_begin(self) -> None:
        """At the top of ``engine.step()``: the backward of the profiled micro batch is done."""
        if self._active() and self.profiler.started:
            get_accelerator().synchronize()
            self._step_start = time.perf_counter()

    def step_end(self, boundary: bool) -> None:
        """At the end of ``engine.step()``: after the profiled step's update, write the report."""
        if not (boundary and self.enabled and not self.done and self.profiler.started):
            return
        if self.engine.global_steps != self.config.profile_step + 1:
            return
        get_accelerator().synchronize()
        times = ProfileTimes(fwd=self._fwd, bwd=max(self._step_start - self._fwd_end, 0.0),
                             step=max(time.perf_counter() - self._step_start, 0.0))
        cfg = self.config
        prof = self.profiler
        self.result = ProfileResult(step=cfg.profile_step, flops=prof.get_total_flops(),
                                    macs=prof.get_total_macs(), params=prof.get_total_params(),
                                    times=times, report="")
        self.result.report = self.profiler.print_model_profile(
            profile_step=cfg.profile_step, module_depth=cfg.module_depth,
            top_modules=cfg.top_modules, detailed=cfg.detailed, output_file=cfg.output_file,
            times=times)
        if cfg.output_file:
            log_dist(f"flops profile of step {cfg.profile_step} written to {cfg.output_file}",
                     ranks=[0])
        self.profiler.end_profile()
        self.done = True
