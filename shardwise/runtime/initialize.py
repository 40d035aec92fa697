"""``shardwise.initialize``: DeepSpeed's entry point, argument for argument."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..accelerator import get_accelerator
from ..comm import get_local_rank, init_distributed
from ..comm.topology import Topology
from ..config import ShardwiseConfig, load_config
from ..errors import ConfigError
from ..utils.logging import log_dist, logger
from .dataloader import ShardwiseDataLoader
from .engine import ShardwiseEngine

# the script-side flags (--deepspeed_config, the seed's --windows_optimization ...) live with
# the launcher, which gives them their meaning
from ..launcher.script_args import add_config_arguments, apply_script_args


def _model_parameters(model: torch.nn.Module, model_parameters: Any) -> List[Any]:
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if not params:
        raise ConfigError("initialize(): the optimizer was given no parameters (model_parameters "
                          "is empty and the model has none); pass model_parameters="
                          "model.parameters() or a list of param-group dicts")
    return params


def _build_optimizer(optimizer: Any, cfg: ShardwiseConfig, params: List[Any],
                     device: torch.device) -> Optional[torch.optim.Optimizer]:
    if isinstance(optimizer, torch.optim.Optimizer):
        if cfg.optimizer is not None:
            raise ConfigError("initialize(): an optimizer object was passed and the config has an "
                              f"\"optimizer\" section (type {cfg.optimizer.type!r}); keep one of them")
        return optimizer
    if callable(optimizer):
        built = optimizer(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise ConfigError(f"initialize(): the optimizer callable returned {type(built).__name__}, "
                              "expected a torch.optim.Optimizer")
        return built
    if optimizer is not None:
        raise ConfigError(f"initialize(): optimizer must be a torch.optim.Optimizer or a callable "
                          f"taking the parameters, got {type(optimizer).__name__}")
    if cfg.optimizer is None:
        return None
    from ..optim import build_optimizer
    return build_optimizer(cfg.optimizer.type, params, dict(cfg.optimizer.params),
                           device_type=device.type)


def _build_scheduler(lr_scheduler: Any, cfg: ShardwiseConfig, optimizer: Optional[torch.optim.Optimizer]):
    if lr_scheduler is not None and hasattr(lr_scheduler, "step"):
        return lr_scheduler  # a scheduler object (built on the client optimizer, whose groups we keep)
    if optimizer is None:
        return None
    if lr_scheduler is not None:
        if not callable(lr_scheduler):
            raise ConfigError(f"initialize(): lr_scheduler must be a scheduler object or a callable "
                              f"taking the optimizer, got {type(lr_scheduler).__name__}")
        return lr_scheduler(optimizer)
    if cfg.scheduler is None:
        return None
    from ..optim import build_scheduler
    return build_scheduler(cfg.scheduler.type, optimizer, dict(cfg.scheduler.params))


def _hidden_size(model: torch.nn.Module) -> Optional[int]:
    conf = getattr(model, "config", None)
    return getattr(conf, "hidden_size", None) or getattr(conf, "d_model", None)


def _named_groups(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]):
    """Per optimizer group, its trainable (name, param) pairs; and the frozen remainder."""
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(p, name)
    groups, seen = [], set()
    if optimizer is not None:
        for gi, group in enumerate(optimizer.param_groups):
            named = []
            for p in group["params"]:
                if p not in names:
                    raise ConfigError(f"initialize(): optimizer param group {gi} holds a tensor of "
                                      f"shape {tuple(p.shape)} that is not a parameter of the model")
                if p.requires_grad and p not in seen:
                    named.append((names[p], p))
                    seen.add(p)
            groups.append(named)
    frozen = [(n, p) for p, n in names.items() if p not in seen]
    return groups, frozen


def _grad_accum_dtype(cfg: ShardwiseConfig) -> torch.dtype:
    """fp32 accumulation by default (exact across micro steps); ``data_types.grad_accum_dtype``
    may pick the compute dtype to save device memory."""
    from ..config.base import torch_dtype_of
    return torch_dtype_of(cfg.data_types.grad_accum_dtype) or torch.float32


def _build_strategy(cfg: ShardwiseConfig, model: torch.nn.Module, groups, frozen,
                    device: torch.device, dp_group):
    zero = cfg.zero_optimization
    _check_nvme_optimizer(zero)
    if zero.stage == 3:
        from ..zero.stage3 import Stage3Strategy
        return Stage3Strategy(config=cfg, module=model, param_groups=groups, frozen=frozen,
                              group=dp_group, device=device)
    offload = zero.offload_optimizer_device
    oo = zero.offload_optimizer if offload != "none" else None
    if oo is not None and getattr(oo, "delayed_update", False) and float(getattr(oo, "ratio", 1.0)) < 1.0:
        raise ConfigError(f"zero_optimization.offload_optimizer: delayed_update needs ratio 1.0 "
                          f"(got ratio {oo.ratio}); the delayed update applies to the whole optimizer")
    if offload in ("cpu", "nvme") and zero.stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer needs stage >= 1 (got stage 0); set "
                          "\"stage\": 1 or 2")
    from ..zero.data_parallel import DataParallelStrategy
    return DataParallelStrategy(
        stage=zero.stage, param_groups=groups, group=dp_group, device=device,
        compute_dtype=cfg.compute_dtype if not cfg.torch_autocast.enabled else torch.float32,
        # offloaded buckets are also the unit of the CPU step that overlaps backward: keep
        # them small enough for the overlap to start early
        bucket_elems=int(min(zero.reduce_bucket_size, 50_000_000) if oo is not None
                         else zero.reduce_bucket_size),
        overlap_comm=bool(zero.overlap_comm),
        comm_dtype=cfg.communication_dtype, predivide=float(cfg.gradient_predivide_factor),
        offload_device=torch.device("cpu") if offload in ("cpu", "nvme") else None,
        nvme_config=cfg if offload == "nvme" else None,
        pin_memory=bool(oo and oo.pin_memory), offload_ratio=float(getattr(oo, "ratio", 1.0) or 1.0),
        delayed_update=bool(getattr(oo, "delayed_update", False)),
        delayed_update_warmup=int(getattr(oo, "delayed_update_warmup", 0) or 0),
        eager_offload_step=not cfg.fp16.enabled and not float(cfg.gradient_clipping or 0) > 0,
        grad_dtype=_grad_accum_dtype(cfg), frozen=frozen)


def _check_nvme_optimizer(zero) -> None:
    """``offload_optimizer.device: "nvme"``: what it cannot be combined with."""
    oo = zero.offload_optimizer
    if zero.offload_optimizer_device != "nvme":
        return
    if getattr(oo, "delayed_update", False):
        raise ConfigError("zero_optimization.offload_optimizer: delayed_update needs device \"cpu\" "
                          "(got \"nvme\": the states are streamed from the swap files at the step, "
                          "so there is no background step to delay); drop delayed_update or use "
                          "\"device\": \"cpu\"")
    if float(getattr(oo, "ratio", 1.0)) < 1.0:
        raise ConfigError(f"zero_optimization.offload_optimizer: ratio {oo.ratio} needs device "
                          "\"cpu\"; with \"nvme\" every optimizer state is offloaded (ratio 1.0)")


def initialize(args: Any = None, model: Optional[torch.nn.Module] = None,
               optimizer: Optional[Union[torch.optim.Optimizer, Callable]] = None,
               model_parameters: Optional[Iterable[Any]] = None, training_data: Any = None,
               lr_scheduler: Any = None, mpu: Any = None, dist_init_required: Optional[bool] = None,
               collate_fn: Optional[Callable] = None, config: Any = None,
               config_params: Any = None) -> Tuple[ShardwiseEngine, Any, Any, Any]:
    """Wrap ``model`` for training; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    Arguments and semantics follow ``deepspeed.initialize``. ``optimizer`` and
    ``lr_scheduler`` may be objects or callables (called with the parameters / the
    optimizer); ``training_data`` gives a data-parallel loader of micro batches.
    """
    if model is None:
        raise ConfigError("initialize(): model is required (got None)")
    if mpu is not None:
        raise ConfigError("initialize(): mpu (model parallelism) is not supported; shardwise "
                          "is data-parallel (ZeRO) only — pass mpu=None")
    init_distributed(dist_init_required=dist_init_required)
    topology = Topology.data_parallel()
    dp_group = topology.dp_group
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    effects = apply_script_args(args) if args is not None else None
    cfg = load_config(config, args=args, config_params=config_params, world_size=world)
    client_lr = optimizer.param_groups[0]["lr"] if isinstance(optimizer, torch.optim.Optimizer) else None
    cfg.resolve_auto(hidden_size=_hidden_size(model), optimizer_lr=client_lr)
    for note in getattr(effects, "notes", ()) or ():
        log_dist(note, ranks=[0])

    acc = get_accelerator()
    local_rank = get_local_rank()
    # more ranks than devices (several processes sharing one GPU, e.g. gloo tests): wrap around
    index = local_rank % max(acc.device_count(), 1) if acc.kind in ("cuda", "xpu") else None
    device = acc.device(index)
    if index is not None:
        acc.set_device(index)
    if cfg.fp16.enabled and not acc.is_fp16_supported():
        raise ConfigError(f"fp16.enabled is true but {acc.kind} cannot compute in fp16")
    if cfg.bf16.enabled and not acc.is_bf16_supported():
        raise ConfigError(f"bf16.enabled is true but this {acc.kind} device has no bf16 support; "
                          "use fp16 or fp32")

    params = _model_parameters(model, model_parameters)
    if cfg.zero_optimization.stage < 3:
        dtype = cfg.compute_dtype if not cfg.torch_autocast.enabled else torch.float32
        model.to(device=device, dtype=dtype)
    if cfg.fp8.enabled:  # swaps modules, keeps the Parameter objects (and so the param groups)
        _apply_fp8(cfg, model, device)
    # stage 3 with optimizer offload steps CPU masters: pick the CPU's fused kernels
    zero = cfg.zero_optimization
    opt_device = (torch.device("cpu")
                  if zero.stage == 3 and zero.offload_optimizer_device in ("cpu", "nvme") else device)
    opt = _build_optimizer(optimizer, cfg, params, opt_device)
    groups, frozen = _named_groups(model, opt)
    if opt is not None and type(opt).__name__ == "Lamb" and cfg.zero_optimization.stage >= 1 and world > 1:
        raise ConfigError("optimizer Lamb computes a trust ratio per whole tensor, which ZeRO "
                          f"stage {cfg.zero_optimization.stage} splits across {world} ranks; use "
                          "stage 0 or another optimizer")
    if opt is not None:
        strategy = _build_strategy(cfg, model, groups, frozen, device, dp_group)
    elif zero.stage == 3:
        # no optimizer (inference, ZeRO-Inference style): stage 3 still partitions the model
        # (and offloads it under offload_param) and gathers each module around its use
        from ..zero.stage3 import Stage3Params
        strategy = Stage3Params(config=cfg, module=model, group=dp_group, device=device,
                                training=False)
    else:
        strategy = None
    scaler = None
    if cfg.fp16.enabled:
        from ..precision import create_loss_scaler
        scaler = create_loss_scaler(cfg.fp16)

    engine_kwargs = dict(module=model, config=cfg, optimizer=opt, lr_scheduler=None,
                         strategy=strategy, loss_scaler=scaler, device=device, dp_group=dp_group)
    engine_cls = ShardwiseEngine
    if cfg.hybrid_engine.enabled:  # DeepSpeed's Hybrid Engine: the same engine plus generate()
        from .hybrid_engine import HybridEngine
        engine_cls = HybridEngine
    engine = engine_cls(**engine_kwargs)
    engine.lr_scheduler = _build_scheduler(lr_scheduler, cfg, engine.optimizer.inner if opt else None)
    if training_data is not None:
        engine.training_dataloader = ShardwiseDataLoader(
            training_data, batch_size=engine.train_micro_batch_size_per_gpu(), rank=rank,
            world_size=world, collate_fn=collate_fn,
            num_workers=getattr(effects, "dataloader_num_workers", None),
            pin_memory=getattr(effects, "pin_memory", None), seed=cfg.seed or 0,
            drop_last=bool(cfg.dataloader_drop_last))
    _configure_activation_checkpointing(cfg, model)
    if cfg.compile.enabled or cfg.compile.deepcompile:  # after checkpointing wrapped the blocks
        engine.compile()
    log_dist(f"shardwise engine: ZeRO stage {cfg.zero_optimization.stage}, "
             f"{str(cfg.compute_dtype).replace('torch.', '')}, world size {world}, device {device}, "
             f"micro batch {cfg.train_micro_batch_size_per_gpu} x GA "
             f"{cfg.gradient_accumulation_steps} = {cfg.train_batch_size}", ranks=[0])
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _apply_fp8(cfg: ShardwiseConfig, model: torch.nn.Module, device: torch.device) -> None:
    from ..precision.fp8 import apply_fp8
    plan = apply_fp8(model, cfg.fp8.recipe, cfg.fp8.skip_modules, device)
    log_dist(f"fp8: {len(plan.convert)} linear layers use FP8 matmuls (recipe "
             f"{cfg.fp8.recipe!r}), {len(plan.skipped)} stay in high precision", ranks=[0])


def _configure_activation_checkpointing(cfg: ShardwiseConfig, model: torch.nn.Module) -> None:
    section = cfg.activation_checkpointing
    try:
        from ..activation import configure_from_engine
    except ImportError:
        return
    plan = configure_from_engine(section, model)
    if getattr(plan, "wrapped", None):
        log_dist(f"activation checkpointing: policy {plan.policy!r} on {len(plan.wrapped)} modules",
                 ranks=[0])


__all__ = ["initialize", "add_config_arguments"]
