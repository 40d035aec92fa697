"""Group-wise weight-only quantization for ZeRO-Inference streaming (int8 / int4), torch ops only.

DeepSpeed's key: ``"weight_quantization": {"quantized_initialization": {"num_bits": 4 or 8,
"group_size": 64}}``. A layer's streamed weights are one flat float array (each tensor padded
to a multiple of ``group_size``); every run of ``group_size`` consecutive elements (a piece of
one weight row when the row length divides by the group size) gets its own asymmetric range:
``x ~= q * scale + low`` with ``q`` in ``[0, 2**bits - 1]``. The host copy is one byte buffer
``[q payload | scales (fp16) | lows (fp16)]``; int4 codes are packed two per byte (element
``2j`` in the low nibble, ``2j + 1`` in the high one). The device copies those bytes (4x / 2x
fewer than bf16, plus 4 bytes of fp16 scale and low per group) and expands them into the
compute dtype with a few elementwise ops (``dequantize_into``).

``quantized_perplexity_delta`` reports what it costs on a fixed text.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import nn

from shardwise.errors import ConfigError

SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class QuantSpec:
    """``num_bits`` (4 or 8) and ``group_size`` of the group-wise quantization."""

    num_bits: int
    group_size: int

    def __post_init__(self) -> None:
        if self.num_bits not in (4, 8):
            raise ConfigError(f"weight_quantization.quantized_initialization.num_bits = "
                              f"{self.num_bits!r}: ZeRO-Inference streams int4 or int8 weights; "
                              f"use 4 or 8.")
        if self.group_size < 2 or self.group_size % 2:
            raise ConfigError(f"weight_quantization.quantized_initialization.group_size = "
                              f"{self.group_size!r}: expected a positive even number (DeepSpeed's "
                              f"default is 64).")

    @property
    def levels(self) -> int:
        return (1 << self.num_bits) - 1

    def payload_bytes(self, numel: int) -> int:
        """Bytes of the codes of ``numel`` elements (a multiple of ``group_size``)."""
        return numel if self.num_bits == 8 else numel // 2

    def packed_bytes(self, numel: int) -> int:
        """Bytes of codes plus fp16 scale and low per group (rounded up to 64)."""
        groups = numel // self.group_size
        n = self.payload_bytes(numel) + 2 * groups * 2
        return n + (-n % 64)


def quantize_flat(flat: torch.Tensor, spec: QuantSpec, out: torch.Tensor) -> None:
    """Quantize float ``flat`` (numel a multiple of group_size) into the uint8 buffer ``out``."""
    n, g = flat.numel(), spec.group_size
    groups = flat.detach().float().view(n // g, g)
    low = groups.amin(dim=1)
    high = groups.amax(dim=1)
    scale = ((high - low) / spec.levels).clamp(min=1e-8)
    scale16 = scale.to(SCALE_DTYPE)
    low16 = low.to(SCALE_DTYPE)
    # codes are computed against the fp16-rounded scale/low, the numbers dequantization uses
    q = torch.round((groups - low16.float()[:, None]) / scale16.float()[:, None])
    q = q.clamp_(0, spec.levels).to(torch.uint8).view(-1)
    if spec.num_bits == 4:
        q = q[0::2] | (q[1::2] << 4)
    pay = spec.payload_bytes(n)
    out[:pay].copy_(q)
    out[pay:pay + 2 * (n // g)].view(SCALE_DTYPE).copy_(scale16)
    out[pay + 2 * (n // g):pay + 4 * (n // g)].view(SCALE_DTYPE).copy_(low16)


def dequantize_into(packed: torch.Tensor, spec: QuantSpec, out: torch.Tensor) -> None:
    """Expand the uint8 ``packed`` bytes into ``out`` (flat, compute dtype, same device)."""
    n, g = out.numel(), spec.group_size
    groups = n // g
    pay = spec.payload_bytes(n)
    codes = packed[:pay]
    if spec.num_bits == 4:
        codes = torch.stack((codes & 0xF, codes >> 4), dim=-1)
    scale = packed[pay:pay + 2 * groups].view(SCALE_DTYPE).to(out.dtype)
    low = packed[pay + 2 * groups:pay + 4 * groups].view(SCALE_DTYPE).to(out.dtype)
    values = codes.reshape(groups, g).to(out.dtype)
    torch.addcmul(low[:, None], values, scale[:, None], out=out.view(groups, g))


def roundtrip(tensor: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``tensor`` quantized and dequantized (the values streaming computes with)."""
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    padded = n + (-n % spec.group_size)
    src = torch.zeros(padded, dtype=tensor.dtype)
    src[:n] = flat.cpu()
    packed = torch.empty(spec.packed_bytes(padded), dtype=torch.uint8)
    quantize_flat(src, spec, packed)
    out = torch.empty(padded, dtype=tensor.dtype)
    dequantize_into(packed, spec, out)
    return out[:n].view_as(tensor).to(tensor.device)


@torch.no_grad()
def quantized_perplexity_delta(model: nn.Module, input_ids: torch.Tensor, spec: QuantSpec,
                               min_numel: int = 0) -> Dict[str, float]:
    """Perplexity of ``model`` and of a copy whose decoder-layer weights (tensors with more
    than ``min_numel`` elements, as streaming quantizes them) went through ``spec``.

    Returns ``{"ppl_float", "ppl_quant", "delta", "relative"}``; ``model`` is not changed.
    """
    from .quant import perplexity
    from .streaming import decoder_layers
    quant = copy.deepcopy(model).eval()
    for layer in decoder_layers(quant):
        for p in layer.parameters():
            if p.numel() > min_numel and p.is_floating_point():
                p.data = roundtrip(p.data, spec)
    ppl_float = perplexity(lambda ids: model(ids).logits, input_ids)
    ppl_quant = perplexity(lambda ids: quant(ids).logits, input_ids)
    return {"ppl_float": ppl_float, "ppl_quant": ppl_quant, "delta": ppl_quant - ppl_float,
            "relative": (ppl_quant - ppl_float) / ppl_float if math.isfinite(ppl_float) else math.nan}


# --- config (DeepSpeed's "weight_quantization" section) -------------------------------------
from pydantic import Field  # noqa: E402

from shardwise.config.base import ConfigModel  # noqa: E402


class QuantizedInitConfig(ConfigModel):
    """``weight_quantization.quantized_initialization``: quantize the weights when they are
    placed (ZeRO-Inference keeps the host copy quantized and dequantizes after the copy)."""

    num_bits: int = 8
    """4 or 8 bits per weight."""
    group_size: int = Field(64, ge=2)
    """Consecutive elements sharing one scale and offset (DeepSpeed's example: 64)."""
    group_dim: int = 1
    """DeepSpeed's grouping dimension; groups here run along the last (input) dimension."""
    symmetric: bool = False
    """DeepSpeed's switch; groups here are always asymmetric (min/max), as DeepSpeed's default."""


class WeightQuantizationConfig(ConfigModel):
    """``weight_quantization`` (DeepSpeed's ZeRO-Inference key): weight-only quantized streaming."""

    deepspeed_only = {"post_init_quant": "only quantized_initialization is implemented (the "
                                         "streamed layers are quantized when they are placed)"}

    quantized_initialization: Optional[QuantizedInitConfig] = None
    """Quantize the streamed weights when the model is placed (see QuantizedInitConfig)."""

    def spec(self) -> Optional[QuantSpec]:
        q = self.quantized_initialization
        return None if q is None else QuantSpec(int(q.num_bits), int(q.group_size))
