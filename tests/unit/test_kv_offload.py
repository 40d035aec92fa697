"""kv_offload: the fast path's KV cache in (pinned) host memory, streamed to the device one
layer ahead; greedy tokens equal the plain model's generate (CPU: device = CPU, same code)."""
import copy

import pytest
import torch

import shardwise
from shardwise.inference.kv_offload import OffloadedKVCache
from tests.unit._inference_models import prompts
from tests.unit.test_zero_inference import model, reference, zero


@pytest.mark.parametrize("family,layers,offload", [("llama", 3, True), ("opt", 3, True),
                                                    ("llama", 1, False)])
def test_kv_offload_tokens_equal_plain_generate(family, layers, offload):
    m = model(family, layers=layers)
    ids, mask, ref = reference(m, batch=3, new=6)
    extra = {"zero_optimization": zero(m)} if offload else {}
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32", replace_with_kernel_inject=True,
                                   kv_offload=True, max_out_tokens=128, **extra)
    assert eng.decoder is not None and eng.decoder.kv_offload
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=1)
    assert torch.equal(out, ref)
    cache = eng.decoder.cache
    assert isinstance(cache, OffloadedKVCache) and len(cache.slots) == 2
    assert all(h.device.type == "cpu" for h in cache.host) and cache.filled == ids.shape[1] + 5
    # with more layers than the two device slots, each step copies every layer's filled
    # prefix up (far less than whole layers); one layer stays in its slot: no copies at all
    if layers > 2:
        assert 0 < cache.stats["bytes_in"] < 6 * layers * cache.host[0].numel() * 4
    else:
        assert cache.stats["bytes_in"] == 0
    # the cache is reused by a second generate (a new prefill restarts it): same tokens
    again = eng.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=1)
    assert torch.equal(again, ref)


def test_kv_offload_host_cache_holds_the_plain_cache_values():
    """The host buffers hold exactly what the on-device static cache holds after a generate."""
    m = model("llama", layers=3)
    ids, mask = prompts(2)
    plain = shardwise.init_inference(copy.deepcopy(m), dtype="fp32", replace_with_kernel_inject=True,
                                     max_out_tokens=128)
    off = shardwise.init_inference(copy.deepcopy(m), dtype="fp32", replace_with_kernel_inject=True,
                                   max_out_tokens=128, kv_offload=True)
    for eng in (plain, off):
        eng.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=1)
    n = off.decoder.cache.filled
    for i in range(3):
        k, v = plain.decoder.cache.kv(i)
        host = off.decoder.cache.host[i]  # (length, 2, batch, heads, dim)
        torch.testing.assert_close(host[:n, 0].permute(1, 2, 0, 3), k[:, :, :n], rtol=0, atol=0)
        torch.testing.assert_close(host[:n, 1].permute(1, 2, 0, 3), v[:, :, :n], rtol=0, atol=0)


def test_kv_offload_without_fast_path_says_so(monkeypatch):
    said = []
    monkeypatch.setattr("shardwise.inference.zero_inference.warn_once", said.append)
    m = model("llama", layers=2)
    ids, mask, ref = reference(m, batch=2, new=3)
    eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32", kv_offload=True)
    assert eng.decoder is None and any("kv_offload" in s for s in said)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=1)
    assert torch.equal(out, ref)


def test_auto_batch_size_counts_two_layers_of_cache_with_kv_offload():
    from shardwise.inference.zero_inference import bytes_per_sequence
    m = model("llama", layers=8)
    full = bytes_per_sequence(m.config, 512, 64, torch.bfloat16)
    off = bytes_per_sequence(m.config, 512, 64, torch.bfloat16, kv_offload=True)
    cache_full = 2 * 8 * 2 * 16 * 640 * 2  # K+V, 8 layers, 2 KV heads of 16, 640 slots, bf16
    assert full - off == cache_full - cache_full * 2 // 8
