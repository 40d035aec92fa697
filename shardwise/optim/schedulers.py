"""DeepSpeed's LR schedules (``"scheduler": {"type": ..., "params": {...}}``), same formulas.

Every schedule follows ``deepspeed/runtime/lr_schedules.py``: it is indexed by
``last_batch_iteration`` (-1 before the first ``step()``), ``step()`` advances it by one
and writes the new lr into every param group, and constructing it writes the lr for
``last_batch_iteration`` into the optimizer at once (so the first optimizer step uses the
schedule's starting value, e.g. ``warmup_min_lr``). State dicts are plain JSON.

Any ``torch.optim.lr_scheduler`` class can be named too (``StepLR``, ``CosineAnnealingLR``,
...), except those needing a callable, other schedulers or a metric.
"""
from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import torch

from shardwise.errors import ConfigError
from shardwise.utils.logging import warn_once

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest",
           "build_scheduler", "SCHEDULER_NAMES"]

Number = Union[int, float]
WARMUP_TYPES = ("log", "linear")


def _param_groups(optimizer: Any) -> list:
    """The param groups of a torch optimizer or of a wrapper exposing one (ZeRO, fp16)."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None and hasattr(optimizer, "optimizer"):
        groups = getattr(optimizer.optimizer, "param_groups", None)
    if groups is None:
        raise ConfigError(f"a scheduler needs an optimizer with param_groups, got "
                          f"{type(optimizer).__name__}.")
    return groups


def _update_lr(param_groups: list, lrs: Sequence[float]) -> List[float]:
    for group, lr in zip(param_groups, lrs):
        # Keep a tensor lr a tensor (torch supports it, e.g. for capturable optimizers).
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [float(lr) for lr in lrs]


def _per_group(value: Any, name: str, n_groups: int) -> List[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ConfigError(f"scheduler.params.{name} has {len(value)} values but the optimizer "
                              f"has {n_groups} param groups; give one value or one per group.")
        return [float(v) for v in value]
    return [float(value)] * n_groups


def _int_param(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value):
        raise ConfigError(f"scheduler.params.{name} must be an integer, got {value!r}.")
    if int(value) < minimum:
        raise ConfigError(f"scheduler.params.{name} must be >= {minimum}, got {value!r}.")
    return int(value)


def _warmup_type(value: str) -> str:
    if value not in WARMUP_TYPES:
        raise ConfigError(f"scheduler.params.warmup_type must be one of {list(WARMUP_TYPES)}, got "
                          f"{value!r}.")
    return value


def _warmup_steps(value: Any) -> int:
    steps = _int_param("warmup_num_steps", value, 0)
    # DeepSpeed clamps to 2 so that log(warmup_num_steps) > 0; 0 means "no warmup" in
    # many published configs and keeps working.
    if steps < 2:
        warn_once(f"scheduler.params.warmup_num_steps={steps} is treated as 2, as DeepSpeed does.")
    return max(2, steps)


def _warmup_gamma(it: int, warmup_num_steps: int, inverse_log: float, warmup_type: str) -> float:
    """The 0→1 warmup fraction at iteration ``it`` (< warmup_num_steps)."""
    if warmup_type == "log":
        return inverse_log * math.log(it + 1)
    return it / warmup_num_steps


class _Schedule:
    """Shared step / state logic; subclasses implement ``get_lr()``."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = _int_param("last_batch_iteration", last_batch_iteration, -1)
        self._last_lr: List[float] = []

    @property
    def param_groups(self) -> list:
        return _param_groups(self.optimizer)

    def get_lr(self) -> List[float]:
        """The lr of every param group at ``last_batch_iteration``."""
        raise NotImplementedError

    def get_last_lr(self) -> List[float]:
        """The lrs last written into the optimizer."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next one) and set the lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = int(last_batch_iteration)
        self._apply()

    def _apply(self) -> None:
        self._last_lr = _update_lr(self.param_groups, self.get_lr())

    def state_dict(self) -> Dict[str, Any]:
        """JSON-serialisable state (DeepSpeed's key, so DeepSpeed checkpoints load)."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the position and rewrite the optimizer's lrs for it."""
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()


class WarmupLR(_Schedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    lr(it) = min + (max - min) * gamma, gamma = log(it + 1) / log(W) ("log") or it / W
    ("linear") for it < W, else 1; W = max(2, warmup_num_steps). Before the first step
    (it = -1) the lr is ``warmup_min_lr``. ``warmup_max_lr`` defaults to the optimizer's lr
    (current DeepSpeed; older versions defaulted to 0.001).
    """

    def __init__(self, optimizer: Any, warmup_min_lr: Number = 0.0,
                 warmup_max_lr: Optional[Number] = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        n = len(self.param_groups)
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in self.param_groups]
        self.min_lrs = _per_group(warmup_min_lr, "warmup_min_lr", n)
        self.max_lrs = _per_group(warmup_max_lr, "warmup_max_lr", n)
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = _warmup_steps(warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self._apply()

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps,
                                 self.inverse_log_warm_up, self.warmup_type)
        return 1.0

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``.

    After warmup: lr = min + (max - min) * max(0, (total - it) / max(1, total - W)),
    W = max(2, warmup_num_steps) (DeepSpeed's exact expression).
    """

    def __init__(self, optimizer: Any, total_num_steps: Optional[int] = None,
                 warmup_min_lr: Number = 0.0, warmup_max_lr: Number = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _total_steps("WarmupDecayLR", total_num_steps, warmup_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._get_gamma()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


def _total_steps(kind: str, total_num_steps: Any, warmup_num_steps: Any) -> int:
    if total_num_steps is None:
        raise ConfigError(f"scheduler type {kind!r} needs scheduler.params.total_num_steps (the "
                          "number of optimizer steps in the run).")
    total = _int_param("total_num_steps", total_num_steps, 1)
    warmup = _int_param("warmup_num_steps", warmup_num_steps, 0)
    if total < warmup:
        raise ConfigError(f"scheduler {kind!r}: total_num_steps={total} is less than "
                          f"warmup_num_steps={warmup}, so the decay phase would never start. "
                          "Raise total_num_steps or lower warmup_num_steps.")
    return total


class WarmupCosineLR(_Schedule):
    """Warm up from ``warmup_min_ratio`` to 1 of the optimizer's lr, then cosine-decay to ``cos_min_ratio``.

    ratio(it) = wmin + (1 - wmin) * gamma during warmup (gamma as WarmupLR); after it,
    p = min(1, (it - W + 1) / max(1, total - W)) and
    ratio = max(0, cmin + (1 - cmin) * (1 + cos(pi * p)) / 2). lr = base_lr * ratio; the
    base lrs are the optimizer's at construction. At it = -1 the lr is 0 (as DeepSpeed).
    """

    def __init__(self, optimizer: Any, total_num_steps: Optional[int] = None,
                 warmup_min_ratio: Number = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: Number = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = _total_steps("WarmupCosineLR", total_num_steps, warmup_num_steps)
        for name, value in (("warmup_min_ratio", warmup_min_ratio), ("cos_min_ratio", cos_min_ratio)):
            if not 0.0 <= float(value) <= 1.0:
                raise ConfigError(f"scheduler.params.{name} must be in [0, 1] (a fraction of the "
                                  f"optimizer's lr), got {value!r}.")
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_num_steps = _warmup_steps(warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [float(g["lr"]) for g in self.param_groups]
        self._apply()

    def get_lr_ratio(self) -> float:
        """The fraction of the base lr at ``last_batch_iteration``."""
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            gamma = _warmup_gamma(it, self.warmup_num_steps, self.inverse_log_warm_up,
                                  self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (it - self.warmup_num_steps + 1)
                       / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> List[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]

    def state_dict(self) -> Dict[str, Any]:
        # The base lrs are stored because a resumed optimizer's lr is the scheduled one.
        return {"last_batch_iteration": self.last_batch_iteration, "org_lrs": list(self.org_lrs)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "org_lrs" in state:
            self.org_lrs = [float(v) for v in state["org_lrs"]]
        super().load_state_dict(state)


class LRRangeTest(_Schedule):
    """Grow the lr from ``lr_range_test_min_lr`` to find the largest stable one.

    lr(it) = min_lr * (1 + step_rate * x), x = (it + 1) / step_size, floored when
    ``lr_range_test_staircase``.
    """

    def __init__(self, optimizer: Any, lr_range_test_min_lr: Number = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: Number = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(lr_range_test_min_lr, "lr_range_test_min_lr", len(self.param_groups))
        self.step_size = _int_param("lr_range_test_step_size", lr_range_test_step_size, 1)
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        self._apply()

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lr)
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lr]


class OneCycle(_Schedule):
    """1Cycle: lr rises ``cycle_min_lr``→``cycle_max_lr`` over ``cycle_first_step_size``,
    falls back over ``cycle_second_step_size``, then decays; momentum (beta1) moves inversely.

    In the cycle, with b = it + 1 and T = first + second: x = 1 + b/T - floor(1 + b/T);
    scale = x / r on the rise (r = first / T), (x - 1) / (r - 1) on the fall; a stair count
    > 0 quantises the scale to floor(position * count) / count. lr = min + (max - min) * scale,
    beta1 = max_mom - (max_mom - min_mom) * scale. After the cycle (it >= T):
    lr = min / (1 + decay_lr_rate * d / decay_step_size), beta1 = max_mom * (1 + decay_mom_rate
    * d / decay_step_size), d = it - T + 1 (no decay if either rate or the step size is 0).
    As in DeepSpeed, momentum is written as betas = (beta1, 0.99) and only for optimizers
    with ``betas`` (Adam-like).
    """

    def __init__(self, optimizer: Any, cycle_min_lr: Optional[Number] = None,
                 cycle_max_lr: Optional[Number] = None, decay_lr_rate: Number = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: Optional[int] = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: Optional[int] = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: Number = 0.8,
                 cycle_max_mom: Number = 0.9, decay_mom_rate: Number = 0.0,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if cycle_min_lr is None or cycle_max_lr is None:
            raise ConfigError("scheduler type 'OneCycle' needs scheduler.params.cycle_min_lr and "
                              f"cycle_max_lr, got cycle_min_lr={cycle_min_lr!r}, "
                              f"cycle_max_lr={cycle_max_lr!r}.")
        first = _int_param("cycle_first_step_size", cycle_first_step_size, 1)
        second = first if cycle_second_step_size is None else _int_param(
            "cycle_second_step_size", cycle_second_step_size, 1)
        self.first_step_size, self.second_step_size = float(first), float(second)
        self.total_size = float(first + second)
        self.step_ratio = first / self.total_size
        self.first_stair_count = _int_param("cycle_first_stair_count", cycle_first_stair_count, -1)
        self.second_stair_count = (self.first_stair_count if cycle_second_stair_count is None else
                                   _int_param("cycle_second_stair_count", cycle_second_stair_count, -1))
        self.decay_step_size = _int_param("decay_step_size", decay_step_size, 0)
        n = len(self.param_groups)
        self.min_lrs = _per_group(cycle_min_lr, "cycle_min_lr", n)
        self.max_lrs = _per_group(cycle_max_lr, "cycle_max_lr", n)
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = self.decay_step_size == 0 or self.decay_lr_rate == 0
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = self.decay_step_size == 0 or self.decay_mom_rate == 0
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in getattr(self._torch_optimizer(), "defaults", {}):
            warn_once(f"OneCycle: cycle_momentum is disabled because "
                      f"{type(self._torch_optimizer()).__name__} has no betas.")
            self.cycle_momentum = False
        self.min_moms = [(float(cycle_min_mom), 0.99)] * n
        self.max_moms = [(float(cycle_max_mom), 0.99)] * n
        if self.last_batch_iteration == -1:
            # DeepSpeed starts at the cycle's minimum lr and minimum momentum.
            self._last_lr = _update_lr(self.param_groups, self.min_lrs)
            if self.cycle_momentum:
                for group, mom in zip(self.param_groups, self.min_moms):
                    group["betas"] = mom
        else:
            self._apply()

    def _torch_optimizer(self) -> Any:
        opt = self.optimizer
        return opt if hasattr(opt, "defaults") else getattr(opt, "optimizer", opt)

    def _get_scale_factor(self) -> float:
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor, stair_count = x / self.step_ratio, self.first_stair_count
        else:
            scale_factor, stair_count = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stair_count > 0:
            # Quantise from the integer position, not from scale_factor, whose float value at a
            # half-cycle boundary can land just under an exact stair.
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                position = cycle_iteration * stair_count / self.first_step_size
            else:
                position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale_factor = math.floor(position) / stair_count
        return scale_factor

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        decay_iteration = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_lr_rate * decay_iteration / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> Optional[List[tuple]]:
        """The betas of every param group at ``last_batch_iteration`` (None if not cycled)."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1])
                    for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        decay_iteration = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_mom_rate * decay_iteration / self.decay_step_size
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        moms = self.get_mom()
        for group, mom in zip(self.param_groups, moms or []):
            group["betas"] = mom


_DEEPSPEED: Dict[str, type] = {cls.__name__.lower(): cls for cls in
                               (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}
# These need a callable, other schedulers or a metric in step(), which a config cannot give.
_TORCH_EXCLUDED = {"LambdaLR", "MultiplicativeLR", "SequentialLR", "ChainedScheduler",
                   "ReduceLROnPlateau", "LRScheduler"}


def _torch_schedulers() -> Dict[str, type]:
    base = torch.optim.lr_scheduler.LRScheduler
    found = {}
    for name in dir(torch.optim.lr_scheduler):
        obj = getattr(torch.optim.lr_scheduler, name)
        if (isinstance(obj, type) and issubclass(obj, base) and name not in _TORCH_EXCLUDED
                and not name.startswith("_")):
            found[name.lower()] = obj
    return found


_TORCH = _torch_schedulers()
SCHEDULER_NAMES: List[str] = [cls.__name__ for cls in _DEEPSPEED.values()] + sorted(
    cls.__name__ for cls in _TORCH.values())
"""Every scheduler type ``build_scheduler`` accepts (case-insensitive)."""


def build_scheduler(sched_type: str, optimizer: Any, params: Optional[Mapping[str, Any]] = None
                    ) -> Union["_Schedule", torch.optim.lr_scheduler.LRScheduler]:
    """Build the LR scheduler a DeepSpeed ``scheduler`` config section describes.

    Args:
        sched_type: ``scheduler.type`` (case-insensitive), a DeepSpeed schedule or a
            ``torch.optim.lr_scheduler`` class name.
        optimizer: the torch optimizer (or a wrapper with ``.optimizer``/``param_groups``).
        params: ``scheduler.params`` (``"auto"`` values must already be resolved).
    """
    key = str(sched_type).strip().lower()
    cls = _DEEPSPEED.get(key) or _TORCH.get(key)
    if cls is None:
        near = difflib.get_close_matches(key, [n.lower() for n in SCHEDULER_NAMES], n=1, cutoff=0.5)
        names = {n.lower(): n for n in SCHEDULER_NAMES}
        hint = f" Did you mean {names[near[0]]!r}?" if near else ""
        excluded = (f" ({sched_type!r} needs a callable, other schedulers or a metric, which a "
                    "config cannot give; build it yourself and pass lr_scheduler=)."
                    if key in {n.lower() for n in _TORCH_EXCLUDED} else "")
        raise ConfigError(f"scheduler.type {sched_type!r} is not a known scheduler.{excluded}{hint} "
                          f"Valid types (case-insensitive): {', '.join(SCHEDULER_NAMES)}.")
    kwargs = dict(params or {})
    for name, value in kwargs.items():
        if isinstance(value, str) and value.strip().lower() == "auto":
            raise ConfigError(f"scheduler.params.{name} is still \"auto\"; resolve it (e.g. through "
                              "the HF Trainer integration) or set a number.")
    _check_kwargs(cls, kwargs)
    if key in _TORCH and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = getattr(optimizer, "optimizer", optimizer)
    try:
        return cls(optimizer, **kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError, KeyError) as err:
        raise ConfigError(f"{cls.__name__}(**scheduler.params) rejected the config: {err}. "
                          f"scheduler.params given: {kwargs!r}") from err


def _check_kwargs(cls: type, kwargs: Mapping[str, Any]) -> None:
    sig = inspect.signature(cls.__init__)
    accepted = sorted(n for n in sig.parameters if n not in ("self", "optimizer"))
    for name in kwargs:
        if name not in accepted:
            near = difflib.get_close_matches(name, accepted, n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"scheduler.params.{name} is not a parameter of {cls.__name__}.{hint} "
                              f"Accepted: {', '.join(accepted)}.")
