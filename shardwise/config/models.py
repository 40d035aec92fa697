"""The small config sections: precision, optimizer, scheduler, activation checkpointing,
checkpoint, aio, data types and the seed's ``windows_specific``.

Field names, defaults and meanings follow DeepSpeed's config-json reference; fields that
are ours (not DeepSpeed's) say so in their docstring.
"""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional

import torch
from pydantic import Field, field_serializer, field_validator, model_validator

from shardwise.errors import ConfigError

from .base import ConfigModel, canonical_dtype_name, torch_dtype_of


class FP16Config(ConfigModel):
    """``fp16``: half-precision training with DeepSpeed's dynamic loss scaler."""

    enabled: bool = False
    """Train with fp16 weights/activations and fp32 master weights."""
    auto_cast: bool = False
    """Cast the module's floating-point inputs to fp16 before forward."""
    loss_scale: float = 0.0
    """Static loss scale; 0 means dynamic loss scaling."""
    initial_scale_power: int = 16
    """The dynamic scaler starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic scale is doubled."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is lowered (delayed shift)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis counter on every step without overflow."""
    min_loss_scale: float = 1.0
    """The dynamic scale never goes below this."""
    fp16_master_weights_and_grads: bool = False
    """Keep master weights and gradients in fp16 (DeepSpeed allows this with ZeRO-2 only)."""


class BF16Config(ConfigModel):
    """``bf16`` (also spelled ``bfloat16``): bfloat16 training, no loss scaling needed."""

    enabled: bool = False
    """Train with bf16 weights/activations and fp32 master weights."""


class TorchAutocastConfig(ConfigModel):
    """``torch_autocast``: run forward under ``torch.autocast`` with fp32 weights."""

    enabled: bool = False
    """Wrap forward in ``torch.autocast(device_type, dtype)``."""
    dtype: torch.dtype = torch.bfloat16
    """Autocast's lower-precision dtype ("bf16"/"fp16" or a torch name); a ``torch.dtype``."""
    lower_precision_safe_modules: Optional[List[str]] = None
    """Module class names (e.g. "torch.nn.Linear") whose parameters may be communicated in
    the lower precision; None means DeepSpeed's default (Linear and Conv layers)."""

    @field_validator("dtype", mode="before")
    @classmethod
    def _parse_dtype(cls, value: Any) -> torch.dtype:
        return torch_dtype_of(canonical_dtype_name(value, "torch_autocast.dtype"))

    @field_serializer("dtype")
    def _dump_dtype(self, value: torch.dtype) -> str:
        return canonical_dtype_name(value, "torch_autocast.dtype")


class OptimizerConfig(ConfigModel):
    """``optimizer``: which optimizer the engine builds. The type name is checked by the
    optimizer registry (``shardwise.optim``), not here, so new names need no config change."""

    type: str
    """DeepSpeed optimizer name, e.g. "Adam", "AdamW", "Lamb", "Lion", "SGD" (case-insensitive)."""
    params: Dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the optimizer's constructor (lr, betas, eps, weight_decay, ...)."""
    legacy_fusion: bool = False
    """DeepSpeed key for its old fused fp16 optimizer; accepted, no effect."""

    @model_validator(mode="after")
    def _no_max_grad_norm(self) -> "OptimizerConfig":
        if "max_grad_norm" in self.params:
            raise ConfigError(
                f"optimizer.params.max_grad_norm = {self.params['max_grad_norm']!r} is not an "
                f"optimizer argument: gradient clipping is done by the engine on the global norm. "
                f"Remove it from optimizer.params and set the top-level key instead, e.g. "
                f"\"gradient_clipping\": {self.params['max_grad_norm']!r}.")
        return self


class SchedulerConfig(ConfigModel):
    """``scheduler``: the learning-rate schedule the engine builds and steps."""

    type: str
    """DeepSpeed scheduler name, e.g. "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle",
    "LRRangeTest"; checked by the scheduler registry."""
    params: Dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the scheduler (warmup_min_lr, warmup_max_lr, warmup_num_steps, ...)."""


class ActivationCheckpointingConfig(ConfigModel):
    """``activation_checkpointing``: recompute activations in backward instead of storing them.

    A plain data model: the activation package validates combinations of these keys."""

    partition_activations: bool = False
    """Shard checkpointed activations across model-parallel ranks (DeepSpeed)."""
    contiguous_memory_optimization: bool = False
    """Copy checkpoints into one contiguous buffer to avoid fragmentation (DeepSpeed)."""
    cpu_checkpointing: bool = False
    """Keep the checkpointed activations in CPU memory (DeepSpeed)."""
    number_checkpoints: Optional[int] = None
    """Number of checkpoints per forward, used to size the contiguous buffer (DeepSpeed)."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronize the device at each checkpoint boundary (DeepSpeed)."""
    profile: bool = False
    """Log forward/backward time of each checkpointed function (DeepSpeed)."""
    modules: List[str] = Field(default_factory=list)
    """Ours: class names of the modules to wrap in activation checkpointing (e.g. "GPT2Block")."""
    policy: Literal["full", "selective", "offload"] = "full"
    """Ours: "full" recomputes the whole module, "selective" keeps cheap-to-store ops (matmul
    outputs) and recomputes the rest, "offload" keeps saved tensors in (pinned) CPU memory."""

    @field_validator("policy", mode="before")
    @classmethod
    def _lower_policy(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("number_checkpoints", mode="before")
    @classmethod
    def _false_is_none(cls, value: Any) -> Any:
        # Widely copied DeepSpeed examples write "number_checkpoints": false (meaning unset).
        return None if value is False else value


class CheckpointConfig(ConfigModel):
    """``checkpoint``: how ``save_checkpoint``/``load_checkpoint`` behave."""

    tag_validation: Literal["Warn", "Ignore", "Fail"] = "Warn"
    """Check that every rank saves under the same tag: warn, ignore, or raise (case-insensitive)."""
    use_node_local_storage: bool = False
    """Each node writes to its own local disk (rank-local files), no shared filesystem needed."""
    load_universal: bool = False
    """Load a universal (world-size independent) checkpoint; shardwise checkpoints always are."""
    async_save: bool = False
    """Write checkpoint files in a background thread after copying tensors to CPU."""
    parallel_write: Dict[str, Any] = Field(default_factory=dict)
    """DeepSpeed's ``{"pipeline_stage": bool}``; accepted for compatibility."""
    windows_path_optimization: bool = False
    """Seed key; no effect: shardwise always uses pathlib and ':'-free file names."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _title_case(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("warn", "ignore", "fail"):
            return value.strip().capitalize()
        return value


class AioConfig(ConfigModel):
    """``aio``: the asynchronous file IO used by NVMe offload and checkpoint writing."""

    block_size: int = 1048576
    """Bytes per read/write request."""
    queue_depth: int = 8
    """Requests in flight per thread."""
    intra_op_parallelism: int = 1
    """Threads that split one tensor's IO."""
    single_submit: bool = False
    """Submit requests one at a time instead of in batches."""
    overlap_events: bool = True
    """Overlap submitting new requests with waiting for finished ones."""
    thread_count: int = 1
    """IO worker threads."""
    use_gds: bool = False
    """GPUDirect Storage; needs NVIDIA's cuFile, so shardwise falls back to host IO."""
    windows_io_optimization: bool = False
    """Seed key; no effect: shardwise's IO uses Python threads with positioned reads/writes
    that behave the same on NTFS and POSIX filesystems."""


class DataTypesConfig(ConfigModel):
    """``data_types``: dtypes of internal buffers."""

    grad_accum_dtype: Optional[str] = None
    """Dtype of the gradient accumulation buffer ("fp32"/"fp16"/"bf16"); None: the parameter dtype
    (fp32 master gradients under fp16/bf16)."""

    @field_validator("grad_accum_dtype", mode="before")
    @classmethod
    def _canon(cls, value: Any) -> Optional[str]:
        return canonical_dtype_name(value, "data_types.grad_accum_dtype")


class WindowsSpecificConfig(ConfigModel):
    """``windows_specific``: a key from the seed article (not in DeepSpeed), given real meaning."""

    enable: bool = False
    """Acknowledged, changes nothing: shardwise's Windows behaviour (spawn start method, gloo,
    pathlib paths) is always on under Windows and never needed elsewhere."""
    memory_optimization: Literal["none", "normal", "aggressive"] = "none"
    """"aggressive": the engine empties the device allocator cache after every optimizer step
    (lower peak reserved memory, notably under Windows' WDDM driver, at some speed cost).
    "normal" and "none" leave the caching allocator alone."""

    @field_validator("memory_optimization", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value
