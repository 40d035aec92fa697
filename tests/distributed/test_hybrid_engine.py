"""Hybrid Engine (issue 23) on 2 gloo ranks: each rank generates for its own prompts from the
gathered ZeRO-2/3 weights; tokens equal a plain reference holding the same weights, before
and after an optimizer step, and training keeps parity with an engine that never generated."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed._hybrid import scenarios, tp_scenario

CASES = [("llama", 3, 1), ("opt", 2, 1)]  # (family, ZeRO stage, training steps)


def test_hybrid_generate_two_ranks_stage3_and_stage2():
    results = run_distributed(scenarios, 2, CASES)
    for case, per_rank in zip(CASES, zip(*results)):
        for rank, r in enumerate(per_rank):
            for got, want in zip(r["tokens"], r["reference"]):
                assert torch.equal(got, want), (case, rank, got, want)
            assert not torch.equal(r["tokens"][0], r["tokens"][-1]), case
            assert r["losses"] == r["twin_losses"], (case, rank)
            for name, w in r["weights"].items():
                assert torch.equal(w, r["twin_weights"][name]), (case, rank, name)
        # the ranks trained one model together: the same weights everywhere
        for name, w in per_rank[0]["weights"].items():
            assert torch.equal(w, per_rank[1]["weights"][name]), (case, name)
        assert not torch.equal(per_rank[0]["tokens"][0], per_rank[1]["tokens"][0])  # own prompts


@pytest.mark.slow
def test_inference_tp_size_two_generates_on_autotp_shards():
    results = run_distributed(tp_scenario, 2, "llama", 3)
    full_rows = (4 + 2 + 2) * 16  # tiny Llama: 4 query + 2 KV heads of 16, fused q/k/v rows
    for rank, r in enumerate(results):
        for got, want in zip(r["tokens"], r["reference"]):
            assert torch.equal(got, want), (rank, got, want)
        assert r["proj_rows"] == [full_rows / 2] * 2  # each rank holds half of each projection
        assert not torch.equal(r["tokens"][0], r["tokens"][-1])
