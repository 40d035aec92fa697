"""``InferenceConfig``: the config of ``shardwise.init_inference``, with DeepSpeed's names.

``load_inference_config(config, **kwargs)`` takes what ``deepspeed.init_inference`` takes:
nothing, a dict, a path to a JSON file (comments allowed), keyword arguments, or a dict and
keyword arguments together (merged; one key given both ways with different values is an
error naming the key, as in DeepSpeed). Every key DeepSpeed's ``DeepSpeedInferenceConfig``
accepts loads, with its default and its aliases (``kernel_inject``, ``tp``, ``max_tokens``,
``min_tokens``, ``tm``, ``injection_dict``, ``ckpt_config``, ``args``); keys that change nothing
here warn once with what happens instead. DeepSpeed rejects unknown keys; shardwise accepts
the seed article's invented ones (``inference``, ``zero_optimization``, ``windows_*``) and warns
naming each. Any other unknown key is an error with the nearest valid key.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from shardwise.config.aio import AioConfig
from shardwise.config.base import ConfigModel, canonical_dtype_name
from shardwise.config.jsonc import load_file
from shardwise.config.keys import WalkReport, normalize
from shardwise.config.loader import _convert
from shardwise.config.zero import ZeroConfig
from shardwise.errors import ConfigError
from shardwise.utils.logging import warn_once

from .quant_stream import WeightQuantizationConfig

#: dtype names accepted by ``dtype`` (DeepSpeed's spellings plus int8).
DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16,
                                  "bf16": torch.bfloat16, "int8": torch.int8}
_INT8_SPELLINGS = ("int8", "torch.int8")


class TensorParallelConfig(ConfigModel):
    """``tensor_parallel`` (alias ``tp``): AutoTP, Megatron-style head / MLP-column split."""

    inert = {"tp_grain_size": "shards follow attention heads and whole MLP columns; the "
                              "grain size is not used"}

    enabled: bool = True
    """Turn tensor parallelism on/off (DeepSpeed's key)."""
    tp_size: int = Field(1, ge=1)
    """Ranks one model is split over; must divide the attention and KV heads and the world size."""
    tp_grain_size: int = Field(64, ge=1)
    """DeepSpeed's MLP/lm_head split granularity (accepted, no effect here)."""
    mpu: Any = None
    """An object with ``get_model_parallel_group()``; its group is used as the TP group."""
    tp_group: Any = None
    """A ``torch.distributed`` process group to use as the TP group (default: all ranks)."""
    windows_tp_optimization: bool = False
    """The seed article's invented key: accepted, no effect (warns)."""


class MoEConfig(ConfigModel):
    """``moe``: DeepSpeed-MoE inference (accepted; no expert parallelism here)."""

    aliases = {"num_experts": "moe_experts", "expert_group": "ep_group"}
    enabled: bool = True
    """Whether the model is an MoE model (DeepSpeed's key)."""
    ep_size: int = Field(1, ge=1)
    """Expert-parallel ranks (only 1 is supported)."""
    moe_experts: List[int] = Field(default_factory=lambda: [1])
    """Global number of experts per MoE layer."""
    type: str = "standard"
    """"standard" or "residual"."""
    ep_mp_group: Any = None
    """Expert model-parallel group (unused)."""
    ep_group: Any = None
    """Expert-parallel group (unused)."""


class QuantConfig(ConfigModel):
    """``quant``: DeepSpeed's MoQ settings (only ``dtype: int8`` weight-only quantizes here)."""

    inert = {"activation": "activations stay in the compute dtype (dtype \"int8\" is weight-only)",
             "weight": "dtype \"int8\" quantizes weights to 8 bits, one symmetric scale per output "
                       "channel (int4: weight_quantization under ZeRO-Inference)",
             "qkv": "q/k/v are quantized like every other projection with dtype \"int8\""}

    enabled: bool = True
    """DeepSpeed's key; the quantization scheme here is fixed (per-channel symmetric int8)."""
    activation: Dict[str, Any] = Field(default_factory=dict)
    """Activation quantization settings (not implemented; weights only)."""
    weight: Dict[str, Any] = Field(default_factory=dict)
    """Weight quantization settings (``num_bits`` other than 8 is not implemented)."""
    qkv: Dict[str, Any] = Field(default_factory=dict)
    """QKV quantization settings (no effect)."""
    lm_head: bool = True
    """Not DeepSpeed's: with ``dtype: "int8"``, quantize the output head too (as gpt-fast and
    torchao do). A head tied to the input embedding stays in float either way (an int8 copy
    would add memory). ``false`` keeps every head in the compute dtype (Hugging Face's
    bitsandbytes int8 skips ``lm_head`` the same way)."""


class CheckpointLoadConfig(ConfigModel):
    """``checkpoint_config`` (alias ``ckpt_config``)."""

    checkpoint_dir: Optional[str] = None
    """Directory to load weights from (same as ``checkpoint``)."""
    save_mp_checkpoint_path: Optional[str] = None
    """Not implemented: saving resharded checkpoints."""
    base_dir: Optional[str] = None
    """Root of relative checkpoint paths."""


class SeedInferenceSection(ConfigModel):
    """The seed article's nested ``inference`` section: its known keys act as top-level keys."""

    aliases = {"kernel_inject": "replace_with_kernel_inject"}
    replace_with_kernel_inject: Optional[bool] = None
    """Same as the top-level key (the article nests it)."""
    enable_cuda_graph: Optional[bool] = None
    """Same as the top-level key."""
    windows_kernel_optimization: bool = False
    """The seed article's invented key: accepted, no effect (warns)."""


class InferenceConfig(ConfigModel):
    """A validated ``init_inference`` config (DeepSpeed's ``DeepSpeedInferenceConfig`` keys)."""

    aliases = {"kernel_inject": "replace_with_kernel_inject", "tp": "tensor_parallel",
               "max_tokens": "max_out_tokens", "min_tokens": "min_out_tokens",
               "tm": "triangular_masking", "injection_dict": "injection_policy",
               "ckpt_config": "checkpoint_config", "args": "config",
               "expert_group": "ep_group", "expert_mp_group": "ep_mp_group",
               "zero_optimization": "zero"}
    inert = {
        "use_triton": "shardwise runs PyTorch's own kernels (torch.compile may use Triton itself)",
        "triton_autotune": "there are no Triton kernels of ours to tune",
        "triangular_masking": "causal masking follows the model",
        "keep_module_on_host": "weights are placed on the inference device",
        "set_empty_params": "use shardwise.OnDevice(device=\"meta\") plus checkpoint=",
        "save_mp_checkpoint_path": "resharded checkpoints are not written",
        "return_tuple": "the model's own output type is returned",
        "training_mp_size": "checkpoints of any TP size load (they are gathered by name)",
        "replace_method": "deprecated in DeepSpeed, no effect",
        "injection_policy_tuple": "AutoTP finds the split from the model structure",
        "injection_policy": "AutoTP finds column/row-parallel layers from the model structure "
                            "(Llama/Mistral/Qwen2, OPT, GPT-2, GPT-NeoX layouts); the policy is "
                            "not applied",
        "config": "the model's own config is used",
        "transposed_mode": "no effect",
        "ep_size": "expert parallelism is not implemented",
        "moe_experts": "expert parallelism is not implemented",
        "moe_type": "expert parallelism is not implemented",
        "ep_group": "expert parallelism is not implemented",
        "ep_mp_group": "expert parallelism is not implemented",
    }

    replace_with_kernel_inject: bool = False
    """"Kernel injection": the static-KV-cache decode path (compiled + CUDA graphs on CUDA)."""
    dtype: str = "fp16"
    """"fp32" | "fp16" | "bf16" | "int8" (or a torch dtype). int8 = weight-only int8 linears
    with bf16 (CUDA) / fp32 (CPU) activations. DeepSpeed's default is fp16; on a CPU-only
    machine an unset dtype keeps the model's own dtype (fp16 on CPU is slow)."""
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """AutoTP settings (alias ``tp``)."""
    enable_cuda_graph: Optional[bool] = None
    """Capture the decode step in a CUDA graph. Unset: on with kernel injection on CUDA
    (DeepSpeed's default is False; graphs are what makes decode fast here)."""
    use_triton: bool = False
    """DeepSpeed's Triton kernels (no effect: nothing of ours is compiled)."""
    triton_autotune: bool = False
    """DeepSpeed's Triton autotuning (no effect)."""
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO settings; stage 3 + offload_param is ZeRO-Inference (alias ``zero_optimization``)."""
    weight_quantization: WeightQuantizationConfig = Field(default_factory=WeightQuantizationConfig)
    """ZeRO-Inference's weight-only quantized streaming (DeepSpeed's ds_config key):
    ``{"quantized_initialization": {"num_bits": 4 or 8, "group_size": 64}}``."""
    kv_offload: bool = False
    """DeepSpeed ZeRO-Inference's KV-cache offload (its examples' ``--kv-offload``): the
    fast path's KV cache lives in pinned host memory and each layer's K/V is streamed to the
    device one layer ahead of its attention (pays when the cache does not fit on the device)."""
    aio: AioConfig = Field(default_factory=AioConfig)
    """Async file IO for ``zero.offload_param.device = "nvme"`` (DeepSpeed's ds_config section)."""
    triangular_masking: bool = True
    """DeepSpeed's masking switch (no effect; causal masking follows the model)."""
    moe: Union[bool, MoEConfig] = Field(default_factory=MoEConfig)
    """MoE settings (accepted; no expert parallelism)."""
    keep_module_on_host: bool = False
    """DeepSpeed: keep loaded weights on the host (no effect)."""
    quant: QuantConfig = Field(default_factory=QuantConfig)
    """DeepSpeed's MoQ settings (see ``dtype: int8``)."""
    checkpoint: Optional[Union[str, Dict[str, Any]]] = None
    """A Hugging Face model directory, a shardwise export/training checkpoint directory, or
    a DeepSpeed-style JSON descriptor (dict or path) with ``checkpoints`` file names."""
    base_dir: str = ""
    """Root of the relative paths in ``checkpoint``."""
    set_empty_params: bool = False
    """DeepSpeed: the module was built with empty params (no effect; see OnDevice)."""
    save_mp_checkpoint_path: Optional[str] = None
    """DeepSpeed: save the resharded checkpoint here (not implemented)."""
    checkpoint_config: CheckpointLoadConfig = Field(default_factory=CheckpointLoadConfig)
    """Checkpoint settings (alias ``ckpt_config``)."""
    return_tuple: bool = True
    """DeepSpeed: injected layers return tuples (no effect)."""
    training_mp_size: int = 1
    """DeepSpeed: the TP size the checkpoint was trained with (no effect)."""
    replace_method: str = "auto"
    """Deprecated in DeepSpeed (no effect)."""
    injection_policy: Optional[Dict[Any, Any]] = None
    """AutoTP override: {layer class or name: (names of row-parallel linears, ...)}; the
    linears named are row-parallel (all-reduce after), the others in that layer column-parallel."""
    injection_policy_tuple: Optional[tuple] = None
    """DeepSpeed internal (no effect)."""
    config: Optional[Dict[str, Any]] = None
    """DeepSpeed's ``args`` (no effect)."""
    max_out_tokens: int = Field(1024, ge=1)
    """Most tokens (prompt + generated) per sequence; the static KV cache's length bound."""
    min_out_tokens: int = Field(1, ge=1)
    """Fewest tokens the runtime must be able to produce; an error when the cache cannot."""
    transposed_mode: bool = False
    """DeepSpeed internal (no effect)."""
    mp_size: int = Field(1, ge=1)
    """Deprecated spelling of ``tensor_parallel.tp_size``."""
    mpu: Any = None
    """Deprecated spelling of ``tensor_parallel.mpu``."""
    ep_size: int = 1
    """Deprecated (moe.ep_size)."""
    ep_group: Any = None
    """Deprecated (moe.ep_group)."""
    ep_mp_group: Any = None
    """Deprecated (moe.ep_mp_group)."""
    moe_experts: List[int] = Field(default_factory=lambda: [1])
    """Deprecated (moe.moe_experts)."""
    moe_type: str = "standard"
    """Deprecated (moe.type)."""
    inference: Optional[SeedInferenceSection] = None
    """Not DeepSpeed's: the seed article nests kernel_inject here; its keys apply as top-level."""
    windows_specific: Optional[Dict[str, Any]] = None
    """Not DeepSpeed's: the seed article's section (accepted, no effect)."""

    _notes: List[str] = PrivateAttr(default_factory=list)
    _dtype_given: bool = PrivateAttr(default=False)

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: Any) -> str:
        if value is torch.int8 or (isinstance(value, str) and value.strip().lower() in _INT8_SPELLINGS):
            return "int8"
        if isinstance(value, str) and value.strip().lower() == "bfloat":
            return "bf16"
        try:
            return canonical_dtype_name(value, "dtype")
        except ConfigError as err:
            raise ConfigError(f"{err} For weight-only int8 use \"dtype\": \"int8\".") from None

    @field_validator("checkpoint", mode="before")
    @classmethod
    def _path_to_str(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @model_validator(mode="after")
    def _fold_legacy(self) -> "InferenceConfig":
        if self.mp_size != 1:
            if self.tensor_parallel.tp_size not in (1, self.mp_size):
                raise ConfigError(f"mp_size = {self.mp_size} and tensor_parallel.tp_size = "
                                  f"{self.tensor_parallel.tp_size} disagree; mp_size is the old "
                                  f"name of tensor_parallel.tp_size: set only tensor_parallel.")
            self.tensor_parallel.tp_size = self.mp_size
        if self.mpu is not None and self.tensor_parallel.mpu is None:
            self.tensor_parallel.mpu = self.mpu
        if isinstance(self.moe, bool):
            self.moe = MoEConfig(enabled=self.moe)
        seed = self.inference
        if seed is not None:
            if seed.replace_with_kernel_inject is not None:
                self.replace_with_kernel_inject = self.replace_with_kernel_inject or \
                    seed.replace_with_kernel_inject
            if seed.enable_cuda_graph is not None and self.enable_cuda_graph is None:
                self.enable_cuda_graph = seed.enable_cuda_graph
        if self.min_out_tokens > self.max_out_tokens:
            raise ConfigError(f"min_out_tokens = {self.min_out_tokens} is larger than max_out_tokens "
                              f"= {self.max_out_tokens}; the rule: the static KV cache "
                              f"(max_out_tokens) must hold at least min_out_tokens. Raise "
                              f"max_out_tokens to {self.min_out_tokens} or more.")
        if self.checkpoint is None and self.checkpoint_config.checkpoint_dir:
            self.checkpoint = self.checkpoint_config.checkpoint_dir
        return self

    # --- derived ------------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        """The effective tensor-parallel size (1 when ``tensor_parallel.enabled`` is false)."""
        return self.tensor_parallel.tp_size if self.tensor_parallel.enabled else 1

    @property
    def int8(self) -> bool:
        """True for weight-only int8."""
        return self.dtype == "int8"

    @property
    def dtype_given(self) -> bool:
        """True when the user set ``dtype`` (the fp16 default is then not applied on CPU)."""
        return self._dtype_given

    @property
    def wants_param_offload(self) -> bool:
        """True for ZeRO-Inference: zero stage 3 with offload_param to cpu/nvme."""
        off = self.zero.offload_param
        return self.zero.stage == 3 and off is not None and off.device != "none"

    @property
    def warnings(self) -> List[str]:
        """The warning texts produced while loading (each also logged once)."""
        return list(self._notes)


# --- loading ------------------------------------------------------------------------------
def _source_dict(config: Any) -> Dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, InferenceConfig):
        raise ConfigError("config is already an InferenceConfig; pass it as the only config "
                          "(no keyword arguments) or pass a dict.")
    if isinstance(config, dict):
        return copy.copy(config)  # torch dtypes / groups inside are not deep-copied
    if isinstance(config, (str, os.PathLike)):
        path = Path(config).expanduser()
        if not path.is_file():
            raise ConfigError(f"config = {str(config)!r}: no such JSON file ({path.resolve()}). "
                              f"Pass a dict or the path of an existing ds_config.json.")
        return load_file(path)
    raise ConfigError(f"'config' argument expected a dict or a JSON file path, got "
                      f"{type(config).__name__}: {config!r}.")


def merge_kwargs(config_dict: Dict[str, Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """DeepSpeed's rule: kwargs join the config; a key in both with different values errors."""
    for key in sorted(set(config_dict) & set(kwargs)):
        if config_dict[key] != kwargs[key]:
            raise ConfigError(f"Conflicting argument '{key}' in 'config': {config_dict[key]!r} "
                              f"and kwargs: {kwargs[key]!r}. Give '{key}' only once (or the "
                              f"same value both ways).")
    merged = dict(config_dict)
    merged.update(kwargs)
    return merged


_SEED_KEYS = {"inference", "zero_optimization", "windows_specific"}


def _seed_notes(raw: Dict[str, Any], cfg: InferenceConfig) -> List[str]:
    notes = []
    if "inference" in raw:
        notes.append("Config key 'inference' is not a DeepSpeed init_inference key (the seed "
                     "article nests kernel_inject there); its replace_with_kernel_inject / "
                     "kernel_inject / enable_cuda_graph are applied as top-level keys.")
    if cfg.inference is not None and cfg.inference.windows_kernel_optimization:
        notes.append("inference.windows_kernel_optimization: no effect: shardwise compiles and "
                     "injects no kernels; PyTorch's own kernels are used on every platform.")
    if cfg.tensor_parallel.windows_tp_optimization:
        notes.append("tensor_parallel.windows_tp_optimization: no effect: AutoTP splits heads "
                     "and MLP columns the same way on every platform (gloo on Windows).")
    if "zero_optimization" in raw:
        notes.append("Config key 'zero_optimization' is read as init_inference's 'zero' section "
                     "(DeepSpeed's key name there is 'zero').")
    if cfg.windows_specific:
        notes.append("Config key 'windows_specific' has no effect on inference.")
    return notes


def load_inference_config(config: Any = None, **kwargs: Any) -> InferenceConfig:
    """Build an ``InferenceConfig`` from a dict / JSON path / None plus keyword arguments."""
    if isinstance(config, InferenceConfig) and not kwargs:
        return config
    raw = merge_kwargs(_source_dict(config), kwargs)
    report = WalkReport()
    clean = normalize(raw, InferenceConfig, report)
    # a misspelt key (report.typos) is an unknown key with an obvious suggestion here: both
    # are errors, since DeepSpeed's inference config rejects unknown keys
    unknown = report.unknown + [(dotted, known) for dotted, known, _ in report.typos]
    if unknown:
        lines = []
        for dotted, suggestion in unknown:
            hint = f" Did you mean '{suggestion}'?" if suggestion else ""
            lines.append(f"'{dotted}'{hint}")
        raise ConfigError("Unknown init_inference config key(s): " + "; ".join(lines)
                          + ". The accepted keys are DeepSpeed's DeepSpeedInferenceConfig "
                            "fields (see docs/inference.md).")
    try:
        cfg = InferenceConfig.model_validate(clean)
    except ValidationError as exc:
        raise _convert(exc) from None
    cfg._dtype_given = "dtype" in clean
    cfg._notes = report.notes + _seed_notes(raw, cfg)
    if "lm_head" in (clean.get("quant") or {}) and not cfg.int8:
        cfg._notes.append(f"quant.lm_head applies to dtype \"int8\" only; with dtype "
                          f"\"{cfg.dtype}\" no weight is quantized.")
    for note in cfg._notes:
        warn_once(note)
    return cfg


def describe(cfg: InferenceConfig) -> str:
    """A one-line JSON summary of the main settings (for logs)."""
    return json.dumps({"dtype": cfg.dtype, "tp_size": cfg.tp_size,
                       "replace_with_kernel_inject": cfg.replace_with_kernel_inject,
                       "enable_cuda_graph": cfg.enable_cuda_graph,
                       "max_out_tokens": cfg.max_out_tokens})
