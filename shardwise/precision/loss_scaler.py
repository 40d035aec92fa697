"""fp16 loss scaling with DeepSpeed's exact dynamic-scale rules.

fp16 gradients underflow to zero when they are small, so the loss is multiplied by a
large scale before backward and the gradients are divided by it before the optimizer
step. A dynamic scaler starts high, halves the scale when a step overflows (the step is
skipped) and doubles it after ``scale_window`` clean steps, so training rides just
under the overflow edge.

The update rule mirrors ``deepspeed/runtime/fp16/loss_scaler.py`` (``DynamicLossScaler``
up to DeepSpeed 0.17): hysteresis (``delayed_shift``) tolerates that many overflows
before the scale drops, and ``consecutive_hysteresis`` refills the tolerance after any
clean step instead of only when the scale grows.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Dict, Iterable, Optional

import torch

from shardwise.errors import ConfigError, ShardwiseError
from shardwise.utils.logging import log_dist

__all__ = ["LossScaleUnderflowError", "StaticLossScaler", "DynamicLossScaler",
           "create_loss_scaler", "has_overflow"]


class LossScaleUnderflowError(ShardwiseError, RuntimeError):
    """The dynamic loss scale would have to drop below ``min_loss_scale``."""


def has_overflow(tensors: Iterable[Optional[torch.Tensor]]) -> bool:
    """True when any element of any tensor is inf or NaN (``None`` entries are skipped).

    Uses the infinity norm (max |x|): it is finite exactly when every element is finite
    and, unlike the 2-norm, cannot itself overflow in fp16 for large finite values.
    One host sync per device, whatever the number of tensors.
    """
    by_device: Dict[torch.device, list] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        by_device.setdefault(t.device, []).append(t.detach())
    for device_tensors in by_device.values():
        norms = torch._foreach_norm(device_tensors, math.inf)
        # float() on the stacked flags is the single sync for this device.
        if not bool(torch.stack([n.float() for n in norms]).isfinite().all()):
            return True
    return False


class _LossScaler:
    """What both scalers share: the current scale and how a loss is scaled by it."""

    cur_scale: float

    @property
    def loss_scale(self) -> float:
        """The current scale (the same as ``cur_scale``)."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``, to call backward on."""
        return loss * self.cur_scale


class StaticLossScaler(_LossScaler):
    """A fixed loss scale (``fp16.loss_scale`` > 0); never changes, never skips a step."""

    def __init__(self, scale: float = 1.0) -> None:
        _check_positive_finite("fp16.loss_scale", scale)
        self.cur_scale: float = float(scale)
        self.dynamic: bool = False
        self.cur_iter: int = 0

    def update_scale(self, overflow: bool) -> None:
        """A static scale ignores overflow; only the iteration counter moves."""
        self.cur_iter += 1

    def state_dict(self) -> Dict[str, Any]:
        """Plain JSON-serialisable state."""
        return {"dynamic": False, "cur_scale": self.cur_scale, "cur_iter": self.cur_iter}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore the iteration counter; the scale stays the configured one."""
        self.cur_iter = int(state.get("cur_iter", 0))

    def __repr__(self) -> str:
        return f"StaticLossScaler(cur_scale={self.cur_scale})"


class DynamicLossScaler(_LossScaler):
    """DeepSpeed's dynamic loss scaler (same argument names and update rule).

    Args:
        init_scale: the first scale tried (DeepSpeed: ``2 ** fp16.initial_scale_power``).
        scale_window: clean iterations between two scale increases (``loss_scale_window``).
        min_scale: the floor of the scale (``min_loss_scale``).
        delayed_shift: overflows tolerated before the scale drops (``hysteresis``).
        consecutive_hysteresis: refill the tolerance after every clean iteration.
        raise_error_at_min_scale: raise instead of continuing when an overflow happens
            while the scale is already at ``min_scale``.
        scale_factor: the multiplier for growth and shrink (DeepSpeed fixes it at 2).
    """

    def __init__(self, init_scale: float = 2.0 ** 32, scale_window: int = 1000,
                 min_scale: float = 1.0, delayed_shift: int = 1,
                 consecutive_hysteresis: bool = False, raise_error_at_min_scale: bool = True,
                 scale_factor: float = 2.0) -> None:
        _check_positive_finite("fp16.initial_scale_power (2**power)", init_scale)
        _check_positive_finite("fp16.min_loss_scale", min_scale)
        _check_positive_int("fp16.loss_scale_window", scale_window)
        _check_positive_int("fp16.hysteresis", delayed_shift)
        if not (scale_factor > 1.0 and math.isfinite(scale_factor)):
            raise ConfigError(f"loss scale_factor must be a finite number > 1, got {scale_factor!r}.")
        self.cur_scale: float = float(init_scale)
        self.cur_iter: int = 0
        self.last_overflow_iter: int = -1
        self.scale_factor: float = float(scale_factor)
        self.scale_window: int = int(scale_window)
        self.min_scale: float = float(min_scale)
        self.delayed_shift: int = int(delayed_shift)
        self.cur_hysteresis: int = int(delayed_shift)
        self.consecutive_hysteresis: bool = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale: bool = bool(raise_error_at_min_scale)
        self.dynamic: bool = True

    def update_scale(self, overflow: bool) -> None:
        """Advance one iteration; ``overflow`` says whether this iteration's grads were inf/NaN."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleUnderflowError(
                        f"fp16 gradients overflowed at iteration {self.cur_iter} while the loss scale "
                        f"is already at min_loss_scale={self.min_scale:g}; the scale cannot drop "
                        "further, which usually means training is diverging (inf/NaN that no "
                        "scale can fix). Fix: lower the learning rate, check the data, switch to "
                        "bf16 ({\"bf16\": {\"enabled\": true}}), or set a lower fp16.min_loss_scale.")
                next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                log_dist(f"OVERFLOW! Skipping step. Attempted loss scale: {self.cur_scale:g}, "
                         f"reducing to {next_scale:g}")
                self.cur_scale = next_scale
            else:
                log_dist(f"OVERFLOW! Skipping step. Attempted loss scale: {self.cur_scale:g}, "
                         f"but hysteresis is {self.cur_hysteresis}; reducing hysteresis to "
                         f"{self.cur_hysteresis - 1}")
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> Dict[str, Any]:
        """Plain JSON-serialisable state: the counters plus the settings they were made with."""
        return {"dynamic": True, "cur_scale": self.cur_scale, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis, "scale_window": self.scale_window,
                "min_scale": self.min_scale, "delayed_shift": self.delayed_shift,
                "consecutive_hysteresis": self.consecutive_hysteresis,
                "scale_factor": self.scale_factor}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore the counters and current scale.

        The settings (window, min scale, hysteresis) stay those of the current config, so a
        resumed run may change them; the stored ones are informational.
        """
        if not state.get("dynamic", True):
            raise ConfigError("loss scaler state is from a static scaler (fp16.loss_scale > 0) but "
                              "the current config is dynamic (fp16.loss_scale = 0); use the same "
                              "fp16.loss_scale as the run that saved the checkpoint.")
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = min(int(state["cur_hysteresis"]), self.delayed_shift)

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(cur_scale={self.cur_scale:g}, cur_iter={self.cur_iter}, "
                f"cur_hysteresis={self.cur_hysteresis}, scale_window={self.scale_window}, "
                f"min_scale={self.min_scale:g})")


def _get(cfg: Any, name: str, default: Any) -> Any:
    """Read ``name`` from an attribute object (the fp16 config model) or a plain dict."""
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def create_loss_scaler(fp16_cfg: Any):
    """Build the scaler an ``fp16`` config section asks for.

    ``fp16_cfg`` is the fp16 config model or a dict with DeepSpeed's keys: ``loss_scale``
    (0 = dynamic, DeepSpeed's default), ``initial_scale_power`` (16), ``loss_scale_window``
    (1000), ``hysteresis`` (2), ``consecutive_hysteresis`` (False), ``min_loss_scale`` (1)
    and optionally ``raise_error_at_min_scale`` (True).
    """
    loss_scale = _get(fp16_cfg, "loss_scale", 0)
    if loss_scale is None or float(loss_scale) < 0:
        raise ConfigError(f"fp16.loss_scale must be 0 (dynamic) or a positive static scale, "
                          f"got {loss_scale!r}.")
    if float(loss_scale) > 0:
        return StaticLossScaler(float(loss_scale))
    power = _get(fp16_cfg, "initial_scale_power", 16)
    if not isinstance(power, (int, float)) or isinstance(power, bool) or not 0 <= power <= 64:
        raise ConfigError(f"fp16.initial_scale_power must be a number in [0, 64] (the first dynamic "
                          f"scale is 2**power), got {power!r}. DeepSpeed's default is 16.")
    return DynamicLossScaler(
        init_scale=2.0 ** power,
        scale_window=_get(fp16_cfg, "loss_scale_window", 1000),
        min_scale=_get(fp16_cfg, "min_loss_scale", 1.0),
        delayed_shift=_get(fp16_cfg, "hysteresis", 2),
        consecutive_hysteresis=_get(fp16_cfg, "consecutive_hysteresis", False),
        raise_error_at_min_scale=_get(fp16_cfg, "raise_error_at_min_scale", True))


def _check_positive_finite(name: str, value: Any) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive finite number, got {value!r}.")


def _check_positive_int(name: str, value: Any) -> None:
    is_int = isinstance(value, int) or (isinstance(value, float) and float(value).is_integer())
    if isinstance(value, bool) or not is_int or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}.")
