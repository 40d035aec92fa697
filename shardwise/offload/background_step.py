"""The delayed parameter update's background CPU step (ZeRO-Offload §4.3), off the boundary.

Everything that blocks or passes over the whole model runs on the worker, where it overlaps
the next window instead of holding up the step's critical path: waiting for the boundary's
last gradient copies, reading the engine's scale factor (which may depend on the norm),
multiplying the gradients, the optimizer step itself and copying its result into spare
shards that are swapped in at the next boundary.
"""
from __future__ import annotations

from concurrent.futures import Executor, Future
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..accelerator import get_accelerator


def submit_background_step(pool: Executor, *, step: Callable[[], None],
                           grads: List[torch.Tensor], factor: Optional[torch.Tensor],
                           master_device: torch.device, grads_ready: Callable[[], None],
                           writes: Sequence[Tuple[torch.Tensor, torch.Tensor]] = ()) -> Future:
    """Queue ``step`` (a snapshot of the optimizer's step) on ``pool``: first
    ``grads_ready()``, then ``grads *= factor`` (None: unscaled), the step, and each
    ``(master, spare)`` of ``writes`` copied into the spare shard."""
    factor_ready = None
    if factor is not None and factor.device.type != "cpu":
        acc = get_accelerator()
        factor_ready = acc.Event()
        factor_ready.record(acc.current_stream(factor.device))

    def background() -> None:
        grads_ready()
        if factor is not None:
            if factor_ready is not None:
                factor_ready.synchronize()
            scale = factor.to(master_device)
            for g in grads:
                g.mul_(scale)
        step()
        with torch.no_grad():
            for master, spare in writes:
                spare[:master.numel()].copy_(master)

    return pool.submit(background)
