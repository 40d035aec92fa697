"""Tiny Hugging Face causal LMs (built from transformers configs) and a plain-torch reference
for the stage-3 tests: Llama (multi-head attention), Mistral (grouped-query attention: fewer
key/value heads than query heads), OPT and GPT-2, all small enough for a CPU test."""
from __future__ import annotations

from typing import Dict, List

import torch

VOCAB, SEQ = 128, 8
MODEL_KINDS = ("llama", "gqa", "opt")
BLOCK_CLASS = {"llama": "LlamaDecoderLayer", "gqa": "MistralDecoderLayer",
               "opt": "OPTDecoderLayer", "gpt2": "GPT2Block"}


def hf_config(kind: str):
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64)
    if kind == "llama":
        return transformers.LlamaConfig(intermediate_size=64, num_key_value_heads=4, **common)
    if kind == "llama-gqa":  # Llama itself with grouped-query attention
        return transformers.LlamaConfig(intermediate_size=64, num_key_value_heads=2, **common)
    if kind == "gqa":
        return transformers.MistralConfig(intermediate_size=64, num_key_value_heads=2, **common)
    if kind == "opt":
        return transformers.OPTConfig(ffn_dim=64, word_embed_proj_dim=32, dropout=0.0,
                                      attention_dropout=0.0, **common)
    if kind == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                       n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0)
    raise ValueError(kind)


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    import transformers
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(hf_config(kind))


def batches(steps: int, global_batch: int, seed: int = 7) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (global_batch, SEQ), generator=g) for _ in range(steps)]


def reference(kind: str, steps: int, global_batch: int, lr: float) -> Dict[str, torch.Tensor]:
    """Plain single-process torch: AdamW on each whole global batch, no checkpointing."""
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for ids in batches(steps, global_batch):
        model(input_ids=ids, labels=ids).loss.backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def mismatches(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> List[str]:
    """Names whose values differ beyond reduction-order rounding. A key-projection bias has
    an exact gradient of 0 (softmax ignores a shift shared by all keys), so Adam turns
    rounding noise into full-size steps there: those are compared loosely."""
    bad = []
    for name, want in ref.items():
        loose = name.endswith("k_proj.bias")
        rtol, atol = (0.0, 1e-3) if loose else (1e-4, 1e-5)
        if not torch.allclose(got[name].float(), want, rtol=rtol, atol=atol):
            bad.append(f"{name}: max abs diff {(got[name].float() - want).abs().max():.3g}")
    return bad
