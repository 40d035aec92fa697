"""Host-memory helpers for stage-3 offload: pinned buffers and gradient streaming to the CPU.

``offload_param`` keeps each parameter's shard in (pinned) CPU memory; ``partition.py``
copies it to the accelerator right before the all-gather (``non_blocking`` from pinned
memory), so fetching a module costs one host-to-device copy of this rank's chunk.

``offload_optimizer`` keeps the fp32 masters and their gradients on the CPU. Reduced
gradient chunks arrive on the accelerator during backward; ``GradStager`` copies them into
a pinned staging pool on a side stream and adds them into the CPU gradient partition once
the copies are done. The pool grows to the largest batch of chunks drained at once and is
then reused every step: nothing is reallocated per step.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ...accelerator import get_accelerator


def alloc_host(numel: int, device: torch.device, pin: bool) -> torch.Tensor:
    """A zeroed fp32 buffer on ``device``; pinned when it is host memory and pinning helps."""
    t = torch.zeros(numel, dtype=torch.float32, device=device)
    if pin and t.device.type == "cpu":
        t = get_accelerator().pin_memory(t)
    return t


class GradStager:
    """Adds accelerator-side gradient chunks into host-side fp32 partitions."""

    def __init__(self, device: torch.device, master_device: torch.device) -> None:
        self.crosses = torch.device(device).type != torch.device(master_device).type
        self.stream = None
        if self.crosses and torch.device(device).type == "cuda":
            self.stream = torch.cuda.Stream(device=device)
        self.pool: Optional[torch.Tensor] = None
        self.used = 0
        self.queued: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def add_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.numel() == 0:
            return
        if not self.crosses or self.stream is None:
            dst.add_(src.to(dst.device, dtype=dst.dtype))
            return
        n = src.numel()
        if self.pool is None or self.used + n > self.pool.numel():
            self.flush()  # the pool is about to be reused or grown: finish what is queued
            if self.pool is None or n > self.pool.numel():
                self.pool = get_accelerator().pin_memory(torch.empty(max(n, 1 << 20)))
        tmp = self.pool[self.used:self.used + n]
        self.used += n
        self.stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self.stream):
            tmp.copy_(src, non_blocking=True)
            src.record_stream(self.stream)
        self.queued.append((dst, tmp))

    def flush(self) -> None:
        if self.stream is not None and self.queued:
            self.stream.synchronize()
        for dst, tmp in self.queued:
            dst.add_(tmp)
        self.queued.clear()
        self.used = 0
