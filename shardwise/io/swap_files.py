"""Named swap files of one rank in one :class:`~.swap_dir.SwapDir`, moved through
:class:`~.aio_handle.AsyncIOHandle` between the files and page-aligned host buffers.

What NVMe *parameter* offload needs, shared by the training side (stage 3's ``FileShard``,
``zero/stage3/file_shard.py``) and ZeRO-Inference (``inference/streaming.py``):

- a swap folder made and probed at setup (errors name ``nvme_path``), removed by
  :meth:`SwapFiles.close` or at interpreter exit;
- one reader and one writer handle (a read never queues behind the writes, and back);
- files padded to :data:`~.aligned.ALIGN` bytes, so every transfer can go ``O_DIRECT``
  from an aligned buffer of :func:`padded` bytes.

DeepSpeed sends a parameter partition to NVMe only when it has at least
:data:`MIN_NVME_BYTES` bytes; smaller ones stay in host memory (the callers apply it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from .aio_handle import AsyncIOHandle, IORequest
from .aligned import ALIGN, alloc_aligned
from .swap_dir import SwapDir

#: DeepSpeed's rule for offload_param to NVMe: smaller partitions stay in host memory.
MIN_NVME_BYTES = 1 << 20


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of aligned blocks (at least one)."""
    return max(ALIGN, nbytes + (-nbytes % ALIGN))


@dataclass(frozen=True)
class SwapFile:
    """One swap file: its path and its (aligned) size in bytes."""

    path: str
    nbytes: int


class SwapFiles:
    """The swap files of one rank under ``nvme_path`` (see the module docstring); ``key``
    names the config key in error messages."""

    def __init__(self, nvme_path: Optional[str], rank: int, key: str,
                 aio_kwargs: Optional[Dict[str, Any]] = None) -> None:
        self.dir = SwapDir(nvme_path, rank, key=key)
        kwargs = dict(aio_kwargs or {})
        self.reader = AsyncIOHandle(**kwargs)
        self.writer = AsyncIOHandle(**kwargs)

    @property
    def path(self) -> str:
        return str(self.dir.path)

    def file(self, name: str, nbytes: int) -> SwapFile:
        """The swap file ``name`` holding ``nbytes`` bytes (padded; not created yet)."""
        return SwapFile(str(self.dir.file(name)), padded(nbytes))

    def write_bytes(self, name: str, data: torch.Tensor) -> SwapFile:
        """Write the host bytes ``data`` (any alignment) into a new swap file ``name``, zero
        padded, and wait for it."""
        flat = data.reshape(-1).view(torch.uint8)
        target = self.file(name, flat.numel())
        bounce = alloc_aligned(target.nbytes)
        bounce[:flat.numel()].copy_(flat)
        bounce[flat.numel():].zero_()
        self.writer.sync_pwrite(bounce, target.path, 0)
        return target

    def read_request(self, buf: torch.Tensor, target: SwapFile) -> IORequest:
        """Start reading ``target`` into the first ``target.nbytes`` bytes of the aligned
        host buffer ``buf``."""
        return self.reader.read_request(buf[:target.nbytes], target.path, 0)

    def write_request(self, buf: torch.Tensor, target: SwapFile) -> IORequest:
        """Start writing the first ``target.nbytes`` bytes of ``buf`` into ``target``."""
        return self.writer.write_request(buf[:target.nbytes], target.path, 0)

    @property
    def closed(self) -> bool:
        return self.dir.closed

    def close(self) -> None:
        """Wait for pending IO, stop the IO threads and remove the swap folder."""
        try:
            self.reader.close()
            self.writer.close()
        finally:
            self.dir.close()
