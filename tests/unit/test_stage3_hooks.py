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


def _count_gathers(engine) -> list:
    """The names of the parameters each gather of ``engine`` starts from released, appended
    as they start (the engine's own method is wrapped for the rest of its life)."""
    from shardwise.zero.stage3.partition import record_of
    name_of = {id(record_of(p)): n for n, p in engine.module.named_parameters()}
    gathers = engine.strategy.gathers
    real_start = gathers.start
    started: list = []

    def counting_start(recs):
        recs = list(recs)
        started.extend(name_of[id(r)] for r in recs if r.status == "released")
        return real_start(recs)

    gathers.start = counting_start
    return started


def _config(ga: int, delayed: bool = False, reuse: int = 0, live: int = 10**9) -> dict:
    """``reuse`` 0: only the edge modules are kept across a turn (nothing else is reused
    within 0 elements)."""
    zero = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1,
            "stage3_max_reuse_distance": reuse, "stage3_max_live_parameters": live}
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


@pytest.mark.parametrize("bound", ["max_reuse_distance", "max_live_parameters"])
def test_parameters_reused_across_a_turn_within_max_reuse_distance_stay_gathered(bound: str):
    """DeepSpeed's stage3_max_reuse_distance counts along a trace that runs through forward
    and backward: a module whose next use (in the other pass) comes within that many
    elements keeps its gathered parameters over the turn instead of gathering them twice.
    TinyNet runs fc1, fc2, head forward and head, fc2, fc1 backward; with a distance between
    2 x head (fc2's gap over the forward->backward turn) and 2 x (fc2 + head) (fc1's gap), fc2
    stays gathered into backward; its gap over the backward->forward turn, 2 x fc1, is
    shorter still, so it stays into the next forward too; fc1 (forward->backward) and head
    (backward->forward) do not. The same sets when the distance is unbounded but what is kept
    must leave the prefetch bucket (1 element) of room under max_live_parameters, set to
    everything but one element: the two modules nearest each turn fit, the third does not."""
    import shardwise
    from shardwise.zero.stage3.partition import record_of
    model = make_model()
    size = {n: p.numel() for n, p in model.named_parameters()}
    fc1, fc2, head = (size[f"{m}.weight"] + size[f"{m}.bias"] for m in ("fc1", "fc2", "head"))
    assert 2 * head < 2 * fc1 < 2 * (fc2 + head) - 1 < 2 * (fc1 + fc2)
    if bound == "max_reuse_distance":
        config = _config(ga=2, reuse=2 * (fc2 + head) - 1)
    else:
        config = _config(ga=2, reuse=10**9, live=1 + fc1 + fc2 + head - 1)
    engine, *_ = shardwise.initialize(model=model, config=config)
    padded = {n: record_of(p).padded for n, p in engine.module.named_parameters()}
    assert padded == size  # one rank: nothing padded, so the distances above are exact
    started = _count_gathers(engine)
    seen, fc2_gathers = [], []
    for x, y in global_batches(3, 4):
        for k in range(2):
            started.clear()
            loss = engine(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2])
            after_forward = _gathered(engine)
            engine.backward(loss)
            seen.append((after_forward, _gathered(engine)))
            fc2_gathers.append(started.count("fc2.weight"))
            engine.step()
    fc1_names, fc2_names = {"fc1.weight", "fc1.bias"}, {"fc2.weight", "fc2.bias"}
    head_names = {"head.weight", "head.bias"}
    for i, (after_forward, after_backward) in enumerate(seen[1:], start=1):
        assert after_forward == fc2_names | head_names, i
        boundary = i % 2 == 1
        assert after_backward == (set() if boundary else fc1_names | fc2_names), i
    # once traced, fc2 is gathered once per window: by the forward after a step, and never
    # again by its backward or by the window's second forward
    assert fc2_gathers[1:] == [0, 1, 0, 1, 0], fc2_gathers
    engine.destroy()


def test_kept_parameters_change_nothing_in_the_result():
    import shardwise
    engine, *_ = shardwise.initialize(model=make_model(), config=_config(ga=3, reuse=10**9))
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


def _train_llama_counting_gathers(reuse: int, windows: int = 3, ga: int = 2):
    """An 8-layer Llama with grouped-query attention under stage 3 (nothing persistent, each
    decoder layer gathered as one piece), GA 2: how often each layer is gathered in each
    window, and the trained parameters."""
    import shardwise
    import transformers
    from shardwise.zero import GatheredParameters
    from tests.distributed._hf_tiny import batches, hf_config

    config = hf_config("llama-gqa")
    config.num_hidden_layers = 8
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    engine, *_ = shardwise.initialize(model=model, config=engine_config(
        3, 2, ga, 0.0, 1e-2, zero_optimization={
            "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1,
            "stage3_max_reuse_distance": reuse, "stage3_max_live_parameters": 10**9}))
    # each decoder layer gathered as one piece, as the compiled engine gathers it
    engine.strategy.coordinator.set_units(list(engine.module.model.layers))
    started = _count_gathers(engine)
    counts = []
    for ids in batches(windows, 2 * ga):
        started.clear()
        for k in range(ga):
            part = ids[2 * k:2 * k + 2]
            engine.backward(engine(input_ids=part, labels=part).loss)
            engine.step()
        counts.append([started.count(f"model.layers.{i}.self_attn.q_proj.weight")
                       for i in range(8)])
    with GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return sizes, counts, params


def test_a_llama_gathers_the_layers_nearest_each_turn_once_less():
    """The rule on a user's shape (Llama, GQA, every parameter partitioned): in a window of two
    micro steps a layer is gathered four times (each forward, each backward) less once per
    turn it is kept over. Layer k stays gathered into backward when twice the elements after
    it in forward (the later layers, the final norm, the lm_head) are within
    max_reuse_distance, and from backward into the next forward when twice the elements
    before it (the embedding, the earlier layers) are. The kept copies change no result."""
    sizes, plain_counts, plain = _train_llama_counting_gathers(reuse=0)
    layer = sum(v for n, v in sizes.items() if n.startswith("model.layers.0."))
    norm, head = sizes["model.norm.weight"], sizes["lm_head.weight"]
    embed = sizes["model.embed_tokens.weight"]
    reuse = 2 * (3 * layer + norm + head)
    after = {k: 2 * ((7 - k) * layer + norm + head) for k in range(8)}
    before = {k: 2 * (k * layer + embed) for k in range(8)}
    kept_into_backward = {k for k in range(8) if after[k] <= reuse}
    kept_into_forward = {k for k in range(8) if before[k] <= reuse}
    assert kept_into_backward == {4, 5, 6, 7} and kept_into_forward == {0, 1, 2, 3}
    _, counts, params = _train_llama_counting_gathers(reuse=reuse)
    _, all_counts, all_kept = _train_llama_counting_gathers(reuse=10**9)
    want = [4 - 2 * (k in kept_into_backward) - (k in kept_into_forward) for k in range(8)]
    for window in range(1, 3):  # the first window records the order
        assert plain_counts[window] == [4] * 8, plain_counts
        assert counts[window] == want, counts
        assert all_counts[window] == [1] * 8, all_counts
    for name in plain:
        assert torch.equal(params[name], plain[name]), name
        assert torch.equal(all_kept[name], plain[name]), name
