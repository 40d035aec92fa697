"""The small config sections: precision, optimizer, scheduler, activation checkpointing,
checkpoint, aio, data types, compile and the seed's ``windows_specific``.

Field names, defaults and meanings follow DeepSpeed's config-json reference; fields that
are ours (not DeepSpeed's) say so in their docstring.
"""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional

import torch
from pydantic import Field, field_serializer, field_validator, model_validator

from shardwise.errors import ConfigError

from .aio import AioConfig  # noqa: F401  (re-exported: the section lives in aio.py)
from .base import ConfigModel, canonical_dtype_name, lowered, torch_dtype_of


class FP16Config(ConfigModel):
    """``fp16``: half-precision training with DeepSpeed's dynamic loss scaler."""

    inert = {"fp16_master_weights_and_grads": "master weights and gradients are always fp32"}

    enabled: bool = False
    """Train with fp16 weights/activations and fp32 master weights."""
    auto_cast: bool = False
    """DeepSpeed key; no effect: with fp16 (or bf16) enabled the engine always casts the
    module's floating-point inputs to the compute dtype before forward."""
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
    """DeepSpeed key; accepted, no effect (warns when true): master weights and gradients
    are always fp32."""


class BF16Config(ConfigModel):
    """``bf16`` (also spelled ``bfloat16``): bfloat16 training, no loss scaling needed."""

    deepspeed_only = {
        "immediate_grad_update": "gradients always accumulate in fp32 buffers "
                                 "(data_types.grad_accum_dtype chooses otherwise)",
        "check_grad_overflow": "bf16 runs never skip a step for overflow",
        "bf16_master_weights_and_grads": "master weights and gradients are always fp32",
        "bf16_optimizer_states": "optimizer states are always fp32",
    }

    enabled: bool = False
    """Train with bf16 weights/activations and fp32 master weights."""


class TorchAutocastConfig(ConfigModel):
    """``torch_autocast``: run forward under ``torch.autocast`` with fp32 weights."""

    inert = {"lower_precision_safe_modules": "gradients are reduced in communication_data_type "
                                             "(default fp32) for every module"}

    enabled: bool = False
    """Wrap forward in ``torch.autocast(device_type, dtype)``."""
    dtype: torch.dtype = torch.bfloat16
    """Autocast's lower-precision dtype ("bf16"/"fp16" or a torch name); a ``torch.dtype``."""
    lower_precision_safe_modules: Optional[List[str]] = None
    """DeepSpeed key; accepted, no effect (warns when set): gradients are reduced in
    communication_data_type (default: the gradient buffers' fp32) for every module."""

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
    policy: Literal["full", "selective", "selective_ops", "offload"] = "full"
    """Ours: "full" recomputes the whole module; "selective" keeps the matmul and attention
    outputs and recomputes the norms and the MLP's elementwise ops from their inputs (see
    docs/activation.md); "selective_ops" is the op-level variant (torch's selective
    checkpoint over the whole block: keep matmul/attention outputs, recompute every other
    op); "offload" keeps saved tensors in (pinned) CPU memory."""

    _lower_policy = field_validator("policy", mode="before")(classmethod(lambda cls, value: lowered(value)))

    @field_validator("number_checkpoints", mode="before")
    @classmethod
    def _false_is_none(cls, value: Any) -> Any:
        # Widely copied DeepSpeed examples write "number_checkpoints": false (meaning unset).
        return None if value is False else value


class CheckpointConfig(ConfigModel):
    """``checkpoint``: how ``save_checkpoint``/``load_checkpoint`` behave."""

    inert = {"use_node_local_storage": "save_dir must be reachable by every rank (a shared "
                                       "filesystem across nodes)"}

    tag_validation: Literal["Warn", "Ignore", "Fail"] = "Warn"
    """Check that every rank saves under the same tag: warn, ignore, or raise (case-insensitive)."""
    use_node_local_storage: bool = False
    """DeepSpeed key; accepted, no effect (warns when true): save_dir must be one folder every
    rank can reach (a shared filesystem on several nodes); see docs/checkpoint.md."""
    load_universal: bool = False
    """DeepSpeed key; no effect: every shardwise checkpoint loads at any world size and stage
    (it is "universal" already)."""
    async_save: bool = False
    """Write checkpoint files in a background thread after copying tensors to CPU."""
    parallel_write: Dict[str, Any] = Field(default_factory=dict)
    """DeepSpeed's ``{"pipeline_stage": bool}``; accepted, no effect (no pipeline stages)."""
    windows_path_optimization: bool = False
    """Seed key; no effect on any platform: shardwise always uses pathlib and ':'-free file
    names."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _title_case(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("warn", "ignore", "fail"):
            return value.strip().capitalize()
        return value


class DataTypesConfig(ConfigModel):
    """``data_types``: dtypes of internal buffers."""

    deepspeed_only = {"param_dtype": "the parameter dtype follows fp16.enabled / bf16.enabled"}

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
    pathlib paths) is always on under Windows and never needed elsewhere (no effect there,
    logged once at info level)."""
    memory_optimization: Literal["none", "normal", "aggressive"] = "none"
    """"aggressive", on Windows: the engine empties the device allocator cache after every
    optimizer step (lower peak reserved memory under Windows' WDDM driver, at some speed
    cost). "normal" and "none" leave the caching allocator alone. No effect on other
    platforms (logged once at info level)."""

    _lower = field_validator("memory_optimization", mode="before")(
        classmethod(lambda cls, value: lowered(value)))


#: DeepCompile's tuning keys (DeepSpeed >= 0.16.6 puts them in the ``compile`` section). They
#: only steer DeepCompile's graph passes, which shardwise does not have: accepted, dropped, noted.
DEEPCOMPILE_KEYS = (
    "free_activation", "free_activation_threshold", "offload_activation", "offload_opt_states",
    "double_buffer", "symmetric_memory", "debug_log", "dump_graphs", "offload_parameters",
    "sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather",
    "keep_int_input_tensors", "keep_all_input_tensors", "passes", "autoep_non_moe",
    "offload_activation_pin_memory",
)


def torch_compile_kwarg_names() -> List[str]:
    """Keyword arguments of this torch's ``torch.compile`` that a config may set (all but the
    model and the backend, which has its own key). Read from the signature, so a newer torch's
    new arguments are accepted without a change here."""
    import inspect
    compile_fn = getattr(torch, "compile", None)
    if compile_fn is None:
        return []
    params = inspect.signature(compile_fn).parameters
    return [name for name, p in params.items()
            if name not in ("model", "backend") and p.kind == inspect.Parameter.KEYWORD_ONLY]


def check_compile_kwargs(kwargs: Dict[str, Any], key: str) -> Dict[str, Any]:
    """Raise ConfigError unless every key of ``kwargs`` is a ``torch.compile`` keyword argument
    (``backend`` is refused: it has its own key). ``key`` names the source in the message."""
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{key} = {kwargs!r} ({type(kwargs).__name__}) must be a dict of "
                          f"torch.compile keyword arguments, e.g. {{\"mode\": \"max-autotune\"}}.")
    if "backend" in kwargs:
        raise ConfigError(f"{key} has \"backend\": {kwargs['backend']!r}, but the backend has its "
                          f"own key: move it to compile.backend (or engine.compile(backend=...)) "
                          f"and remove it from {key}.")
    allowed = torch_compile_kwarg_names()
    bad = sorted(k for k in kwargs if k not in allowed)
    if bad and allowed:
        raise ConfigError(f"{key}: {bad} {'is not a' if len(bad) == 1 else 'are not'} "
                          f"torch.compile keyword argument{'s' if len(bad) > 1 else ''} in torch "
                          f"{torch.__version__}; valid: {', '.join(allowed)} (e.g. "
                          f"{{\"mode\": \"max-autotune\"}}). Remove or rename {bad}.")
    return dict(kwargs)


class CompileConfig(ConfigModel):
    """``compile``: ``torch.compile`` the model when the engine is built (DeepSpeed's section).

    DeepSpeed 0.14 compiled the model when ``enabled`` was true; later DeepSpeed releases ask
    for ``engine.compile()`` and reuse the section for DeepCompile. shardwise does both:
    ``enabled`` (or ``deepcompile``) compiles at ``initialize()``, ``engine.compile()`` compiles
    on demand. Under ZeRO stage 3 each decoder layer is compiled with the gathers, releases and
    gradient reduce-scatters around it (FSDP2's composition with torch.compile); DeepCompile's
    tuning keys load with a warning (there are no DeepCompile graph passes here)."""

    enabled: bool = False
    """Compile the model with ``torch.compile`` at ``initialize()`` (DeepSpeed 0.14's key);
    ``engine.compile()`` does the same later. Works with every ZeRO stage: under stage 3 each
    block is compiled on its own, its gathers and releases running eagerly around it."""
    backend: str = "inductor"
    """``torch.compile`` backend: a name from ``torch._dynamo.list_backends()`` ("inductor",
    "aot_eager", "eager", "cudagraphs", ...) or a dotted path "package.module.fn" to a backend
    callable (DeepSpeed's rule). When the backend cannot work here (no Triton for a GPU, no
    C++ compiler for inductor on CPU, no dynamo), the model stays eager with one warning."""
    kwargs: Dict[str, Any] = Field(default_factory=dict)
    """Further ``torch.compile`` keyword arguments ("mode", "fullgraph", "dynamic", "options",
    ...); checked against this torch's ``torch.compile`` signature."""
    granularity: Literal["blocks", "module"] = "blocks"
    """Ours: "blocks" compiles each repeated block separately (every child of the model's
    largest ``nn.ModuleList`` of one class, e.g. the decoder layers; torchtitan's recipe):
    compile time is that of one block, since the blocks share one graph, and a graph break
    stays inside one block. "module" compiles the whole model in one piece, as DeepSpeed's
    ``engine.compile()`` does. A model without such a list is compiled whole."""
    deepcompile: bool = False
    """DeepSpeed's DeepCompile switch: compiled training with the ZeRO (stage 3: parameter
    gather/release, gradient reduce-scatter, prefetch) communication kept outside per-block
    compiled regions. True compiles at ``initialize()`` as ``enabled`` does (a later plain
    ``engine.compile()``, which DeepSpeed scripts call, then does nothing); DeepCompile's own
    graph passes and their tuning keys are not reproduced."""

    _lower_granularity = field_validator("granularity", mode="before")(classmethod(lambda cls, value: lowered(value)))

    @field_validator("backend", mode="before")
    @classmethod
    def _backend_name(cls, value: Any) -> Any:
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"compile.backend = {value!r} ({type(value).__name__}) must be a "
                              f"backend name such as \"inductor\", \"aot_eager\" or \"eager\", or a "
                              f"dotted path \"package.module.fn\" (a callable backend can be passed "
                              f"to engine.compile(backend=...)).")
        return value.strip()

    @field_validator("kwargs", mode="before")
    @classmethod
    def _check_kwargs(cls, value: Any) -> Any:
        return check_compile_kwargs({} if value is None else value, "compile.kwargs")

    @classmethod
    def rewrite_raw(cls, raw: Any, path: str, notes: list) -> Any:
        """Drop DeepCompile's tuning keys (one note naming them) so they do not read as unknown."""
        if not isinstance(raw, dict):
            return raw
        dropped = [k for k in raw if k in DEEPCOMPILE_KEYS or str(k).startswith("global_layer_scheduler")]
        if dropped:
            notes.append(f"Config keys {', '.join(f'{path}.{k}' for k in dropped)} are DeepCompile "
                         f"options, accepted with no effect: shardwise has no DeepCompile graph "
                         f"passes (the section's deepcompile and enabled keys compile each "
                         f"decoder layer, with ZeRO's communication around the compiled layers).")
        return {k: v for k, v in raw.items() if k not in dropped}
