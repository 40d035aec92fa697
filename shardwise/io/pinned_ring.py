"""A ring of host buffers that device tensors are copied into before a write.

Buffers are pinned when the accelerator supports it, so the copy of chunk i+1 runs on the
DMA engine while chunk i is written. They are allocated once per ring (not per chunk: a fresh
32 MiB pageable buffer per chunk costs ~8k page faults and a synchronous copy through the
driver's staging buffer each time), on first use (a CPU-only writer allocates none).
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from .checksums import Crc, crc_value, crc_workers


def ring_slots() -> int:
    """Buffers in a writer's ring: one the DMA fills, one being written, and one per crc
    worker whose checksum of an already written chunk may still be running."""
    return crc_workers() + 2


def event_module(device: torch.device) -> Optional[Any]:
    """``torch.cuda`` / ``torch.xpu`` when that backend has streams and events (so a copy
    into pinned memory can run asynchronously), else None (the copy is synchronous)."""
    mod = getattr(torch, device.type, None)
    if device.type in ("cuda", "xpu") and all(hasattr(mod, a) for a in ("Event", "current_stream")):
        return mod
    return None


def alloc_host(nbytes: int) -> torch.Tensor:
    """A uint8 host buffer, pinned when the accelerator supports it (pageable otherwise, or
    when pinning fails: pinning is an optimisation only, e.g. the pinned limit is hit)."""
    try:
        from ..accelerator import get_accelerator
        if get_accelerator().pin_memory_supported():
            return get_accelerator().pinned_empty(nbytes, torch.uint8)
    except Exception:
        pass
    return torch.empty(nbytes, dtype=torch.uint8)


class Slot:
    """One host buffer of the ring and the pieces of tensors staged in it."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.array = buf.numpy()
        self.pinned = buf.is_pinned()
        self.fill = 0
        self.pieces: List[Tuple[int, int, int]] = []  # (item index, begin, end) in this buffer
        self.events: List[Any] = []  # (device, event) the copies into this buffer finish at
        self.keep: List[torch.Tensor] = []  # sources kept alive until their copies finished
        self.crcs: List[Crc] = []
        self.written = True

    @property
    def capacity(self) -> int:
        return self.buf.numel()

    def reset(self) -> None:
        for crc in self.crcs:  # the crc pool may still read the previous content
            crc_value(crc)
        self.fill, self.pieces, self.events, self.keep, self.crcs = 0, [], [], [], []
        self.written = False

    def stage(self, index: int, piece: torch.Tensor) -> None:
        """Start copying ``piece`` (flat uint8, on a device) into the free end of the buffer."""
        n = piece.numel()
        dst = self.buf[self.fill:self.fill + n]
        stream_mod = event_module(piece.device) if self.pinned else None
        dst.copy_(piece, non_blocking=stream_mod is not None)
        if stream_mod is not None:
            if not any(dev == piece.device for dev, _ in self.events):
                self.events.append((piece.device, None))
            self.keep.append(piece)
        self.pieces.append((index, self.fill, self.fill + n))
        self.fill += n

    def close(self) -> None:
        """Record, per device, an event after the last copy queued into this buffer."""
        closed = []
        for dev, _ in self.events:
            mod = event_module(dev)
            event = mod.Event()
            event.record(mod.current_stream(dev))
            closed.append((dev, event))
        self.events = closed

    def wait(self) -> None:
        for _dev, event in self.events:
            event.synchronize()
        self.events, self.keep = [], []


class HostRing:
    """``slots`` round-robin host buffers of ``chunk_bytes`` each, allocated on first use."""

    def __init__(self, chunk_bytes: int, slots: Optional[int] = None) -> None:
        self.chunk_bytes = chunk_bytes
        self.max_slots = slots if slots is not None else ring_slots()
        self._slots: List[Slot] = []
        self._next = 0

    @staticmethod
    def _alloc(nbytes: int) -> torch.Tensor:
        return alloc_host(nbytes)

    def acquire(self) -> Slot:
        """The next buffer in turn (the caller waits until it is written before reusing it)."""
        if len(self._slots) < self.max_slots:
            slot = Slot(self._alloc(self.chunk_bytes))
            self._slots.append(slot)
        else:
            slot = self._slots[self._next % len(self._slots)]
            self._next += 1
        return slot
