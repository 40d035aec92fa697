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
    assert len(linears) == 2 * 7 + 1  # q k v o gate up down per layer, and the (untied) head
    assert isinstance(eng.module.lm_head, WeightOnlyInt8Linear)
    ids, mask = prompts(3)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    assert out.shape == (3, ids.shape[1] + 4)
    assert (eng.decoder is not None) == inject
    ref = m(ids, attention_mask=mask).logits
    got = eng.module(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert (got[keep] - ref[keep]).abs().max() < 0.05 * ref[keep].abs().max()


@pytest.mark.parametrize("family", ["opt", "llama", "gpt2"])  # tied heads stay float; Llama's is int8
def test_int8_fast_path_equals_int8_plain_module(family):
    m = tiny(family)
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="int8", replace_with_kernel_inject=True,
                                   max_out_tokens=64)
    assert eng.decoder.lm_head is eng.module.get_output_embeddings()
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


@pytest.mark.parametrize("family,tied", [("llama", False), ("gpt2", True), ("opt", True)])
def test_lm_head_quantized_unless_tied_or_turned_off(family, tied):
    """The output head is int8 by default (its bytes are read every decode step) unless it
    shares the input embedding's weight; ``quant.lm_head: false`` keeps it in float."""
    from shardwise.inference.quant import tied_head
    m = tiny(family)
    assert tied_head(m) == tied
    with shardwise.OnDevice(dtype=torch.float32, device="meta"):  # meta weights share pointer 0
        assert tied_head(type(m)(m.config)) == tied
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="int8", max_out_tokens=64)
    head = eng.module.get_output_embeddings()
    assert isinstance(head, WeightOnlyInt8Linear) != tied
    if tied:  # the embedding still holds the float weight the head reads
        assert head.weight is eng.module.get_input_embeddings().weight
    off = shardwise.init_inference(copy.deepcopy(m), config={"dtype": "int8", "quant": {"lm_head": False}},
                                   max_out_tokens=64)
    assert not isinstance(off.module.get_output_embeddings(), WeightOnlyInt8Linear)
    ids, mask = prompts(2)
    ref = m(ids, attention_mask=mask).logits
    keep = mask.bool()
    for engine in (eng, off):  # both close to the float model's logits
        got = engine.module(ids, attention_mask=mask).logits
        assert (got[keep] - ref[keep]).abs().max() < 0.05 * ref[keep].abs().max()


def test_perplexity_delta_with_and_without_the_head():
    m = tiny("llama")
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    with_head = int8_perplexity_delta(m, ids, dtype=torch.float32)
    without = int8_perplexity_delta(m, ids, dtype=torch.float32, head=False)
    assert with_head["ppl_float"] == without["ppl_float"]
    assert with_head["ppl_int8"] != without["ppl_int8"]  # the head's rounding is in one of them
    assert abs(with_head["relative"]) < 0.02 and abs(without["relative"]) < 0.02


def test_decode_options_reach_an_int8_head():
    from shardwise.inference.options import DecodeOptions
    eng = shardwise.init_inference(tiny("llama"), dtype="int8", replace_with_kernel_inject=True,
                                   max_out_tokens=64)
    head = eng.decoder.lm_head
    for text, kernel, realize in (("base", "reduction", True), ("realize_inputs=false", "reduction", False),
                                  ("int8=int8pack", "int8pack", True)):
        eng.decoder.set_options(DecodeOptions.parse(text))
        assert (head.int8_kernel, head.realize_input) == (kernel, realize), text
