"""ZeRO stage 3 under torch.compile ("deepcompile"): a tiny Llama with grouped-query attention
(built from a transformers config; its linear weights above the persistence threshold, its
norms below) trains to plain torch's parameters at world sizes 1 and 2, with and without
``offload_param``, and the delayed-update (DPU) offload trains compiled as it does eager.

Each run shows what ran: a counting backend (aot_eager inside, so no C++ compiler is needed)
counts the graphs dynamo compiled and the calls of the compiled code. Exactly one graph for
the decoder layers (plus the toolchain probe's) across all steps means no graph break inside a
layer and no recompile from step to step; one call per layer per micro step means the
compiled code is what trained, the stage-3 hooks running eagerly around it.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed._parity import causal_lm_reference

import transformers
if not torch._dynamo.is_dynamo_supported():  # e.g. a Python newer than this torch's dynamo
    pytest.skip("dynamo is not supported here", allow_module_level=True)

VOCAB, SEQ, MICRO, GA, STEPS, LR, LAYERS = 128, 8, 2, 2, 3, 1e-2, 2


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False)  # training: no KV cache (it would make each layer its own graph)
    return transformers.LlamaForCausalLM(cfg)


def batches(world: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (MICRO * GA * world, SEQ), generator=g) for _ in range(STEPS)]


def reference(world: int) -> Dict[str, torch.Tensor]:
    """Plain single-process torch, AdamW on each whole global batch. The global batch is the
    engine's micro batches concatenated; the loss is the mean of their (equal-size) means."""
    return causal_lm_reference(build(), batches(world), MICRO, GA * world, LR)


class CountingBackend:
    """aot_eager, counting the graphs it compiles and the calls of their compiled code."""

    def __init__(self) -> None:
        self.compiles = 0
        self.runs = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo import lookup_backend
        self.compiles += 1
        inner = lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args):
            self.runs += 1
            return inner(*args)
        return run


def config(offload: str, dpu: bool = False) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 100,
            "stage3_prefetch_bucket_size": 3000, "reduce_bucket_size": 500}
    if offload == "cpu":
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu", "delayed_update": dpu}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
            "steps_per_print": 0, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": zero}


def train(rank: int, world: int, cfg: dict, compiled: bool) -> dict:
    """Train ``STEPS`` steps (rank r takes micro batch k·W + r); the gathered parameters and
    what ran."""
    import shardwise
    from shardwise.zero import GatheredParameters
    torch._dynamo.reset()
    engine, *_ = shardwise.initialize(model=build(), config=cfg)
    backend = CountingBackend()
    if compiled:
        engine.compile(backend=backend)
    counts = [(backend.compiles, backend.runs)]
    for ids in batches(world):
        for k in range(GA):
            mb = ids[(k * world + rank) * MICRO:(k * world + rank + 1) * MICRO]
            loss = engine(input_ids=mb, labels=mb).loss
            engine.backward(loss)
            engine.step()
        counts.append((backend.compiles, backend.runs))
    with GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    result = engine._compile_result if compiled else None
    inner_hooks = sum(len(m._forward_pre_hooks) for layer in engine.module.model.layers
                      for m in layer.modules() if m is not layer)
    return {"params": params, "counts": counts, "is_compiled": engine.is_compiled,
            "units": bool(result and result.zero3_units), "inner_hooks": inner_hooks,
            "loss": result.loss if result else ()}


def check_compiled_run(out: dict) -> None:
    """Compiled: one graph for every layer and one for the HF loss function, built at the
    first micro step and never again; per micro step one compiled call per layer and one for
    the loss."""
    assert out["is_compiled"] and out["units"], "stage 3 + compile stayed eager"
    assert out["inner_hooks"] == 0  # the layer is one gather unit: no hooks inside it
    assert out["loss"] == ("",)  # the root LlamaForCausalLM's loss_function
    probe = out["counts"][0]
    assert probe == (1, 1)  # the toolchain probe compiled and ran the backend once
    for step, (compiles, runs) in enumerate(out["counts"][1:], start=1):
        assert compiles == 3, f"step {step}: {compiles - 1} graphs (want 2: layers, loss)"
        assert runs == 1 + step * GA * (LAYERS + 1), f"step {step}: {runs - 1} compiled calls"


def mismatches(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> List[str]:
    return [f"{n}: max abs diff {(got[n].float() - w).abs().max():.3g}" for n, w in want.items()
            if not torch.allclose(got[n].float(), w, rtol=1e-4, atol=1e-5)]


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_compiled_stage3_matches_torch_at_world_1(offload: str) -> None:
    out = train(0, 1, config(offload), compiled=True)
    check_compiled_run(out)
    assert not mismatches(out["params"], reference(1))


def _world2(rank: int, world: int, offload: str) -> dict:
    return train(rank, world, config(offload), compiled=True)


@pytest.mark.parametrize("offload", ["cpu", pytest.param("none", marks=pytest.mark.slow)])
def test_compiled_stage3_matches_torch_at_world_2(offload: str) -> None:
    """offload_param at world 2 takes every path of the plain one (the shard's copy to the
    compute device, then the all-gather); the plain run is in the slow set."""
    want = reference(2)
    for out in run_distributed(_world2, 2, offload):
        check_compiled_run(out)
        assert not mismatches(out["params"], want)


def test_compiled_stage3_dpu_trains_like_eager_dpu() -> None:
    """The delayed update under compile: the same parameters as the same config eager (whose
    own parity with the DPU's definition is tested with the other offload tests)."""
    cfg = config("cpu", dpu=True)
    cfg["zero_optimization"]["offload_optimizer"]["delayed_update_warmup"] = 1
    eager = train(0, 1, cfg, compiled=False)
    out = train(0, 1, cfg, compiled=True)
    check_compiled_run(out)
    assert not mismatches(out["params"], {n: p.float() for n, p in eager["params"].items()})
    assert mismatches(eager["params"], {n: p.detach() for n, p in build().named_parameters()})


def test_compiled_parameters_only_stage3_generates_the_plain_tokens() -> None:
    """No optimizer (ZeRO-Inference's route): the compiled layers under eval()/no_grad give the
    plain model's greedy tokens, twice (the second run prefetches)."""
    import shardwise
    prompt = torch.tensor([[3, 14, 15, 9, 2]])
    gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
               use_cache=False)  # with a cache each layer index is a graph of its own: slower
    plain = build().eval()
    with torch.no_grad():
        want = plain.generate(prompt, **gen)
    torch._dynamo.reset()
    engine, *_ = shardwise.initialize(model=build(), config={
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100},
        "compile": {"deepcompile": True, "backend": "aot_eager"}})
    assert engine.is_compiled and engine._compile_result.zero3_units
    engine.eval()
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(engine.module.generate(prompt, **gen), want)


def test_compiled_stage3_with_parameters_and_optimizer_on_nvme(tmp_path) -> None:
    # the three branches met here: compiled layers as gather units, parameter shards read
    # ahead from swap files, optimizer states streamed from swap files at the step
    cfg = config("none")
    cfg["zero_optimization"]["offload_param"] = {
        "device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0, "min_nvme_bytes": 0}
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    out = train(0, 1, cfg, compiled=True)
    check_compiled_run(out)
    assert not mismatches(out["params"], reference(1))
    files = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert files, "nothing was swapped to the NVMe path"  # the engine is not destroyed here
