"""The Hybrid Engine scenario shared by the unit (world size 1) and distributed tests.

One process (or each rank) builds a hybrid engine, a twin engine that never generates and a
plain reference model; it generates, trains, generates again, and reports what the tests
compare: the engine's tokens against the reference holding the same (gathered) weights, and
the losses and final weights against the twin.
"""
from __future__ import annotations

import copy
import os
import sys
from typing import Any, Dict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
from _inference_models import VOCAB, prompts, tiny  # noqa: E402

import shardwise  # noqa: E402


def config(stage: int, hybrid: Dict[str, Any] = None, offload: bool = False) -> Dict[str, Any]:
    zero: Dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter really partitioned
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-2}}, "steps_per_print": 1000}
    if hybrid is not None:
        cfg["hybrid_engine"] = dict({"enabled": True, "max_out_tokens": 64}, **hybrid)
    return cfg


def gathered_weights(engine: Any) -> Dict[str, torch.Tensor]:
    params = list(engine.module.parameters())
    with shardwise.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def reference_tokens(ref: torch.nn.Module, weights: Dict[str, torch.Tensor], ids, mask, new: int):
    ref.load_state_dict(weights, strict=False)
    return ref.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)


def train_step(engine: Any, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, VOCAB, (2, 10), generator=g)
    torch.manual_seed(seed)  # the same dropout masks in both engines
    loss = engine(x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def scenario(rank: int, world: int, family: str, stage: int, hybrid: Dict[str, Any] = None,
             offload: bool = False, steps: int = 2) -> Dict[str, Any]:
    """Generate / train / generate; returns tokens, references, losses and final weights."""
    model = tiny(family)
    ref, twin = copy.deepcopy(model), copy.deepcopy(model)
    engine, *_ = shardwise.initialize(model=model, config=config(stage, hybrid or {}, offload))
    plain, *_ = shardwise.initialize(model=twin, config=config(stage, None, offload))
    plain.train()  # the same dropout as the hybrid engine, which is back in train mode
    ids, mask = prompts(2, seed=10 + rank)
    out: Dict[str, Any] = {"tokens": [], "reference": [], "losses": [], "twin_losses": []}

    def generate() -> None:
        engine.eval()
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        out["tokens"].append(got)
        out["reference"].append(reference_tokens(ref, gathered_weights(engine), ids, mask, 6))
        engine.train()

    generate()
    for step in range(steps):
        out["losses"].append(train_step(engine, 100 * step + rank))
        out["twin_losses"].append(train_step(plain, 100 * step + rank))
        generate()
    out["weights"] = gathered_weights(engine)
    out["twin_weights"] = gathered_weights(plain)
    out["copy_bytes"] = engine.generate_stats.get("copy_bytes", 0.0)
    return out


def scenarios(rank: int, world: int, cases: list) -> list:
    """Several ``scenario`` runs in one spawn (the processes' start-up is the slow part)."""
    return [scenario(rank, world, family, stage, steps=steps) for family, stage, steps in cases]


def tp_scenario(rank: int, world: int, family: str, stage: int) -> Dict[str, Any]:
    """``inference_tp_size`` = world: generation on AutoTP shards, training stays ZeRO."""
    model = tiny(family)
    ref = copy.deepcopy(model)
    engine, *_ = shardwise.initialize(model=model, config=config(stage, {"inference_tp_size": world}))
    ids, mask = prompts(2, seed=10 + rank)
    out: Dict[str, Any] = {"tokens": [], "reference": [], "proj_rows": []}
    for step in range(2):
        engine.eval()
        out["tokens"].append(engine.generate(ids, attention_mask=mask, max_new_tokens=6))
        out["proj_rows"].append(engine.generate_stats["proj_rows"])
        out["reference"].append(reference_tokens(ref, gathered_weights(engine), ids, mask, 6))
        engine.train()
        train_step(engine, step * world + rank)
    return out
