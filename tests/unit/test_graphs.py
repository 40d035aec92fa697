"""accelerator.graphs.GraphedCallable's graph and pool lifecycle, on the CPU.

CI has no GPU, so ``torch.cuda``'s graph surface is replaced by a model of the caching
allocator's rule for private pools (c10/cuda/CUDACachingAllocator.cpp, beginAllocateToPool):
a capture into a pool id that the allocator still knows must find a live graph on it
(use_count > 0); a destroyed graph only decrements the count, and the pool stays known until
its memory is released. tests/gpu/test_graphs_gpu.py and test_inference_gpu.py's regional
rows run the real thing.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref

import pytest
import torch

from shardwise.accelerator.graphs import GraphedCallable


class _Allocator:
    def __init__(self) -> None:
        self.use_count: dict = {}
        self._ids = itertools.count(1)
        self.captures = []

    def handle(self):
        return (0, next(self._ids))

    def begin(self, pool) -> None:
        if pool in self.use_count:
            if self.use_count[pool] <= 0:
                raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
            self.use_count[pool] += 1
        else:
            self.use_count[pool] = 1
        self.captures.append(pool)

    def release(self, pool) -> None:
        self.use_count[pool] -= 1


@pytest.fixture
def allocator(monkeypatch):
    alloc = _Allocator()

    class Stream:
        def __init__(self, device=None) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

    class CUDAGraph:
        def __init__(self) -> None:
            self.pool = None

        def replay(self) -> None:
            pass

    @contextlib.contextmanager
    def graph(g, pool=None):
        alloc.begin(pool)
        g.pool = pool
        weakref.finalize(g, alloc.release, pool)
        yield

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", alloc.handle)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return alloc


def test_shapes_share_a_pool_and_reset_captures_into_a_fresh_one(allocator):
    """The regional decode step at batch 1, then batch 32 after the cache was reallocated:
    before the fix the second capture reused the dead pool and the allocator asserted."""
    step = GraphedCallable(lambda x: x * 2, warmup=1)
    one = step(torch.ones(1, 4))
    assert torch.equal(one, torch.full((1, 4), 2.0))
    step(torch.ones(2, 4))  # a second shape while the first graph lives: the same pool
    assert len(step) == 2 and allocator.captures[0] == allocator.captures[1]
    step.reset()  # what FastDecoder does when its KV cache is reallocated
    assert len(step) == 0 and allocator.use_count[allocator.captures[0]] == 0
    out = step(torch.full((32, 4), 3.0))  # `one` still holds memory of the old pool
    assert torch.equal(out, torch.full((32, 4), 6.0)) and len(step) == 1
    assert allocator.captures[2] != allocator.captures[0]
    assert allocator.use_count[allocator.captures[2]] == 1
