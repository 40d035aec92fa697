"""Checkpointing a model without editing it: wrap the ``forward`` of named module classes.

``apply(model, "full", modules=["LlamaDecoderLayer"])`` replaces each matching module's
``forward`` with one that runs the original under a checkpoint. Only the bound method is
replaced, never the module object, so ``state_dict`` keys, parameter identity and hooks are
unchanged. Policies:

* ``full``: recompute the whole module in backward (inputs kept, honouring
  ``cpu_checkpointing`` / ``partition_activations`` from ``configure()``).
* ``selective``: inside each wrapped block, recompute only the norm submodules and the MLP's
  elementwise ops (its matmul outputs are kept); attention, RoPE and residuals are left alone
  (see ``selective.py`` for what this keeps and why). A block without norm or MLP submodules
  gets ``selective_ops``.
* ``selective_ops``: torch's op-level selective checkpoint over the whole block: keep the
  outputs of matmuls and attention kernels, recompute every other op (activations, norms,
  RoPE). Needs torch >= 2.4; older torch falls back to ``full`` with a warning.
* ``offload``: no recompute; every activation the module saves goes to pinned host memory and
  comes back in backward.

Wrapping is a no-op in eval mode or under ``torch.no_grad()``. A module on which Hugging Face's
``gradient_checkpointing_enable()`` is active is left to Hugging Face (checkpointing twice would
only cost a second recompute).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import torch

from ..errors import ConfigError
from ..utils.logging import log_dist, warn_once
from .recompute import run_checkpoint
from .cpu_offload import OffloadSavedTensors, SavedTensorStats, warn_if_host_only
from .selective import BlockScope, NormRecompute, current_scope, find_parts

POLICIES = ("full", "selective", "selective_ops", "offload")


def _saved_ops() -> Tuple[Any, ...]:
    """aten ops whose outputs selective checkpointing keeps (matmuls and fused attention)."""
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_flash_attention_forward", "_efficient_attention_forward")
    aten = torch.ops.aten
    return tuple(getattr(aten, n).default for n in names if hasattr(aten, n))


def selective_context_fn() -> Optional[Callable[[], Tuple[Any, Any]]]:
    """A ``context_fn`` for torch's checkpoint that saves matmul/attention outputs only."""
    try:
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    except ImportError:  # torch < 2.4
        warn_once("activation_checkpointing.policy='selective' needs torch >= 2.4 "
                  f"(found {torch.__version__}); falling back to full recompute")
        return None
    saved = set(_saved_ops())

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


@dataclass
class _WrapInfo:
    """What ``apply`` stored on a wrapped module (as ``module._shardwise_ac``)."""

    policy: str
    original_forward: Optional[Callable[..., Any]]
    context_fn: Optional[Callable[[], Tuple[Any, Any]]]
    stats: SavedTensorStats = field(default_factory=SavedTensorStats)
    role: str = "block"
    """``block`` (a module ``apply`` matched) or, under ``selective``, ``norm`` / ``mlp``."""
    parts: Tuple[str, ...] = ()
    """Under ``selective``: qualified names (in the block) of the wrapped norms and MLPs."""


_RECOMPUTING = threading.local()  # ids of modules whose __call__ is replaying a recompute


@contextlib.contextmanager
def _recomputing(module: torch.nn.Module):
    active = getattr(_RECOMPUTING, "ids", None)
    if active is None:
        active = _RECOMPUTING.ids = set()
    active.add(id(module))
    try:
        yield
    finally:
        active.discard(id(module))


def _recompute_through_call(module: torch.nn.Module) -> Callable[..., Any]:
    """The recompute goes through ``module.__call__`` (its hooks run again, as in Hugging
    Face's checkpointing), with the wrapper bypassed so it does not checkpoint itself again."""
    def call(*args: Any, **kwargs: Any) -> Any:
        with _recomputing(module):
            return module(*args, **kwargs)
    return call


def _wrapped_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    info: _WrapInfo = self._shardwise_ac
    call = info.original_forward or functools.partial(type(self).forward, self)
    if not (self.training and torch.is_grad_enabled()) or id(self) in getattr(_RECOMPUTING, "ids", ()):
        return call(*args, **kwargs)
    if info.policy == "offload":
        with OffloadSavedTensors(info.stats):
            return call(*args, **kwargs)
    if getattr(self, "gradient_checkpointing", False) is True:
        return call(*args, **kwargs)  # Hugging Face checkpoints this layer already
    if info.policy == "selective" and info.parts:
        with BlockScope():  # the norms and the MLP inside checkpoint themselves
            return call(*args, **kwargs)
    return run_checkpoint(call, args, kwargs, context_fn=info.context_fn,
                          recompute_function=_recompute_through_call(self))


def _part_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A norm or MLP inside a block wrapped with ``selective``: recomputed only while that
    block's forward runs (so not in eval, under no_grad, in a recompute, or when called on
    its own)."""
    info: _WrapInfo = self._shardwise_ac
    call = info.original_forward or functools.partial(type(self).forward, self)
    scope = current_scope()
    if (scope is None or not (self.training and torch.is_grad_enabled())
            or id(self) in getattr(_RECOMPUTING, "ids", ())):
        return call(*args, **kwargs)
    if info.role == "norm":
        recipe = NormRecompute(self, call, args, kwargs, _recompute_through_call(self))
        scope.register(recipe)
        out, recipe.output = recipe.output, None  # the recipe must not keep it alive
        return out
    return run_checkpoint(call, args, kwargs, context_fn=info.context_fn,
                          recompute_function=_recompute_through_call(self),
                          rebuild_input=scope.rebuild_input)


@dataclass(frozen=True)
class ApplyResult:
    """Which modules ``apply`` wrapped."""

    policy: str
    """The policy applied."""
    wrapped: Tuple[str, ...]
    """Qualified names of wrapped modules."""
    skipped: Tuple[str, ...]
    """Matching modules left alone (already wrapped, or HF checkpointing on)."""


def _default_modules(model: torch.nn.Module) -> List[str]:
    """Hugging Face models name their repeated blocks in ``_no_split_modules``."""
    names = list(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ConfigError("checkpointing.apply: modules=None and the model does not declare "
                          "_no_split_modules; pass modules=[...] with the block class names, "
                          f"present: {', '.join(sorted(_class_names(model)))}")
    return names


def _class_names(model: torch.nn.Module) -> set:
    return {type(m).__name__ for m in model.modules()}


def apply(model: torch.nn.Module, policy: str = "full",
          modules: Optional[Iterable[str]] = None) -> ApplyResult:
    """Wrap every submodule whose class name is in ``modules`` with ``policy``.

    ``modules=None`` uses a Hugging Face model's ``_no_split_modules`` (its decoder layers).
    Raises ``ConfigError`` for an unknown policy or a class name not present in ``model``.
    """
    if policy not in POLICIES:
        raise ConfigError(f"checkpointing.apply: policy={policy!r} is not one of "
                          f"{', '.join(POLICIES)}")
    wanted: Sequence[str] = list(modules) if modules is not None else _default_modules(model)
    present = _class_names(model)
    missing = [name for name in wanted if name not in present]
    if missing:
        raise ConfigError(f"activation_checkpointing.modules: {missing} not found in the model; "
                          f"module classes present: {', '.join(sorted(present))}")
    context_fn = selective_context_fn() if policy in ("selective", "selective_ops") else None
    if policy == "offload":
        warn_if_host_only("activation_checkpointing.policy='offload'")
    wrapped, skipped, fallback = [], [], []
    for qualname, module in model.named_modules():
        if type(module).__name__ not in wanted:
            continue
        if hasattr(module, "_shardwise_ac") or getattr(module, "gradient_checkpointing", False) is True:
            skipped.append(qualname)
            continue
        info = _WrapInfo(policy, module.__dict__.get("forward"), context_fn)
        if policy == "selective" and context_fn is not None:
            info.parts = _wrap_parts(module, context_fn)
            if not info.parts:
                fallback.append(qualname)
                info.policy = "selective_ops"
        _wrap(module, info, _wrapped_forward)
        wrapped.append(qualname)
    log_dist(f"activation checkpointing ({policy}): wrapped {len(wrapped)} module(s) of class "
             f"{', '.join(wanted)}" + (f"; skipped {len(skipped)} (already checkpointed)" if skipped else ""))
    if fallback:
        log_dist(f"activation checkpointing (selective): {len(fallback)} block(s) have no norm or MLP "
                 f"submodule ({fallback[0]}, ...), so they use op-level selective (selective_ops)")
    return ApplyResult(policy, tuple(wrapped), tuple(skipped))


def _wrap(module: torch.nn.Module, info: _WrapInfo, forward: Callable[..., Any]) -> None:
    module._shardwise_ac = info
    # A bound method (not a closure): deepcopy/pickle rebind it to the copied module.
    module.forward = types.MethodType(forward, module)


def _wrap_parts(block: torch.nn.Module, context_fn: Callable[[], Tuple[Any, Any]]) -> Tuple[str, ...]:
    """Wrap the norms and MLPs of ``block`` for ``selective``; returns their names in it."""
    names = []
    for role, name, part in find_parts(block):
        if hasattr(part, "_shardwise_ac") or getattr(part, "gradient_checkpointing", False) is True:
            continue  # checkpointed on its own already
        info = _WrapInfo("selective", part.__dict__.get("forward"),
                         context_fn if role == "mlp" else None, role=role)
        _wrap(part, info, _part_forward)
        names.append(name)
    return tuple(names)


def remove(model: torch.nn.Module) -> int:
    """Undo ``apply``: restore every wrapped module's forward (and, under ``selective``, its
    norms' and MLPs'). Returns how many modules ``apply`` had matched."""
    count = 0
    for module in model.modules():
        info = module.__dict__.pop("_shardwise_ac", None)
        if info is None:
            continue
        if info.original_forward is not None:
            module.forward = info.original_forward
        else:
            module.__dict__.pop("forward", None)
        count += info.role == "block"
    return count


def offload_stats(model: torch.nn.Module) -> SavedTensorStats:
    """Summed ``SavedTensorStats`` of every module wrapped with the ``offload`` policy."""
    total = SavedTensorStats()
    for module in model.modules():
        info = getattr(module, "_shardwise_ac", None)
        if info is not None and info.policy == "offload":
            for name in total.__dataclass_fields__:
                setattr(total, name, getattr(total, name) + getattr(info.stats, name))
    return total
