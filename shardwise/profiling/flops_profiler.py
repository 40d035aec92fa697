"""DeepSpeed's flops profiler on PyTorch's own flop counter.

``FlopsProfiler`` measures, per module of a model, the parameters, the forward pass's
multiply-accumulates (MACs) and floating-point operations, and the forward latency.
Operations are counted by ``torch.utils.flop_counter.FlopCounterMode`` (a dispatch mode,
so it sees SDPA, fused kernels and anything a module calls) with the rules of
``flop_rules.py`` added; each module's share comes from forward pre/post hooks that read the
counter before and after the module runs, and time it (synchronising the accelerator, as
DeepSpeed does, only while profiling).

``get_model_profile`` is the one-call entry (DeepSpeed's signature and return tuple); the
engine drives a ``FlopsProfiler`` from the ``flops_profiler`` config section
(``engine_profile.py``). The report text lives in ``flops_report.py``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..accelerator import get_accelerator
from ..errors import ShardwiseError
from ..utils.logging import logger
from . import flop_rules
from .flops_report import (ProfileTimes, macs_to_string, number_to_string, params_to_string,
                           duration_to_string, render_profile)

__all__ = ["FlopsProfiler", "get_model_profile", "number_to_string", "macs_to_string",
           "params_to_string", "duration_to_string"]


@dataclass
class ModuleProfile:
    """What one module measured while profiling (its submodules included)."""

    params: int = 0
    """Parameters of the module and its submodules (full size under ZeRO-3)."""
    flops_by_op: Dict[Any, int] = field(default_factory=dict)
    """FLOPs counted while the module's forward ran, per aten op."""
    duration: float = 0.0
    """Seconds spent in the module's forward (all calls)."""
    calls: int = 0
    """Forward calls seen."""


def param_numel(p: torch.Tensor) -> int:
    """Elements of a parameter; a ZeRO-3 partitioned one counts its full size (its ``.data``
    is empty between uses), as "params per GPU" means the model's, not the shard's."""
    meta = getattr(p, "sw_meta", None)
    return int(meta.numel) if meta is not None and hasattr(meta, "numel") else int(p.numel())


class FlopsProfiler:
    """Profile the forward passes of ``model`` between ``start_profile`` and ``stop_profile``.

    ``ds_engine`` (an engine, optional) adds the world, batch and step figures to the report;
    ``recompute_fwd_factor`` is the share of the forward recomputed in backward by
    activation checkpointing (0.0 none, 1.0 all), used for the fwd+bwd FLOPS estimate.
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None,
                 recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.started = False
        self._counter: Optional[FlopCounterMode] = None
        self._profiles: Dict[nn.Module, ModuleProfile] = {}
        self._open: Dict[nn.Module, List[Tuple[Dict[Any, int], float]]] = {}
        self._handles: List[Any] = []
        self._mac_ops: FrozenSet[Any] = flop_rules.mac_ops()
        self._sync = get_accelerator().synchronize

    # --- lifecycle -------------------------------------------------------------------------
    def start_profile(self, ignore_list: Optional[Sequence[type]] = None) -> None:
        """Reset the counts and start counting every forward of the model.

        Modules whose type is in ``ignore_list`` get no profile of their own (their work
        counts toward their parent), as in DeepSpeed.
        """
        if self._counter is not None:
            self.stop_profile()
        self.reset_profile()
        ignored = tuple(ignore_list or ())
        for module in self.model.modules():
            if ignored and isinstance(module, ignored) and module is not self.model:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_hook))
            self._handles.append(module.register_forward_hook(self._post_hook, always_call=True))
        self._counter = FlopCounterMode(display=False, custom_mapping=flop_rules.custom_mapping())
        self._counter.__enter__()
        self.started = True
        logger.debug("Flops profiler started")

    def stop_profile(self) -> None:
        """Stop counting; the measured profile stays readable until ``end_profile``."""
        if self._counter is not None:
            counter, self._counter = self._counter, None
            counter.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._open.clear()

    def reset_profile(self) -> None:
        """Zero every module's counts and latency (and re-read the parameter counts)."""
        self._profiles = {m: ModuleProfile(params=self._module_params(m))
                          for m in self.model.modules()}
        self._open.clear()
        if self._counter is not None:
            self._counter.flop_counts.clear()

    def end_profile(self) -> None:
        """Stop profiling and drop the measurements."""
        if not self.started:
            return
        self.stop_profile()
        self._profiles = {}
        self.started = False
        logger.debug("Flops profiler finished")

    # --- hooks -----------------------------------------------------------------------------
    def _global_counts(self) -> Dict[Any, int]:
        counter = self._counter
        return dict(counter.flop_counts.get("Global", {})) if counter is not None else {}

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        self._sync()
        self._open.setdefault(module, []).append((self._global_counts(), time.perf_counter()))

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._open.get(module)
        if not stack:
            return
        before, t0 = stack.pop()
        self._sync()
        elapsed = time.perf_counter() - t0
        prof = self._profiles.setdefault(module, ModuleProfile(params=self._module_params(module)))
        for op, count in self._global_counts().items():
            delta = count - before.get(op, 0)
            if delta:
                prof.flops_by_op[op] = prof.flops_by_op.get(op, 0) + delta
        prof.duration += elapsed
        prof.calls += 1

    @staticmethod
    def _module_params(module: nn.Module) -> int:
        return sum(param_numel(p) for p in module.parameters())

    # --- per-module queries ----------------------------------------------------------------
    def module_profile(self, module: nn.Module) -> ModuleProfile:
        """The raw profile of ``module`` (an empty one if it was never seen)."""
        return self._profiles.get(module) or ModuleProfile(params=self._module_params(module))

    def module_flops_macs(self, module: nn.Module) -> Tuple[int, int]:
        """(FLOPs, MACs) of one module; a container never called itself (a ModuleList) sums
        its children, as DeepSpeed's totals do."""
        prof = self._profiles.get(module)
        if prof is not None and prof.calls:
            return flop_rules.split_counts(prof.flops_by_op, self._mac_ops)
        flops = macs = 0
        for child in module.children():
            f, m = self.module_flops_macs(child)
            flops, macs = flops + f, macs + m
        return flops, macs

    def module_duration(self, module: nn.Module) -> float:
        """Forward seconds of one module (a never-called container: the sum of its children)."""
        prof = self._profiles.get(module)
        if prof is not None and prof.calls:
            return prof.duration
        return sum(self.module_duration(child) for child in module.children())

    # --- totals (DeepSpeed's getters) ------------------------------------------------------
    def get_total_flops(self, as_string: bool = False) -> Any:
        """Forward FLOPs of the model (all profiled forward passes)."""
        flops = self.module_flops_macs(self.model)[0]
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> Any:
        """Forward multiply-accumulates of the model."""
        macs = self.module_flops_macs(self.model)[1]
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> Any:
        """Forward latency of the model in seconds."""
        duration = self.module_duration(self.model)
        return duration_to_string(duration) if as_string else duration

    def get_total_params(self, as_string: bool = False) -> Any:
        """Parameters of the model (per model-parallel rank: all of them here)."""
        params = self.module_profile(self.model).params
        return params_to_string(params) if as_string else params

    # --- report ----------------------------------------------------------------------------
    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1,
                            top_modules: int = 1, detailed: bool = True,
                            output_file: Optional[str] = None,
                            times: Optional[ProfileTimes] = None) -> Optional[str]:
        """Print DeepSpeed's profile report (to ``output_file`` when given); returns the text.

        ``times`` carries the engine-measured backward/step latencies, when known.
        """
        if not self.started:
            return None
        text = render_profile(self, profile_step=profile_step, module_depth=module_depth,
                              top_modules=top_modules, detailed=detailed, times=times)
        if output_file:
            path = Path(output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        else:
            print(text, flush=True)
        return text

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print the top modules by params, MACs and latency at each depth."""
        from .flops_report import render_aggregated
        print(render_aggregated(self, module_depth=module_depth, top_modules=top_modules))


def _make_input(model: nn.Module, input_shape: Any) -> torch.Tensor:
    if not isinstance(input_shape, tuple) or len(input_shape) < 1:
        raise ShardwiseError(f"get_model_profile: input_shape must be a non-empty tuple such as "
                             f"(batch, features), got {input_shape!r}")
    first = next(model.parameters(), None)
    if first is None:
        return torch.ones(input_shape)
    return torch.ones(input_shape, dtype=first.dtype, device=first.device)


def _run(model: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any], mode: str) -> Any:
    fn = model.generate if mode == "generate" else model
    return fn(*args, **kwargs)


def get_model_profile(model: nn.Module, input_shape: Optional[tuple] = None,
                      args: Sequence[Any] = [], kwargs: Dict[str, Any] = {},  # noqa: B006 (DeepSpeed's signature)
                      print_profile: bool = True, detailed: bool = True, module_depth: int = -1,
                      top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: Optional[str] = None,
                      ignore_modules: Optional[Sequence[type]] = None,
                      mode: str = "forward") -> Tuple[Any, Any, Any]:
    """Profile one forward pass of ``model``; returns ``(flops, macs, params)``.

    The model is called as ``model(*args, **kwargs)`` (or with one tensor of ``input_shape``
    in the parameters' dtype and device), ``warm_up`` times unprofiled and once profiled, in
    eval mode and without autograd; its train/eval mode is restored afterwards. With
    ``as_string`` the numbers come back as DeepSpeed's strings ("1.2 GMACs"). ``mode=
    "generate"`` profiles ``model.generate`` instead of the forward.
    """
    if not isinstance(model, nn.Module):
        raise ShardwiseError(f"get_model_profile: model must be a torch.nn.Module, "
                             f"got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ShardwiseError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    if input_shape is not None:
        args = [_make_input(model, input_shape)]
    if not args and not kwargs:
        raise ShardwiseError("get_model_profile: give the model's inputs: input_shape=(...), "
                             "args=[...] or kwargs={...}")
    was_training = model.training
    model.eval()
    prof = FlopsProfiler(model)
    try:
        with torch.no_grad():
            for _ in range(int(warm_up)):
                _run(model, args, kwargs, mode)
            prof.start_profile(ignore_list=ignore_modules)
            _run(model, args, kwargs, mode)
            prof.stop_profile()
        flops, macs, params = (prof.get_total_flops(), prof.get_total_macs(),
                               prof.get_total_params())
        if print_profile:
            prof.print_model_profile(profile_step=warm_up, module_depth=module_depth,
                                     top_modules=top_modules, detailed=detailed,
                                     output_file=output_file)
    finally:
        prof.end_profile()
        model.train(was_training)
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
