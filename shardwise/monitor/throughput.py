"""Throughput helpers: tokens in a batch, model FLOPs per token, the accelerator's peak."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from ..zero.stage3.partition import full_numel

def peak_flops(device: torch.device) -> Optional[float]:
    """Peak FLOP/s of one device, or None when unknown (then no MFU is reported): the flops
    profiler's table (profiling/peak_flops.py), SHARDWISE_PEAK_TFLOPS overriding it."""
    from ..profiling.peak_flops import device_peak_flops
    return device_peak_flops(device)


def batch_tokens(args: tuple, kwargs: Dict[str, Any]) -> Optional[Tuple[int, int]]:
    """(tokens, sequence length) of a batch with ``input_ids`` (keyword, a dict argument, or an
    integer tensor first argument, as HF models take it); None otherwise."""
    ids = kwargs.get("input_ids")
    if ids is None and args:
        first = args[0]
        if isinstance(first, dict):
            ids = first.get("input_ids")
        elif torch.is_tensor(first) and not first.is_floating_point() and first.dim() >= 1:
            ids = first
    if not torch.is_tensor(ids) or ids.dim() == 0:
        return None
    return ids.numel(), int(ids.shape[-1])


@dataclass(frozen=True)
class FlopsModel:
    """FLOPs of forward + backward per token: 6 * N_matmul + 12 * layers * hidden * seq
    (PaLM appendix B; N_matmul = parameters minus an untied input embedding table)."""

    matmul_params: int
    layers: int
    hidden: int

    def per_token(self, seq_len: int) -> float:
        return 6.0 * self.matmul_params + 12.0 * self.layers * self.hidden * seq_len

    @classmethod
    def of(cls, module: torch.nn.Module) -> Optional["FlopsModel"]:
        """Known for transformer models with an HF-style config (layers and hidden size)."""
        conf = getattr(module, "config", None)
        layers = getattr(conf, "num_hidden_layers", None) or getattr(conf, "n_layer", None)
        hidden = getattr(conf, "hidden_size", None) or getattr(conf, "n_embd", None)
        if not layers or not hidden:
            return None
        params = {id(p): p for p in module.parameters()}.values()
        total = sum(full_numel(p) for p in params)
        emb = _untied_input_embedding(module)
        return cls(matmul_params=total - emb, layers=int(layers), hidden=int(hidden))


def _untied_input_embedding(module: torch.nn.Module) -> int:
    get_in = getattr(module, "get_input_embeddings", None)
    get_out = getattr(module, "get_output_embeddings", None)
    try:
        emb = get_in() if callable(get_in) else None
        out = get_out() if callable(get_out) else None
    except (NotImplementedError, AttributeError):
        return 0
    if emb is None or not hasattr(emb, "weight"):
        return 0
    if out is not None and getattr(out, "weight", None) is emb.weight:
        return 0  # tied: the table is also the LM head, a real matmul
    return full_numel(emb.weight)
