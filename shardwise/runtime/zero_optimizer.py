"""``engine.optimizer``: the user's torch optimizer, re-pointed at fp32 master partitions.

DeepSpeed users read ``engine.optimizer.cur_scale``, ``.param_groups`` and ``.state_dict()``;
this wrapper offers those names while the real work happens in the inner torch optimizer
(fused kernels) and the ZeRO strategy.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ..zero.strategy import ZeroStrategy


class ZeroOptimizer:
    """Wraps the inner optimizer whose params are this rank's fp32 master slices."""

    def __init__(self, inner: torch.optim.Optimizer, strategy: ZeroStrategy,
                 loss_scaler: Any = None) -> None:
        self.inner = inner
        self.strategy = strategy
        self.loss_scaler = loss_scaler
        masters = strategy.master_param_groups()
        if len(masters) != len(inner.param_groups):
            raise RuntimeError("internal: master groups do not match optimizer groups")
        for group, params in zip(inner.param_groups, masters):
            group["params"] = params
        inner.state.clear()
        strategy.bind_optimizer(inner)
        if hasattr(inner, "_patch_step_function"):
            inner._patch_step_function()

    # --- DeepSpeed-facing attributes --------------------------------------------------------
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Dict[Any, Any]:
        return self.inner.state

    @property
    def defaults(self) -> Dict[str, Any]:
        return self.inner.defaults

    @property
    def cur_scale(self) -> float:
        return float(self.loss_scaler.cur_scale) if self.loss_scaler is not None else 1.0

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        return bool(getattr(self.loss_scaler, "dynamic", False))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.strategy.zero_grads()

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state for this rank's partition (use engine.save_checkpoint
        for a checkpoint that any world size can read)."""
        out = {"optimizer": self.inner.state_dict()}
        if self.loss_scaler is not None:
            out["loss_scaler"] = self.loss_scaler.state_dict()
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.inner.load_state_dict(state["optimizer"])
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.strategy.stage}, inner={type(self.inner).__name__})"
