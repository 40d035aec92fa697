"""dtype "int8": weight-only int8 linears (per-channel scales), accuracy measured."""
import copy

import pytest
import torch
from torch import nn

import shardwise
from shardwise.inference.quant import (WeightOnlyInt8Linear, int8_gemv, int8_linear,
                                       int8_perplexity_delta, quantize_weight)
from tests.unit._inference_models import prompts, tiny


def test_per_channel_quantization_round_trips():
    w = torch.randn(32, 16) * torch.linspace(0.01, 3, 32)[:, None]  # rows of very different scale
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (32,)
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()  # half a step per channel
    x = torch.randn(5, 16)
    torch.testing.assert_close(int8_linear(x, q, scale), x @ (q.float() * scale[:, None]).t(),
                               rtol=1e-4, atol=1e-4)
    # the compiled-CUDA decode form (reduction instead of matmul) computes the same product
    for rows in (x[:1], x[:2, None]):
        torch.testing.assert_close(int8_gemv(rows, q, scale), int8_linear(rows, q, scale),
                                   rtol=1e-4, atol=1e-4)
    half = x[:1].bfloat16()
    assert int8_gemv(half, q, scale).dtype == torch.bfloat16


@pytest.mark.parametrize("inject", [False, True])
def test_int8_engine_runs_and_stays_close(inject):
    m = tiny("llama")
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="int8", replace_with_kernel_inject=inject,
                                   max_out_tokens=64)
    linears = [mod for mod in eng.module.modules() if isinstance(mod, WeightOnlyInt8Linear)]
    assert len(linears) == 2 * 7  # q k v o gate up down per layer; the head stays float
    assert isinstance(eng.module.lm_head, nn.Linear)
    ids, mask = prompts(3)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    assert out.shape == (3, ids.shape[1] + 4)
    assert (eng.decoder is not None) == inject
    ref = m(ids, attention_mask=mask).logits
    got = eng.module(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert (got[keep] - ref[keep]).abs().max() < 0.05 * ref[keep].abs().max()


def test_int8_fast_path_equals_int8_plain_module():
    m = tiny("opt")
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="int8", replace_with_kernel_inject=True,
                                   max_out_tokens=64)
    ids, mask = prompts(3)
    ref = eng.module.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=1,
                              eos_token_id=None)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=1, eos_token_id=None)
    assert torch.equal(out, ref)


def test_perplexity_delta_is_reported():
    m = tiny("llama")
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    res = int8_perplexity_delta(m, ids, dtype=torch.float32)
    assert res["ppl_float"] > 1 and res["ppl_int8"] > 1
    assert abs(res["relative"]) < 0.02
    assert all(isinstance(p, nn.Parameter) for p in m.parameters())  # caller's model untouched
