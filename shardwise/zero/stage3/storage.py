"""Where a stage-3 shard lives: a small storage interface instead of a bare tensor.

A partitioned parameter keeps this rank's chunk of its elements in a :class:`ShardStorage`.
The backends are resident tensors (:class:`TensorShard`: on the accelerator, or in (pinned)
host memory under ``offload_param``) and swap files (``file_shard.FileShard``, under
``offload_param: {device: "nvme"}``). Readers ask :meth:`ShardStorage.tensor` for a tensor
with the chunk's elements (or :meth:`ShardStorage.copy_to` for a copy); writers go through
:meth:`ShardStorage.write_`; the delayed update swaps two storages of one parameter with
:meth:`ShardStorage.swap`. The gather copies a shard to the device between
:meth:`ShardStorage.staged` and :meth:`ShardStorage.unstage` (a file backend lends one of its
read buffers for that time), and the coordinator may :meth:`ShardStorage.prefetch` ahead.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from ...accelerator import get_accelerator


@runtime_checkable
class ShardStorage(Protocol):
    """The chunk of one partitioned parameter that this rank owns (padding included)."""

    @property
    def numel(self) -> int:
        """Elements of the chunk (padding included)."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        ...

    @property
    def device(self) -> torch.device:
        """Where the resident copy lives (the host for offloaded shards)."""
        ...

    @property
    def resident(self) -> bool:
        """True when :meth:`tensor` is the shard's own memory (not a copy)."""
        ...

    def tensor(self) -> torch.Tensor:
        """A tensor holding the chunk; resident backends return their own memory (writes
        into it are writes into the shard); a file backend returns a host copy whose in-place
        edits reach the file when the owner commits (``Stage3Params.before_shard_write``)."""
        ...

    def copy_to(self, dst: torch.Tensor) -> None:
        """Copy the chunk's first ``dst.numel()`` elements into ``dst``."""
        ...

    def prefetch(self) -> bool:
        """Start bringing the chunk into memory ahead of use; False when no buffer is free
        (resident backends: nothing to do, True)."""
        ...

    def staged(self) -> torch.Tensor:
        """The chunk in memory for a copy to the device, valid until :meth:`unstage`."""
        ...

    def unstage(self, event: Any = None) -> None:
        """The copy out of :meth:`staged` is queued; its memory may be reused once ``event``
        (an accelerator event; None: at once) has completed."""
        ...

    def write_(self, src: torch.Tensor, offset: int = 0, non_blocking: bool = False) -> None:
        """Copy ``src`` into the chunk at ``offset``."""
        ...

    def swap(self, other: "ShardStorage") -> None:
        """Exchange contents with ``other`` (same geometry) without copying."""
        ...


class TensorShard:
    """A shard resident in memory: an accelerator tensor, or host memory (pinned on request
    when an accelerator can use pinned memory)."""

    __slots__ = ("_t",)

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    @classmethod
    def zeros(cls, numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> "TensorShard":
        return cls(get_accelerator().host_zeros(numel, dtype, device, pin))

    @classmethod
    def copy_of(cls, t: torch.Tensor, device: torch.device, dtype: torch.dtype, pin: bool) -> "TensorShard":
        """A new shard on ``device`` holding ``t``'s elements."""
        if pin and torch.device(device).type == "cpu":  # allocated pinned, filled in place
            return cls(get_accelerator().pinned_empty(t.shape, dtype).copy_(t))
        return cls(t.to(device=device, dtype=dtype, copy=True).contiguous())

    @property
    def numel(self) -> int:
        return self._t.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self._t.dtype

    @property
    def device(self) -> torch.device:
        return self._t.device

    @property
    def pinned(self) -> bool:
        return self._t.device.type == "cpu" and self._t.is_pinned()

    resident = True

    def tensor(self) -> torch.Tensor:
        return self._t

    def copy_to(self, dst: torch.Tensor) -> None:
        dst.copy_(self._t[:dst.numel()])

    def prefetch(self) -> bool:
        return True

    def staged(self) -> torch.Tensor:
        return self._t

    def unstage(self, event: Any = None) -> None:
        pass

    def write_(self, src: torch.Tensor, offset: int = 0, non_blocking: bool = False) -> None:
        with torch.no_grad():
            self._t[offset:offset + src.numel()].copy_(src.reshape(-1), non_blocking=non_blocking)

    def swap(self, other: "ShardStorage") -> None:
        if not isinstance(other, TensorShard):
            raise TypeError(f"cannot swap a TensorShard with {type(other).__name__}")
        self._t, other._t = other._t, self._t

    def __repr__(self) -> str:
        return f"TensorShard({self.numel}, {self.dtype}, {self.device}{', pinned' if self.pinned else ''})"
