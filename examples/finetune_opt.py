"""Fine-tune an OPT model with shardwise — the seed article's section 4.1 script.

    python examples/finetune_opt.py                      # tiny OPT, built-in corpus, CPU, ~1 min
    shardwise --num_gpus 2 examples/finetune_opt.py --deepspeed --deepspeed_config examples/ds_config.json
    python examples/finetune_opt.py --size 125m --steps 200   # OPT-125M's shape (random init)

The model is built from a ``transformers.OPTConfig`` (there are no hub downloads here), the
text is a small built-in corpus and the tokenizer is byte-level, so the script runs on a
fresh machine. The training loop is DeepSpeed's, with ``deepspeed`` spelled ``shardwise``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset
from tqdm import tqdm
from transformers import OPTConfig, OPTForCausalLM

import shardwise

HERE = Path(__file__).resolve().parent
CORPUS = """\
DeepSpeed is a deep learning optimization library that makes distributed training easy.
ZeRO partitions optimizer states, gradients and parameters across data-parallel ranks.
Offloading optimizer states to CPU memory lets a single GPU train a much larger model.
Mixed precision keeps a master copy of the weights in float32 and computes in half precision.
A dynamic loss scaler skips steps whose gradients overflow and lowers the scale.
Activation checkpointing trades recomputation for memory during the backward pass.
Windows users run the same scripts: processes are spawned and gloo carries the collectives.
Checkpoints store every parameter as slices with their global shape and offsets.
""" * 8

SIZES = {
    # a model that trains in about a minute on two CPU cores
    "tiny": dict(hidden_size=64, num_hidden_layers=2, ffn_dim=256, num_attention_heads=4,
                 word_embed_proj_dim=64, max_position_embeddings=128),
    # OPT-125M's shape (facebook/opt-125m), random init
    "125m": dict(hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12,
                 word_embed_proj_dim=768, max_position_embeddings=2048),
}


class ByteCorpus(Dataset):
    """Fixed-length windows of the corpus as bytes (vocabulary of 256 + 2 specials)."""

    def __init__(self, text: str, seq_len: int) -> None:
        data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long) + 2
        n = (len(data) - 1) // seq_len
        self.windows = data[: n * seq_len].view(n, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        ids = self.windows[i]
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = shardwise.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=258, pad_token_id=1, bos_token_id=0,
                                     eos_token_id=0, **SIZES[args.size]))
    if args.deepspeed_config or getattr(args, "shardwise_config", None):
        config = None  # initialize(args=args) reads --deepspeed_config
    else:
        config = json.loads("\n".join(l for l in (HERE / "ds_config.json").read_text().splitlines()
                                      if not l.strip().startswith("//")))
        config["scheduler"]["params"]["warmup_num_steps"] = 10  # a short run warms up quickly
        config["optimizer"]["params"]["lr"] = config["scheduler"]["params"]["warmup_max_lr"] = 3e-3

    dataset = ByteCorpus(CORPUS, args.seq_len)
    model_engine, optimizer, dataloader, scheduler = shardwise.initialize(
        args=args if config is None else None, model=model, model_parameters=model.parameters(),
        training_data=dataset, config=config)

    total_micro = args.steps * model_engine.gradient_accumulation_steps()
    bar = tqdm(total=args.steps, desc="train", unit="step",
               disable=model_engine.global_rank != 0)
    start, micro, first_loss = time.perf_counter(), 0, None
    while micro < total_micro:
        for batch in dataloader:
            loss = model_engine(**batch).loss
            model_engine.backward(loss)
            model_engine.step()
            micro += 1
            if micro % model_engine.gradient_accumulation_steps() == 0:  # an optimizer step ended
                value = loss.item()
                first_loss = value if first_loss is None else first_loss
                bar.update(1)
                bar.set_postfix(loss=f"{value:.3f}", lr=f"{model_engine.get_lr()[0]:.2e}")
            if micro >= total_micro:
                break
    bar.close()
    if model_engine.global_rank == 0:
        tokens = total_micro * model_engine.train_micro_batch_size_per_gpu() * args.seq_len * model_engine.world_size
        print(f"done: {args.steps} steps, loss {first_loss:.3f} -> {value:.3f}, "
              f"{tokens / (time.perf_counter() - start):.0f} tokens/s")


if __name__ == "__main__":
    main()
