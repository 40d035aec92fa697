"""What saving and loading a checkpoint needs from an engine, typed.

``ShardwiseEngine`` implements it explicitly (it subclasses :class:`CheckpointableEngine`);
the checkpoint functions (``engine_io``) take any object that does, so a test double or
another engine (an inference engine, a hybrid engine) checkpoints through the same code,
and they call it directly: no ``getattr``/``hasattr`` probing of the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol, runtime_checkable

import torch

from ..zero.shard_view import ShardView

COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
"""The engine's step counters a checkpoint saves and restores."""


@dataclass(frozen=True)
class CheckpointSettings:
    """The configuration a checkpoint reads (``checkpoint`` and ``zero_optimization``)."""

    tag_validation: str = "WARN"
    """``checkpoint.tag_validation``: IGNORE, WARN or FAIL on tags that differ across ranks."""
    async_save: bool = False
    """``checkpoint.async_save``: write the tensors on a background thread."""
    gather_16bit_weights_on_model_save: bool = False
    """``zero_optimization.gather_16bit_weights_on_model_save`` (stage 3's save_16bit_model)."""
    config: Dict[str, Any] = field(default_factory=dict)
    """The engine's whole configuration, as recorded in the checkpoint's metadata."""

    @classmethod
    def of(cls, config: Any) -> "CheckpointSettings":
        """From a validated ``ShardwiseConfig``."""
        return cls(tag_validation=str(config.checkpoint.tag_validation).upper(),
                   async_save=bool(config.checkpoint.async_save),
                   gather_16bit_weights_on_model_save=bool(
                       config.zero_optimization.gather_16bit_weights_on_model_save),
                   config=config.to_dict())


class CheckpointOptimizer(Protocol):
    """The engine's optimizer wrapper (``ZeroOptimizer``) as a checkpoint sees it."""

    inner: torch.optim.Optimizer
    """The torch optimizer over the fp32 masters (its states are saved per shard)."""
    loss_scaler: Any
    """The fp16 loss scaler (None without one)."""


@runtime_checkable
class CheckpointableEngine(Protocol):
    """The engine surface ``save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model`` use."""

    module: torch.nn.Module
    device: torch.device
    dp_group: Any
    """The data-parallel process group (None: the default group)."""
    optimizer: Optional[CheckpointOptimizer]
    """The ``ZeroOptimizer`` (None without an optimizer)."""
    loss_scaler: Any
    """The engine's loss scaler when its optimizer has none (None: no fp16 scaling)."""
    lr_scheduler: Any
    """The LR scheduler (None); saved when it has ``state_dict``."""
    training_dataloader: Any
    """The data loader (None); its position is saved when it has ``state_dict``."""
    pending_save: Any
    """A background (``async_save``) save not yet finished (None: none); set by
    ``checkpoint.async_save``, the engine only holds it."""
    global_rank: int
    world_size: int
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int

    def checkpoint_settings(self) -> CheckpointSettings:
        ...

    def shard_views(self) -> List[ShardView]:
        """This rank's piece of every parameter and of its fp32 master (an engine without a
        ZeRO strategy: :func:`whole_views`)."""
        ...

    def refresh_after_load(self, weights_only: bool = False) -> None:
        """Make every copy consistent after the views were written."""
        ...

    def zero_optimization_stage(self) -> int:
        ...

    def gradient_accumulation_steps(self) -> int:
        ...


def whole_views(module: torch.nn.Module, rank: int) -> List[ShardView]:
    """One view per parameter, owned whole by rank 0: the views of an engine without a ZeRO
    strategy (no optimizer), so its weights still save and load."""
    views = []
    for name, p in module.named_parameters():
        n = p.numel() if rank == 0 else 0
        views.append(ShardView(name=name, param=p, global_shape=p.shape, start=0, end=n,
                               weight=p.data.view(-1)[:n], master=None))
    return views
