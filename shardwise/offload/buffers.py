"""What the offload pipeline needs of a flat buffer, typed (no import of the ZeRO layouts).

ZeRO stages 1-2 hand their flat buckets (``zero.flat_buckets.Bucket``) to
:class:`~.optimizer_offload.OptimizerOffload`; any layout with these fields works, so
``offload`` does not depend on ``zero`` (which depends on ``offload``).
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch


class HostSlot(Protocol):
    """One parameter's place in a buffer and the part of it this rank owns."""

    offset: int
    """First element of the parameter in the buffer's flat tensors."""
    own_lo: int
    """First owned element, relative to the parameter."""
    own_hi: int
    master: Optional[torch.Tensor]
    """The fp32 tensor the optimizer steps for the owned range (None: nothing owned)."""


class HostBucket(Protocol):
    """A flat buffer whose owned fp32 range ``[lo, hi)`` is stepped on the host."""

    index: int
    lo: int
    hi: int
    slots: Sequence[HostSlot]
    param_buf: torch.Tensor
    """Compute-dtype parameters on the device (the updated masters are copied here)."""
    master: torch.Tensor
    """This rank's fp32 masters (pinned host memory)."""
    master_grad: torch.Tensor
    """Their gradients (pinned host memory)."""


class PieceSource(Protocol):
    """What stage 3's host masters need of one partitioned parameter's record."""

    @property
    def own_len(self) -> int:
        """Elements of the parameter this rank owns (0: none)."""
        ...

    @property
    def shard(self) -> torch.Tensor:
        """This rank's chunk in the compute dtype (its first ``own_len`` elements are owned)."""
        ...
