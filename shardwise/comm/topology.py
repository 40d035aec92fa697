"""Which process groups an engine's collectives run over, by name.

shardwise is data-parallel (ZeRO) only: the data-parallel group is the default group (every
rank) and tensor parallelism has a group of one. Code that needs a group asks the
:class:`Topology` for it by role instead of hard-coding ``group=None``, so adding a
tensor-parallel or hybrid layout later changes this object, not every collective.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch.distributed as dist


def group_world_rank(group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    """(size, rank) of ``group`` (None: the default group); a process without
    torch.distributed initialised is a world of one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    return 1, 0


def global_rank(group: Optional[dist.ProcessGroup], rank: int) -> int:
    """The global rank of ``group``'s rank ``rank`` (None: the default group, where the two
    are the same): what ``src``/``dst`` of a collective over ``group`` take."""
    return dist.get_global_rank(group, rank) if group is not None else rank


@dataclass(frozen=True)
class Topology:
    """The process groups of one engine."""

    dp_group: Optional[dist.ProcessGroup] = None
    """Data parallelism (ZeRO partitions and gradient reductions); None is the default group."""
    tp_group: Optional[dist.ProcessGroup] = None
    """Tensor parallelism: not supported, so always a group of one (None here)."""

    @classmethod
    def data_parallel(cls) -> "Topology":
        """Every rank in one data-parallel group (what ``initialize`` builds today)."""
        return cls()

    @property
    def dp_size(self) -> int:
        return group_world_rank(self.dp_group)[0]

    @property
    def dp_rank(self) -> int:
        return group_world_rank(self.dp_group)[1]

    @property
    def tp_size(self) -> int:
        return 1 if self.tp_group is None else group_world_rank(self.tp_group)[0]
