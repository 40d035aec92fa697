"""The delayed parameter update's background CPU step (ZeRO-Offload §4.3), off the boundary.

Everything that blocks or passes over the whole model runs on the worker, where it overlaps
the next window instead of holding up the step's critical path: waiting for the boundary's
last gradient copies, reading the engine's scale factor (which may depend on the norm),
multiplying the gradients, the optimizer step itself and copying its result into spare
shards that are swapped in at the next boundary.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..accelerator import get_accelerator


def background_step(*, step: Callable[[], None], grads: List[torch.Tensor],
                    factor: Optional[torch.Tensor], master_device: torch.device,
                    grads_ready: Callable[[], None],
                    writes: Sequence[Tuple[torch.Tensor, torch.Tensor]] = ()) -> Callable[[], None]:
    """The work of a delayed step, for the worker, made on the calling thread (which marks
    where on its stream ``factor`` is ready): run ``step`` (a snapshot of the optimizer's
    step) after ``grads_ready()`` and ``grads *= factor`` (None: unscaled), then copy each
    ``(master, spare)`` of ``writes`` into the spare shard."""
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

    return background
