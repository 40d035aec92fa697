"""Kernel injection = the static-cache decode path: tokens equal Hugging Face generate (CPU fp32)."""
import copy

import pytest
import torch

import shardwise
from transformers import LlamaForCausalLM
from shardwise.errors import ConfigError
from shardwise.inference.arch import Unsupported, describe_model
from tests.unit._inference_models import prompts, tiny


@pytest.fixture(scope="module", params=["llama", "opt"])
def model(request):
    return tiny(request.param)


def _inject(model, **kw):
    kw.setdefault("max_out_tokens", 64)
    return shardwise.init_inference(copy.deepcopy(model), dtype="fp32",
                                    replace_with_kernel_inject=True, **kw)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_equal_hf_generate(model, batch):
    ids, mask = prompts(batch)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         pad_token_id=1, eos_token_id=None)
    eng = _inject(model)
    assert eng.decoder is not None
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                       pad_token_id=1, eos_token_id=None)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("batch", [1, 3])  # 1: unpadded causal prefill (GQA regression)
def test_fast_prefill_logits_match_the_module(model, batch):
    ids, mask = prompts(batch)
    eng = _inject(model)
    from shardwise.inference.decode import hf_positions
    eng.decoder.ensure_cache(batch, ids.shape[1], torch.float32, torch.device("cpu"))
    logits = eng.decoder.prefill(ids, mask, hf_positions(mask), all_logits=True)
    ref = model(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(logits[keep], ref[keep], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["gpt2", "neox"])
def test_other_families_equal_hf_generate(family):
    m = tiny(family)
    ids, mask = prompts(3)
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=1, eos_token_id=None)
    out = _inject(m).generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=1,
                              eos_token_id=None)
    assert torch.equal(out, ref)


def test_eos_pads_finished_rows_like_hf():
    m = tiny("llama")
    ids, mask = prompts(3)
    free = m.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=1, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 1])  # row 0 emits it as its 2nd new token
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=1, eos_token_id=eos)
    out = _inject(m).generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=1,
                              eos_token_id=eos)
    assert torch.equal(out, ref)


def test_sampling_in_the_fast_path_uses_hf_warpers():
    m = tiny("llama")
    ids, mask = prompts(2)
    eng = _inject(m)
    torch.manual_seed(3)
    a = eng.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=1,
                     eos_token_id=None)
    greedy = eng.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None)
    assert torch.equal(a, greedy)  # top_k=1 sampling is greedy
    torch.manual_seed(3)
    b = eng.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, temperature=2.0,
                     top_p=0.9, eos_token_id=None)
    assert b.shape == greedy.shape and ((b >= 0) & (b < 128)).all()


def test_fused_weights_are_views_of_the_module():
    m = tiny("llama")
    eng = _inject(m)
    attn = eng.module.model.layers[0].self_attn
    fused = eng.decoder.blocks[0].qkv.weight
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    ids, mask = prompts(1)
    eng.module.load_state_dict(tiny("llama", seed=7).state_dict())  # in place: seen by the fast path
    ref = tiny("llama", seed=7).generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    assert torch.equal(eng.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None), ref)


def test_beam_search_falls_back_once_with_a_note(caplog):
    m = tiny("opt")
    ids, mask = prompts(1)
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2)
    out = _inject(m).generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2)
    assert torch.equal(out, ref)


def test_unsupported_model_runs_plain_with_a_warning():
    m = tiny("llama")
    m.config.final_logit_softcapping = 30.0
    with pytest.raises(Unsupported, match="final_logit_softcapping"):
        describe_model(m)
    eng = _inject(m)
    assert eng.decoder is None and "final_logit_softcapping" in eng.fast_path_reason
    ids, mask = prompts(1)
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    assert torch.equal(eng.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None), ref)


def test_too_many_tokens_name_max_out_tokens():
    eng = _inject(tiny("llama"), max_out_tokens=10)
    ids, mask = prompts(1)
    with pytest.raises(ConfigError, match="max_out_tokens = 10"):
        eng.generate(ids, attention_mask=mask, max_new_tokens=8)


class _ScaledLlama(LlamaForCausalLM):
    """Same structure as Llama, different math in forward: only the probe can see it."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


def test_probe_catches_math_the_structure_does_not_show():
    src = tiny("llama")
    m = _ScaledLlama(src.config).eval()
    m.load_state_dict(src.state_dict())
    eng = _inject(m)
    assert eng.decoder is None and "logits differ" in eng.fast_path_reason


def test_alibi_flag_true_is_not_mistaken_for_neutral():
    m = tiny("llama")
    m.config.use_alibi = True  # True == 1.0 in Python; the check must not treat it as neutral
    with pytest.raises(Unsupported, match="use_alibi"):
        describe_model(m)


def test_gemma_layout_runs_the_fast_path():
    from transformers import GemmaConfig, GemmaForCausalLM
    torch.manual_seed(0)
    m = GemmaForCausalLM(GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16)).eval()
    eng = _inject(m)
    assert eng.decoder is not None
    ids, mask = prompts(3)
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=1, eos_token_id=None)
    assert torch.equal(eng.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=1,
                                    eos_token_id=None), ref)


def test_decode_options_name_the_bad_value():
    from shardwise.inference.options import DecodeOptions
    with pytest.raises(ConfigError, match="attention = 'flash'"):
        DecodeOptions(attention="flash")


def test_reduction_forms_equal_sdpa_and_linear():
    """The compiled-step alternatives (DecodeOptions "reduction") compute the same values."""
    from shardwise.inference.layers import reduction_attention
    from shardwise.inference.quant import gemv
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 16, generator=g)
    k, v = torch.randn(2, 3, 10, 16, generator=g), torch.randn(2, 3, 10, 16, generator=g)
    mask = torch.rand(2, 1, 4, 10, generator=g) > 0.4
    mask[..., 0] = True  # every row sees a key (decode: its own position)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(reduction_attention(q, k, v, mask, 0.3), ref, rtol=1e-5, atol=1e-5)
    x, w = torch.randn(2, 1, 16, generator=g), torch.randn(24, 16, generator=g)
    torch.testing.assert_close(gemv(x, w), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)


def _math_chunks(q, k, v, bias, scale):
    """(output, log-sum-exp) per block in the efficient kernel's layouts: the output a
    transposed (B, M, H, D) buffer, the log-sum-exp padded to 32 rows; fully masked: NaN."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale + bias.float()
    out = (torch.softmax(scores, dim=-1) @ v.float()).transpose(1, 2).contiguous().transpose(1, 2)
    lse = torch.full((*scores.shape[:2], 32), float("nan"))
    lse[..., :scores.shape[2]] = torch.logsumexp(scores, dim=-1)
    return out, lse[..., :scores.shape[2]]


def test_split_kv_attention_combines_blocks_exactly():
    """Flash-decoding's block combine equals one attention over the whole cache, including
    blocks with no visible key (positions past the current one)."""
    from shardwise.inference.layers import split_kv_attention
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 16, generator=g)
    k, v = torch.randn(2, 3, 32, 16, generator=g), torch.randn(2, 3, 32, 16, generator=g)
    mask = torch.zeros(2, 1, 4, 32, dtype=torch.bool)
    mask[0, ..., :11] = True  # row 0 sees blocks 0-1 (partly), blocks 2-3 are fully masked
    mask[1, ..., 3:20] = True  # row 1: left padding, then up to its position
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    out = split_kv_attention(q, k, v, mask, 0.25, chunk=8, chunks_fn=_math_chunks)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _kernel_like_chunks(q, k, v, bias, scale):
    """As ``_math_chunks``, but a fully masked block answers the way CUDA's efficient kernel
    does (measured on an H100): log-sum-exp +inf, output zeros."""
    out, lse = _math_chunks(q, k, v, bias, scale)
    empty = torch.isneginf(bias).all(-1)  # (B, M, G): this block has no visible key
    lse = torch.where(empty, float("inf"), lse)
    out = torch.where(empty.unsqueeze(-1), 0.0, out)
    return out, lse


def test_split_kv_attention_gives_fully_masked_blocks_no_weight_whatever_the_kernel_returns():
    """Regression (H100, 2026-12-05): the efficient kernel's +inf log-sum-exp for a fully masked
    block went through nan_to_num and weighted an empty block: error 9.9e-3 in that batch row."""
    from shardwise.inference.layers import split_kv_attention
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 2, 16, generator=g)
    k, v = torch.randn(2, 4, 64, 16, generator=g), torch.randn(2, 4, 64, 16, generator=g)
    mask = torch.zeros(2, 1, 2, 64, dtype=torch.bool)
    mask[0, ..., :18] = True  # blocks 2-3 of 16 keys fully masked
    mask[1, ..., 2:50] = True
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
    out = split_kv_attention(q, k, v, mask, 0.125, chunk=16, chunks_fn=_kernel_like_chunks)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_options_parse_the_probe_names():
    from shardwise.inference.options import DecodeOptions
    opts = DecodeOptions.parse("gemv=reduction+attention=split+coordinate_descent=false")
    assert (opts.gemv, opts.attention, opts.coordinate_descent) == ("reduction", "split", False)
    assert DecodeOptions.parse("base") == DecodeOptions()
    with pytest.raises(ConfigError, match="unknown setting 'gemm'"):
        DecodeOptions.parse("gemm=reduction")


def test_max_autotune_option_reaches_the_compile_options(monkeypatch):
    from shardwise.inference.options import DecodeOptions
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.update(kw) or fn)
    eng = shardwise.init_inference(tiny("llama"), dtype="fp32", replace_with_kernel_inject=True,
                                   max_out_tokens=32)
    eng.decoder.set_options(DecodeOptions.parse("max_autotune=true+coordinate_descent=false"))
    eng.decoder.compile_step(cuda_graph=True)
    assert seen["options"]["max_autotune"] is True
    assert seen["options"]["coordinate_descent_tuning"] is False
    assert seen["options"]["triton.cudagraphs"] is True and seen["fullgraph"] is True


def test_auto_attention_splits_only_few_kv_groups():
    """DecodeOptions' default "auto": flash-decoding while batch x KV heads <= SMs / 8 (the
    1.1B Llama at batch 1 on an H100 gained 1.10x; the 7B at batch 1, 32 groups, lost 8%)."""
    from shardwise.inference.options import DecodeOptions, decode_attention_kind
    assert DecodeOptions().attention == "auto"
    assert decode_attention_kind("auto", 4, 640, 132) == "split"  # 1.1B (4 KV heads), batch 1
    assert decode_attention_kind("auto", 16, 640, 132) == "split"
    assert decode_attention_kind("auto", 32, 640, 132) == "sdpa"  # 7B (32 KV heads), batch 1
    assert decode_attention_kind("auto", 4, 600, 132) == "sdpa"  # no whole 64-key blocks
    assert decode_attention_kind("auto", 4, 640, 0) == "sdpa"  # not a GPU
    assert decode_attention_kind("split", 256, 640, 132) == "split"  # asked for: under 2 per SM
    assert decode_attention_kind("split", 264, 640, 132) == "sdpa"  # the plain kernel fills it
    assert decode_attention_kind("reduction", 1024, 640, 132) == "reduction"
    assert decode_attention_kind("sdpa", 1, 640, 132) == "sdpa"


def test_compile_step_reads_the_options_again(monkeypatch):
    """compile_step re-applies the options, so the layers see the device the engine placed
    the weights on (a CPU engine: no SMs, so "auto" never splits there)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    eng = shardwise.init_inference(tiny("llama"), dtype="fp32", replace_with_kernel_inject=True,
                                   max_out_tokens=32)
    for block in eng.decoder.blocks:
        block.sms = 99
    eng.decoder.compile_step(cuda_graph=False)
    assert {(b.decode_attention, b.sms) for b in eng.decoder.blocks} == {("auto", 0)}


def test_int8_kernel_option_reaches_every_projection_and_gives_the_same_tokens():
    """DecodeOptions.int8 = "int8pack" routes the int8 projections through
    torch._weight_int8pack_mm (on CPU it is the eager path anyway, so the tokens must not move);
    a bad value names the choices."""
    from shardwise.inference.options import DecodeOptions
    from shardwise.inference.layers import Proj
    with pytest.raises(ConfigError, match="int8 = 'fast'.*reduction, int8pack"):
        DecodeOptions(int8="fast")
    eng = shardwise.init_inference(tiny("llama"), dtype="int8", replace_with_kernel_inject=True,
                                   max_out_tokens=32)
    ids, mask = prompts(2)
    before = eng.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=1, eos_token_id=None)
    eng.decoder.set_options(DecodeOptions.parse("int8=int8pack"))
    projs = [m for m in eng.decoder.modules() if isinstance(m, Proj) and m.scale is not None]
    assert projs and {p.int8_kernel for p in projs} == {"int8pack"}
    after = eng.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=1, eos_token_id=None)
    assert torch.equal(before, after)


def test_int8pack_on_a_torch_without_it_is_a_clear_error(monkeypatch):
    from shardwise.inference import decode
    from shardwise.inference.options import DecodeOptions
    monkeypatch.setattr(decode, "int8pack_available", lambda device_type: False)
    eng = shardwise.init_inference(tiny("llama"), dtype="int8", replace_with_kernel_inject=True,
                                   max_out_tokens=32)
    with pytest.raises(ConfigError, match=r"no torch._weight_int8pack_mm for cpu; use int8='reduction'"):
        eng.decoder.set_options(DecodeOptions.parse("int8=int8pack"))


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_regional_compile_traces_one_layer_and_gives_hf_tokens(family, monkeypatch):
    """DecodeOptions.regional: every decoder layer runs compiled code, dynamo traces the layer
    once for all of them (the cold start does not grow with depth), and the tokens are the
    plain model's. A later whole-step compile drops the per-layer compiled code again."""
    from shardwise.inference.options import DecodeOptions
    real_compile = torch.compile
    graphs, calls = [], []

    def counting(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            calls.append(1)
            return gm(*args)
        return run

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=counting,
                                                                       fullgraph=True, dynamic=False))
    torch._dynamo.reset()
    m = tiny(family)
    m.config.num_hidden_layers  # noqa: B018 - the tiny models have several layers
    eng = _inject(m)
    layers = len(eng.decoder.blocks)
    assert layers >= 2
    eng.decoder.set_options(DecodeOptions.parse("regional=true"))
    eng.decoder.compile_step(cuda_graph=False)
    ids, mask = prompts(3)
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=1, eos_token_id=None)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=1, eos_token_id=None)
    assert torch.equal(out, ref)
    assert len(graphs) == 1, f"{len(graphs)} graphs for {layers} identical layers"
    assert len(calls) == 4 * layers  # every layer of every decode step ran the compiled code
    eng.decoder.set_options(DecodeOptions())
    eng.decoder.compile_step(cuda_graph=False)
    assert all(b._compiled_call_impl is None for b in eng.decoder.blocks)


def test_regional_auto_compiles_per_layer_from_the_layer_size(monkeypatch):
    """DecodeOptions.regional = "auto" (the default): per-layer compilation for layers of at
    least REGIONAL_LAYER_BYTES of projection weights (the 7B Llama's), the whole step below
    (the 1.1B's); True and False force it; other values are refused."""
    from shardwise.errors import ConfigError
    from shardwise.inference import options
    m = tiny("llama")
    eng = _inject(m)
    expected = sum(p.numel() * p.element_size() for n, p in m.model.layers[0].named_parameters()
                   if "proj" in n)
    assert eng.decoder.layer_bytes() == expected
    assert options.DecodeOptions().regional == "auto" == options.DecodeOptions.parse("regional=auto").regional
    seven_b = 4096 * (4 * 4096 + 3 * 11008) * 2  # q, k, v, o + gate, up, down in bf16
    one_b = 2048 * (2 * 2048 + 2 * 256 + 3 * 5632) * 2  # GQA: 4 KV heads of 64
    assert options.regional_compile("auto", seven_b) and not options.regional_compile("auto", one_b)
    assert options.regional_compile(True, 0) and not options.regional_compile(False, seven_b)
    for threshold, regional in ((expected, True), (expected + 1, False)):
        monkeypatch.setattr(options, "REGIONAL_LAYER_BYTES", threshold)
        eng.decoder.set_options(options.DecodeOptions())
        eng.decoder.compile_step(cuda_graph=False)
        assert all((b._compiled_call_impl is not None) == regional for b in eng.decoder.blocks)
    with pytest.raises(ConfigError, match=r"DecodeOptions.regional = 'maybe'; expected one of True, False, auto"):
        options.DecodeOptions.parse("regional=maybe")
