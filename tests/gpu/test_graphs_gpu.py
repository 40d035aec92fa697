"""accelerator.graphs.GraphedCallable on CUDA: captured once per input shape, replays see new
inputs, and ``reset`` re-captures after a buffer the graph reads was reallocated."""
from __future__ import annotations

import pytest
import torch

from shardwise.accelerator.graphs import GraphedCallable

pytestmark = pytest.mark.gpu


def test_replays_follow_inputs_and_shapes_and_reset():
    state = {"table": torch.arange(4.0, device="cuda")}
    eager_calls = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        eager_calls.append(1)
        return x * 2 + state["table"][: x.shape[-1]].sum()

    step = GraphedCallable(fn, warmup=2)
    a = torch.ones(3, device="cuda")
    assert torch.equal(step(a), a * 2 + 3)  # 0+1+2
    assert len(eager_calls) == 3  # two warm-ups and the capture
    b = torch.full((3,), 5.0, device="cuda")
    assert torch.equal(step(b), b * 2 + 3) and len(eager_calls) == 3  # a replay
    c = torch.ones(2, device="cuda")
    assert torch.equal(step(c), c * 2 + 1) and len(step) == 2  # its own graph
    state["table"] = torch.full((4,), 10.0, device="cuda")  # reallocated
    assert torch.equal(step(b), b * 2 + 3)  # the graph still reads the old table
    step.reset()
    assert torch.equal(step(b), b * 2 + 30) and len(step) == 1
