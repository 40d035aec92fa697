"""The training engine: forward, backward and step, the same calls on every ZeRO stage.

The engine owns the loop's bookkeeping (accumulation boundary, loss scaling, overflow
skip, global-norm clipping, scheduler, counters, logging). Everything that depends on how
parameters, gradients and optimizer states are laid out lives in a ZeRO strategy
(``shardwise.zero``), so this file never branches on the stage after construction.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional

import torch
import torch.distributed as dist

from .. import comm
from ..accelerator import get_accelerator
from ..checkpoint.contract import CheckpointableEngine, CheckpointSettings, whole_views
from ..comm.topology import group_world_rank
from ..comm import all_reduce, configure as configure_comms_logger, get_local_rank
from ..profiling.engine_profile import EngineProfile
from ..config import ShardwiseConfig
from ..errors import ConfigError, ZeroError
from ..utils.logging import log_dist
from ..zero.shard_view import ShardView
from ..zero.strategy import EngineStrategy
from ..monitor import DeviceScalar, EngineTimers, MonitorMaster
from ..monitor.throughput import FlopsModel
from .step_logger import StepInfo, StepLogger, momentum_of
from .deepspeed_compat import DeepSpeedCompatMixin
from .deepspeed_unsupported import UNSUPPORTED_ATTRIBUTES, unsupported_error
from .zero_optimizer import ZeroOptimizer


class ShardwiseEngine(DeepSpeedCompatMixin, torch.nn.Module, CheckpointableEngine):
    """DeepSpeed's ``DeepSpeedEngine`` surface over a ZeRO strategy.

    Attribute access that the engine does not define falls through to the wrapped module,
    so ``engine.generate(...)`` or ``engine.config_class`` work as they do on the model;
    DeepSpeed engine names shardwise lacks raise UnsupportedFeatureError first
    (docs/engine_api.md).
    """

    def __init__(self, *, module: torch.nn.Module, config: ShardwiseConfig,
                 optimizer: Optional[torch.optim.Optimizer], lr_scheduler: Any,
                 strategy: Optional[EngineStrategy], loss_scaler: Any, device: torch.device,
                 dp_group: Optional[dist.ProcessGroup], training_dataloader: Any = None) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.device = device
        self.dp_group = dp_group
        self.strategy = strategy
        self.optimizer = (ZeroOptimizer(optimizer, strategy, loss_scaler)
                          if optimizer is not None else None)
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.loss_scaler = loss_scaler
        self.pending_save: Any = None
        """A background checkpoint save (``checkpoint.async_save``) not finished yet."""
        self.global_rank = group_world_rank(None)[1]
        self.world_size = group_world_rank(dp_group)[0]
        self.local_rank = get_local_rank()
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._global_grad_norm: Optional[torch.Tensor] = None
        self._norm_ready: Any = None
        """Set when the norm was summed on a side stream: ``wait()`` before reading it."""
        self._in_no_sync = False
        self._autocast_dtype = (config.torch_autocast.dtype if config.torch_autocast.enabled
                                else None)
        self._compute_dtype = config.compute_dtype
        # reporting (runtime/step_logger.py, shardwise/monitor): DeepSpeed's engine.monitor
        zero = config.zero_optimization
        offloaded = zero.offload_optimizer_device != "none" or zero.offload_param_device != "none"
        self.timers = EngineTimers(bool(config.wall_clock_breakdown), get_accelerator().synchronize,
                                   offload=offloaded and strategy is not None)
        if self.timers.copies is not None:  # offload copy times (monitor/copy_timers.py)
            strategy.set_copy_timer(self.timers.copies)
        self.monitor = MonitorMaster.from_config(config, rank=self.global_rank)
        self.step_logger = StepLogger(
            steps_per_print=config.steps_per_print, samples_per_step=self.train_batch_size(),
            world_size=self.world_size, timers=self.timers, monitor=self.monitor,
            rank=self.global_rank, flops=FlopsModel.of(module), device=device)
        self._empty_cache_after_step = bool(getattr(config, "empty_cache_after_step", False))
        self._init_deepspeed_compat()
        configure_comms_logger(config)  # the comms_logger section (shardwise/comm)
        self._profile = EngineProfile(self)  # the flops_profiler section (shardwise/profiling)
        self.flops_profiler = self._profile.profiler  # DeepSpeed's attribute (None when off)
        from ..autotuning.engine_probe import make_probe
        self._autotuning_probe = make_probe(config)  # None unless the autotuner runs this

    # --- attribute fall-through ------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in UNSUPPORTED_ATTRIBUTES:  # a DeepSpeed name: never the module's namesake
                raise unsupported_error(name, call=False) from None
            module = super().__getattr__("module")
            return getattr(module, name)

    # --- batch geometry ----------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return int(self.config.train_batch_size)

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self.config.train_micro_batch_size_per_gpu)

    def gradient_accumulation_steps(self) -> int:
        return int(self.config.gradient_accumulation_steps)

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:  # set_gradient_accumulation_boundary()
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def zero_optimization_stage(self) -> int:
        return int(self.config.zero_optimization.stage)

    # --- forward -------------------------------------------------------------------------------
    def _cast_inputs(self, value: Any) -> Any:
        if torch.is_tensor(value):
            if value.is_floating_point() and self._compute_dtype != torch.float32:
                value = value.to(self._compute_dtype)
            return value.to(self.device, non_blocking=True)
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast_inputs(v) for v in value)
        if isinstance(value, dict):
            return {k: self._cast_inputs(v) for k, v in value.items()}
        return value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._cast_inputs(args), self._cast_inputs(kwargs)
        if self._autotuning_probe is not None:
            self._autotuning_probe.on_forward(self, args, kwargs)
        self.step_logger.record_batch(args, kwargs)
        self.timers.start("fwd")
        ctx = (torch.autocast(device_type=self.device.type, dtype=self._autocast_dtype)
               if self._autocast_dtype is not None else contextlib.nullcontext())
        with ctx, self._profile.forward():
            out = self.module(*args, **kwargs)
        self.timers.stop("fwd")
        if self._autotuning_probe is not None:
            self._autotuning_probe.after_forward(self)
        return out

    # --- backward ------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Scale the loss (1/GA and the fp16 loss scale) and run backward.

        Gradients accumulate locally; on the accumulation boundary the strategy reduces them,
        overlapping the rest of backward where the stage allows it.
        """
        if self.optimizer is None:
            raise ConfigError("engine.backward() needs an optimizer: pass optimizer= to "
                              "initialize() or add an \"optimizer\" section to the config")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(f"engine.backward() takes a scalar loss tensor, got "
                             f"{type(loss).__name__} of shape {getattr(loss, 'shape', None)}")
        self.step_logger.record_loss(loss)
        boundary = self.is_gradient_accumulation_boundary() and not self._in_no_sync
        scaled = loss.float()
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            scaled = scaled / self.gradient_accumulation_steps()
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.cur_scale
        self.timers.start("bwd")
        self.strategy.before_backward(boundary)
        self.timers.start("bwd_inner")
        scaled.backward(retain_graph=retain_graph)
        self.timers.stop("bwd_inner")
        self.timers.start("bwd_allreduce")
        self.strategy.after_backward(boundary)
        self.timers.stop("bwd_allreduce")
        self.timers.stop("bwd")
        return loss

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (stages 0 and 1 only, as in DeepSpeed);
        ``engine.step()`` is not allowed inside."""
        reason = self.strategy.no_sync_allowed() if self.strategy is not None else None
        if reason:
            raise ZeroError(reason)
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    # --- step ----------------------------------------------------------------------------------
    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """Count the micro step; on the accumulation boundary update the parameters."""
        if self._in_no_sync:
            raise ZeroError("engine.step() was called inside engine.no_sync(); leave the "
                            "context first (DeepSpeed forbids this too)")
        if self.optimizer is None:
            raise ConfigError("engine.step() needs an optimizer: pass optimizer= to "
                              "initialize() or add an \"optimizer\" section to the config")
        boundary = self.is_gradient_accumulation_boundary()
        self._step_applied = False
        self._profile.step_begin()
        if boundary:
            self.timers.start("step")
            self._take_optimizer_step(lr_kwargs)
            self.timers.stop("step")
            self.global_samples += self.train_batch_size()
            self.step_logger.on_step(self._step_info())
        self.micro_steps += 1
        self._profile.step_end(boundary)
        if boundary and self._autotuning_probe is not None:
            self._autotuning_probe.after_step(self)

    def _step_info(self) -> StepInfo:
        """What the step logger and the monitors report after an optimizer step."""
        norm = self._global_grad_norm
        return StepInfo(
            global_steps=self.global_steps, global_samples=self.global_samples,
            micro_steps=self.micro_steps + 1, lrs=self.get_lr(),
            moms=momentum_of(self.optimizer.param_groups),
            loss_scale=self.loss_scaler.cur_scale if self.loss_scaler is not None else None,
            skipped=self.skipped_steps,
            grad_norm=DeviceScalar(norm, self._norm_ready) if norm is not None else None)

    def _take_optimizer_step(self, lr_kwargs: Optional[dict]) -> None:
        grads = self.strategy.master_grads()
        if self.loss_scaler is not None and self._overflow(grads):
            self.strategy.zero_grads()
            self.loss_scaler.update_scale(True)
            self.skipped_steps += 1
            self.global_steps += 1
            self._global_grad_norm = None
            log_dist(f"step {self.global_steps}: gradient overflow, step skipped; loss scale "
                     f"now {self.loss_scaler.cur_scale:g}", ranks=[0])
            return
        factor = self._grad_factor(grads)
        self.strategy.optimizer_step(self.optimizer.inner, factor)
        self.strategy.after_step(True)
        self.strategy.zero_grads()
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.global_steps += 1
        self._step_applied = True
        if self._empty_cache_after_step:
            get_accelerator().empty_cache()

    def _overflow(self, grads: List[torch.Tensor]) -> bool:
        flags = [torch.logical_not(torch.isfinite(g).all()) for g in grads if g.numel()]
        flag = (torch.stack(flags).any().float() if flags else torch.zeros((), device=self.device))
        flag = flag.to(self.device)
        if self.world_size > 1:
            all_reduce(flag, op=dist.ReduceOp.MAX, group=self.dp_group)
        return bool(flag.item())

    def _grad_factor(self, grads: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """The one multiply that turns reduced sums into the update's gradients:
        1/(DP divisor × loss scale), times the clip coefficient (None: nothing to do).
        Also records the global norm; no host sync happens here."""
        inv = 1.0 / self.strategy.grad_divisor
        if self.loss_scaler is not None:
            inv /= self.loss_scaler.cur_scale
        clip = float(self.config.gradient_clipping or 0.0)
        # a norm the step does not depend on is only reported: the strategy may sum it on a
        # side stream, off the path of the next window's kernels
        side = (self.strategy.side_norm_stream()
                if clip <= 0 and self.loss_scaler is None else None)
        norms = [n.to(self.device) for n in self.strategy.grad_norms(grads, in_order=side is None)]
        with side if side is not None else contextlib.nullcontext() as ready:
            if ready is not None:
                ready.keep(norms)
            sumsq = (torch.stack(norms).square().sum() if norms
                     else torch.zeros((), device=self.device))
            if self.strategy.grads_partitioned and self.world_size > 1:
                all_reduce(sumsq, group=self.dp_group)
            norm = sumsq.sqrt() * inv
        self._global_grad_norm = norm
        self._norm_ready = ready
        if clip > 0:
            return inv * torch.clamp(clip / (norm + 1e-6), max=1.0)
        if inv != 1.0:
            return torch.tensor(inv, device=self.device)
        return None

    # --- counters and queries ----------------------------------------------------------------------
    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_global_grad_norm(self) -> Optional[float]:
        if self._global_grad_norm is None:
            return None
        if self._norm_ready is not None:
            self._norm_ready.wait()  # summed on a side stream (see _grad_factor)
        return float(self._global_grad_norm)

    def get_lr(self) -> List[float]:
        if self.optimizer is None:
            return []
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_loss_scale(self) -> float:
        return self.optimizer.cur_scale if self.optimizer is not None else 1.0

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.strategy.zero_grads()

    def train(self, mode: bool = True) -> "ShardwiseEngine":
        self.module.train(mode)
        self.training = mode
        return self

    def eval(self) -> "ShardwiseEngine":
        return self.train(False)

    # --- torch.compile (runtime/compile.py) ------------------------------------------------------
    def compile(self, backend: Any = None, compile_kwargs: Optional[dict] = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False,
                granularity: Optional[str] = None) -> None:
        """DeepSpeed's ``engine.compile()``: ``torch.compile`` the module in place; arguments left
        None come from the config's ``compile`` section (backend, kwargs, granularity)."""
        from .compile import compile_engine
        compile_engine(self, backend=backend, compile_kwargs=compile_kwargs, schedule=schedule,
                       compiled_autograd_enabled=compiled_autograd_enabled, granularity=granularity)

    @property
    def is_compiled(self) -> bool:
        """True once ``compile()`` (or ``"compile": {"enabled": true}``) compiled something."""
        result = self.__dict__.get("_compile_result")
        return bool(result is not None and result.is_compiled)

    # --- checkpoint contract --------------------------------------------------------------------
    def checkpoint_settings(self) -> CheckpointSettings:
        return CheckpointSettings.of(self.config)

    def shard_views(self) -> List[ShardView]:
        if self.strategy is None:  # no optimizer: every parameter whole, owned by rank 0
            return whole_views(self.module, self.global_rank)
        return self.strategy.shard_views()

    def refresh_after_load(self, weights_only: bool = False) -> None:
        if self.strategy is not None:
            self.strategy.refresh_after_load(weights_only)
        elif comm.is_initialized() and self.world_size > 1:  # rank 0 read the whole weights
            for p in self.module.parameters():
                comm.broadcast(p.data, src=0, group=self.dp_group)

    def save_checkpoint(self, save_dir: Any, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        from ..checkpoint.engine_io import save_checkpoint
        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state or {},
                               save_latest=save_latest,
                               exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: Any, tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, **kwargs: Any):
        from ..checkpoint.engine_io import load_checkpoint
        return load_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states,
                               load_module_only=load_module_only, **kwargs)

    def save_16bit_model(self, save_dir: Any, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        from ..checkpoint.engine_io import save_16bit_model
        return save_16bit_model(self, save_dir, save_filename=save_filename,
                                exclude_frozen_parameters=exclude_frozen_parameters)

    def destroy(self) -> None:
        """Finish background work (a pending async checkpoint, a delayed update) and remove the
        engine's hooks from the module (DeepSpeed's ``engine.destroy()``)."""
        from ..checkpoint.async_save import wait_pending
        wait_pending(self)
        self.monitor.close()
        if self.strategy is not None:
            self.strategy.flush()
            self.strategy.remove_hooks()  # and its offload worker threads

    def __repr__(self) -> str:
        return (f"ShardwiseEngine(stage={self.zero_optimization_stage()}, dtype="
                f"{self._compute_dtype}, world_size={self.world_size}, device={self.device})")
