"""Activation checkpointing on CUDA: memory really leaves the device; the estimator matches."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

ck = shardwise.checkpointing
H, LAYERS = 1024, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.up = nn.Linear(H, 4 * H)
        self.down = nn.Linear(4 * H, H)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(LAYERS)]).cuda()


def _forward_memory(model: nn.Module, x: torch.Tensor):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.manual_seed(1)
    out = model(x)
    torch.cuda.synchronize()
    # Blocks freed while a side-stream copy used them are returned on the next allocation.
    torch.empty(1, device="cuda")
    held = torch.cuda.memory_allocated() - before
    out.float().square().mean().backward()
    torch.cuda.synchronize()
    return held, [p.grad.clone() for p in model.parameters()]


@pytest.fixture(autouse=True)
def _fresh_state():
    ck.configure()
    yield
    ck.configure()


def test_cpu_checkpointing_and_offload_free_device_memory():
    x = torch.randn(8, 512, H, device="cuda")
    block_input = x.numel() * x.element_size()
    plain_held, plain_grads = _forward_memory(_net(), x)

    full = _net()
    ck.apply(full, "full", modules=["Block"])
    full_held, full_grads = _forward_memory(full, x)

    ck.configure(checkpoint_in_cpu=True)
    cpu = _net()
    ck.apply(cpu, "full", modules=["Block"])
    cpu_held, cpu_grads = _forward_memory(cpu, x)
    ck.configure()

    off = _net()
    ck.apply(off, "offload", modules=["Block"])
    off_held, off_grads = _forward_memory(off, x)
    stats = ck.offload_stats(off)

    # full keeps one input per block; cpu_checkpointing keeps (almost) none of them on the device.
    assert full_held < plain_held / 4
    assert full_held >= (LAYERS - 1) * block_input
    assert cpu_held <= full_held - (LAYERS - 1) * block_input + block_input
    assert stats.kept_on_device_count == 0 and stats.offloaded_bytes > plain_held / 2
    assert off_held < plain_held / 4
    for grads in (full_grads, cpu_grads, off_grads):
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(plain_grads, grads))


def test_activation_estimate_within_10_percent_on_cuda():
    import transformers
    from shardwise.profiling.memory_estimator import estimate_activations, model_shape
    cfg = transformers.LlamaConfig(hidden_size=512, num_hidden_layers=4, intermediate_size=1408,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=8000,
                                   use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).train()
    b, s = 4, 512
    ids = torch.randint(0, cfg.vocab_size, (b, s), device="cuda")
    results = {}
    for mode in ("none", "full"):
        if mode == "full":
            ck.apply(model, "full")
        # Earlier tests in this process can leave CUDA tensors in reference cycles; a garbage
        # collection inside the measured forward once freed 1.5 GB of them and made "full"
        # negative (2026-12-06, after test_engine_gpu). Collect first, none during the forward.
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        gc.disable()
        try:
            out = model(input_ids=ids, labels=ids)
            torch.cuda.synchronize()
        finally:
            gc.enable()
        results[mode] = torch.cuda.memory_allocated() - before
        out.loss.backward()
        del out
        model.zero_grad(set_to_none=True)
    shape = model_shape(model)
    est_none = estimate_activations(shape, b, s, "bf16").device
    # After the forward no block is being recomputed, so compare "full" without that one block.
    est_full = estimate_activations(shape, b, s, "bf16", "full").device
    from shardwise.profiling.memory_estimator import activation_bytes_per_layer
    est_full -= activation_bytes_per_layer(shape, b, s, 2)
    assert abs(est_none - results["none"]) <= 0.1 * results["none"]
    assert abs(est_full - results["full"]) <= 0.1 * results["full"]
