"""Parameters-only ZeRO stage 3: ``initialize`` without an optimizer partitions (and, with
``offload_param``, offloads) the model, and ``generate`` gives the plain model's tokens."""
from __future__ import annotations

import pytest
import torch

from tests.distributed._hf_tiny import build

PROMPT = torch.tensor([[3, 14, 15, 9, 2]])
GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload_param"])
@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_stage3_without_optimizer_partitions_and_generates_the_same_tokens(kind: str,
                                                                          offload: bool) -> None:
    import shardwise
    from shardwise.zero import is_partitioned
    from shardwise.zero.stage3.partition import record_of
    plain = build(kind).eval()
    with torch.no_grad():
        want = plain.generate(PROMPT, **GEN)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 10}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
    engine, optimizer, _, _ = shardwise.initialize(
        model=build(kind), config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})
    assert optimizer is None
    parts = [p for p in engine.module.parameters() if is_partitioned(p)]
    assert len(parts) == sum(1 for _ in engine.module.parameters()), "every parameter is above 10"
    assert all(p.numel() == 0 for p in parts)
    if offload:
        assert {record_of(p).shard.device.type for p in parts} == {"cpu"}
    engine.eval()
    with torch.no_grad():
        got = engine.module.generate(PROMPT, **GEN)
    assert torch.equal(got, want), (got, want)
    assert all(p.numel() == 0 for p in parts), "parameters left gathered after generate()"
    engine.destroy()


def test_eval_forward_keeps_the_training_trace() -> None:
    """An eval/generate forward records its own order: the training trace survives it."""
    import shardwise
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10}}
    engine, *_ = shardwise.initialize(model=build("llama"), config=cfg)
    ids = torch.randint(0, 100, (2, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    coord = engine.strategy.coordinator
    train = coord.traces["train"]
    assert train.modules, "a training forward records its order"
    with torch.no_grad():
        engine.module.generate(PROMPT, **GEN)
    assert coord.traces["train"] is train, "generate() replaced the training trace"
    assert coord.traces["eval"].modules and coord.traces["eval"] is not train
    engine.destroy()
