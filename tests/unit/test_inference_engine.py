"""The InferenceEngine's plain path: Hugging Face generate semantics, forward, dtype."""
import copy

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import shardwise
from tests.unit._inference_models import prompts, tiny
from tests.unit.test_inference_config import SEED_4_2


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


def _engine(model, **kw):
    return shardwise.init_inference(copy.deepcopy(model), dtype="fp32", **kw)


def test_public_names():
    assert shardwise.init_inference.__name__ == "init_inference"
    assert shardwise.OnDevice.__name__ == "OnDevice"


def test_plain_engine_generate_equals_hf(llama):
    eng = _engine(llama)
    ids, mask = prompts(3)
    assert eng.decoder is None and eng.module is not llama
    for kwargs in ({"do_sample": False}, {"num_beams": 2}):
        ref = llama.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=1, **kwargs)
        out = eng.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=1, **kwargs)
        assert torch.equal(out, ref)


def test_sampling_follows_the_seed(llama):
    eng = _engine(llama)
    ids, mask = prompts(1)
    torch.manual_seed(5)
    ref = llama.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=20)
    torch.manual_seed(5)
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=20)
    assert torch.equal(out, ref)


def test_forward_and_call_give_the_module_logits(llama):
    eng = _engine(llama)
    ids, mask = prompts(2)
    ref = llama(ids, attention_mask=mask).logits
    torch.testing.assert_close(eng(ids, attention_mask=mask).logits, ref)
    torch.testing.assert_close(eng.forward(ids, attention_mask=mask).logits, ref)


def test_dtype_converts_the_module(llama):
    eng = shardwise.init_inference(copy.deepcopy(llama), dtype="bf16")
    assert eng.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in eng.module.parameters())
    kept = shardwise.init_inference(copy.deepcopy(llama))  # CPU, dtype not given: model's own
    assert next(kept.module.parameters()).dtype == torch.float32


class _StopAfter(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


class _Collect:
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("inject", [False, True])
def test_stopping_criteria_and_streamer(llama, inject):
    eng = _engine(llama, replace_with_kernel_inject=inject, max_out_tokens=64)
    ids, mask = prompts(1)
    stop = StoppingCriteriaList([_StopAfter(ids.shape[1] + 3)])
    ref = llama.generate(ids, attention_mask=mask, max_new_tokens=8, stopping_criteria=stop)
    streamer = _Collect()
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=8, stopping_criteria=stop,
                       streamer=streamer)
    assert torch.equal(out, ref) and out.shape[1] <= ids.shape[1] + 3
    assert streamer.ended and torch.equal(streamer.chunks[0], ids)
    assert torch.equal(torch.cat([c.view(-1) for c in streamer.chunks[1:]]), out[0, ids.shape[1]:])


def test_seed_config_loads_and_generates(llama, caplog):
    eng = shardwise.init_inference(copy.deepcopy(llama), config=SEED_4_2, dtype="fp32",
                                   max_out_tokens=64)
    assert eng.decoder is not None  # kernel_inject from the nested "inference" section
    ids, mask = prompts(1)
    ref = llama.generate(ids, attention_mask=mask, max_new_tokens=4)
    assert torch.equal(eng.generate(ids, attention_mask=mask, max_new_tokens=4), ref)


def test_cuda_graph_without_cuda_says_so(llama):
    from shardwise.utils.logging import logger
    seen = []
    handler = type("H", (__import__("logging").Handler,), {"emit": lambda self, r: seen.append(r.getMessage())})()
    logger.addHandler(handler)
    try:
        _engine(llama, enable_cuda_graph=True)
    finally:
        logger.removeHandler(handler)
    assert any("enable_cuda_graph" in m and "eagerly" in m for m in seen)
