"""The ``fp8`` section with ZeRO stage 3: a tiny Llama with grouped-query attention (its linear
weights above the persistence threshold, so partitioned) trains with torchao's Float8Linear to
the parameters of plain single-process torch running the same Float8Linear model, at world
sizes 1 and 2 (gloo), with and without ``offload_param``, eager and compiled.

The reference converts its model with torchao too and runs each engine micro batch as its own
forward/backward (dynamic scaling takes its amax per forward, so the micro batches, not the
global batch, are what must match). torch's CPU ``_scaled_mm`` runs the FP8 matmuls; the
engine's platform check (which refuses CPUs for users) is bypassed in the workers only.
torchao is optional for users and part of the ``test`` extra, so these run in CI.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed._parity import causal_lm_reference

import transformers

VOCAB, SEQ, MICRO, GA, STEPS, LR, LAYERS = 128, 16, 2, 2, 3, 1e-3, 2


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def batches(world: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (MICRO * GA * world, SEQ), generator=g) for _ in range(STEPS)]


def reference(world: int) -> Dict[str, torch.Tensor]:
    """Single-process torch: the same Float8Linear swap, AdamW on the mean of the micro losses."""
    from shardwise.precision import fp8
    model = build()
    fp8.convert_fp8(model, fp8.plan_fp8(model), "tensorwise")
    return causal_lm_reference(model, batches(world), MICRO, GA * world, LR)


def config(offload: bool) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 100,
            "stage3_prefetch_bucket_size": 20000, "reduce_bucket_size": 5000}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
            "steps_per_print": 0, "gradient_clipping": 0.0, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "fp8": {"enabled": True, "recipe": "tensorwise"}}


def train(rank: int, world: int, offload: bool, compiled: bool) -> dict:
    import shardwise
    from shardwise.precision import fp8
    from shardwise.zero import GatheredParameters
    torch._dynamo.reset()
    check = fp8.check_fp8_available
    fp8.check_fp8_available = lambda device: None  # CPU: torch's _scaled_mm (see the docstring)
    try:  # world 1 runs in pytest's own process: the check comes back for the other tests
        engine, *_ = shardwise.initialize(model=build(), config=config(offload))
    finally:
        fp8.check_fp8_available = check
    graphs = []
    if compiled:
        def backend(gm, example_inputs):  # aot_eager (no C++ toolchain needed), counted
            graphs.append(gm)
            return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
        engine.compile(backend=backend)
    for ids in batches(world):
        for k in range(GA):
            mb = ids[(k * world + rank) * MICRO:(k * world + rank + 1) * MICRO]
            engine.backward(engine(input_ids=mb, labels=mb).loss)
            engine.step()
    float8 = sum(type(m).__name__ == "Float8Linear" for m in engine.module.modules())
    partitioned = sum(1 for p in engine.module.parameters() if p.numel() == 0 or p.data.numel() == 0)
    with GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"params": params, "float8": float8, "partitioned": partitioned,
            "compiled": engine.is_compiled, "graphs": len(graphs)}


def mismatches(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], world: int) -> List[str]:
    # world 2 adds the ranks' halves in another order than the reference's one sum
    rtol, atol = (1e-5, 1e-6) if world == 1 else (1e-4, 1e-5)
    return [f"{n}: max abs diff {(got[n].float() - w).abs().max():.3g}" for n, w in want.items()
            if not torch.allclose(got[n].float(), w, rtol=rtol, atol=atol)]


def check(out: dict, want: Dict[str, torch.Tensor], world: int, compiled: bool) -> None:
    assert out["float8"] == 7 * LAYERS, out["float8"]  # q k v o gate up down per layer
    assert out["partitioned"] >= 7 * LAYERS  # the FP8 layers' weights are stage-3 shards
    if compiled:
        assert out["compiled"] and out["graphs"] >= 1, "stage 3 + fp8 + compile stayed eager"
    assert not mismatches(out["params"], want, world)
    moved = [n for n, w in want.items() if "layers" in n and "weight" in n]
    assert moved and not torch.equal(out["params"][moved[0]].float(),
                                      build().state_dict()[moved[0]].float())


@pytest.mark.parametrize("offload, compiled", [(False, False), (True, False), (False, True)])
def test_stage3_fp8_matches_torch_at_world_1(offload: bool, compiled: bool) -> None:
    check(train(0, 1, offload, compiled), reference(1), 1, compiled)


def _worker(rank: int, world: int, offload: bool, compiled: bool) -> dict:
    return train(rank, world, offload, compiled)


@pytest.mark.parametrize("offload, compiled", [
    (False, False), (True, False), pytest.param(False, True, marks=pytest.mark.slow)])
def test_stage3_fp8_matches_torch_at_world_2(offload: bool, compiled: bool) -> None:
    want = reference(2)
    outs = run_distributed(_worker, 2, offload, compiled)
    for out in outs:
        check(out, want, 2, compiled)
    assert torch.equal(outs[0]["params"]["lm_head.weight"], outs[1]["params"]["lm_head.weight"])
