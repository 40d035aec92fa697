"""Flat buckets: the memory layout behind ZeRO stages 0, 1 and 2.

Each optimizer param group's trainable parameters are packed, in reverse registration order
(roughly the order backward produces their gradients), into buckets of about
``reduce_bucket_size`` elements. A bucket owns three flat buffers:

- ``param_buf`` (compute dtype, device): the parameters' ``.data`` are views into it, so an
  all-gather lands directly in the module's weights and parameters keep their identity;
- ``grad_buf`` (fp32 unless ``data_types.grad_accum_dtype`` says otherwise, device):
  gradients accumulate here across micro steps;
- ``master`` / ``master_grad`` (fp32): this rank's slice ``[lo, hi)`` of the bucket, which is
  what the optimizer steps. When nothing is partitioned, offloaded or down-cast these are
  views of ``param_buf`` / ``grad_buf`` themselves (no copies at all).

Every bucket is padded to a multiple of the world size and split evenly, so one
reduce-scatter per bucket hands each rank exactly its slice (Megatron-style bucket sharding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from ..accelerator import get_accelerator


@dataclass
class ParamSlot:
    """Where one parameter sits in its bucket and which part of it this rank owns."""

    name: str
    param: torch.nn.Parameter
    offset: int
    """First element of the parameter in the bucket's flat buffers."""
    own_lo: int
    """First owned element, relative to the parameter (== own_hi: none owned)."""
    own_hi: int
    master: Optional[torch.Tensor] = None
    """The fp32 tensor the optimizer steps for the owned range (view into bucket.master)."""

    @property
    def numel(self) -> int:
        return self.param.numel()


@dataclass
class Bucket:
    index: int
    group_index: int
    slots: List[ParamSlot]
    numel: int
    """Padded size: a multiple of the world size."""
    lo: int
    hi: int
    param_buf: torch.Tensor
    grad_buf: torch.Tensor
    master: torch.Tensor
    master_grad: torch.Tensor
    pending: int = 0
    """Parameters whose gradient has not arrived yet in the current backward."""
    work: Any = None
    """In-flight reduction handle."""
    comm_buf: Optional[torch.Tensor] = None
    """Scratch for reduced-precision communication (communication_data_type)."""
    offloaded: bool = False
    """Its masters and their gradients live in host memory (``offload_optimizer``)."""
    grad_is_master: bool = False
    """``master_grad`` is a view of ``grad_buf`` itself (nothing partitioned or widened)."""
    reduce_src: Optional[torch.Tensor] = None
    """What the last reduction read (``grad_buf``, or its reduced-precision copy)."""
    rs_out: Optional[torch.Tensor] = None
    """This rank's reduce-scatter output, when it cannot land in ``master_grad`` directly."""
    host_written: bool = False
    """The host partition already holds gradients of the current accumulation window."""


def plan_buckets(named_params: Sequence[tuple], bucket_elems: int) -> List[List[tuple]]:
    """Split (name, param) pairs into consecutive runs of about ``bucket_elems`` elements."""
    runs: List[List[tuple]] = []
    current: List[tuple] = []
    size = 0
    for name, p in named_params:
        if current and size + p.numel() > bucket_elems:
            runs.append(current)
            current, size = [], 0
        current.append((name, p))
        size += p.numel()
    if current:
        runs.append(current)
    return runs


def build_bucket(index: int, group_index: int, run: List[tuple], *, world: int, rank: int,
                 partitioned: bool, compute_dtype: torch.dtype, device: torch.device,
                 master_device: torch.device, pin: bool, separate_master: bool = False,
                 grad_dtype: torch.dtype = torch.float32, pin_master: Optional[bool] = None) -> Bucket:
    """Allocate one bucket's buffers and point the parameters' data into ``param_buf``.
    ``pin_master``: pin the host masters (default: as ``pin``; NVMe offload moves them to
    swap files at once, and freed pinned memory stays cached by the allocator)."""
    total = sum(p.numel() for _, p in run)
    numel = -(-total // world) * world if partitioned else total
    lo, hi = (rank * (numel // world), (rank + 1) * (numel // world)) if partitioned else (0, numel)
    param_buf = torch.zeros(numel, dtype=compute_dtype, device=device)
    grad_buf = torch.zeros(numel, dtype=grad_dtype, device=device)
    slots: List[ParamSlot] = []
    offset = 0
    with torch.no_grad():
        for name, p in run:
            n = p.numel()
            param_buf[offset:offset + n].copy_(p.detach().reshape(-1))
            p.data = param_buf[offset:offset + n].view_as(p)
            a, b = max(offset, lo), min(offset + n, hi)
            own_lo, own_hi = (a - offset, b - offset) if a < b else (0, 0)
            slots.append(ParamSlot(name=name, param=p, offset=offset, own_lo=own_lo, own_hi=own_hi))
            offset += n
    shares_memory = (compute_dtype == torch.float32 and master_device == device
                     and not partitioned and not separate_master)
    if shares_memory:
        master, master_grad = param_buf, grad_buf
    else:
        accel = get_accelerator()
        offloaded = master_device != device
        if offloaded and (pin if pin_master is None else pin_master):
            # masters are DMA'd straight to the device: allocated pinned, filled in place
            master = accel.pinned_empty(hi - lo, torch.float32).copy_(param_buf[lo:hi])
        else:
            master = param_buf[lo:hi].to(device=master_device, dtype=torch.float32, copy=True)
        if partitioned or offloaded or separate_master or grad_dtype != torch.float32:
            master_grad = accel.host_zeros(hi - lo, torch.float32, master_device, offloaded and pin)
        else:
            master_grad = grad_buf
    bucket = Bucket(index=index, group_index=group_index, slots=slots, numel=numel, lo=lo, hi=hi,
                    param_buf=param_buf, grad_buf=grad_buf, master=master, master_grad=master_grad)
    for slot in slots:
        if slot.own_hi > slot.own_lo:
            a = slot.offset + slot.own_lo - lo
            b = slot.offset + slot.own_hi - lo
            slot.master = master[a:b]
            slot.master.grad = master_grad[a:b]
    return bucket


def grad_view(bucket: Bucket, slot: ParamSlot) -> torch.Tensor:
    """The slot's full gradient inside the bucket's fp32 accumulation buffer."""
    return bucket.grad_buf[slot.offset:slot.offset + slot.numel].view_as(slot.param)
