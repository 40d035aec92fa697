"""Throughput helpers: tokens in a batch, model FLOPs per token, the accelerator's peak."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

#: dense bf16 peak TFLOP/s by a substring of the device name (first match wins);
#: SHARDWISE_PEAK_TFLOPS overrides (and is the only source on a CPU)
PEAK_TFLOPS: Tuple[Tuple[str, float], ...] = (
    ("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("GH200", 989.0), ("B200", 2250.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("A6000", 155.0), ("L4", 121.0),
    ("4090", 165.0), ("3090", 71.0), ("V100", 125.0), ("MI300X", 1307.0), ("MI250", 362.0),
)
PEAK_ENV = "SHARDWISE_PEAK_TFLOPS"


def peak_flops(device: torch.device) -> Optional[float]:
    """Peak FLOP/s of one device, or None when unknown (then no MFU is reported)."""
    env = os.environ.get(PEAK_ENV)
    if env:
        return float(env) * 1e12
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


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
        total = sum(int(getattr(p, "sw_numel", 0) or p.numel()) for p in params)
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
    return int(getattr(emb.weight, "sw_numel", 0) or emb.weight.numel())
