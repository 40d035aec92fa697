"""``zero_optimization``: the ZeRO stage, its buckets, and CPU/NVMe offload.

Names and defaults are DeepSpeed's. The stage-3 keys may be written with or without the
``stage3_`` prefix; they are stored under the bare name. JSON numbers such as ``5e8``
arrive as floats and are accepted for the integer fields when they have no fraction.
"""
from __future__ import annotations

import sys
from typing import Any, Literal, Optional

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from shardwise.errors import ConfigError

from .base import ConfigModel, lowered

OffloadDevice = Literal["none", "cpu", "nvme"]


class OffloadOptimizerConfig(ConfigModel):
    """``zero_optimization.offload_optimizer``: fp32 master weights and optimizer states live
    on the CPU (or in swap files on NVMe) and the optimizer step runs on the CPU. Valid with
    stages 1-3 (DeepSpeed: NVMe with stage 3 only)."""

    deepspeed_only = {
        "super_offload": "SuperOffload is not implemented",
        "cpuadam_cores_perc": "there is no DeepSpeedCPUAdam; SHARDWISE_OFFLOAD_THREADS sets the "
                              "CPU step's threads",
    }

    device: OffloadDevice = "none"
    """Where optimizer states live: "none" (accelerator), "cpu" (host memory) or "nvme"
    (per-rank swap files under nvme_path, streamed through pinned buffers at the step)."""
    nvme_path: Optional[str] = None
    """NVMe swap directory; required with device "nvme". Each rank's files go to
    ``<nvme_path>/shardwise_swap/<run>-rank<N>/``, made (with a probe write) at initialize and
    removed by engine.destroy() and at interpreter exit."""
    pin_memory: bool = False
    """Use page-locked CPU buffers: faster, asynchronous host<->device copies, more RAM locked."""
    buffer_count: int = Field(4, ge=0)
    """NVMe: pinned buffers the sub-groups stream through (at least 2; with 3 or more, reading
    the next sub-group, stepping one and writing the previous one back overlap)."""
    pipeline_read: bool = False
    """NVMe key; no effect: shardwise always reads the next sub-group ahead."""
    pipeline_write: bool = False
    """NVMe key; no effect: shardwise always writes sub-groups back behind the step."""
    fast_init: bool = False
    """NVMe key; no effect: initialize always writes each sub-group's masters once, with
    zeroed states."""
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of optimizer states offloaded (the rest stay on the accelerator). DeepSpeed
    allows < 1.0 with stage 3 only."""
    delayed_update: bool = False
    """Ours: ZeRO-Offload's one-step delayed parameter update (DPU), stages 1-3: the CPU step
    of step t overlaps forward/backward of step t+1, so parameters lag one step. Stage 3 keeps
    a second set of host gradient partitions for it (4 bytes per parameter over the ranks)."""
    delayed_update_warmup: int = Field(0, ge=0)
    """Ours: optimizer steps run without delay before DPU starts (early steps change most)."""

    @field_validator("device", mode="before")
    @classmethod
    def _lower_device(cls, value: Any) -> Any:
        return lowered(value)

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> "OffloadOptimizerConfig":
        if self.device == "nvme" and not self.nvme_path:
            raise ConfigError(
                "zero_optimization.offload_optimizer.device is \"nvme\" but nvme_path is not set. "
                "Add a directory on a fast local disk, e.g. \"nvme_path\": \"/local_nvme\", "
                "or use \"device\": \"cpu\".")
        return self


class OffloadParamConfig(ConfigModel):
    """``zero_optimization.offload_param``: parameters live on the CPU (or NVMe) between uses.
    Valid with stage 3 only."""

    device: OffloadDevice = "none"
    """Where partitioned parameters live: "none" (accelerator), "cpu" (host memory) or
    "nvme" (per-rank swap files under ``nvme_path``, read ahead of use through
    ``buffer_count`` pinned buffers)."""
    nvme_path: Optional[str] = None
    """Folder for the parameter swap files (device "nvme"); each run and rank gets its own
    sub-folder, removed by ``engine.destroy()`` and at exit."""
    pin_memory: bool = False
    """Use page-locked CPU buffers for the parameter partitions kept in host memory (the
    NVMe read buffers are always pinned)."""
    buffer_count: int = Field(5, ge=0)
    """Device "nvme": read/write buffers of the parameter swap files (at least 1; the
    partitions read ahead of the module that needs them use all but one)."""
    buffer_size: int = Field(100_000_000, ge=0)
    """Device "nvme": elements per buffer; a partition larger than this is an error at
    initialize (DeepSpeed's rule). Buffers are allocated at the size of the largest NVMe
    partition when that is smaller."""
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    """Device "nvme" with an optimizer: elements of NVMe-sized partitions kept in host memory
    instead (the first ones, in parameter order), as DeepSpeed does; 0 sends them all to NVMe.
    A parameters-only engine (no optimizer) sends them all to NVMe."""
    min_nvme_bytes: int = Field(1 << 20, ge=0)
    """Ours, device "nvme": partitions smaller than this many bytes stay in host memory
    (DeepSpeed's fixed 1 MiB; lower it to send small models' partitions to the disk)."""

    @field_validator("device", mode="before")
    @classmethod
    def _lower_device(cls, value: Any) -> Any:
        return lowered(value)

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> "OffloadParamConfig":
        if self.device == "nvme" and not self.nvme_path:
            raise ConfigError(
                "zero_optimization.offload_param.device is \"nvme\" but nvme_path is not set. "
                "Add a directory on a fast local disk, e.g. \"nvme_path\": \"/local_nvme\", "
                "or use \"device\": \"cpu\".")
        return self


class ZeroConfig(ConfigModel):
    """``zero_optimization``: partition optimizer states (1), gradients (2), parameters (3)."""

    aliases = {
        "stage3_prefetch_bucket_size": "prefetch_bucket_size",
        "stage3_param_persistence_threshold": "param_persistence_threshold",
        "stage3_model_persistence_threshold": "model_persistence_threshold",
        "stage3_max_live_parameters": "max_live_parameters",
        "stage3_max_reuse_distance": "max_reuse_distance",
        "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save": "gather_16bit_weights_on_model_save",
        "stage3_module_granularity_threshold": "module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
    }
    inert = {
        "use_multi_rank_bucket_allreduce": "shardwise always reduces each bucket with one collective",
        "load_from_fp32_weights": "shardwise checkpoints always hold fp32 master weights and load them",
        "zero_hpz_partition_size": "ZeRO++ hierarchical partitioning is not implemented",
        "zero_quantized_weights": "ZeRO++ quantized weight communication is not implemented",
        "zero_quantized_nontrainable_weights": "ZeRO++ weight quantization is not implemented",
        "zero_quantized_gradients": "ZeRO++ quantized gradient communication is not implemented",
        "mics_shard_size": "MiCS sub-group sharding is not implemented",
        "mics_hierarchical_params_gather": "MiCS is not implemented",
        "memory_efficient_linear": "shardwise uses torch's own Linear",
        "override_module_apply": "shardwise's stage 3 gathers parameters in hooks only",
        "pipeline_loading_checkpoint": "pipeline parallelism is not implemented",
        "legacy_stage1": "there is one stage-1 implementation",
        "elastic_checkpoint": "shardwise checkpoints load at any world size anyway",
        "round_robin_gradients": "gradient copies to the CPU are not spread over ranks",
        "module_granularity_threshold": "every module is its own stage-3 fetch unit",
        "use_all_reduce_for_fetch_params": "stage 3 always fetches parameters with all-gather",
        "ignore_unused_parameters": "shardwise never checks for parameters without a gradient",
    }
    deepspeed_only = {
        "zenflow": "ZenFlow is not implemented (offload_optimizer.delayed_update is the "
                   "one-step delayed CPU update)",
        "allgather_sequential": "stage 3 gathers are always bucketed",
        "stage3_allgather_sequential": "stage 3 gathers are always bucketed",
        "zeropp_loco_param": "ZeRO++ (LoCo) is not implemented",
        "log_trace_cache_warnings": "the stage-3 trace is re-recorded silently when it changes",
        "enable_sanity_checks": "DeepSpeed's stage-3 sanity checks are not implemented",
        "save_muon_momentum_buffer_in_memory": "there is no Muon optimizer",
        "leaf_module": "leaf modules are not implemented; stage 3 hooks every module",
    }

    stage: int = 0
    """0 disabled (plain data parallel), 1 optimizer states, 2 + gradients, 3 + parameters."""
    contiguous_gradients: bool = True
    """DeepSpeed key; no effect: gradients always go into flat, bucketed buffers."""
    overlap_comm: Optional[bool] = None
    """Overlap gradient reduction with backward. Unset: True for stage 3, False otherwise."""
    reduce_scatter: bool = True
    """DeepSpeed key; no effect: stages 2-3 always reduce-scatter, stages 0-1 all-reduce."""
    reduce_bucket_size: int = Field(500_000_000, ge=0)
    """Gradient elements reduced per collective ("auto": hidden_size**2)."""
    allgather_partitions: bool = True
    """DeepSpeed key; no effect: updated partitions are always all-gathered."""
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    """DeepSpeed key; no effect: stages 1-2 all-gather the updated parameters bucket by
    bucket, in the buckets of reduce_bucket_size."""
    round_robin_gradients: bool = False
    """DeepSpeed key; accepted, no effect (warns when true)."""
    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    """Optimizer state offload; see its keys."""
    offload_param: Optional[OffloadParamConfig] = None
    """Parameter offload (stage 3 only); see its keys."""
    sub_group_size: int = Field(1_000_000_000, ge=0)
    """Stage 3 with offload_optimizer on NVMe: elements per swap-file sub-group (100M when
    not set: DeepSpeed's 1e9 would make each pinned buffer 12 GB for AdamW). Otherwise no
    effect: offloaded steps go bucket by bucket (stages 1-2) or parameter by parameter."""
    prefetch_bucket_size: int = Field(50_000_000, ge=0)
    """Stage 3: parameter elements prefetched ahead of use ("auto": 0.9 * hidden_size**2)."""
    param_persistence_threshold: int = Field(100_000, ge=0)
    """Stage 3: parameters with fewer elements stay whole on every rank ("auto": 10 * hidden_size)."""
    model_persistence_threshold: int = Field(sys.maxsize, ge=0)
    """Stage 3: cap on the total elements kept whole by param_persistence_threshold."""
    max_live_parameters: int = Field(1_000_000_000, ge=0)
    """Stage 3: gathered parameter elements allowed at once before releasing."""
    max_reuse_distance: int = Field(1_000_000_000, ge=0)
    """Stage 3: do not release a parameter reused within this many elements."""
    gather_16bit_weights_on_model_save: bool = False
    """Stage 3: gather full weights for ``save_16bit_model()``."""
    module_granularity_threshold: int = Field(0, ge=0)
    """DeepSpeed stage-3 key; accepted, no effect (warns when set): every module is its own
    fetch unit."""
    use_all_reduce_for_fetch_params: bool = False
    """DeepSpeed stage-3 key; accepted, no effect (warns when true): parameters are always
    fetched with all-gather."""
    elastic_checkpoint: bool = False
    """DeepSpeed legacy key; shardwise checkpoints are elastic anyway."""
    ignore_unused_parameters: bool = True
    """DeepSpeed key; no effect (warns when false): shardwise never checks for parameters
    that got no gradient in a step."""
    legacy_stage1: bool = False
    """DeepSpeed legacy key; accepted, no effect."""
    mics_shard_size: int = -1
    """MiCS shard group size (-1: off); accepted, no effect."""
    mics_hierarchical_params_gather: bool = False
    """MiCS key; accepted, no effect."""
    use_multi_rank_bucket_allreduce: bool = True
    """DeepSpeed key; accepted, no effect."""
    load_from_fp32_weights: bool = True
    """Initialise master weights from the checkpoint's fp32 copy (always done)."""
    zero_hpz_partition_size: int = Field(1, ge=0)
    """ZeRO++ key; accepted, no effect."""
    zero_quantized_weights: bool = False
    """ZeRO++ key; accepted, no effect."""
    zero_quantized_nontrainable_weights: bool = False
    """ZeRO++ key; accepted, no effect."""
    zero_quantized_gradients: bool = False
    """ZeRO++ key; accepted, no effect."""
    memory_efficient_linear: bool = True
    """DeepSpeed stage-3 key; accepted, no effect."""
    override_module_apply: bool = True
    """DeepSpeed stage-3 key; accepted, no effect."""
    pipeline_loading_checkpoint: bool = False
    """DeepSpeed key; accepted, no effect."""

    @classmethod
    def rewrite_raw(cls, raw: Any, path: str, notes: list) -> Any:
        # DeepSpeed's oldest format: "zero_optimization": true means stage 1.
        if isinstance(raw, bool):
            notes.append(f"{path}: the boolean form is deprecated (DeepSpeed too); "
                         f"read as {{\"stage\": {int(raw)}}}. Write \"{path}\": {{\"stage\": {int(raw)}}}.")
            return {"stage": int(raw)}
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        # DeepSpeed's deprecated offload booleans, translated the way DeepSpeed does.
        pin = raw.pop("cpu_offload_use_pin_memory", None)
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if old in raw:
                value = raw.pop(old)
                notes.append(f"{path}.{old} is deprecated (DeepSpeed too); use "
                             f"\"{new}\": {{\"device\": \"cpu\"}} instead.")
                if value and new not in raw:
                    raw[new] = {"device": "cpu", "pin_memory": bool(pin)}
        if pin is not None:
            notes.append(f"{path}.cpu_offload_use_pin_memory is deprecated; use \"pin_memory\" "
                         f"inside offload_optimizer / offload_param.")
        return raw

    @field_validator("stage", mode="before")
    @classmethod
    def _stage_in_range(cls, value: Any) -> Any:
        if isinstance(value, str):  # "2", " 2 ", "2.0": pydantic's lax int parsing, as DeepSpeed
            try:
                value = TypeAdapter(int).validate_python(value)
            except ValidationError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value not in (0, 1, 2, 3):
            raise ConfigError(
                f"zero_optimization.stage = {value!r} is not a ZeRO stage. Valid stages are 0 "
                f"(off), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters), e.g. "
                f"\"zero_optimization\": {{\"stage\": 2}}.")
        return int(value)

    @model_validator(mode="after")
    def _resolve_and_check(self) -> "ZeroConfig":
        if self.overlap_comm is None:
            # DeepSpeed's dynamic default: stage 3 prefetches and reduces on side streams anyway.
            self.overlap_comm = self.stage == 3
        opt = self.offload_optimizer
        if opt is not None and opt.device != "none" and self.stage == 0:
            raise ConfigError(
                f"zero_optimization.offload_optimizer.device = {opt.device!r} needs ZeRO stage 1, 2 "
                f"or 3, but zero_optimization.stage = 0. Set \"stage\": 2 (or drop offload_optimizer).")
        # ratio < 1 (partial offload) works on stages 1-3 in shardwise (DeepSpeed: stage 3 only)
        return self

    @property
    def offload_optimizer_device(self) -> str:
        """"none" | "cpu" | "nvme": where optimizer states live."""
        return "none" if self.offload_optimizer is None else self.offload_optimizer.device

    @property
    def offload_param_device(self) -> str:
        """"none" | "cpu" | "nvme": where stage-3 parameter partitions live."""
        return "none" if self.offload_param is None else self.offload_param.device
