"""DeepSpeed's ``deepspeed.ops.gds``: ``gds_handle``, the aio handle with GPUDirect Storage.

``gds_handle`` is :class:`shardwise.io.aio_handle.AsyncIOHandle` with ``use_gds=True`` plus
DeepSpeed's device-buffer methods. kvikio registers nothing up front here, so pinning a
device tensor is a no-op that reports success.
"""
from __future__ import annotations

import torch

from ...io.aio_handle import AsyncIOHandle
from ..op_builder import GDSBuilder


class gds_handle(AsyncIOHandle):  # noqa: N801  (DeepSpeed's name)
    """DeepSpeed's ``gds_handle(block_size, queue_depth, single_submit, overlap_events,
    intra_op_parallelism)``."""

    def __init__(self, block_size: int = 1024 * 1024, queue_depth: int = 128,
                 single_submit: bool = False, overlap_events: bool = False,
                 intra_op_parallelism: int = 1) -> None:
        super().__init__(block_size, queue_depth, single_submit, overlap_events,
                         intra_op_parallelism, use_gds=True)

    def new_pinned_device_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        device = example_tensor.device if example_tensor.is_cuda else torch.device("cuda")
        return torch.empty(int(num_elem), dtype=example_tensor.dtype, device=device)

    def free_pinned_device_tensor(self, tensor: torch.Tensor) -> bool:
        return True

    def pin_device_tensor(self, tensor: torch.Tensor) -> bool:
        return True

    def unpin_device_tensor(self, tensor: torch.Tensor) -> bool:
        return True


__all__ = ["GDSBuilder", "gds_handle"]
