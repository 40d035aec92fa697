"""DeepSpeed optimizer names (``"optimizer": {"type": ..., "params": {...}}``) → torch optimizers.

DeepSpeed's own types keep DeepSpeed's meaning and defaults:

* ``Adam``: DeepSpeed's FusedAdam / DeepSpeedCPUAdam, whose ``adam_w_mode`` defaults to
  true, i.e. *decoupled* weight decay. So ``Adam`` builds ``torch.optim.AdamW`` unless
  ``adam_w_mode`` is false (then ``torch.optim.Adam``, L2 weight decay). ``AdamW`` is
  always ``torch.optim.AdamW``. Defaults are FusedAdam's (lr 1e-3, betas (0.9, 0.999),
  eps 1e-8, weight_decay 0; note torch's AdamW would default weight_decay to 0.01).
* ``Lamb``, ``Lion``: shardwise's own ``_foreach`` implementations (DeepSpeed defaults).
* ``Adagrad``, ``SGD`` and every other ``torch.optim`` class by name, as DeepSpeed falls
  back to ``getattr(torch.optim, type)``.

The fused torch kernels (Adam, AdamW, SGD, Adagrad; CUDA and, since torch 2.4, CPU) are
picked when every parameter is on a device that has them; otherwise ``foreach``.
"""
from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set

import torch

from shardwise.errors import ConfigError
from shardwise.utils.logging import warn_once

from .lamb import Lamb
from .lion import Lion

__all__ = ["build_optimizer", "OPTIMIZER_NAMES"]


@dataclass(frozen=True)
class _Spec:
    """How one DeepSpeed optimizer type maps onto a torch optimizer class."""

    cls: type
    """The optimizer class built."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """DeepSpeed's defaults, applied where the JSON omits the key (they differ from torch's)."""
    dropped: frozenset = frozenset()
    """DeepSpeed-only keys accepted and ignored (documented in the module docstring)."""


_FUSED_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
# torch_adam: "use torch's implementation" — shardwise always does. set_grad_none: torch's
# zero_grad already sets grads to None. fp32_optimizer_states (DeepSpeedCPUAdam): states
# follow the master parameters, which are fp32 under mixed precision anyway.
_ADAM_DROPPED = frozenset({"torch_adam", "adam_w_mode", "set_grad_none", "fp32_optimizer_states"})

_SPECS: Dict[str, _Spec] = {
    "adam": _Spec(torch.optim.AdamW, _FUSED_ADAM_DEFAULTS, _ADAM_DROPPED),
    "adamw": _Spec(torch.optim.AdamW, _FUSED_ADAM_DEFAULTS, _ADAM_DROPPED),
    "lamb": _Spec(Lamb),
    # DeepSpeed's FusedLion defaults (lr 1e-3, betas (0.9, 0.999)) differ from the paper's,
    # which the Lion class itself uses; a DeepSpeed config gets DeepSpeed's.
    "lion": _Spec(Lion, {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0},
                  frozenset({"set_grad_none"})),
}

_UNSUPPORTED: Dict[str, str] = {
    **{name.lower(): (f"optimizer type {name!r} needs DeepSpeed's compressed (1-bit) "
                      "communication backend, which shardwise does not implement. Use \"Adam\" "
                      "(or \"Lamb\" for OneBitLamb) with the same params instead.")
       for name in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")},
    **{name.lower(): (f"optimizer type {name!r} needs the `mup` package's width-scaled "
                      "parameter groups, which shardwise does not build. Use "
                      f"\"{name[2:]}\" with mup's parameter groups passed as model_parameters.")
       for name in ("MuAdam", "MuAdamW", "MuSGD")},
    "lbfgs": ("optimizer type 'LBFGS' needs a closure re-evaluating the model on every step, "
              "which a training engine cannot provide. Use \"Adam\" or \"SGD\"."),
}


# Classes whose fused kernel covers fewer devices than torch's generic fused list
# (Adagrad's docstring: "CPU and CUDA only").
_FUSED_DEVICES_BY_CLASS: Dict[type, Set[str]] = {torch.optim.Adagrad: {"cpu", "cuda"}}


def _torch_optimizers() -> Dict[str, type]:
    """Every public ``torch.optim.Optimizer`` subclass, keyed by lower-case name."""
    found = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)
                and obj is not torch.optim.Optimizer and not name.startswith("_")):
            found[name.lower()] = obj
    return found


_TORCH = _torch_optimizers()
_CANONICAL = {**{n.lower(): n for n in ("Adam", "AdamW", "Lamb", "Lion")},
              **{cls.__name__.lower(): cls.__name__ for cls in _TORCH.values()}}
OPTIMIZER_NAMES: List[str] = sorted(
    set(_CANONICAL.values()) - {"LBFGS"}, key=str.lower)
"""Every optimizer type ``build_optimizer`` accepts (case-insensitive)."""


def build_optimizer(opt_type: str, params: Iterable, opt_params: Optional[Mapping[str, Any]] = None,
                    *, device_type: str = "cpu") -> torch.optim.Optimizer:
    """Build the optimizer a DeepSpeed ``optimizer`` config section describes.

    Args:
        opt_type: DeepSpeed's ``optimizer.type`` (case-insensitive), e.g. ``"AdamW"``.
        params: tensors or param-group dicts, as torch optimizers accept.
        opt_params: ``optimizer.params`` from the config (``"auto"`` values must already be
            resolved).
        device_type: the device kind the optimizer will step on (``"cpu"`` when offloaded);
            fused kernels are used only if it and every parameter's device support them.
    """
    key = str(opt_type).strip().lower()
    if key in _UNSUPPORTED:
        raise ConfigError(_UNSUPPORTED[key])
    spec = _SPECS.get(key) or (_Spec(_TORCH[key]) if key in _TORCH else None)
    if spec is None:
        raise ConfigError(_unknown_type_message(opt_type))
    kwargs = _resolve_kwargs(key, spec, dict(opt_params or {}))
    cls = spec.cls
    if key == "adam" and not kwargs.pop("_adam_w_mode"):
        cls = torch.optim.Adam
    kwargs.pop("_adam_w_mode", None)

    param_list = _materialise(params)
    # `fused` is ours to decide (and is accepted for classes without a fused kernel).
    wants_fused = kwargs.pop("fused", None)
    _check_kwargs(opt_type, cls, kwargs)
    kwargs.update(_kernel_choice(cls, param_list, device_type, kwargs, wants_fused))
    try:
        return cls(param_list, **kwargs)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ConfigError(f"{cls.__name__}(**optimizer.params) rejected the config: {err}. "
                          f"optimizer.params given: {dict(opt_params or {})!r}") from err


def _resolve_kwargs(key: str, spec: _Spec, raw: Dict[str, Any]) -> Dict[str, Any]:
    """Apply DeepSpeed's defaults and DeepSpeed-only keys; return the torch kwargs."""
    for name, value in raw.items():
        if isinstance(value, str) and value.strip().lower() == "auto":
            raise ConfigError(f"optimizer.params.{name} is still \"auto\"; \"auto\" must be resolved "
                              "(e.g. by the HF Trainer integration) before building the optimizer. "
                              "Set a number instead.")
    kwargs = {**spec.defaults, **raw}
    if key in ("adam", "adamw"):
        bias_correction = kwargs.pop("bias_correction", True)
        if not bias_correction:
            raise ConfigError("optimizer.params.bias_correction=false is not supported: torch's "
                              "Adam/AdamW always apply bias correction. Remove the key (or set it "
                              "to true).")
        # AdamW forces decoupled decay, as DeepSpeed's effective_adam_w_mode does.
        kwargs["_adam_w_mode"] = key == "adamw" or bool(kwargs.get("adam_w_mode", True))
    for name in spec.dropped:
        kwargs.pop(name, None)
    if isinstance(kwargs.get("betas"), list):
        kwargs["betas"] = tuple(kwargs["betas"])
    return kwargs


def _materialise(params: Iterable) -> list:
    """Turn ``params`` into a list and reject an empty one with a clear message."""
    if isinstance(params, torch.Tensor):
        params = [params]
    param_list = list(params)
    count = sum(len(_group_tensors(p)) if isinstance(p, Mapping) else 1 for p in param_list)
    if count == 0:
        raise ConfigError("optimizer given without parameters: the model_parameters / params "
                          "iterable is empty (a generator already consumed, or a model whose "
                          "parameters all have requires_grad=False). Pass model.parameters().")
    return param_list


def _group_tensors(group: Mapping) -> list:
    tensors = group.get("params", [])
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _all_tensors(param_list: list) -> list:
    tensors = []
    for p in param_list:
        tensors.extend(_group_tensors(p) if isinstance(p, Mapping) else [p])
    return tensors


def _accepted(cls: type) -> Optional[Set[str]]:
    """Keyword names ``cls.__init__`` accepts (None if it takes ``**kwargs``)."""
    sig = inspect.signature(cls.__init__)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return {n for n in sig.parameters if n not in ("self", "params")}


def _check_kwargs(opt_type: str, cls: type, kwargs: Mapping[str, Any]) -> None:
    accepted = _accepted(cls)
    if accepted is None:
        return
    for name in kwargs:
        if name not in accepted:
            near = difflib.get_close_matches(name, sorted(accepted), n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"optimizer.params.{name} is not a parameter of {cls.__name__} "
                              f"(optimizer type {opt_type!r}).{hint} Accepted: "
                              f"{', '.join(sorted(accepted))}.")


def _kernel_choice(cls: type, param_list: list, device_type: str, kwargs: Mapping[str, Any],
                   wants_fused: Optional[bool]) -> Dict[str, Any]:
    """``fused=True`` where torch has the kernel for every parameter, else ``foreach=True``.

    An explicit ``fused: false`` or ``foreach`` in the config wins; ``fused: true`` on a
    device (or class) without the kernel falls back, with a warning, instead of failing at
    the first step.
    """
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    accepted = _accepted(cls) or set()
    if kwargs.get("differentiable"):
        return {}
    tensors = _all_tensors(param_list)
    # Meta tensors are not in torch's fused list, so a meta-initialised model gets foreach.
    devices = {t.device.type for t in tensors} | {device_type}
    fused_devices = _FUSED_DEVICES_BY_CLASS.get(cls, set(_get_fused_kernels_supported_devices()))
    fused_ok = ("fused" in accepted and devices <= fused_devices
                and all(torch.is_floating_point(t) for t in tensors))
    if wants_fused and not fused_ok:
        warn_once(f"optimizer.params.fused=true but {cls.__name__} has no fused kernel for "
                  f"devices {sorted(devices)}; using foreach instead.")
    if fused_ok and wants_fused is not False and kwargs.get("foreach") is not True:
        return {"fused": True}
    choice: Dict[str, Any] = {"fused": False} if wants_fused is False and "fused" in accepted else {}
    # foreach works on every device (torch falls back per tensor where no kernel exists).
    if "foreach" in accepted and "foreach" not in kwargs:
        choice["foreach"] = True
    return choice


def _unknown_type_message(opt_type: Any) -> str:
    near = difflib.get_close_matches(str(opt_type).lower(), list(_CANONICAL) + list(_UNSUPPORTED),
                                     n=1, cutoff=0.5)
    hint = f" Did you mean {_CANONICAL.get(near[0], near[0])!r}?" if near else ""
    return (f"optimizer.type {opt_type!r} is not a known optimizer.{hint} Valid types "
            f"(case-insensitive): {', '.join(OPTIMIZER_NAMES)}.")
