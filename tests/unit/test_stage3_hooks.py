"""zero/stage3/hooks.py: what stays gathered across the gather schedule's two turns.

The last module of a forward that records gradients is the first of its backward, and the
first module of forward comes right after a backward that is not followed by a step: their
parameters stay gathered across each turn. Across an optimizer step (and a delayed update
reaching the weights) nothing gathered may survive."""
from __future__ import annotations

import pytest
import torch

from tests.distributed._parity import (engine_config, global_batches, make_model, max_rel_diff,
                                       reference_params)


def _gathered(engine) -> set:
    from shardwise.zero.stage3.partition import record_of
    return {n for n, p in engine.module.named_parameters()
            if record_of(p) is not None and record_of(p).status != "released"}


def _config(ga: int, delayed: bool = False) -> dict:
    zero = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1}
    if delayed:
        zero["offload_optimizer"] = {"device": "cpu", "delayed_update": True}
    return engine_config(3, 2, ga, 0.0, 1e-2, zero_optimization=zero)


def test_edge_modules_stay_gathered_across_turns_and_a_step_releases_all():
    import shardwise
    engine, *_ = shardwise.initialize(model=make_model(), config=_config(ga=2))
    first, last = {"fc1.weight", "fc1.bias"}, {"head.weight", "head.bias"}
    seen = []
    for x, y in global_batches(3, 4):
        for k in range(2):
            loss = engine(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2])
            after_forward = _gathered(engine)
            engine.backward(loss)
            after_backward = _gathered(engine)
            engine.step()
            seen.append((after_forward, after_backward, _gathered(engine)))
    # the very first forward only records the order: nothing is known to keep yet
    assert seen[0][0] == set()
    for i, (after_forward, after_backward, after_step) in enumerate(seen):
        if i:  # the first module was used (and released) by the forward; the last waits
            assert after_forward == last, i
        boundary = i % 2 == 1
        # the non-boundary backward keeps the first module for the next forward...
        assert after_backward == (set() if boundary else first), i
        # ...and nothing survives a step
        assert after_step == (set() if boundary else first), i
    with torch.no_grad():  # no backward follows: nothing is kept for one
        engine(*global_batches(1, 2)[0])
    assert _gathered(engine) == set()
    engine.destroy()


def test_kept_parameters_change_nothing_in_the_result():
    import shardwise
    engine, *_ = shardwise.initialize(model=make_model(), config=_config(ga=3))
    for x, y in global_batches(4, 6):
        for k in range(3):
            engine.backward(engine(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2]))
            engine.step()
    from shardwise.zero import GatheredParameters
    with GatheredParameters(list(engine.module.parameters())):
        got = {k: v.detach().float().clone() for k, v in engine.module.named_parameters()}
    assert not max_rel_diff(got, reference_params(4, 6, 1e-2, 0.0))
    engine.destroy()


@pytest.mark.parametrize("how", ["flush", "shard_views"])
def test_a_delayed_update_reaching_the_weights_releases_what_was_kept(how: str):
    """DPU: the update of the last step lands mid-window (a checkpoint flushes it); the
    first module's weights kept since the last backward are stale from then on."""
    import shardwise
    engine, *_ = shardwise.initialize(model=make_model(), config=_config(ga=2, delayed=True))
    (x, y), (x2, y2) = global_batches(2, 4)
    for k in range(2):  # one full step: its update is pending in the background
        engine.backward(engine(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2]))
        engine.step()
    engine.backward(engine(x2[:2], y2[:2]))
    engine.step()
    assert _gathered(engine) == {"fc1.weight", "fc1.bias"}
    assert engine.strategy.schedule.pending is not None
    getattr(engine.strategy, how)()
    assert _gathered(engine) == set()
    engine.destroy()


class _LossAndLogits(torch.nn.Module):
    """An HF-style root: returns (loss, logits), the loss computed from the logits inside."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(32, 48)

    def forward(self, x, y):
        logits = self.head(torch.relu(self.body(x)))
        return torch.nn.functional.cross_entropy(logits, y), logits


def test_an_unused_output_gets_no_materialised_zero_gradient():
    """Regression: the root's outputs were wrapped in an autograd function that let autograd
    fill a zero gradient of the logits' size for the logits the loss backward never used
    (1 GiB at the 1.1B benchmark's backward peak), and add it into their real gradient."""
    import shardwise
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if torch.is_tensor(out):
                self.made.append((func.overloadpacket.__name__, tuple(out.shape)))
            return out

    torch.manual_seed(0)
    model = _LossAndLogits()
    zero = {"stage3_param_persistence_threshold": 0}
    engine, *_ = shardwise.initialize(model=model, config=engine_config(
        3, 6, 1, 0.0, 1e-2, zero_optimization=zero))
    x, y = torch.randn(6, 16), torch.randint(0, 48, (6,))
    loss, logits = engine(x, y)
    with Recorder() as rec:
        engine.backward(loss)
    zeros = [(op, shape) for op, shape in rec.made
             if shape == tuple(logits.shape) and "zero" in op]
    assert not zeros, zeros
    engine.step()
    engine.destroy()
