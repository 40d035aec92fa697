"""An engine that is no longer referenced frees its model, gradients and optimizer states.

Before the fix every engine kept them until the process ended, ``destroy()`` or not: the
stage 0-2 gradient hooks were bound methods of the strategy stored on the parameters (where the
cycle collector cannot see them), and stage 3's partition records called back into the
strategy strongly while the process-wide owner table kept the records alive. A loop that
builds engines (RLHF, a sweep, a notebook) grew by four times the model each time.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import shardwise

# 256 x 512 projections: above stage 3's persistence threshold, so they are partitioned
CFG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=512)

ZERO = {
    "stage0": {"stage": 0},
    "stage2": {"stage": 2},
    "stage2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "stage3": {"stage": 3},
    "stage3_offload": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                       "offload_param": {"device": "cpu"}},
}


def _train_and_drop(zero, destroy: bool):
    """Train two steps, drop every reference; returns weak references to what must be freed."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, optimizer, _, _ = shardwise.initialize(model=model, config=config)
    ids = torch.randint(0, CFG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    partitioned = 0
    if zero["stage"] == 3:
        record = engine.strategy.partitioner.record
        partitioned = sum(record(p) is not None and p.numel() == 0 for p in model.parameters())
    refs = [weakref.ref(p) for p in model.parameters()] + [weakref.ref(engine),
                                                          weakref.ref(optimizer)]
    if destroy:
        engine.destroy()
    del engine, optimizer, model, loss
    return refs, partitioned


@pytest.mark.parametrize("name", sorted(ZERO))
@pytest.mark.parametrize("destroy", [False, True], ids=["dropped", "destroyed"])
def test_an_engine_dropped_frees_its_model_and_states(name, destroy):
    refs, partitioned = _train_and_drop(ZERO[name], destroy)
    if name.startswith("stage3"):
        assert partitioned >= 8, "the test model must have partitioned parameters"
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} objects outlived their engine: " \
                      f"{[type(o).__name__ for o in alive][:5]}"


def test_an_nvme_offload_engine_dropped_frees_its_model_and_its_swap_files(tmp_path):
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    refs, partitioned = _train_and_drop({"stage": 3, "offload_param": nvme,
                                         "offload_optimizer": nvme}, destroy=False)
    assert partitioned >= 8
    gc.collect()
    assert not [r for r in refs if r() is not None]
    assert not [f for f in tmp_path.rglob("*") if f.is_file()]


def test_a_model_built_under_zero_init_is_freed_with_its_engine():
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with shardwise.zero.Init(config_dict_or_path=config):
        model = LlamaForCausalLM(LlamaConfig(**CFG))
    engine, optimizer, _, _ = shardwise.initialize(model=model, config=config)
    ids = torch.randint(0, CFG["vocab_size"], (2, 16))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    refs = [weakref.ref(p) for p in model.parameters()] + [weakref.ref(engine)]
    del engine, optimizer, model
    gc.collect()
    assert not [r for r in refs if r() is not None]


def test_a_dead_engines_gradient_hooks_do_nothing():
    """The model outlives its engine (a user keeps training it with plain torch): the hooks
    left on its parameters are inert and the gradients are plain ``.grad`` again."""
    model = LlamaForCausalLM(LlamaConfig(**CFG))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, optimizer, _, _ = shardwise.initialize(model=model, config=config)
    ids = torch.randint(0, CFG["vocab_size"], (2, 16))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    ref = weakref.ref(engine)
    del engine, optimizer
    gc.collect()
    assert ref() is None
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
