"""A callable replayed as CUDA graphs that we capture ourselves (one per input shape).

The fast decode path normally lets ``torch.compile`` capture its step (inductor's CUDA graph
trees). With regional compilation (``DecodeOptions.regional``) only each decoder layer is
compiled and the step around the layers runs eagerly, so the graph has to be captured here:

    step = GraphedCallable(decoder.step)
    logits = step(ids, pos, positions, key_mask)   # 1st call per shape: warm up, capture, replay

Each call copies its inputs into the graph's static input tensors and replays; the returned
tensor lives in the graph's memory and is valid until the next call (as with inductor's
graphs). Whatever else the callable reads (weights, the KV cache, rotary tables) is baked
into the graph by address: call :meth:`reset` when any of it is reallocated.

The graphs of one ``GraphedCallable`` share a memory pool while any of them lives. ``reset``
drops the pool handle with the graphs: PyTorch's caching allocator refuses a capture into a
pool whose graphs are all gone but whose memory is not yet released ("use_count > 0
INTERNAL ASSERT FAILED"), which is what a batch-size change under regional compilation did
on the 2026-12-07 H100 run (RESULTS.md, eighteenth session).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch

Key = Tuple[Tuple[Tuple[int, ...], torch.dtype], ...]


class GraphedCallable:
    """``fn(*tensors) -> tensor`` as CUDA graph replays, captured on first use per shape."""

    def __init__(self, fn: Callable[..., torch.Tensor], warmup: int = 2) -> None:
        self.fn = fn
        self.warmup = warmup
        """Eager calls on a side stream before capture: compilation, autotuning and lazy
        initialisation must not happen while a graph is being captured."""
        self._graphs: Dict[Key, Tuple[List[torch.Tensor], Any, torch.Tensor]] = {}
        self._pool: Any = None

    def reset(self) -> None:
        """Forget every graph (something they read was reallocated) and their memory pool."""
        self._graphs.clear()
        self._pool = None

    def __len__(self) -> int:
        return len(self._graphs)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        key = tuple((tuple(t.shape), t.dtype) for t in inputs)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(inputs)
        static, graph, out = entry
        for buffer, value in zip(static, inputs):
            buffer.copy_(value, non_blocking=True)
        graph.replay()
        return out

    def _capture(self, inputs: Tuple[torch.Tensor, ...]) -> Tuple[List[torch.Tensor], Any, torch.Tensor]:
        static = [t.clone() for t in inputs]
        side = torch.cuda.Stream(device=static[0].device)
        side.wait_stream(torch.cuda.current_stream(static[0].device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.fn(*static)
        torch.cuda.current_stream(static[0].device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.fn(*static)
        return static, graph, out


__all__ = ["GraphedCallable"]
