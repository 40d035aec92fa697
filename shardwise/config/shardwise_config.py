"""``ShardwiseConfig``: the whole ds_config.json, with DeepSpeed's top-level key names.

Build it with ``load_config`` (which also derives the batch triple and reports unknown
keys); the engine reads the attributes and the derived properties below.
"""
from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, Optional

import torch
from pydantic import Field, PrivateAttr, field_validator, model_validator

from shardwise.errors import ConfigError

from .base import ConfigModel, canonical_dtype_name, torch_dtype_of
from .models import (ActivationCheckpointingConfig, AioConfig, BF16Config, CheckpointConfig,
                     CompileConfig, DataTypesConfig, FP16Config, OptimizerConfig, SchedulerConfig,
                     TorchAutocastConfig, WindowsSpecificConfig)
from .monitor import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
from .profiling import CommsLoggerConfig, FlopsProfilerConfig
from .zero import ZeroConfig

class ShardwiseConfig(ConfigModel):
    """A validated DeepSpeed-compatible training config."""

    aliases = {"bfloat16": "bf16"}
    inert = {
        "dump_state": "initialize() logs the resolved stage, dtype and batch sizes in one line",
        "prescale_gradients": "gradients are always divided by gradient_predivide_factor before "
                              "the reduction and by world_size / factor after it",
    }
    deepspeed_only = {
        "gradient_allreduce_op": "reduced gradients are always averaged over the ranks",
        "managed_gradient_accumulation": "the engine owns the accumulation boundary (see "
                                         "engine.set_gradient_accumulation_boundary)",
        "log_level": "set the level of the \"shardwise\" logger (SHARDWISE_LOG_LEVEL)",
    }

    # --- batch --------------------------------------------------------------------------
    train_batch_size: Optional[int] = None
    """Global batch per optimizer step = micro x GA x world size (an int after load_config)."""
    train_micro_batch_size_per_gpu: Optional[int] = None
    """Samples per forward/backward on one rank (an int after load_config)."""
    gradient_accumulation_steps: Optional[int] = None
    """Micro-batches accumulated per optimizer step (an int after load_config)."""

    # --- engine behaviour ---------------------------------------------------------------
    steps_per_print: int = 10
    """Log loss/lr/throughput every this many optimizer steps."""
    wall_clock_breakdown: bool = False
    """Time forward/backward/step separately and log the breakdown."""
    dump_state: bool = False
    """DeepSpeed key; accepted, no effect (warns when true): ``initialize()`` logs the stage,
    dtype, world size and batch triple in one line anyway."""
    gradient_clipping: float = Field(0.0, ge=0.0)
    """Clip gradients to this global L2 norm; 0 = off (PyTorch's and DeepSpeed < 0.19.6's default;
    DeepSpeed 0.19.6+ defaults to 1.0, we keep 0 so nothing clips unless asked). "auto": 0."""
    prescale_gradients: bool = False
    """DeepSpeed key; accepted, no effect (warns when true): gradients are always divided by
    gradient_predivide_factor before the reduction and by world_size / factor after it."""
    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    """Gradients are divided by this before the reduction and by world_size / factor after it
    (a factor > 1 keeps fp16 sums from overflowing)."""
    communication_data_type: Optional[str] = None
    """Dtype of gradient reductions: "fp32" | "fp16" | "bf16" (torch names accepted);
    None: the gradients' own dtype."""
    seed: Optional[int] = None
    """Ours: seed of the shuffling of the data loaders the engine builds
    (``initialize(training_data=...)``, ``engine.deepspeed_io()``); None means 0. It does not
    seed torch, random or numpy: do that in your script."""
    memory_breakdown: bool = False
    """DeepSpeed key; no effect: every ``steps_per_print`` line already shows peak device
    memory (GPU) and the host RSS."""
    zero_allow_untested_optimizer: bool = True
    """DeepSpeed key; no effect: ZeRO accepts every torch optimizer (DeepSpeed defaults to
    False and refuses untested client optimizers)."""
    strict_config: bool = False
    """Ours: unknown keys (and offload_param with stage < 3) are errors instead of warnings."""

    # --- sections -----------------------------------------------------------------------
    optimizer: Optional[OptimizerConfig] = None
    """The optimizer to build; None: the client passes one (or none)."""
    scheduler: Optional[SchedulerConfig] = None
    """The learning-rate scheduler to build; None: none (or the client's)."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    """fp16 mixed precision with dynamic loss scaling."""
    bf16: BF16Config = Field(default_factory=BF16Config)
    """bf16 mixed precision (also spelled "bfloat16")."""
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    """torch.autocast around forward, weights stay fp32."""
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO stage, buckets and offload."""
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig)
    """Activation checkpointing options."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint save/load options."""
    aio: AioConfig = Field(default_factory=AioConfig)
    """Asynchronous file IO options (NVMe offload, checkpoints)."""
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    """Profile one training step's flops, params and latency (shardwise.profiling)."""
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    """Time and size every collective (shardwise.comm.log_summary())."""
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """Dtypes of internal buffers."""
    windows_specific: WindowsSpecificConfig = Field(default_factory=WindowsSpecificConfig)
    """The seed article's Windows section (see platform_keys.py)."""
    compile: CompileConfig = Field(default_factory=CompileConfig)
    """torch.compile of the model at initialize() (runtime/compile.py applies it)."""
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard monitor events (shardwise.monitor)."""
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    """CSV monitor: one file per tag (shardwise.monitor)."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases monitor (shardwise.monitor)."""
    comet: CometConfig = Field(default_factory=CometConfig)
    """Comet monitor (shardwise.monitor)."""

    # --- accepted, kept verbatim, no effect (reasons in ignored.py) ----------------------
    autotuning: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    elasticity: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    compression_training: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    data_efficiency: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    curriculum_learning: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    sparse_attention: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    pipeline: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    amp: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    zero_force_ds_cpu_optimizer: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    hybrid_engine: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    eigenvalue: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    progressive_layer_drop: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    quantize_training: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    weight_quantization: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    nebula: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    graph_harvesting: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    timers: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    disable_allgather: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    fp32_allreduce: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    sparse_gradients: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    vocabulary_size: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    dataloader_drop_last: Optional[bool] = None
    """The data loaders the engine builds (``initialize(training_data=...)``,
    ``engine.deepspeed_io()``) drop the last incomplete batch when true."""
    seq_parallel_communication_data_type: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    sequence_parallel_size: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    use_data_before_expert_parallelism: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    expert_parallel: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    tensor_parallel: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py). The seed's windows_tp_optimization lives here."""
    inference: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py). The seed's windows_kernel_optimization lives here."""
    checkpoint_engine: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""
    monitor_config: Any = None
    """Accepted, kept verbatim, no effect (reason in ignored.py)."""

    _world_size: int = PrivateAttr(default=1)
    _auto_paths: FrozenSet[str] = PrivateAttr(default_factory=frozenset)
    _notes: List[str] = PrivateAttr(default_factory=list)
    _infos: List[str] = PrivateAttr(default_factory=list)

    @field_validator("compile", "tensorboard", "csv_monitor", "wandb", "comet", mode="before")
    @classmethod
    def _null_compile(cls, value: Any) -> Any:
        # "compile": null (or false) is DeepSpeed's "no section": the defaults, off (same for
        # the monitor sections).
        return {} if value is None or value is False else value

    @field_validator("flops_profiler", "comms_logger", mode="before")
    @classmethod
    def _null_section(cls, value: Any) -> Any:
        # a section given as null (or false) is no section: the defaults, off
        return {} if value is None or value is False else value

    @field_validator("communication_data_type", mode="before")
    @classmethod
    def _canon_comm_dtype(cls, value: Any) -> Optional[str]:
        return canonical_dtype_name(value, "communication_data_type")

    @model_validator(mode="after")
    def _one_half_precision(self) -> "ShardwiseConfig":
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError(
                "fp16.enabled and bf16.enabled are both true, but a run uses one half-precision "
                "format. Keep one: \"bf16\": {\"enabled\": true} (no loss scaling, Ampere+ GPUs "
                "and CPUs) or \"fp16\": {\"enabled\": true} (dynamic loss scaling), and set the "
                "other to false.")
        return self

    # --- derived values the engine reads ------------------------------------------------
    @property
    def world_size(self) -> int:
        """The data-parallel world size the batch triple was resolved for."""
        return self._world_size

    @property
    def auto_fields(self) -> FrozenSet[str]:
        """Dotted paths (canonical names) that were "auto" in the user's config."""
        return self._auto_paths

    @property
    def warnings(self) -> List[str]:
        """Every warning text load_config emitted for this config, in order."""
        return list(self._notes)

    @property
    def infos(self) -> List[str]:
        """Every info-level text load_config logged for this config (e.g. the seed's Windows
        keys on another platform), in order."""
        return list(self._infos)

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of the module's weights and activations: fp16, bf16, else fp32 (torch_autocast
        keeps fp32 weights and lowers precision per op, so it is fp32 here too)."""
        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32

    @property
    def communication_dtype(self) -> Optional[torch.dtype]:
        """``communication_data_type`` as a torch dtype (None: reduce in the gradients' dtype)."""
        return torch_dtype_of(self.communication_data_type)

    @property
    def empty_cache_after_step(self) -> bool:
        """True on Windows when windows_specific.memory_optimization is "aggressive": the engine
        empties the allocator cache after each optimizer step (elsewhere the key has no effect)."""
        from .platform_keys import on_windows
        return self.windows_specific.memory_optimization == "aggressive" and on_windows()

    # --- methods -------------------------------------------------------------------------
    def resolve_auto(self, hidden_size: Optional[int] = None,
                     optimizer_lr: Optional[float] = None) -> "ShardwiseConfig":
        """Fill the "auto" values that depend on the model or optimizer (see auto.py); returns self."""
        from .auto import resolve_auto
        return resolve_auto(self, hidden_size=hidden_size, optimizer_lr=optimizer_lr)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable dict of the resolved values (canonical key names), for checkpoints.

        Feeding it back to load_config gives an equal config."""
        return self.model_dump(mode="json")

