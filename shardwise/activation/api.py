"""``shardwise.checkpointing``: DeepSpeed's ``deepspeed.checkpointing`` functions, same names.

``configure()`` reads the ``activation_checkpointing`` section (from a DeepSpeed config dict
or path, overridden by keyword arguments), validates the combination and sets the
module-level state that ``checkpoint()`` consults. The engine calls ``configure_from_engine``
instead, which also wraps the configured module classes (see ``policies.py``).
"""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from ..errors import ConfigError
from ..utils.logging import log_dist, logger
from .recompute import STATE, CheckpointingSettings, run_checkpoint
from .cpu_offload import warn_if_host_only
from .profile import CheckpointRecord

# DeepSpeed's key -> the keyword of configure() that overrides it.
_KEYS = {
    "partition_activations": "partition_activations",
    "contiguous_memory_optimization": "contiguous_checkpointing",
    "cpu_checkpointing": "checkpoint_in_cpu",
    "number_checkpoints": "num_checkpoints",
    "synchronize_checkpoint_boundary": "synchronize",
    "profile": "profile",
}
# Keys shardwise adds to the section (used by the engine; configure() accepts and ignores them).
_POLICY_KEYS = ("modules", "policy")


def _section_from(deepspeed_config: Any) -> dict:
    """The ``activation_checkpointing`` dict of a config given as dict, path, or object."""
    if deepspeed_config is None:
        return {}
    if isinstance(deepspeed_config, (str, Path)):
        path = Path(deepspeed_config)
        if not path.is_file():
            raise ConfigError(f"checkpointing.configure(deepspeed_config={str(path)!r}): no such "
                              f"file; pass the path of your ds_config.json or a dict")
        deepspeed_config = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(deepspeed_config, dict):
        section = deepspeed_config.get("activation_checkpointing", {}) or {}
    else:  # a parsed config object from shardwise.config or DeepSpeed
        section = getattr(deepspeed_config, "activation_checkpointing", None) or {}
        if hasattr(section, "model_dump"):
            section = section.model_dump()
        elif not isinstance(section, dict):
            section = {k: getattr(section, k) for k in _KEYS if hasattr(section, k)}
    unknown = [k for k in section if k not in _KEYS and k not in _POLICY_KEYS]
    if unknown:
        hints = {k: difflib.get_close_matches(k, [*_KEYS, *_POLICY_KEYS], n=1) for k in unknown}
        detail = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
        raise ConfigError(f"activation_checkpointing: unknown key(s) {detail}; valid keys are "
                          f"{', '.join([*_KEYS, *_POLICY_KEYS])}")
    return dict(section)


def validate(values: dict, mp_world_size: int = 1) -> CheckpointingSettings:
    """Check types and combinations; raise ``ConfigError`` naming keys, values and the fix."""
    for key in ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                "synchronize_checkpoint_boundary", "profile"):
        value = values.get(key, False)
        if value is None:
            values[key] = False
        elif not isinstance(value, bool):
            raise ConfigError(f"activation_checkpointing.{key} must be true or false, got "
                              f"{value!r} ({type(value).__name__})")
    n = values.get("number_checkpoints")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError(f"activation_checkpointing.number_checkpoints must be a positive "
                          f"integer (the number of checkpointed layers), got {n!r}")
    if values.get("contiguous_memory_optimization") and not values.get("partition_activations"):
        raise ConfigError(
            "activation_checkpointing.contiguous_memory_optimization=true needs "
            f"partition_activations=true (got partition_activations="
            f"{values.get('partition_activations')!r}): the contiguous buffer holds partitioned "
            "activations; set partition_activations to true or contiguous_memory_optimization "
            "to false")
    if values.get("contiguous_memory_optimization") and n is None:
        raise ConfigError(
            "activation_checkpointing.contiguous_memory_optimization=true needs "
            "number_checkpoints (the number of checkpointed layers per forward) to size its "
            "buffer; got number_checkpoints=None. Set it, e.g. to num_hidden_layers")
    settings = CheckpointingSettings(**{k: values.get(k, CheckpointingSettings.__dataclass_fields__[k].default)
                                        for k in _KEYS})
    _log_effects(settings, mp_world_size)
    return settings


def _log_effects(s: CheckpointingSettings, mp_world_size: int) -> None:
    """Say, for keys that are on but cannot act in this setup, why nothing happens."""
    if s.partition_activations and mp_world_size <= 1:
        log_dist("activation_checkpointing.partition_activations=true: there is no model "
                 "parallelism (model-parallel world size 1), so saved activations have nothing to "
                 "be split across; each rank keeps its inputs whole"
                 + (" (they still go to the contiguous buffer)" if s.contiguous_memory_optimization else ""))
    if s.cpu_checkpointing:
        warn_if_host_only("activation_checkpointing.cpu_checkpointing",
                          "saved inputs are copied to separate host buffers, which saves nothing")
    if s.number_checkpoints is not None and not s.contiguous_memory_optimization:
        log_dist(f"activation_checkpointing.number_checkpoints={s.number_checkpoints} only sizes "
                 f"the contiguous buffer; with contiguous_memory_optimization=false it is unused")


def _install(settings: CheckpointingSettings, mpu: Any) -> None:
    STATE.mpu = mpu
    STATE.settings = settings
    STATE.configured = True
    reset()
    logger.debug(f"activation checkpointing configured: {settings}")


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> CheckpointingSettings:
    """Configure activation checkpointing (DeepSpeed's ``deepspeed.checkpointing.configure``).

    Values come from ``deepspeed_config``'s ``activation_checkpointing`` section; keyword
    arguments that are not None override them. ``mpu_`` is a model-parallel unit with
    ``get_model_parallel_group/rank/world_size`` (None: no model parallelism).
    """
    values = _section_from(deepspeed_config)
    overrides = {"partition_activations": partition_activations,
                 "contiguous_memory_optimization": contiguous_checkpointing,
                 "cpu_checkpointing": checkpoint_in_cpu, "number_checkpoints": num_checkpoints,
                 "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    values.update({k: v for k, v in overrides.items() if v is not None})
    mp = mpu_.get_model_parallel_world_size() if mpu_ is not None else 1
    settings = validate({k: values.get(k) for k in _KEYS}, mp)
    _install(settings, mpu_)
    return settings


def is_configured() -> bool:
    """Whether ``configure()`` (or the engine) has set up activation checkpointing."""
    return STATE.configured


def reset() -> None:
    """Drop contiguous buffers, counters and profile records (DeepSpeed's ``reset``).

    Call it between forwards that have no backward (evaluation) when contiguous buffers are on.
    """
    STATE.buffers.clear()
    STATE.live.clear()
    STATE.calls = 0
    STATE.sync_calls = 0
    STATE.profiler.reset()


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Checkpoint ``function(*args)``: its activations are recomputed in backward.

    Same call as DeepSpeed's ``deepspeed.checkpointing.checkpoint``. Unlike DeepSpeed's
    reentrant implementation it also produces parameter gradients when no input requires
    grad, and works with ``torch.autograd.grad``.
    """
    return run_checkpoint(function, args, {})


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's ``non_reentrant_checkpoint``; also accepts keyword arguments."""
    return run_checkpoint(function, args, kwargs)


def get_profile() -> Sequence[CheckpointRecord]:
    """Per-checkpoint records collected while ``profile`` is on (since the last ``reset()``)."""
    return tuple(STATE.profiler.records)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Reseed only the model-parallel stream (DeepSpeed's helper of the same name)."""
    from .rng import _MODEL_PARALLEL_RNG_TRACKER_NAME, get_cuda_rng_tracker
    tracker = get_cuda_rng_tracker()
    mp_rank = STATE.mpu.get_model_parallel_rank() if STATE.mpu is not None else 0
    states = tracker.get_states()
    states.pop(_MODEL_PARALLEL_RNG_TRACKER_NAME, None)
    tracker.reset()
    tracker.set_states(states)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + mp_rank)


def _world_mpu(mp_world_size: int) -> Any:
    """An mpu over the default process group, when that group *is* the model-parallel group."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != mp_world_size:
        raise ConfigError(
            f"activation_checkpointing.partition_activations with mp_world_size={mp_world_size} "
            f"needs a model-parallel group: pass mpu= (an object with get_model_parallel_group/"
            f"rank/world_size) or run with a default process group of exactly {mp_world_size} "
            f"ranks (it has {dist.get_world_size() if dist.is_initialized() else 'none'})")
    return WorldMPU()


class WorldMPU:
    """The default process group seen as the model-parallel group (for tests and TP-only runs)."""

    def get_model_parallel_group(self) -> Any:
        import torch.distributed as dist
        return dist.group.WORLD

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist
        return dist.get_rank()

    def get_model_parallel_world_size(self) -> int:
        import torch.distributed as dist
        return dist.get_world_size()


@dataclass(frozen=True)
class ActivationCheckpointingPlan:
    """What ``configure_from_engine`` did (for the engine's log and for tests)."""

    settings: CheckpointingSettings
    """The validated values now in effect."""
    policy: str
    """``full``, ``selective`` or ``offload``."""
    wrapped: tuple
    """Qualified names of the modules whose forward was wrapped."""
    skipped: tuple
    """Qualified names of matching modules left alone (e.g. HF checkpointing already on)."""
    mp_world_size: int = 1
    """Model-parallel world size used for partitioning."""


def configure_from_engine(ac_cfg: Any, model: Optional[torch.nn.Module], *, mp_world_size: int = 1,
                          mpu: Any = None) -> ActivationCheckpointingPlan:
    """Validate the engine's ``activation_checkpointing`` model, configure, and apply the policy."""
    from .policies import POLICIES, apply
    values = {k: getattr(ac_cfg, k, None) for k in _KEYS}
    policy = getattr(ac_cfg, "policy", None) or "full"
    modules = list(getattr(ac_cfg, "modules", None) or [])
    if policy not in POLICIES:
        raise ConfigError(f"activation_checkpointing.policy={policy!r} is not one of "
                          f"{', '.join(POLICIES)}")
    if mpu is None and mp_world_size > 1 and values.get("partition_activations"):
        mpu = _world_mpu(mp_world_size)
    settings = validate(values, mp_world_size)
    _install(settings, mpu)
    if policy == "offload" and (settings.cpu_checkpointing or settings.partition_activations):
        log_dist("activation_checkpointing.policy='offload' keeps activations without recompute, "
                 "so cpu_checkpointing/partition_activations (which act on checkpoint inputs) only "
                 "affect explicit checkpoint() calls")
    wrapped: tuple = ()
    skipped: tuple = ()
    if modules:
        if model is None:
            raise ConfigError("activation_checkpointing.modules is set but no model was given to "
                              "wrap; pass model= to initialize()")
        result = apply(model, policy, modules=modules)
        wrapped, skipped = result.wrapped, result.skipped
    elif policy != "full":
        log_dist(f"activation_checkpointing.policy={policy!r} has no effect without "
                 f"activation_checkpointing.modules (the module class names to wrap)")
    return ActivationCheckpointingPlan(settings, policy, wrapped, skipped, mp_world_size)
