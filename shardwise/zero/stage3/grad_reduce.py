"""Stage-3 gradient reduction: each partitioned gradient reduce-scattered as autograd
finishes it, on every micro step, and handed on as this rank's chunk.

A full-size gradient lives only until its reduction is launched: it is padded (and cast to
the communication dtype, pre-divided when asked) into a flat buffer, reduce-scattered
asynchronously and freed. Reductions queue until about ``reduce_bucket_size`` elements are in
flight, then the oldest are waited for and delivered (``deliver(param, record, chunk)``) to
whoever accumulates them (the strategy's fp32 gradient partitions). One rank has no
collective to batch: each gradient is delivered at once, in its own dtype.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ...comm import reduce_scatter_flat
from .partition import PartitionedParam

Deliver = Callable[[torch.nn.Parameter, PartitionedParam, torch.Tensor], None]


class GradReducer:
    """Reduce-scatter queue of one engine's partitioned gradients."""

    def __init__(self, *, world: int, group: Optional[dist.ProcessGroup], comm_dtype: torch.dtype,
                 predivide: float, bucket_elems: int, deliver: Deliver) -> None:
        self.world = world
        self.group = group
        self.comm_dtype = comm_dtype
        self.predivide = predivide
        self.deliver = deliver
        # one rank has no collective to batch: hand each gradient on at once
        self.drain_elems = bucket_elems if world > 1 else 0
        self._pending: List[Tuple[torch.nn.Parameter, PartitionedParam, Any, torch.Tensor,
                                  torch.Tensor]] = []
        self._pending_elems = 0

    def reduce(self, p: torch.nn.Parameter, rec: PartitionedParam) -> None:
        """Take ``p``'s full gradient off it and launch its reduction (nothing else keeps
        the full gradient alive: it is freed before any wait)."""
        grad, p.grad = p.grad, None
        if grad is None:
            return
        if self.world == 1 and self.predivide == 1.0:
            # nothing to pad or reduce: the gradient goes to its partition as it is (in its
            # own dtype, so a bf16 gradient crosses PCIe at half the bytes)
            out = buf = grad.reshape(-1)
            work = None
        else:
            buf = torch.zeros(rec.padded, dtype=self.comm_dtype, device=grad.device)
            buf[:rec.numel].copy_(grad.reshape(-1))
            if self.predivide != 1.0:
                buf.div_(self.predivide)
            del grad
            if self.world == 1:
                out, work = buf, None
            else:
                out = torch.empty(rec.chunk, dtype=self.comm_dtype, device=buf.device)
                work = reduce_scatter_flat(out, buf, group=self.group, async_op=True)
        self._pending.append((p, rec, work, out, buf))
        self._pending_elems += rec.padded
        if self._pending_elems > self.drain_elems:
            self.drain(keep_last=1 if self.world > 1 else 0)

    def drain(self, keep_last: int = 0) -> None:
        """Wait for queued reductions (all but the last ``keep_last``) and deliver them."""
        while len(self._pending) > keep_last:
            p, rec, work, out, _buf = self._pending.pop(0)
            self._pending_elems -= rec.padded
            if work is not None:
                work.wait()
            self.deliver(p, rec, out[:rec.own_len])
