"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms") on torch ``_foreach_*`` ops.

    c = beta1 * m + (1 - beta1) * g
    w = w * (1 - lr * weight_decay) - lr * sign(c)     (decoupled weight decay)
    m = beta2 * m + (1 - beta2) * g

One state tensor per parameter (half of Adam's), which is why it is popular under
ZeRO. The update is elementwise, so any partitioning of a parameter gives the same
result as the whole tensor.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Tuple

import torch

from ._state import collect_group

from shardwise.errors import ConfigError

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Lion optimizer with the paper's defaults.

    Args:
        params: tensors or param-group dicts.
        lr: learning rate (the paper suggests 3-10x smaller than AdamW's).
        betas: (beta1, beta2): beta1 interpolates the update direction, beta2 the momentum.
        weight_decay: decoupled weight decay coefficient (scaled by lr).
    """

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: Tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if not (isinstance(lr, torch.Tensor) or lr >= 0):
            raise ConfigError(f"optimizer.params.lr must be >= 0, got {lr!r}.")
        if len(betas) != 2 or not all(0.0 <= b <= 1.0 for b in betas):
            raise ConfigError(f"optimizer.params.betas must be two numbers in [0, 1], got {betas!r}.")
        if weight_decay < 0:
            raise ConfigError(f"optimizer.params.weight_decay must be >= 0, got {weight_decay!r}.")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One Lion update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            t = collect_group(self, group, ("exp_avg",))
            if t["params"]:
                _lion_update(group, t["params"], t["grads"], t["exp_avg"], t["step"])
        return loss


def _lion_update(group: dict, params, grads, exp_avgs, steps) -> None:
    beta1, beta2 = group["betas"]
    lr, wd = group["lr"], group["weight_decay"]
    torch._foreach_add_(steps, 1.0)
    direction = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(direction, grads, alpha=1.0 - beta1)
    torch._foreach_sign_(direction)
    if wd != 0:
        torch._foreach_mul_(params, 1.0 - lr * wd)
    if isinstance(lr, torch.Tensor):
        torch._foreach_mul_(direction, lr)
        torch._foreach_sub_(params, direction)
    else:
        torch._foreach_add_(params, direction, alpha=-lr)
    # The momentum is updated after the step, with beta2 (not beta1): the paper's key trick.
    torch._foreach_mul_(exp_avgs, beta2)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta2)
