"""``FusedAdam`` and ``DeepSpeedCPUAdam``: torch's fused Adam/AdamW under DeepSpeed's names."""
from __future__ import annotations

from typing import Any, Iterable, Tuple

import torch

from ..optim.registry import build_optimizer


def FusedAdam(params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,  # noqa: N802
              betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
              adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
              set_grad_none: bool = True) -> torch.optim.Optimizer:
    """DeepSpeed's FusedAdam signature; AdamW when ``adam_w_mode`` (its default)."""
    return build_optimizer("Adam", params, dict(
        lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, adam_w_mode=adam_w_mode,
        weight_decay=weight_decay, amsgrad=amsgrad), device_type=_device_type(params))


def DeepSpeedCPUAdam(model_params: Iterable[Any], lr: float = 1e-3,  # noqa: N802
                     bias_correction: bool = True, betas: Tuple[float, float] = (0.9, 0.999),
                     eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                     adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adam signature: torch's fused CPU kernel (no JIT build)."""
    return build_optimizer("Adam", model_params, dict(
        lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, adam_w_mode=adamw_mode,
        weight_decay=weight_decay, amsgrad=amsgrad), device_type="cpu")


def _device_type(params: Any) -> str:
    # DeepSpeed constructs FusedAdam on CUDA parameters; look at the first one if we can
    if isinstance(params, (list, tuple)) and params:
        first = params[0]["params"][0] if isinstance(params[0], dict) else params[0]
        return first.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"
