"""The training script the autotuning benchmark tunes: DeepSpeed-style, shardwise or DeepSpeed.

    shardwise --autotuning tune benchmarks/autotune_train.py --deepspeed --deepspeed_config ds.json
    deepspeed --autotuning tune benchmarks/autotune_train.py --framework deepspeed \
        --deepspeed --deepspeed_config ds.json

The model is the benchmarks' Llama (``_common.build_model``, 1.1B by default; the shape flags
are ``_common.add_shape_args``'), trained on random token ids with the micro batch the
config gives. Under an autotuner the engine exits after ``end_profile_step``; otherwise it
trains ``--steps`` optimizer steps.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BenchConfig, add_shape_args, build_model  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", choices=("shardwise", "deepspeed"), default="shardwise")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps outside an autotuner")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    add_shape_args(p, micro_batch=1)
    known, _ = p.parse_known_args()
    lib = __import__(known.framework)
    lib.add_config_arguments(p)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    lib = __import__(args.framework)
    if args.framework == "deepspeed":
        lib.init_distributed()
    device = torch.device("cuda", args.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = BenchConfig(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
                      heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab, seq=args.seq,
                      device=device.type)
    model = build_model(cfg, device)
    engine, _, _, _ = lib.initialize(args=args, model=model, model_parameters=model.parameters())
    mbs = engine.train_micro_batch_size_per_gpu()
    gen = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, cfg.vocab, (mbs, cfg.seq), generator=gen).to(engine.device)
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()


if __name__ == "__main__":
    main()
