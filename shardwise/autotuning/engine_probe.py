"""The engine side of a trial: time the profile steps, write the metrics, exit.

A trial is the user's script run by the autotuner with ``"autotuning": {"enabled": true,
"metric_path": ...}`` in its config (or ``$SHARDWISE_AUTOTUNING_METRIC_PATH`` set). The
engine calls ``on_forward`` before each forward and ``after_step`` after each ``step()``;
everything else lives here, so ``runtime/engine.py`` only holds three short calls.

* Timing: from the first forward of optimizer step ``start_profile_step`` (0-based count of
  finished steps, as DeepSpeed's ``global_steps``) to the end of step ``end_profile_step``;
  the device is synchronised at both ends. Like DeepSpeed, the process exits after that step.
* metrics.json (rank 0): ``throughput`` (samples/s over the global batch), ``latency``
  (seconds per optimizer step), ``flops`` (FLOPS per device, 6 x parameters x tokens, 8 x
  with recompute; null when the tokens per sample are unknown), ``peak_memory`` (bytes,
  the device's peak allocation; the process's peak RSS on a CPU), the batch triple.
* ``model_info.profile``: after the first forward, write model_info.json (parameter count,
  activation bytes of that forward) and exit, as DeepSpeed's profiling run does; with a
  ``metric_path`` too, go on and time the profile steps like any trial (our autotuner's
  profiling run is then also its first experiment).
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from .config import METRIC_PATH_ENV

MODEL_INFO_PATH_ENV = "SHARDWISE_AUTOTUNING_MODEL_INFO_PATH"


def make_probe(config: Any) -> Optional["EngineProbe"]:
    """The probe for a trial run by the autotuner, else None (a normal run pays nothing)."""
    at = getattr(config, "autotuning", None)
    if at is None or not at.enabled:
        return None
    metric_path = at.metric_path or os.environ.get(METRIC_PATH_ENV)
    info_path = None
    if at.profile_model_info:
        info_path = Path(at.model_info_path or os.environ.get(MODEL_INFO_PATH_ENV)
                         or "autotuning_model_info.json")
    if not metric_path and info_path is None:
        return None
    return EngineProbe(Path(metric_path) if metric_path else None, at.start_profile_step,
                       at.end_profile_step, info_path)


def _peak_memory() -> int:
    from ..accelerator import get_accelerator
    accel = get_accelerator()
    if accel.kind != "cpu":
        return int(accel.max_memory_allocated())
    try:
        import psutil
        info = psutil.Process().memory_info()
        return int(getattr(info, "peak_wset", 0) or info.rss)
    except ImportError:  # pragma: no cover - psutil is a dependency
        return 0


def _allocated() -> int:
    from ..accelerator import get_accelerator
    accel = get_accelerator()
    return int(accel.memory_allocated()) if accel.kind != "cpu" else 0


def _sync() -> None:
    from ..accelerator import get_accelerator
    get_accelerator().synchronize()


def _tokens_per_sample(args: tuple, kwargs: Dict[str, Any]) -> Optional[int]:
    """Sequence length of the first integer tensor input (input_ids), else None."""
    values = list(kwargs.values()) + list(args)
    for value in values:
        if torch.is_tensor(value) and not value.is_floating_point() and value.dim() == 2:
            return int(value.shape[1])
    return None


@dataclass
class EngineProbe:
    """Times one trial's profile window and writes its result file."""

    path: Optional[Path]
    """metrics.json; None: a profiling run that exits once model_info.json is written."""
    start_step: int
    end_step: int
    info_path: Optional[Path] = None
    """model_info.json, written after the first forward (DeepSpeed's model_info.profile)."""
    _t0: Optional[float] = None
    _tokens: Optional[int] = None
    _mem_before: int = 0

    def on_forward(self, engine: Any, args: tuple, kwargs: Dict[str, Any]) -> None:
        """Before a forward: start the clock at the first forward of step ``start_step``."""
        if self._tokens is None:
            self._tokens = _tokens_per_sample(args, kwargs)
            if self.info_path is not None:  # the profiling run measures its very first forward
                _sync()
                self._mem_before = _allocated()
        if self._t0 is None and engine.global_steps == self.start_step:
            _sync()
            self._t0 = time.perf_counter()

    def after_forward(self, engine: Any) -> None:
        """After the first forward of a profiling run: write model_info.json; exit unless
        this run is also timed."""
        if self.info_path is None:
            return
        _sync()
        params = list(engine.module.parameters())
        info = {"num_params": sum(map(full_numel, params)),
                "trainable_num_params": sum(full_numel(p) for p in params if p.requires_grad),
                "activation_mem_per_gpu": max(_allocated() - self._mem_before, 0),
                "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
                "tokens_per_sample": self._tokens, "shape": _shape_of(engine.module)}
        self._write(engine, self.info_path, info)
        self.info_path = None
        if self.path is None:
            _exit()

    def after_step(self, engine: Any) -> None:
        """After ``step()``: at the end of step ``end_step`` write the metrics and exit."""
        if self.path is None:
            return
        if engine.global_steps != self.end_step + 1 or self._t0 is None:
            return
        _sync()
        elapsed = time.perf_counter() - self._t0
        steps = self.end_step - self.start_step + 1
        latency = elapsed / steps
        batch = engine.train_batch_size()
        params = sum(map(full_numel, engine.module.parameters()))
        flops = None
        if self._tokens is not None:
            recompute = getattr(getattr(engine.config, "activation_checkpointing", None), "modules", None)
            per_token = (8 if recompute else 6) * params
            flops = per_token * self._tokens * batch / engine.world_size / latency
        self._write(engine, self.path, {
            "throughput": batch / latency, "latency": latency, "flops": flops,
            "peak_memory": _peak_memory(), "tokens_per_sample": self._tokens,
            "train_batch_size": batch, "train_micro_batch_size_per_gpu":
            engine.train_micro_batch_size_per_gpu(), "gradient_accumulation_steps":
            engine.gradient_accumulation_steps(), "profiled_steps": steps, "num_params": params})
        _exit()

    @staticmethod
    def _write(engine: Any, path: Path, data: Dict[str, Any]) -> None:
        if engine.global_rank != 0:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
        os.replace(tmp, path)
        print(f"autotuning: wrote {path}", flush=True)


def full_numel(p: torch.Tensor) -> int:
    """Elements of the whole parameter, also while ZeRO-3 holds only a shard of it."""
    from ..zero.stage3.partition import full_numel
    return full_numel(p)


def _shape_of(module: torch.nn.Module) -> Dict[str, Any]:
    """The transformer shape the memory estimator understands, and the largest module's
    parameter count (what ZeRO-3 gathers at once)."""
    largest = max((sum(full_numel(p) for p in m.parameters(recurse=False)) for m in module.modules()),
                  default=0)
    config = getattr(module, "config", None)
    if config is None:
        return {"largest_layer_params": largest}
    from ..profiling.memory_estimator import _config_shape
    return {**_config_shape(config), "largest_layer_params": largest}


def _exit() -> None:
    """Leave the trial cleanly: flush, close the process group, exit 0 (DeepSpeed exits too)."""
    from .. import comm
    sys.stdout.flush()
    sys.stderr.flush()
    if comm.is_initialized():
        comm.barrier()
        comm.destroy_process_group()
    sys.exit(0)
