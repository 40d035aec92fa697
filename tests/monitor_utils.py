"""A tiny Llama trained a few steps with monitors on; shared by the monitor and plot tests."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

import shardwise

VOCAB, SEQ = 128, 8


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(conf)


def monitor_config(out: Path, *, micro: int = 2, ga: int = 2, steps_per_print: int = 2,
                   **sections: Any) -> Dict[str, Any]:
    cfg: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": ga,
        "steps_per_print": steps_per_print,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-3}},
    }
    cfg.update(sections)
    return cfg


def train(engine: Any, steps: int, micro: int = 2) -> List[float]:
    """Run ``steps`` optimizer steps; returns every loss passed to backward(), as floats."""
    gen = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        ids = torch.randint(0, VOCAB, (micro, SEQ), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        seen.append(float(loss.detach()))
    return seen


def initialize(cfg: Dict[str, Any]) -> Any:
    engine, _, _, _ = shardwise.initialize(model=tiny_llama(), config=cfg)
    return engine


def read_csv(path: Path) -> Tuple[List[str], List[Tuple[int, float]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [(int(s), float(v)) for s, v in rows[1:]]
