"""The ``fp8`` section on an FP8 GPU (compute capability >= 8.9) with torchao installed:
Float8Linear layers train like bf16 at ZeRO stages 0-3, eager and compiled, and checkpoints
keep the bf16 model's parameter names, shapes and dtypes."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import shardwise

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                       reason="needs FP8 tensor cores (compute capability >= 8.9)"),
    pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                       reason="torchao (optional third-party package) is not installed"),
]


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=512,
                                        attn_implementation="sdpa", use_cache=False))


def config(stage: int, fp8: dict | None, compile_: bool = False) -> dict:
    # stage 3: every weight above the persistence threshold is a shard gathered per layer
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 1000} if stage == 3 else {})}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
           "zero_optimization": zero, "steps_per_print": 1_000_000}
    if fp8 is not None:
        cfg["fp8"] = fp8
    if compile_:
        cfg["compile"] = {"enabled": True, "backend": "inductor"}
    return cfg


def train(engine, steps: int) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    # a learnable task: copy a short random pattern (the loss can fall far below ln(vocab))
    pattern = torch.randint(0, 512, (4, 16), generator=gen)
    x = pattern.repeat(1, 8).to(engine.device)
    losses = []
    for _ in range(steps):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_trains_like_bf16(stage: int, recipe: str) -> None:
    ref, *_ = shardwise.initialize(model=llama(), config=config(stage, None))
    ref_losses = train(ref, 40)
    engine, *_ = shardwise.initialize(model=llama(),
                                      config=config(stage, {"enabled": True, "recipe": recipe}))
    kinds = {type(m).__name__ for m in engine.module.modules()}
    assert "Float8Linear" in kinds and type(engine.module.lm_head).__name__ == "Linear"
    losses = train(engine, 40)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]  # it learns
    assert abs(losses[-1] - ref_losses[-1]) <= 0.1 * ref_losses[0], (losses[-1], ref_losses[-1])


@pytest.mark.parametrize("stage", [2, 3])
def test_fp8_compiled_trains(stage: int) -> None:
    engine, *_ = shardwise.initialize(model=llama(),
                                      config=config(stage, {"enabled": True}, compile_=True))
    assert engine.is_compiled
    losses = train(engine, 20)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_fp8_checkpoint_loads_into_a_bf16_engine(tmp_path) -> None:
    engine, *_ = shardwise.initialize(model=llama(), config=config(2, {"enabled": True}))
    train(engine, 3)
    plain = llama()
    assert {k: v.shape for k, v in engine.module.state_dict().items()} == \
        {k: v.shape for k, v in plain.state_dict().items()}
    assert {v.dtype for v in engine.module.state_dict().values()} == {torch.bfloat16}
    engine.save_checkpoint(str(tmp_path), tag="fp8")
    bf16, *_ = shardwise.initialize(model=plain, config=config(2, None))
    bf16.load_checkpoint(str(tmp_path), tag="fp8")
    saved = engine.module.state_dict()
    for name, value in bf16.module.state_dict().items():
        assert torch.equal(value, saved[name]), name
