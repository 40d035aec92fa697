"""A swap store for NVMe offload: sub-groups of tensors in swap files, streamed through a
small ring of pinned buffers.

Interface (for the optimizer / parameter offload that will drive it)::

    groups = [[TensorSpec("master", n, torch.float32), TensorSpec("exp_avg", n, torch.float32),
               TensorSpec("exp_avg_sq", n, torch.float32)] for n in sub_group_sizes]
    store = SwapStore(SwapDir(nvme_path, rank), groups, aio_kwargs=cfg.aio.handle_kwargs(),
                      buffer_count=offload_optimizer.buffer_count)
    for i, tensors in enumerate(initial_values):      # once, at initialize
        store.write_group(i, tensors)
    store.stream(lambda i, views: step(i, *views))    # every step: views live in pinned memory
    store.read_group(i)                               # copies, e.g. for a checkpoint
    store.close()                                     # waits, removes the swap folder

:meth:`SwapStore.stream` runs a callback on each sub-group in order with the pipeline
DeepSpeed calls ``pipeline_read``/``pipeline_write``: while the callback processes group i
from one buffer, group i+1 is being read into the next and group i-1 written back from the
previous, so the disk, the CPU (and the PCIe link, if the callback copies) work at once.
With ``buffer_count`` buffers, ``buffer_count - 2`` groups are read ahead (at least 1; with
two buffers the write-back of i-1 is waited for before i+1 is read into its buffer).

Each group is one file; its tensors sit at 4 KiB-aligned offsets and the buffers are
page-aligned (and pinned when an accelerator is present), so every transfer is an aligned
O_DIRECT request without a bounce copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import ConfigError, StorageError
from .aio_handle import AsyncIOHandle, IORequest
from .aligned import ALIGN, alloc_aligned
from .swap_dir import SwapDir

__all__ = ["SwapDir", "SwapStore", "TensorSpec", "GroupLayout"]


@dataclass(frozen=True)
class TensorSpec:
    """One flat tensor of a sub-group: its name, element count and dtype."""

    name: str
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def _round_up(n: int) -> int:
    return n + (-n % ALIGN)


@dataclass(frozen=True)
class GroupLayout:
    """Where each tensor of a sub-group lives in its file and buffer (aligned offsets)."""

    specs: Tuple[TensorSpec, ...]
    offsets: Tuple[int, ...]
    nbytes: int
    """Bytes of the file and of the buffer part used (a multiple of ALIGN)."""

    @classmethod
    def of(cls, specs: Sequence[TensorSpec]) -> "GroupLayout":
        offsets, pos = [], 0
        for spec in specs:
            offsets.append(pos)
            pos = _round_up(pos + spec.nbytes)
        return cls(tuple(specs), tuple(offsets), max(pos, ALIGN))

    def views(self, buf: torch.Tensor) -> List[torch.Tensor]:
        """The group's tensors as views of a uint8 buffer."""
        return [buf[off:off + spec.nbytes].view(spec.dtype)
                for spec, off in zip(self.specs, self.offsets)]


StepFn = Callable[[int, List[torch.Tensor]], Any]


class SwapStore:
    """Sub-groups of tensors kept in swap files of ``swap_dir`` (see the module docstring)."""

    def __init__(self, swap_dir: SwapDir, groups: Sequence[Sequence[TensorSpec]],
                 aio_kwargs: Optional[Dict[str, Any]] = None, buffer_count: int = 4) -> None:
        if isinstance(buffer_count, bool) or not isinstance(buffer_count, int) or buffer_count < 2:
            raise ConfigError(f"buffer_count = {buffer_count!r}: the swap pipeline needs at least 2 "
                              "pinned buffers (3 or more overlap reading, computing and writing "
                              "back); e.g. \"buffer_count\": 4.")
        self.dir = swap_dir
        self.layouts = [GroupLayout.of(g) for g in groups]
        kwargs = dict(aio_kwargs or {})
        self._reader = AsyncIOHandle(**kwargs)
        self._writer = AsyncIOHandle(**kwargs)
        size = max((layout.nbytes for layout in self.layouts), default=ALIGN)
        self._buffers = [alloc_aligned(size, pin=True) for _ in range(buffer_count)]
        self._written = [False] * len(self.layouts)

    @property
    def buffer_count(self) -> int:
        return len(self._buffers)

    def path(self, index: int) -> str:
        return str(self.dir.file(f"group{index:06d}.swp"))

    def _span(self, slot: int, index: int) -> torch.Tensor:
        return self._buffers[slot][:self.layouts[index].nbytes]

    def write_group(self, index: int, tensors: Sequence[torch.Tensor]) -> None:
        """Store the values of group ``index`` (any device; copied through a buffer)."""
        layout = self.layouts[index]
        if len(tensors) != len(layout.specs):
            raise StorageError(f"group {index}: {len(tensors)} tensors given, the layout has "
                               f"{len(layout.specs)} ({[s.name for s in layout.specs]}).")
        self._writer.wait()  # buffer 0 may still be written back from a stream
        views = layout.views(self._buffers[0])
        for spec, view, tensor in zip(layout.specs, views, tensors):
            if tensor.numel() != spec.numel:
                raise StorageError(f"group {index}: {spec.name} has {tensor.numel()} elements, "
                                   f"the layout says {spec.numel}.")
            view.copy_(tensor.detach().reshape(-1))
        self._writer.sync_pwrite(self._span(0, index), self.path(index), 0)
        self._written[index] = True

    def read_group(self, index: int) -> List[torch.Tensor]:
        """Fresh CPU copies of group ``index``'s tensors."""
        self._require_written(index)
        self._writer.wait()
        self._reader.sync_pread(self._span(0, index), self.path(index), 0)
        return [v.clone() for v in self.layouts[index].views(self._buffers[0])]

    def _require_written(self, index: int) -> None:
        if not self._written[index]:
            raise StorageError(f"group {index} was never written to {self.dir.path}; call "
                               "write_group() for every group before reading or streaming.")

    def stream(self, fn: StepFn, order: Optional[Sequence[int]] = None,
               write_back: bool = True) -> None:
        """Call ``fn(index, views)`` on each group of ``order`` (default: all, in order); the
        views live in a pinned buffer and, with ``write_back``, what ``fn`` leaves in them is
        written back to the group's file. Reads ahead and writes behind (module docstring)."""
        order = list(range(len(self.layouts)) if order is None else order)
        for index in order:
            self._require_written(index)
        self._writer.wait()
        k = len(self._buffers)
        ahead = max(1, k - 2)
        reads: Dict[int, IORequest] = {}
        writes: Dict[int, IORequest] = {}

        def start_read(pos: int) -> None:
            slot = pos % k
            if slot in writes:  # the buffer still holds a group being written back
                writes.pop(slot).wait()
            index = order[pos]
            reads[pos] = self._reader.read_request(self._span(slot, index), self.path(index), 0)

        try:
            for pos in range(min(ahead, len(order))):
                start_read(pos)
            for pos, index in enumerate(order):
                if pos + ahead < len(order):
                    start_read(pos + ahead)
                reads.pop(pos).wait()
                slot = pos % k
                fn(index, self.layouts[index].views(self._buffers[slot]))
                if write_back:
                    writes[slot] = self._writer.write_request(self._span(slot, index),
                                                              self.path(index), 0)
        finally:
            for req in list(reads.values()) + list(writes.values()):
                req.wait()

    def close(self) -> None:
        """Wait for pending IO, stop the IO threads and remove the swap folder."""
        try:
            self._reader.close()
            self._writer.close()
        finally:
            self.dir.close()
