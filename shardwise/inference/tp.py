"""AutoTP: which slice of each projection a rank holds, and the one all-reduce per block.

Megatron's split, found from the module structure (``arch.describe_model``): q/k/v and
gate/up are column-parallel (each rank holds whole attention heads / MLP columns), o and
down are row-parallel (each rank holds the matching input columns, and one all-reduce sums
the partial outputs). Embeddings, norms and the LM head are replicated. ``TPPlan`` checks
the sizes first and names the key, the value and the rule when they do not fit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from shardwise.errors import ConfigError, DistributedError


@dataclass(frozen=True)
class TPPlan:
    """Rank ``rank`` of ``size`` in process group ``group`` (None: the default group)."""

    size: int
    rank: int
    group: Any = None

    @property
    def active(self) -> bool:
        """True when the model is split over more than one rank."""
        return self.size > 1

    def chunk(self, total: int) -> Tuple[int, int]:
        """[start, end) of this rank's equal share of ``total``."""
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def check(self, n_heads: int, n_kv_heads: int, intermediate: int) -> None:
        """Raise ConfigError when tp_size does not divide what it must split."""
        for what, count in (("attention heads", n_heads), ("key/value heads", n_kv_heads),
                            ("MLP columns (intermediate size)", intermediate)):
            if count % self.size:
                raise ConfigError(
                    f"tensor_parallel.tp_size = {self.size} does not divide the model's {count} "
                    f"{what}; the rule: tp_size must divide the attention heads, the KV heads "
                    f"and the MLP width. Use a divisor of {count}, e.g. tp_size = "
                    f"{_largest_divisor(count, self.size)}.")


def _largest_divisor(count: int, below: int) -> int:
    return max(d for d in range(1, below + 1) if count % d == 0)


def make_plan(tp_size: int, group: Any = None, mpu: Any = None) -> TPPlan:
    """The TP plan for this process; checks tp_size against the process group's size."""
    if mpu is not None:
        group = mpu.get_model_parallel_group()
    if tp_size == 1:
        return TPPlan(1, 0, None)
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedError(
            f"tensor_parallel.tp_size = {tp_size} needs {tp_size} processes with torch.distributed "
            f"initialised; launch with `shardwise --num_gpus {tp_size} script.py` (or torchrun) "
            f"and call shardwise.init_distributed() first, or set tp_size to 1.")
    world = dist.get_world_size(group)
    if tp_size > world or world % tp_size:
        raise ConfigError(
            f"tensor_parallel.tp_size = {tp_size} does not fit the world size {world}; the rule: "
            f"tp_size must be at most the number of ranks and divide it. Launch {tp_size} ranks "
            f"or set tp_size to a divisor of {world}.")
    if group is None and world != tp_size:
        ranks = dist.get_rank() // tp_size * tp_size
        groups = [dist.new_group(list(range(s, s + tp_size))) for s in range(0, world, tp_size)]
        group = groups[ranks // tp_size]
    return TPPlan(tp_size, dist.get_rank(group), group)


def all_reduce(x: torch.Tensor, plan: TPPlan) -> torch.Tensor:
    """Sum ``x`` over the TP group (traceable by torch.compile via functional collectives)."""
    if torch.compiler.is_compiling():
        import torch.distributed._functional_collectives as funcol
        group = plan.group if plan.group is not None else dist.group.WORLD
        return funcol.all_reduce(x, "sum", group)
    from .. import comm
    comm.all_reduce(x, group=plan.group)
    return x


def split_ranges(sizes: List[int], plan: TPPlan) -> List[Optional[Tuple[int, int]]]:
    """This rank's [start, end) within each of several concatenated pieces (q, k, v)."""
    return [plan.chunk(s) if plan.active else None for s in sizes]
