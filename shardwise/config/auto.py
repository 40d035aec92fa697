"""The rules for DeepSpeed's (and Hugging Face's) ``"auto"`` values.

The key walker removes every "auto" at load time and records its dotted path, so after
``load_config`` each field already holds a usable value (its default, or the derived batch
size). ``resolve_auto`` then refines the paths that depend on the model or the optimizer:

=========================================  ==============================================
``zero_optimization.reduce_bucket_size``   hidden_size ** 2
``zero_optimization.prefetch_bucket_size`` int(0.9 * hidden_size ** 2)
``..param_persistence_threshold``          10 * hidden_size
``optimizer.params.lr``                    ``optimizer_lr`` (else dropped: optimizer default)
``scheduler.params.warmup_max_lr``,        the optimizer's lr when known (else dropped:
``scheduler.params.cycle_max_lr``          the scheduler's default)
any other optimizer/scheduler param        dropped: the class default applies
batch keys                                 derived like missing keys (see ``batch.py``)
``fp16/bf16.enabled``                      False;  ``gradient_clipping``: 0.0 (off)
anything else                              the field's default
=========================================  ==============================================
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

from shardwise.errors import ConfigError

if TYPE_CHECKING:
    from .shardwise_config import ShardwiseConfig

#: zero_optimization keys derived from the model's hidden size, as HF's integration does.
HIDDEN_SIZE_RULES = {
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.param_persistence_threshold": lambda h: 10 * h,
}
#: scheduler params that mean "the peak learning rate", filled from the optimizer's lr.
PEAK_LR_PARAMS = ("warmup_max_lr", "cycle_max_lr")


def _numeric_lr(params: Dict[str, Any]) -> Optional[float]:
    lr = params.get("lr")
    return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None


def fill_peak_lr(cfg: "ShardwiseConfig", fallback_lr: Optional[float] = None) -> None:
    """Set "auto" peak-lr scheduler params from the optimizer's numeric lr (or ``fallback_lr``,
    the lr of a client optimizer), when one is known."""
    if cfg.scheduler is None:
        return
    lr = _numeric_lr(cfg.optimizer.params) if cfg.optimizer is not None else None
    lr = lr if lr is not None else fallback_lr
    if lr is None:
        return
    for name in PEAK_LR_PARAMS:
        if f"scheduler.params.{name}" in cfg.auto_fields:
            cfg.scheduler.params[name] = lr


def resolve_auto(cfg: "ShardwiseConfig", hidden_size: Optional[int] = None,
                 optimizer_lr: Optional[float] = None) -> "ShardwiseConfig":
    """Refine the "auto" fields of ``cfg`` in place from the model's hidden size and the lr."""
    if hidden_size is not None:
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ConfigError(f"resolve_auto(hidden_size={hidden_size!r}): hidden_size must be a "
                              f"positive int (the model's hidden dimension, e.g. 768).")
        for path, rule in HIDDEN_SIZE_RULES.items():
            if path in cfg.auto_fields:
                setattr(cfg.zero_optimization, path.rsplit(".", 1)[-1], rule(hidden_size))
    if optimizer_lr is not None:
        if isinstance(optimizer_lr, bool) or not isinstance(optimizer_lr, (int, float)) or optimizer_lr < 0:
            raise ConfigError(f"resolve_auto(optimizer_lr={optimizer_lr!r}): optimizer_lr must be a "
                              f"non-negative number, e.g. 5e-5.")
        if cfg.optimizer is not None and "optimizer.params.lr" in cfg.auto_fields:
            cfg.optimizer.params["lr"] = float(optimizer_lr)
    fill_peak_lr(cfg, None if optimizer_lr is None else float(optimizer_lr))
    return cfg
