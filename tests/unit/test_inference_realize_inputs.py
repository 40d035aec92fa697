"""DecodeOptions.realize_inputs / realize_outputs: the reduction GEMV's input (output) becomes
a buffer under compile."""
import pytest
import torch

import shardwise

from shardwise.inference.options import DecodeOptions
from shardwise.inference.layers import Proj
from shardwise.inference.quant import gemv, int8_gemv, int8_linear, quantize_weight, realized
from tests.unit._inference_models import tiny


def _norm_then_gemv(x, w, nw, realize):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    return gemv(h, w, realize_input=realize)


def _traced_targets(fn, *args):
    """The call targets of the graph dynamo hands its backend for ``fn(*args)``."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    return seen


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 1, 256, generator=g), torch.randn(384, 256, generator=g),
            torch.randn(256, generator=g))


@pytest.mark.parametrize("realize", [False, True])
def test_barrier_is_in_the_compiled_graph_only_when_asked(realize):
    x, w, nw = _inputs()
    targets = _traced_targets(lambda a, b, c: _norm_then_gemv(a, b, c, realize), x, w, nw)
    barrier = torch.ops.prims.inductor_force_stride_order.default
    found = [t for t in targets if t in (barrier, torch.ops.prims.inductor_force_stride_order)]
    assert len(found) == (1 if realize else 0), targets


def test_inductor_result_matches_eager_with_the_barrier():
    x, w, nw = _inputs()
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: _norm_then_gemv(a, b, c, True), fullgraph=True,
                             dynamic=False)
    expected = torch.nn.functional.linear(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * nw, w)
    torch.testing.assert_close(compiled(x, w, nw), expected, rtol=1e-4, atol=1e-4)


def test_int8_reduction_keeps_its_values_with_the_barrier():
    x, w, _ = _inputs()
    q, scale = quantize_weight(w)
    expected = x @ (q.float() * scale[:, None]).t()
    torch._dynamo.reset()
    # int8_linear takes the reduction branch only for CUDA; compile that branch directly here
    compiled = torch.compile(lambda a: int8_gemv(a, q, scale, realize_input=True),
                             fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), expected, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(int8_linear(x, q, scale, realize_input=True), expected,
                               rtol=1e-4, atol=1e-3)


def test_realized_is_the_same_tensor_outside_a_compile():
    x = torch.randn(3, 4)
    assert realized(x) is x


def test_option_reaches_every_projection():
    eng = shardwise.init_inference(tiny("llama"), dtype="fp32", replace_with_kernel_inject=True,
                                   max_out_tokens=64)
    dec = eng.decoder
    dec.set_options(DecodeOptions.parse("realize_inputs=true"))
    projs = [m for m in dec.modules() if isinstance(m, Proj)]
    assert projs and all(p.realize_input for p in projs)
    dec.set_options(DecodeOptions())  # "auto": bf16 / fp32 weights stay fused
    assert not any(p.realize_input for p in projs)


def test_auto_realizes_the_int8_projections_only():
    """The default ("auto", measured on an H100: int8 7B step 5.13 -> 3.60 ms) writes the
    int8 GEMVs' inputs first; false turns it off, and bf16 engines keep the fused form."""
    eng = shardwise.init_inference(tiny("llama"), dtype="int8", replace_with_kernel_inject=True,
                                   max_out_tokens=64)
    eng.decoder.set_options(eng.decoder.options)  # what compile_step applies (CUDA only)
    assert eng.decoder.options.realize_inputs == "auto"
    projs = [m for m in eng.decoder.modules() if isinstance(m, Proj)]
    int8 = [p for p in projs if p.scale is not None]
    assert int8 and all(p.realize_input for p in int8)
    assert not any(p.realize_input for p in projs if p.scale is None)  # e.g. an unquantized head
    eng.decoder.set_options(DecodeOptions.parse("realize_inputs=false"))
    assert not any(p.realize_input for p in projs)


def test_option_parses_and_defaults_to_auto():
    assert DecodeOptions().realize_inputs == "auto"
    assert DecodeOptions.parse("gemv=reduction+realize_inputs=true").realize_inputs is True
    assert DecodeOptions.parse("realize_inputs=false").realize_inputs is False
    with pytest.raises(shardwise.errors.ConfigError, match="realize_inputs"):
        DecodeOptions(realize_inputs="sometimes")


def _gemv_then_add(x, w, residual, realize_output):
    return gemv(x, w, realize_output=realize_output) + residual


@pytest.mark.parametrize("realize", [False, True])
def test_output_barrier_is_in_the_compiled_graph_only_when_asked(realize):
    x, w, _ = _inputs()
    residual = torch.randn(1, 1, 384)
    targets = _traced_targets(lambda a, b, c: _gemv_then_add(a, b, c, realize), x, w, residual)
    barrier = torch.ops.prims.inductor_force_stride_order.default
    found = [t for t in targets if t in (barrier, torch.ops.prims.inductor_force_stride_order)]
    assert len(found) == (1 if realize else 0), targets
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: _gemv_then_add(a, b, c, realize), fullgraph=True,
                             dynamic=False)
    torch.testing.assert_close(compiled(x, w, residual), torch.nn.functional.linear(x, w) + residual,
                               rtol=1e-4, atol=1e-4)


def test_realize_outputs_reaches_every_projection_and_is_checked():
    from shardwise.errors import ConfigError
    eng = shardwise.init_inference(tiny("llama"), dtype="int8", replace_with_kernel_inject=True,
                                   max_out_tokens=64)
    dec = eng.decoder
    projs = [m for m in dec.modules() if isinstance(m, Proj)]
    dec.set_options(DecodeOptions.parse("realize_outputs=true"))
    assert projs and all(p.realize_output and p.realize_input for p in projs)
    dec.set_options(DecodeOptions())
    assert not any(p.realize_output for p in projs)
    with pytest.raises(ConfigError, match="realize_outputs"):
        DecodeOptions(realize_outputs="auto")


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_act_epilogue_mlp_equals_the_fused_mlp(dtype, monkeypatch):
    """DecodeOptions.act_epilogue: gate and up as two reductions (Proj.halves) give the fused
    GEMV's MLP output, float and int8 (per-row scales split with the rows), under compile."""
    eng = shardwise.init_inference(tiny("llama"), dtype=dtype, replace_with_kernel_inject=True,
                                   max_out_tokens=64)
    dec = eng.decoder
    block = dec.blocks[0]
    x = torch.randn(1, 1, block.up.weight.shape[1], generator=torch.Generator().manual_seed(1))
    expected = block.mlp(x)  # eager: the fused weight's F.linear / int8pack
    dec.set_options(DecodeOptions.parse("act_epilogue=true+gemv=reduction"))
    assert all(b.act_epilogue for b in dec.blocks)
    # Proj.reduces is True only for a compiled CUDA step: take that branch on the CPU here
    monkeypatch.setattr(Proj, "reduces", lambda self, t: torch.compiler.is_compiling())
    torch._dynamo.reset()
    calls = []
    halves = Proj.halves
    monkeypatch.setattr(Proj, "halves", lambda self, t: calls.append(1) or halves(self, t))
    got = torch.compile(block.mlp, fullgraph=True, dynamic=False)(x)
    assert calls, "the compiled MLP did not take the two-reduction branch"
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    dec.set_options(DecodeOptions())
    assert not any(b.act_epilogue for b in dec.blocks)
    with pytest.raises(shardwise.errors.ConfigError, match="act_epilogue"):
        DecodeOptions(act_epilogue="yes")


def test_reduces_is_false_outside_a_compiled_cuda_step():
    eng = shardwise.init_inference(tiny("llama"), dtype="int8", replace_with_kernel_inject=True,
                                   max_out_tokens=64)
    proj = eng.decoder.blocks[0].up
    assert proj.reduces(torch.zeros(1, 1, proj.weight.shape[1])) is False


def test_flex_decode_attention_equals_masked_sdpa():
    """DecodeOptions.attention="flex": FlexAttention with the mask as a score modification
    gives masked SDPA's output (eager and compiled; left padding and a partly written cache)."""
    from shardwise.inference.layers import flex_decode_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 64, generator=g) for n in (2, 96, 96))
    mask = torch.zeros(2, 1, 2, 96, dtype=torch.bool)
    mask[0, ..., :40] = True
    mask[1, ..., 5:90] = True
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
    torch.testing.assert_close(flex_decode_attention(q, k, v, mask, 0.125), ref, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    compiled = torch.compile(flex_decode_attention, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(q, k, v, mask, 0.125), ref, rtol=1e-5, atol=1e-5)
    assert DecodeOptions.parse("attention=flex").attention == "flex"
