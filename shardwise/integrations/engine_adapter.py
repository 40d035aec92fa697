"""``deepspeed.initialize`` under the alias, and the engine methods Hugging Face calls.

``initialize`` is ``shardwise.initialize``; the engine it returns is re-classed to
:class:`HfEngine`, a subclass that adds methods and keeps every piece of the base engine's
state and behaviour. It adds what transformers' Trainer and Accelerate call on a DeepSpeed
engine:

* ``engine.optimizer.overflow``: whether the last step was skipped for an fp16 overflow.

The rest of what they call (``set_gradient_accumulation_boundary``,
``zero_gather_16bit_weights_on_model_save``, ``_zero3_consolidated_16bit_state_dict``) is the
engine's own DeepSpeed surface (runtime/deepspeed_compat.py).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..runtime.engine import ShardwiseEngine


class HfEngine(ShardwiseEngine):
    """A shardwise engine as transformers' Trainer and Accelerate see it (methods only)."""

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """The engine's step; afterwards ``optimizer.overflow`` says whether an fp16 overflow
        skipped it (DeepSpeed's optimizer attribute: Accelerate's ``step_was_skipped`` reads
        it, and the Trainer then leaves its own LR scheduler alone, as with DeepSpeed)."""
        skipped_before = self.skipped_steps
        super().step(lr_kwargs)
        if self.optimizer is not None:
            self.optimizer.overflow = self.skipped_steps > skipped_before


def adapt(engine: ShardwiseEngine) -> HfEngine:
    """Re-class a freshly built engine as :class:`HfEngine` (adds methods, keeps state)."""
    if not isinstance(engine, ShardwiseEngine):
        raise TypeError(f"adapt() takes a ShardwiseEngine, got {type(engine).__name__}")
    if not isinstance(engine, HfEngine):
        engine.__class__ = HfEngine
        if engine.optimizer is not None:
            engine.optimizer.overflow = False  # Accelerate looks for it when it wraps the optimizer
    return engine  # type: ignore[return-value]


def initialize(args: Any = None, model: Optional[torch.nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               mpu: Any = None, dist_init_required: Optional[bool] = None, collate_fn: Any = None,
               config: Any = None, config_params: Any = None, **deepspeed_only: Any):
    """``deepspeed.initialize`` under the alias: ``shardwise.initialize`` with an :class:`HfEngine`.

    DeepSpeed-only keyword arguments (``mesh_param``, ``distributed_port`` ...) must be unset;
    a set one is an error naming it."""
    set_only = {k: v for k, v in deepspeed_only.items() if v is not None}
    if set_only:
        from ..errors import ConfigError
        raise ConfigError(f"deepspeed.initialize(): {sorted(set_only)} are not supported by "
                          "shardwise (data-parallel ZeRO only); remove them")
    from ..runtime.initialize import initialize as shardwise_initialize
    engine, opt, loader, sched = shardwise_initialize(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
        training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
        dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
        config_params=config_params)
    return adapt(engine), opt, loader, sched
