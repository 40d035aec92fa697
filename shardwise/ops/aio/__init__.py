"""DeepSpeed's ``deepspeed.ops.aio``: ``AsyncIOBuilder`` and the op it loads.

``aio_handle`` is :class:`shardwise.io.aio_handle.AsyncIOHandle` (DeepSpeed's constructor
and methods, in pure Python); ``aio_read``/``aio_write`` are DeepSpeed's one-shot helpers.
"""
from __future__ import annotations

import os
from typing import Union

import torch

from ...io.aio_handle import AsyncIOHandle
from ..op_builder import AsyncIOBuilder

aio_handle = AsyncIOHandle


def aio_read(buffer: torch.Tensor, filename: Union[str, os.PathLike], block_size: int,
             queue_depth: int, single_submit: bool, overlap_events: bool, validate: bool) -> int:
    """Read the whole of ``buffer`` from the start of ``filename``; 0 on success."""
    with AsyncIOHandle(block_size, queue_depth, single_submit, overlap_events) as handle:
        handle.pread(buffer, filename, validate, False, 0)
    return 0


def aio_write(buffer: torch.Tensor, filename: Union[str, os.PathLike], block_size: int,
              queue_depth: int, single_submit: bool, overlap_events: bool, validate: bool) -> int:
    """Write the whole of ``buffer`` at the start of ``filename``; 0 on success."""
    with AsyncIOHandle(block_size, queue_depth, single_submit, overlap_events) as handle:
        handle.pwrite(buffer, filename, validate, False, 0)
    return 0


__all__ = ["AsyncIOBuilder", "aio_handle", "aio_read", "aio_write"]
