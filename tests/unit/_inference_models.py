"""Tiny Hugging Face decoders built from configs (no downloads) for the inference tests."""
from __future__ import annotations

from typing import Tuple

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM,
                          LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM)

VOCAB = 128


def tiny(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if family == "llama":  # GQA: 4 query heads over 2 KV heads
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        return LlamaForCausalLM(cfg).eval()
    if family == "opt":
        cfg = OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64)
        return OPTForCausalLM(cfg).eval()
    if family == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                         bos_token_id=0, eos_token_id=2)
        return GPT2LMHeadModel(cfg).eval()
    if family == "neox":
        cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.5,
                            bos_token_id=0, eos_token_id=2)
        return GPTNeoXForCausalLM(cfg).eval()
    raise ValueError(family)


def prompts(batch: int, length: int = 7, seed: int = 1, pad: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), left-padded by 0, 2, 4, ... tokens per row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, :min(2 * row, length - 1)] = 0
    ids[mask == 0] = pad
    return ids, mask
