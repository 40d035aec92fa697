"""FP8 training of the linear layers through torchao's float8 (the ``fp8`` config section).

``apply_fp8`` swaps the chosen ``nn.Linear`` modules for torchao's ``Float8Linear``: the
forward and both backward matmuls run in FP8 (``torch._scaled_mm``) with scales computed
from the current tensors (dynamic scaling); weights, gradients, optimizer states and
checkpoints stay in the model's own dtype. ``Float8Linear`` keeps the original Parameter
objects, so parameter names, shapes and the optimizer's parameter list are unchanged.

torchao is optional: it is detected here, and ``check_fp8_available`` raises a clear error
at ``initialize()`` when it is missing, when the process computes on a CPU, or when the GPU
has no FP8 tensor cores (compute capability below 8.9). FP8 pays off together with
``torch.compile`` (the ``compile`` section), which fuses the scaling and casting kernels.
"""
from __future__ import annotations

import fnmatch
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from ..errors import ConfigError, UnsupportedFeatureError

INSTALL_HINT = "pip install torchao (0.17 or newer for torch 2.11; pure Python float8 training)"

#: FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer.
MIN_CAPABILITY = (8, 9)

#: torch._scaled_mm wants both matmul dimensions of the weight divisible by 16.
DIM_MULTIPLE = 16


def torchao_available() -> bool:
    """True when torchao's float8 training can be imported (the detection tests monkeypatch)."""
    if importlib.util.find_spec("torchao") is None:
        return False
    try:
        importlib.import_module("torchao.float8")
    except Exception:  # a torchao too old for float8 training, or broken under this torch
        return False
    return True


def check_fp8_available(device: torch.device) -> None:
    """Raise the error that says why FP8 training cannot run here; return when it can.

    Every ZeRO stage can: stage 3 gathers each block's weights before its forward and
    backward, and ``Float8Linear`` casts the gathered high-precision weight to FP8 inside them
    (the shards, the all-gather and the reduce-scatter stay in the model's dtype)."""
    if not torchao_available():
        raise ConfigError(f"fp8.enabled is true but torchao's float8 training is not importable: "
                          f"{INSTALL_HINT}; or set \"fp8\": {{\"enabled\": false}}")
    if device.type != "cuda":
        raise UnsupportedFeatureError(
            f"fp8.enabled is true but this process computes on {device.type}; FP8 matmuls need "
            f"a CUDA GPU with compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
            f"(Ada, Hopper or newer). Set \"fp8\": {{\"enabled\": false}} here")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise UnsupportedFeatureError(
            f"fp8.enabled is true but {name} has compute capability "
            f"{capability[0]}.{capability[1]}; FP8 matmuls need >= "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper or newer). Use bf16 here")


@dataclass(frozen=True)
class FP8Plan:
    """Which linear layers go FP8 and why the others stay as they are."""

    convert: Tuple[str, ...]
    """Full names of the nn.Linear modules to swap for Float8Linear."""
    skipped: Dict[str, str] = field(default_factory=dict)
    """Full name of each nn.Linear kept in high precision -> the reason."""


def _matches(name: str, patterns: Sequence[str]) -> Optional[str]:
    """The first pattern naming module ``name`` (full name, glob, or last component)."""
    last = name.rsplit(".", 1)[-1]
    for pattern in patterns:
        if pattern in (name, last) or fnmatch.fnmatchcase(name, pattern):
            return pattern
    return None


def plan_fp8(model: torch.nn.Module, skip_modules: Sequence[str] = ()) -> FP8Plan:
    """Choose the linear layers to convert: every ``nn.Linear`` except the output head
    (``model.get_output_embeddings()`` or a module named ``lm_head``), those ``skip_modules``
    names, and those whose features are not multiples of 16."""
    head = None
    get_head = getattr(model, "get_output_embeddings", None)
    if callable(get_head):
        try:
            head = get_head()
        except Exception:  # a model that does not implement it
            head = None
    convert, skipped = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or type(module).__name__ == "Float8Linear":
            continue
        pattern = _matches(name, skip_modules)
        if module is head or name.rsplit(".", 1)[-1] == "lm_head":
            skipped[name] = "output head (kept in high precision)"
        elif pattern is not None:
            skipped[name] = f"fp8.skip_modules entry {pattern!r}"
        elif module.in_features % DIM_MULTIPLE or module.out_features % DIM_MULTIPLE:
            skipped[name] = (f"features {module.in_features}x{module.out_features} are not "
                             f"multiples of {DIM_MULTIPLE}")
        else:
            convert.append(name)
    return FP8Plan(convert=tuple(convert), skipped=skipped)


def float8_config(recipe: str) -> Any:
    """torchao's ``Float8LinearConfig`` of a recipe name ("tensorwise", "rowwise", ...)."""
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig.from_recipe_name(recipe)


def convert_fp8(model: torch.nn.Module, plan: FP8Plan, recipe: str) -> int:
    """Swap the plan's modules for Float8Linear in place; returns how many were swapped."""
    from torchao.float8 import convert_to_float8_training

    chosen = frozenset(plan.convert)
    convert_to_float8_training(model, config=float8_config(recipe),
                               module_filter_fn=lambda module, fqn: fqn in chosen)
    return sum(1 for _, m in model.named_modules() if type(m).__name__ == "Float8Linear")


def apply_fp8(model: torch.nn.Module, recipe: str, skip_modules: Sequence[str],
              device: torch.device) -> FP8Plan:
    """Check the platform, then convert the chosen linear layers (the ``fp8`` section).

    Runs before any ZeRO strategy sees the model: the swapped modules keep their Parameter
    objects, so stage 3 partitions, gathers and hooks the same parameters it would have."""
    check_fp8_available(device)
    plan = plan_fp8(model, skip_modules)
    if not plan.convert:
        raise ConfigError(f"fp8.enabled is true but no nn.Linear of the model can use FP8 "
                          f"(kept: {plan.skipped or 'the model has no nn.Linear'}); check "
                          f"fp8.skip_modules or disable fp8")
    convert_fp8(model, plan, recipe)
    return plan


__all__ = ["FP8Plan", "INSTALL_HINT", "MIN_CAPABILITY", "apply_fp8", "check_fp8_available",
           "convert_fp8", "float8_config", "plan_fp8", "torchao_available"]
