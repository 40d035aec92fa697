"""What one rank owns of one parameter: the contract between the ZeRO strategies and
the checkpoint code.

Every strategy (stages 0-3, offloaded or not) describes its state as a list of
``ShardView``; the union over all ranks covers every element of every parameter exactly once,
so a checkpoint written from these views can be read back at any world size and stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ShardView:
    """This rank's slice ``[start, end)`` of the flattened parameter ``name``."""

    name: str
    """Qualified name in ``engine.module`` (the first name, for tied parameters)."""
    param: torch.nn.Parameter
    """The module's parameter object (its ``.data`` may be a view into a flat buffer or empty
    under stage 3)."""
    global_shape: torch.Size
    """The parameter's full, unpartitioned shape."""
    start: int
    """First flat element of the parameter that this rank owns."""
    end: int
    """One past the last owned flat element (``start == end``: this rank owns none)."""
    weight: torch.Tensor
    """1-D view of length ``end - start`` of the compute-dtype weights this rank holds for the
    owned range; writing into it changes the model (call ``engine.refresh_after_load()`` after)."""
    master: Optional[torch.Tensor]
    """1-D fp32 tensor of length ``end - start`` stepped by the inner torch optimizer
    (``engine.optimizer.inner.state[master]`` holds its states); ``None`` for frozen parameters.
    May live on the CPU (offload) and may share storage with ``weight`` (fp32, unpartitioned)."""

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def requires_grad(self) -> bool:
        return self.master is not None
