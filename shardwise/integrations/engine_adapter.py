"""``deepspeed.initialize`` under the alias, and the engine methods Hugging Face calls.

``initialize`` is ``shardwise.initialize``; the engine it returns is re-classed to
:class:`HfEngine`, a subclass that adds methods and keeps every piece of the base engine's
state and behaviour. It adds what transformers' Trainer and Accelerate call on a DeepSpeed
engine:

* ``set_gradient_accumulation_boundary(is_boundary)``: Accelerate calls it before each
  ``engine.backward`` and calls ``engine.step()`` only on the boundary, so the boundary must
  come from it rather than from the micro-step counter.
* ``zero_gather_16bit_weights_on_model_save()`` and
  ``_zero3_consolidated_16bit_state_dict()``: Accelerate's ``get_state_dict`` (the Trainer's
  ``save_model``) under ZeRO-3.
* ``engine.optimizer.overflow``: whether the last step was skipped for an fp16 overflow.

The first three are shims installed only where the base engine lacks them
(:func:`missing_shims`): once the engine's own DeepSpeed-compat surface has them, it owns them.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..runtime.engine import ShardwiseEngine


def _set_gradient_accumulation_boundary(self: ShardwiseEngine, is_boundary: Optional[bool]) -> None:
    """DeepSpeed's override of the accumulation boundary (None: the micro-step counter)."""
    if is_boundary is not None and not isinstance(is_boundary, bool):
        raise TypeError(f"set_gradient_accumulation_boundary() takes True, False or None, got "
                        f"{type(is_boundary).__name__} {is_boundary!r}")
    self.__dict__["_hf_boundary_override"] = is_boundary


def _is_gradient_accumulation_boundary(self: ShardwiseEngine) -> bool:
    override = self.__dict__.get("_hf_boundary_override")
    if override is not None:
        return override
    return ShardwiseEngine.is_gradient_accumulation_boundary(self)


def _zero_gather_16bit_weights_on_model_save(self: ShardwiseEngine) -> bool:
    """``zero_optimization.stage3_gather_16bit_weights_on_model_save``."""
    return bool(self.config.zero_optimization.gather_16bit_weights_on_model_save)


def _zero3_consolidated_16bit_state_dict(self: ShardwiseEngine, exclude_frozen_parameters: bool = False
                                         ) -> Optional[Dict[str, torch.Tensor]]:
    """The full module state dict in the compute dtype on rank 0 (None elsewhere); every rank
    must call it (stage 3 gathers)."""
    from .state_dict import consolidated_state_dict
    return consolidated_state_dict(self, exclude_frozen_parameters=exclude_frozen_parameters)


# name -> shim; a group is installed only where the base engine lacks its first name (the
# engine's own DeepSpeed-compat surface provides them on newer branches, and then owns them)
_SHIM_GROUPS: Tuple[Dict[str, Callable[..., Any]], ...] = (
    {"set_gradient_accumulation_boundary": _set_gradient_accumulation_boundary,
     "is_gradient_accumulation_boundary": _is_gradient_accumulation_boundary},
    {"zero_gather_16bit_weights_on_model_save": _zero_gather_16bit_weights_on_model_save},
    {"_zero3_consolidated_16bit_state_dict": _zero3_consolidated_16bit_state_dict},
)


def missing_shims() -> Dict[str, Callable[..., Any]]:
    """The shims this engine class needs: the groups whose first name the base lacks."""
    out: Dict[str, Callable[..., Any]] = {}
    for group in _SHIM_GROUPS:
        if not hasattr(ShardwiseEngine, next(iter(group))):
            out.update(group)
    return out


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


for _name, _fn in missing_shims().items():
    setattr(HfEngine, _name, _fn)


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
