"""The compiled, CUDA-graphed decode path on a GPU: same tokens as Hugging Face generate."""
import copy

import pytest
import torch

import shardwise
from tests.unit._inference_models import prompts, tiny

pytestmark = pytest.mark.gpu


def _cuda(batch):
    ids, mask = prompts(batch)
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_compiled_graph_decode_equals_hf_fp32(family):
    torch.backends.cuda.matmul.allow_tf32 = False
    m = tiny(family).cuda()
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32", replace_with_kernel_inject=True,
                                   max_out_tokens=64)
    assert eng.cuda_graph and eng.decoder is not None
    for batch in (1, 3):
        ids, mask = _cuda(batch)
        ref = m.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=1, eos_token_id=None)
        out = eng.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=1, eos_token_id=None)
        assert torch.equal(out, ref), (family, batch)
        again = eng.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=1, eos_token_id=None)
        assert torch.equal(again, ref)  # graph replays


def test_bf16_and_int8_run_compiled():
    m = tiny("llama")
    ids, mask = _cuda(3)
    for dtype in ("bf16", "int8"):
        eng = shardwise.init_inference(copy.deepcopy(m), dtype=dtype, replace_with_kernel_inject=True,
                                       max_out_tokens=64)
        eager = copy.deepcopy(eng.module)
        out = eng.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
        ref = eager.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
        assert out.shape == ref.shape
        assert (out == ref).float().mean() > 0.8  # bf16 rounding may flip a late token


@pytest.mark.parametrize("options,new", [
    ("gemv=reduction", 8), ("attention=split", 8), ("attention=reduction", 8),
    ("gemv=reduction+attention=split", 8), ("regional=true", 8), ("regional=true+attention=split", 8),
    # kv_bucket: one graph per bucket (16, 32, 48 over 40 new tokens), one dynamic-length trace
    ("kv_bucket=16", 40), ("kv_bucket=16+regional=true", 40), ("kv_bucket=16+attention=split", 40),
    # the GEMV inputs written to memory first (an inductor barrier), whole step and regional
    ("gemv=reduction+realize_inputs=true", 8), ("gemv=reduction+realize_inputs=true+regional=true", 8),
    # and their outputs (the residual add moves into the next kernel)
    ("gemv=reduction+realize_outputs=true", 8),
    # gate and up as sibling reductions, SiLU(gate) * up their epilogue
    ("gemv=reduction+act_epilogue=true", 8), ("gemv=reduction+act_epilogue=true+regional=true", 8),
    # FlexAttention's decoding template, the mask as a score modification
    ("attention=flex", 8), ("attention=flex+regional=true", 8), ("attention=flex+kv_bucket=16", 40)])
def test_decode_options_give_hf_tokens_fp32(options, new):
    """Every DecodeOptions alternative of the compiled step (decode_probe compares their speed)."""
    from shardwise.inference.options import DecodeOptions
    torch.backends.cuda.matmul.allow_tf32 = False
    m = tiny("llama").cuda()
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32", replace_with_kernel_inject=True,
                                   max_out_tokens=64)
    torch._dynamo.reset()
    eng.decoder.set_options(DecodeOptions.parse(options))
    eng.decoder.compile_step(cuda_graph=True)
    for batch in (1, 3):
        ids, mask = _cuda(batch)
        ref = m.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=1, eos_token_id=None)
        out = eng.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=1, eos_token_id=None)
        assert torch.equal(out, ref), (options, batch)


def test_int8_kernels_give_the_same_tokens():
    """DecodeOptions.int8: torch._weight_int8pack_mm against the inductor reduction (the same
    int8 weights and scales; bf16 rounding may flip a late token), or a clear error where this
    torch has no CUDA int8pack kernel."""
    from shardwise.errors import ConfigError
    from shardwise.inference.options import DecodeOptions
    from shardwise.inference.quant import int8pack_available
    m = tiny("llama")
    ids, mask = _cuda(3)
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="int8", replace_with_kernel_inject=True,
                                   max_out_tokens=64)
    ref = eng.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    if not int8pack_available("cuda"):
        with pytest.raises(ConfigError, match="int8pack"):
            eng.decoder.set_options(DecodeOptions.parse("int8=int8pack"))
        return
    torch._dynamo.reset()
    eng.decoder.set_options(DecodeOptions.parse("int8=int8pack"))
    eng.decoder.compile_step(cuda_graph=True)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    assert out.shape == ref.shape and (out == ref).float().mean() > 0.8


@pytest.mark.parametrize("options", ["regional=false", "regional=true",
                                     "regional=false+realize_outputs=true",
                                     "regional=false+act_epilogue=true+realize_outputs=true"])
def test_int8_head_compiled_whole_step_and_regional(options):
    """The int8 LM head runs in the compiled step (whole step), or compiled on its own beside
    the regional layers (eager it would write its weight out in bf16 every step); with the
    GEMV outputs written first too."""
    regional = "regional=true" in options
    from shardwise.inference.options import DecodeOptions
    from shardwise.inference.quant import WeightOnlyInt8Linear
    m = tiny("llama")
    ids, mask = _cuda(3)
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="int8", replace_with_kernel_inject=True,
                                   max_out_tokens=64)
    assert isinstance(eng.decoder.lm_head, WeightOnlyInt8Linear)
    eager = copy.deepcopy(eng.module)
    torch._dynamo.reset()
    eng.decoder.set_options(DecodeOptions.parse(options))
    eng.decoder.compile_step(cuda_graph=True)
    assert (eng.decoder.lm_head._compiled_call_impl is not None) == regional
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    ref = eager.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    assert out.shape == ref.shape and (out == ref).float().mean() > 0.8


def test_split_kv_attention_with_the_efficient_kernel():
    from shardwise.inference.layers import split_kv_attention
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 4, 2, 64, device="cuda", generator=g)
    k = torch.randn(2, 4, 256, 64, device="cuda", generator=g)
    v = torch.randn(2, 4, 256, 64, device="cuda", generator=g)
    mask = torch.zeros(2, 1, 2, 256, dtype=torch.bool, device="cuda")
    mask[0, ..., :70] = True  # blocks 2 and 3 fully masked
    mask[1, ..., 5:200] = True
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
    torch.testing.assert_close(split_kv_attention(q, k, v, mask, 0.125), ref, rtol=1e-4, atol=1e-4)
    out = split_kv_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.125)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_eos_under_cuda_graphs_equals_hf():
    """EOS is read a few steps late (FinishWatch, no sync per token); the output is still HF's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    m = tiny("llama").cuda()
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32", replace_with_kernel_inject=True,
                                   max_out_tokens=64)
    ids, mask = _cuda(3)
    free = m.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=1, eos_token_id=None)
    for eos in {int(free[0, ids.shape[1] + 1]), int(free[2, -1])}:  # early and at the very end
        ref = m.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=1, eos_token_id=eos)
        out = eng.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=1, eos_token_id=eos)
        assert torch.equal(out, ref), eos
