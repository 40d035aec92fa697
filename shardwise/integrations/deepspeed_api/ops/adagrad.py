"""``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad`` on torch's Adagrad."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from ....optim.registry import build_optimizer


def DeepSpeedCPUAdagrad(model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10,  # noqa: N802
                        weight_decay: float = 0.0, amsgrad: bool = False,
                        fp32_optimizer_states: bool = True) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adagrad signature (``amsgrad`` and ``fp32_optimizer_states`` are
    accepted: DeepSpeed ignores the first, states follow the fp32 masters)."""
    return build_optimizer("Adagrad", model_params, dict(lr=lr, eps=eps, weight_decay=weight_decay),
                           device_type="cpu")


__all__ = ["DeepSpeedCPUAdagrad"]
