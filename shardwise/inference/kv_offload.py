"""``kv_offload: true`` (DeepSpeed ZeRO-Inference's name): the fast path's KV cache in pinned
host memory, streamed to the device one layer ahead of the attention that reads it.

Layout: per layer, one host buffer of shape ``(length, 2, batch, kv_heads, head_dim)`` (K and
V of a position next to each other), so the filled prefix ``[:n]`` of a layer is ONE
contiguous block: one host->device copy per layer, of only the positions written so far.
Two device slots of the same shape take turns; a block sees its slot as the usual
``(batch, kv_heads, length, head_dim)`` K and V views (strided), so ``decode.Block`` does not
know the cache is offloaded.

Per pass (``FastDecoder.prefill`` / ``step``):

* ``begin_pass(prompt)``: a prefill writes positions ``[0, prompt)``, a step one position at
  ``filled`` (the decode loop's ``pos``, which always equals ``filled``);
* ``kv(i)``: waits (device side, an event) for layer ``i``'s copy, then queues layer
  ``i + 1``'s (the next pass's layer 0 after the last layer) on the copy stream into the other
  slot, after the compute of the layer that used that slot last;
* ``written(i)``: after block ``i`` ran, its new positions go back to the host buffer on the
  same copy stream (so a later copy of layer ``i`` always sees them);
* ``end_pass()``: ``filled`` moves on.

Positions past ``filled`` in a slot hold another layer's values: the step's mask hides every
position after ``pos`` and the prefill attends to its own keys only, so they are never read.
On a CPU-only machine the same code runs with the device = CPU (copies are memcpy).
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from ..accelerator import get_accelerator
from .weight_store import host_buffer


class OffloadedKVCache(nn.Module):
    """Drop-in for ``decode.StaticCache`` with the cache in (pinned) host memory."""

    offloaded = True

    def __init__(self, n_layers: int, batch: int, kv_heads: int, length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, pin: bool = True) -> None:
        super().__init__()
        self.batch, self.length, self.dtype, self.device = batch, length, dtype, device
        self.acc = get_accelerator()  # streams and events, looked up once
        self.shape = (length, 2, batch, kv_heads, head_dim)
        self.n_layers = n_layers
        numel = length * 2 * batch * kv_heads * head_dim
        size = torch.empty((), dtype=dtype).element_size()
        self.host: List[torch.Tensor] = []
        for _ in range(n_layers):  # only written positions are ever read: no zeroing
            buf = host_buffer(numel * size, pin=pin and device.type == "cuda")
            self.host.append(buf.view(dtype).view(self.shape))
        # zeroed: positions a step masks out hold finite values (0 * NaN would leak)
        self.slots = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(2)]
        self.views = [self._kv_views(s) for s in self.slots]
        cuda = device.type == "cuda"
        self.stream = self.acc.Stream(device) if cuda else None
        self.owner: List[Optional[int]] = [None, None]  # the layer whose K/V a slot holds
        self.valid = [0, 0]  # ... for positions [0, valid)
        self.ready: List[Any] = [None, None]  # copy into the slot done (copy stream)
        self.done: List[Any] = [None, None]   # compute on the slot done (compute stream)
        self.filled = 0  # positions [0, filled) are in every layer's host buffer
        self.start, self.new = 0, 0  # the current pass writes positions [start, start + new)
        self._current = 1  # the slot of the layer computing now
        self.stats = {"copies": 0, "bytes_in": 0, "bytes_out": 0}

    @staticmethod
    def _kv_views(slot: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        # (L, 2, B, H, D) -> K and V as (B, H, L, D) views
        return slot[:, 0].permute(1, 2, 0, 3), slot[:, 1].permute(1, 2, 0, 3)

    # --- the pass --------------------------------------------------------------------------
    def begin_pass(self, prompt: Optional[int]) -> None:
        """A prefill of ``prompt`` positions (restarts the cache), or one step (None)."""
        if prompt is not None:  # the slots' contents are from an earlier sequence now
            self.start, self.new, self.filled = 0, prompt, 0
            self.owner = [None, None]
        else:
            self.start, self.new = self.filled, 1

    def end_pass(self) -> None:
        self.filled = self.start + self.new

    def kv(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K/V on the device (its copy waited for); layer ``i + 1`` queued."""
        slot = self._fetch(i, self.start, avoid=self._current)
        if self.stream is not None and self.ready[slot] is not None:
            self.acc.current_stream(self.device).wait_event(self.ready[slot])
        self._current = slot
        if i + 1 < self.n_layers:
            self._fetch(i + 1, self.start, avoid=slot)
        return self.views[slot]

    def written(self, i: int) -> None:
        """Block ``i`` wrote its positions ``[start, start + new)``: copy them to the host;
        after the last layer, queue the next step's layer 0 (which must see them)."""
        slot = self._current
        lo, hi = self.start, self.start + self.new
        src, dst = self.slots[slot][lo:hi], self.host[i][lo:hi]
        if self.stream is None:
            dst.copy_(src)
        else:
            ev = self.acc.Event()
            ev.record(self.acc.current_stream(self.device))
            self.done[slot] = ev
            with self.acc.stream(self.stream):
                self.stream.wait_event(ev)
                dst.copy_(src, non_blocking=True)
        self.owner[slot], self.valid[slot] = i, hi  # the slot now holds [0, hi) of layer i
        self.stats["bytes_out"] += dst.numel() * dst.element_size()
        if i == self.n_layers - 1:
            self._fetch(0, hi, avoid=slot)

    def _fetch(self, layer: int, upto: int, avoid: int) -> int:
        """A slot holding ``layer``'s positions ``[0, upto)``: one already there, else a copy
        queued into the slot other than ``avoid``, after that slot's last compute."""
        for s in range(2):
            if self.owner[s] == layer and self.valid[s] >= upto:
                return s
        slot = 1 - avoid
        src, dst = self.host[layer][:upto], self.slots[slot][:upto]
        if self.stream is None:
            dst.copy_(src)
        else:
            with self.acc.stream(self.stream):
                if self.done[slot] is not None:
                    self.stream.wait_event(self.done[slot])
                dst.copy_(src, non_blocking=True)
                ev = self.acc.Event()
                ev.record(self.stream)
            self.ready[slot] = ev
        self.owner[slot], self.valid[slot] = layer, upto
        self.stats["copies"] += 1
        self.stats["bytes_in"] += src.numel() * src.element_size()
        return slot


def host_cache_bytes(n_layers: int, batch: int, kv_heads: int, length: int, head_dim: int,
                     dtype: torch.dtype) -> int:
    """Host bytes of an offloaded cache (what ``kv_offload`` moves off the device)."""
    return n_layers * length * 2 * batch * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
