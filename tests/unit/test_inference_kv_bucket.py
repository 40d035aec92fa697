"""DecodeOptions.kv_bucket: a decode step attends to the written prefix of the static KV cache
(rounded up to the bucket), not the whole cache, with the plain model's tokens and one trace."""
import copy

import pytest
import torch

import shardwise
from shardwise.errors import ConfigError
from shardwise.inference.options import DecodeOptions
from tests.unit._inference_models import prompts, tiny


def _inject(model, **options):
    eng = shardwise.init_inference(copy.deepcopy(model), dtype="fp32",
                                   replace_with_kernel_inject=True, max_out_tokens=64)
    eng.decoder.set_options(DecodeOptions(**options))
    return eng


def _record_lengths(eng, monkeypatch):
    """The key positions each decode step is given (the mask's last dim)."""
    seen = []
    run_step = eng.decoder.run_step

    def spy(ids, pos, positions, key_mask):
        seen.append((int(pos), key_mask.shape[-1]))
        return run_step(ids, pos, positions, key_mask)
    monkeypatch.setattr(eng.decoder, "run_step", spy)
    return seen


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_steps_attend_to_the_bucketed_prefix_and_give_hf_tokens(family, monkeypatch):
    m = tiny(family)
    ids, mask = prompts(3)  # 7 tokens, left padding of 0, 2 and 4
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=1, eos_token_id=None)
    whole = _inject(m)
    eng = _inject(m, kv_bucket=16)
    seen = _record_lengths(eng, monkeypatch)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=1, eos_token_id=None)
    assert torch.equal(out, ref)
    assert torch.equal(whole.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=1,
                                      eos_token_id=None), ref)
    cache = eng.decoder.cache.length
    assert cache == 64 and len(seen) == 23
    for pos, length in seen:  # the smallest multiple of 16 that holds every written position
        assert length % 16 == 0 and pos < length <= pos + 16, (pos, length)
    assert {length for _, length in seen} == {16, 32}  # never the whole 64-position cache


def test_the_bucket_never_exceeds_the_cache():
    eng = _inject(tiny("llama"), kv_bucket=48)
    key_mask = torch.ones(2, 64, dtype=torch.bool)
    assert eng.decoder.visible_keys(key_mask, 10).shape == (2, 48)
    assert eng.decoder.visible_keys(key_mask, 49).shape == (2, 64)  # 96 > the cache's 64
    eng.decoder.set_options(DecodeOptions())
    assert eng.decoder.visible_keys(key_mask, 10) is key_mask


@pytest.mark.parametrize("regional", [True, False])
def test_one_trace_serves_every_bucket(regional, monkeypatch):
    """The compiled step (whole, or each decoder layer) is traced once with the length
    dynamic, not once per bucket (a compile per bucket would multiply the cold start)."""
    real_compile = torch.compile
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=counting,
                                                                       fullgraph=True, dynamic=False))
    torch._dynamo.reset()
    m = tiny("llama")
    ids, mask = prompts(3)
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=1, eos_token_id=None)
    eng = _inject(m, kv_bucket=16, regional=regional)
    eng.decoder.compile_step(cuda_graph=False)
    seen = _record_lengths(eng, monkeypatch)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=1, eos_token_id=None)
    assert torch.equal(out, ref)
    assert {length for _, length in seen} == {16, 32}
    assert len(graphs) == 1, f"{len(graphs)} traces for 2 buckets (regional={regional})"


@pytest.mark.parametrize("bad", [10, -16, True, "32x"])
def test_a_bad_bucket_names_the_option_and_the_rule(bad):
    with pytest.raises(ConfigError, match=r"kv_bucket = .*positive multiple of 16"):
        DecodeOptions(kv_bucket=bad)
    assert DecodeOptions.parse("kv_bucket=32").kv_bucket == 32
    assert DecodeOptions().kv_bucket == 0


def test_kv_bucket_with_the_cache_offloaded_to_the_host():
    """kv_offload's layer slots are (B, H, L, D) views of the whole cache: a step slices them
    to its bucket the same way, with the plain model's tokens."""
    from tests.unit.test_zero_inference import model, reference
    m = model("llama", layers=3)
    ids, mask, ref = reference(m, batch=3, new=20)
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32", replace_with_kernel_inject=True,
                                   kv_offload=True, max_out_tokens=64)
    eng.decoder.set_options(DecodeOptions(kv_bucket=16))
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=1)
    assert eng.decoder.kv_offload and torch.equal(out, ref)

