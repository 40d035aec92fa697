"""Hybrid Engine on CUDA (issue 23): the compiled, CUDA-graphed decode step over the in-place
refreshed inference copy gives the plain model's tokens, before and after optimizer steps."""
from __future__ import annotations

import copy

import pytest
import torch

import shardwise
from tests.distributed._hybrid import gathered_weights, train_step
from tests.unit._inference_models import prompts, tiny

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_cuda_graph_generate_sees_every_step(family):
    model = tiny(family)
    ref = copy.deepcopy(model).cuda()
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-2}},
           "hybrid_engine": {"enabled": True, "max_out_tokens": 64}}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    ids, mask = (t.cuda() for t in prompts(3))
    seen = []
    for step in range(3):
        engine.eval()
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        ref.load_state_dict(gathered_weights(engine), strict=False)
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert torch.equal(got, want), (step, got, want)
        seen.append(got)
        engine.train()
        train_step(engine, step)
    assert not torch.equal(seen[0], seen[-1])
    assert engine._copy is not None and engine._copy.decoder._graphs
