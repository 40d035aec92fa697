"""What saving and loading a checkpoint needs from an engine, typed.

``ShardwiseEngine`` implements it; the checkpoint functions (``engine_io``) take any object
that does, so a test double or another engine (an inference engine, a hybrid engine)
checkpoints through the same code.
"""
from __future__ import annotations

from typing import Any, List, Protocol, runtime_checkable

import torch

from ..zero.shard_view import ShardView


@runtime_checkable
class CheckpointableEngine(Protocol):
    """The engine surface ``save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model`` use."""

    module: torch.nn.Module
    config: Any
    """The validated ``ShardwiseConfig`` (its ``checkpoint`` and ``zero_optimization``)."""
    optimizer: Any
    """The ``ZeroOptimizer`` (None without an optimizer)."""
    lr_scheduler: Any
    global_rank: int
    world_size: int
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int

    def shard_views(self) -> List[ShardView]:
        """This rank's piece of every parameter and of its fp32 master."""
        ...

    def refresh_after_load(self, weights_only: bool = False) -> None:
        """Make every copy consistent after the views were written."""
        ...

    def zero_optimization_stage(self) -> int:
        ...

    def gradient_accumulation_steps(self) -> int:
        ...

