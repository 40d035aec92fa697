"""A tiny DeepSpeed-style training script for the autotuning tests (one CPU process).

Env: TINY_CRASH_MBS=N makes the script raise for micro batch N (a crashing experiment);
TINY_DONE_FILE=path gets "steps micro_batch stage" when the training loop finishes.
"""
import argparse
import os

import torch

import shardwise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    shardwise.add_config_arguments(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    engine, _, _, _ = shardwise.initialize(args=args, model=model, model_parameters=model.parameters())
    mbs = engine.train_micro_batch_size_per_gpu()
    if str(mbs) == os.environ.get("TINY_CRASH_MBS"):
        raise RuntimeError(f"tiny_train: refusing micro batch {mbs} (test crash)")
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        x = torch.randn(mbs, 16)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
    done = os.environ.get("TINY_DONE_FILE")
    if done:
        with open(done, "w", encoding="utf-8") as f:
            f.write(f"{engine.global_steps} {mbs} {engine.zero_optimization_stage()}\n")


if __name__ == "__main__":
    main()
