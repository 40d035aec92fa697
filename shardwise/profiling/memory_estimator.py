"""How much memory a training setup needs, per device and per host, before you run it.

Two layers:

* DeepSpeed's own estimators, same names, same formulas and the same printed table
  (``estimate_zero2_model_states_mem_needs*``, ``estimate_zero3_model_states_mem_needs*``),
  including their ``additional_buffer_factor=1.5`` on host memory.
* ``estimate_memory``: a breakdown per ZeRO stage x offload choice into parameters, gradients,
  optimizer states and activations, from the ZeRO paper's model-state formula
  (2Ψ + 2Ψ + 12Ψ bytes with 16-bit training and Adam, each term divided by the data-parallel
  degree from the stage that partitions it) plus a transformer activation model. It says which
  rows fit the devices and host it sees. The formulas are written out in docs/estimator.md.

Models are never materialised: an ``nn.Module`` may live on the meta device, and a config or a
``config.json`` path is built under ``torch.device("meta")`` (no weights, no download).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..errors import ConfigError

GiB = 2**30
_PRECISION_BYTES = {  # precision -> (param, grad, optimizer-state bytes per parameter, Adam)
    "bf16": (2, 2, 12),  # fp32 master weights + exp_avg + exp_avg_sq
    "fp16": (2, 2, 12),
    "fp32": (4, 4, 8),  # the fp32 weights are the master weights
}
_OFFLOADS = ("none", "optimizer", "optimizer+param")


# --- DeepSpeed's estimators (same names and formulas) --------------------------------------
def estimate_zero2_model_states_mem_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True,
                                          additional_buffer_factor: float = 1.5) -> Tuple[int, int]:
    """(cpu bytes per node, gpu bytes per GPU) for ZeRO-2, DeepSpeed's formula."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 4 * total_params + int(16 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def estimate_zero3_model_states_mem_needs(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                                          num_nodes: int = 1, cpu_offload: bool = True,
                                          cpu_offload_params: bool = True, zero_init: bool = True,
                                          additional_buffer_factor: float = 1.5) -> Tuple[int, int, int]:
    """(cpu bytes per node, gpu bytes per GPU, largest layer bytes) for ZeRO-3, DeepSpeed's formula."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload and cpu_offload_params:
        gpu_mem = largest_layer_memory
        factor = 18 * gpus_factor
    elif cpu_offload:
        gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
        factor = 16 * gpus_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        # Without offload the host only holds what loading the model needs.
        base = largest_layer_params if zero_init else total_params
        return int(base * 4 * num_gpus_per_node * additional_buffer_factor), int(gpu_mem), largest_layer_memory
    if not zero_init:
        factor = max(4 * num_gpus_per_node, factor)
    return int(total_params * factor * additional_buffer_factor), int(gpu_mem), largest_layer_memory


def _header(total_params: int, num_gpus_per_node: int, num_nodes: int) -> str:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    return ("Estimated memory needed for params, optim states and gradients for a:\n"
            f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
            f"SW: Model with {int(total_params / 1e6)}M total params"
            )


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> List[Tuple[int, int, str]]:
    """Print DeepSpeed's ZeRO-2 table for a hypothetical model; return its (cpu, gpu, options) rows."""
    rows = []
    for offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, offload,
                                                         additional_buffer_factor)
        rows.append((cpu, gpu, f"offload_optimizer={'cpu' if offload else 'none'}"))
    print(_header(total_params, num_gpus_per_node, num_nodes) + ".")
    print("  per CPU  |  per GPU |   Options")
    for cpu, gpu, options in rows:
        print(f" {cpu / GiB:7.2f}GB | {gpu / GiB:6.2f}GB | {options}")
    return rows


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> List[Tuple[int, int, str]]:
    """Print DeepSpeed's ZeRO-3 table for a hypothetical model; return its (cpu, gpu, options) rows."""
    rows = []
    for offload in (True, False):
        for offload_params in ((True, False) if offload else (False,)):
            for zero_init in (True, False):
                cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                    total_params, largest_layer_params, num_gpus_per_node, num_nodes, offload,
                    offload_params, zero_init, additional_buffer_factor)
                options = (f"offload_param={'cpu' if offload_params else 'none'}, "
                           f"offload_optimizer={'cpu' if offload else 'none'}, zero_init={int(zero_init)}")
                rows.append((cpu, gpu, options))
    print(_header(total_params, num_gpus_per_node, num_nodes)
          + f", {int(largest_layer_params / 1e6)}M largest layer params.")
    print("  per CPU  |  per GPU |   Options")
    for cpu, gpu, options in rows:
        print(f" {cpu / GiB:7.2f}GB | {gpu / GiB:6.2f}GB | {options}")
    return rows


def model_to_params(model: torch.nn.Module) -> Tuple[int, int]:
    """(total params with shared ones counted once, params of the largest single module).

    Deduplicates by object identity, not ``data_ptr`` as DeepSpeed does: on the meta device
    every parameter reports data pointer 0.
    """
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


def estimate_zero2_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> List[Tuple[int, int, str]]:
    """DeepSpeed's ZeRO-2 estimate for an existing model (meta-device models are fine)."""
    total, _ = model_to_params(model)
    return estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> List[Tuple[int, int, str]]:
    """DeepSpeed's ZeRO-3 estimate for an existing model (meta-device models are fine)."""
    total, largest = model_to_params(model)
    return estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor)


# --- the model's shape -------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What the estimator needs to know about a model."""

    total_params: int
    """Parameters, shared ones counted once."""
    largest_layer_params: int
    """Parameters of the largest single module (gathered at once under ZeRO-3)."""
    num_layers: int = 0
    """Transformer blocks (0: unknown, no activation estimate)."""
    hidden_size: int = 0
    """Model width h."""
    num_heads: int = 0
    """Attention heads a."""
    num_kv_heads: int = 0
    """Key/value heads (grouped-query attention); equals num_heads without GQA."""
    intermediate_size: int = 0
    """MLP width i."""
    vocab_size: int = 0
    """Vocabulary size V (logits and loss)."""
    gated_mlp: bool = True
    """SwiGLU-style MLP (gate, up, down: Llama, Mistral, Qwen) rather than GeLU (GPT)."""


def _config_shape(config: Any) -> Dict[str, Any]:
    get = lambda *names, default=0: next((getattr(config, n) for n in names  # noqa: E731
                                          if getattr(config, n, None) is not None), default)
    h = get("hidden_size", "n_embd", "d_model")
    heads = get("num_attention_heads", "n_head", "num_heads")
    act = str(get("hidden_act", "activation_function", default="")).lower()
    return dict(num_layers=get("num_hidden_layers", "n_layer", "num_layers"), hidden_size=h, num_heads=heads,
                num_kv_heads=get("num_key_value_heads", default=heads), vocab_size=get("vocab_size"),
                intermediate_size=get("intermediate_size", "n_inner", "ffn_dim", default=4 * h) or 4 * h,
                gated_mlp=act in ("silu", "swiglu", "swish") or "gated" in act)


def _build_on_meta(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _load_config(path: Path) -> Any:
    from transformers import AutoConfig
    if not path.exists():
        raise ConfigError(f"estimate: model config {str(path)!r} does not exist; pass a config.json "
                          f"(or the folder holding it)")
    if path.is_dir():
        return AutoConfig.from_pretrained(str(path))
    data = json.loads(path.read_text(encoding="utf-8"))
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ConfigError(f"estimate: {str(path)!r} has no 'model_type' key, so the architecture is "
                          f"unknown; add e.g. \"model_type\": \"llama\"")
    return AutoConfig.for_model(model_type, **data)


def model_shape(model_or_config: Any) -> ModelShape:
    """Shape of an ``nn.Module`` (meta OK), a transformers config, or a config.json path."""
    if isinstance(model_or_config, ModelShape):
        return model_or_config
    if isinstance(model_or_config, (str, Path)):
        model_or_config = _load_config(Path(model_or_config))
    if isinstance(model_or_config, torch.nn.Module):
        model, config = model_or_config, getattr(model_or_config, "config", None)
    elif hasattr(model_or_config, "to_dict"):  # a transformers PretrainedConfig
        config = model_or_config
        model = _build_on_meta(config)
    else:
        raise ConfigError(f"estimate_memory: model_or_config must be an nn.Module, a transformers config "
                          f"or a path to config.json, got {type(model_or_config).__name__}")
    total, largest = model_to_params(model)
    extra = _config_shape(config) if config is not None else {}
    return ModelShape(total_params=total, largest_layer_params=largest, **extra)


# --- activations -------------------------------------------------------------------------
def activation_bytes_per_layer(shape: ModelShape, micro_batch: int, seq_len: int, act_bytes: int,
                               flash: bool = True) -> int:
    """Bytes autograd keeps for one transformer block (see docs/estimator.md for the terms)."""
    e, r, h = act_bytes, micro_batch * seq_len, shape.hidden_size
    a = shape.num_heads
    if not shape.gated_mlp:
        # Korthikanti et al. 2022 (16-bit): s*b*h*(34 + 5*a*s/h); the 5as/h term is the
        # attention matrix, which fused (flash / memory-efficient) SDPA never stores.
        per = r * h * 34 * e // 2
        return per + (0 if flash else 5 * a * seq_len * r * e // 2)
    kv = shape.num_kv_heads * (h // a)
    norms = 2 * _rmsnorm_bytes(r, h, e)
    # SDPA keeps q and k after RoPE, v, its output (which o_proj reads in place) and the fp32
    # log-sum-exp; RoPE's multiplications by cos/sin keep only cos/sin (shared by all layers).
    attention = 2 * e * r * h + 2 * e * r * kv + 4 * micro_batch * a * seq_len
    if not flash:
        attention += 5 * a * seq_len * r * e // 2
    mlp = 4 * e * r * shape.intermediate_size  # gate, act(gate), up, act*up
    return norms + attention + mlp


def _rmsnorm_bytes(r: int, h: int, e: int) -> int:
    """RMSNorm in HF style: fp32 input, fp32 rsqrt, normalised in input dtype, scaled output."""
    return 4 * r * h + 4 * r + 2 * e * r * h


def selective_bytes_per_layer(shape: ModelShape, micro_batch: int, seq_len: int, act_bytes: int) -> int:
    """Bytes kept per block by the ``selective`` policy: its input plus matmul/attention outputs."""
    e, r, h = act_bytes, micro_batch * seq_len, shape.hidden_size
    kv = shape.num_kv_heads * (h // max(shape.num_heads, 1))
    i = shape.intermediate_size
    mm = (h + 2 * kv + h) + (2 * i + h) if shape.gated_mlp else (3 * h + h) + (i + h)
    return e * r * (h + mm + h) + 4 * micro_batch * shape.num_heads * seq_len  # input + mm outs + sdpa out


def head_bytes(shape: ModelShape, micro_batch: int, seq_len: int, act_bytes: int) -> int:
    """Final norm, logits (returned to the caller), the loss's fp32 log-softmax, token ids."""
    r, e = micro_batch * seq_len, act_bytes
    return _rmsnorm_bytes(r, shape.hidden_size, e) + (e + 4) * r * shape.vocab_size + 16 * r


@dataclass(frozen=True)
class ActivationEstimate:
    """Device and host bytes for activations under one checkpointing choice."""

    device: int
    host: int
    method: str


def estimate_activations(shape: ModelShape, micro_batch: int, seq_len: int, precision: str = "bf16",
                         activation_checkpointing: Union[bool, str] = False, flash: bool = True) -> ActivationEstimate:
    """Activation bytes for ``activation_checkpointing`` in False/'full'/True/'selective'/'offload'/'cpu'."""
    if shape.num_layers == 0 or shape.hidden_size == 0:
        return ActivationEstimate(0, 0, "unknown (no transformer config)")
    e = _PRECISION_BYTES[precision][0]
    layers = shape.num_layers
    one = activation_bytes_per_layer(shape, micro_batch, seq_len, e, flash)
    head = head_bytes(shape, micro_batch, seq_len, e)
    boundary = e * micro_batch * seq_len * shape.hidden_size  # a block's input
    mode = {True: "full", False: "none"}.get(activation_checkpointing, activation_checkpointing)
    if mode == "none":
        return ActivationEstimate(layers * one + head, 0, "none")
    if mode == "full":  # every block keeps its input; one block is live during its recompute
        return ActivationEstimate(layers * boundary + one + head, 0, "full")
    if mode == "cpu":  # full, with the kept inputs in host memory
        return ActivationEstimate(one + head + boundary, layers * boundary, "full+cpu_checkpointing")
    if mode == "selective":
        kept = selective_bytes_per_layer(shape, micro_batch, seq_len, e)
        return ActivationEstimate(layers * kept + (one - kept) + head, 0, "selective")
    if mode == "offload":  # saved tensors stream to the host; about one block in flight
        return ActivationEstimate(one + head, layers * one, "offload")
    raise ConfigError(f"estimate_memory: activation_checkpointing={activation_checkpointing!r} is not "
                      f"one of False, True, 'full', 'selective', 'offload', 'cpu'")


# --- the general estimate ----------------------------------------------------------------
@dataclass(frozen=True)
class EstimateRow:
    """One (stage, offload) setting: bytes per device and per host, and whether it fits."""

    stage: int
    offload: str
    params: int
    """Per device: parameters (ZeRO-3: this rank's partition + the largest gathered layer)."""
    grads: int
    """Per device: gradients (ZeRO-3 also the largest layer's full gradient)."""
    optimizer: int
    """Per device: optimizer states (fp32 master weights and Adam moments)."""
    activations: int
    """Per device: activations for one micro batch."""
    host: int
    """Per host (node): offloaded model states and activations of all its ranks."""
    fits: Optional[bool]
    """Fits device and host memory (None when the limits are unknown)."""

    @property
    def device_total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


@dataclass
class MemoryEstimate:
    """``estimate_memory``'s answer: rows plus the inputs they were computed from."""

    shape: ModelShape
    num_gpus: int
    num_nodes: int
    precision: str
    micro_batch: int
    seq_len: int
    activation_checkpointing: Union[bool, str]
    device_memory: Optional[int]
    host_memory: Optional[int]
    rows: List[EstimateRow] = field(default_factory=list)

    def row(self, stage: int, offload: str = "none") -> EstimateRow:
        for r in self.rows:
            if r.stage == stage and r.offload == offload:
                return r
        raise KeyError(f"no row for stage={stage}, offload={offload!r}")

    def table(self) -> str:
        """A fixed-width table in GiB, one row per setting."""
        lim = lambda v: f"{v / GiB:.1f} GiB" if v else "unknown"  # noqa: E731
        lines = [f"Model: {self.shape.total_params / 1e6:.1f}M params ({self.shape.largest_layer_params / 1e6:.1f}M "
                 f"largest layer); {self.num_nodes} node(s) x {self.num_gpus} device(s); {self.precision}; "
                 f"micro batch {self.micro_batch} x seq {self.seq_len}; activation checkpointing: "
                 f"{self.activation_checkpointing}",
                 f"Limits: device {lim(self.device_memory)}, host {lim(self.host_memory)}",
                 f"{'stage':>5} {'offload':<16}{'params':>9}{'grads':>9}{'optim':>9}{'activ':>9}"
                 f"{'device':>10}{'host':>10}  fits"]
        for r in self.rows:
            fits = {True: "yes", False: "NO", None: "?"}[r.fits]
            lines.append(f"{r.stage:>5} {r.offload:<16}" + "".join(
                f"{v / GiB:>9.2f}" for v in (r.params, r.grads, r.optimizer, r.activations))
                + f"{r.device_total / GiB:>10.2f}{r.host / GiB:>10.2f}  {fits}")
        lines.append("(GiB per device; host = per node. Add ~10-20% for allocator fragmentation and "
                     "communication buckets.)")
        return "\n".join(lines)

    def to_json(self) -> str:
        data = asdict(self)
        for row, obj in zip(data["rows"], self.rows):
            row["device_total"] = obj.device_total
        return json.dumps(data, indent=2, default=str)


def _row(shape: ModelShape, stage: int, offload: str, num_gpus: int, num_nodes: int, precision: str,
         act: ActivationEstimate) -> EstimateRow:
    p_b, g_b, o_b = _precision_bytes(precision)
    n = num_gpus * num_nodes
    psi, layer = shape.total_params, shape.largest_layer_params
    # Which state is divided by the data-parallel degree: optimizer from stage 1, gradients
    # from stage 2, parameters at stage 3 (the ZeRO paper's Pos, Pos+g, Pos+g+p).
    params = p_b * psi / (n if stage >= 3 else 1)
    grads = g_b * psi / (n if stage >= 2 else 1)
    optimizer = o_b * psi / (n if stage >= 1 else 1)
    host_per_rank = 0.0
    if stage == 3:  # a gathered layer (params, then its full gradient) is live at a time
        params += p_b * layer
        grads += g_b * layer
    if offload in ("optimizer", "optimizer+param"):
        # Optimizer states and the fp32 gradient partition live on the host; the device keeps
        # only reduce buckets (not counted) for gradients.
        host_per_rank += optimizer + (4 * psi / n if p_b < 4 else 0)
        optimizer = 0.0
        grads = g_b * layer if stage == 3 else 0.0
    if offload == "optimizer+param":
        host_per_rank += p_b * psi / n
        params = p_b * layer
    return EstimateRow(stage, offload, int(params), int(grads), int(optimizer), act.device,
                       int(host_per_rank * num_gpus + act.host * num_gpus), None)


def _precision_bytes(precision: str) -> Tuple[int, int, int]:
    if precision not in _PRECISION_BYTES:
        raise ConfigError(f"estimate_memory: precision={precision!r} is not one of "
                          f"{', '.join(_PRECISION_BYTES)}")
    return _PRECISION_BYTES[precision]


def _valid(stage: int, offload: str) -> bool:
    """DeepSpeed offloads optimizer states from stage 1 and parameters only at stage 3."""
    return offload == "none" or (offload == "optimizer" and stage >= 1) or (offload == "optimizer+param" and stage == 3)


def _detected_limits() -> Tuple[Optional[int], Optional[int]]:
    from ..accelerator import get_accelerator
    import psutil
    accel = get_accelerator()
    device = accel.total_memory() if accel.kind != "cpu" else None
    return device, psutil.virtual_memory().total


def estimate_memory(model_or_config: Any, *, num_gpus: int = 1, num_nodes: int = 1,
                    stages: Sequence[int] = (0, 1, 2, 3), offload: Sequence[str] = _OFFLOADS,
                    precision: str = "bf16", micro_batch: int = 1, seq_len: int = 2048,
                    activation_checkpointing: Union[bool, str] = False, device_memory: Optional[int] = None,
                    host_memory: Optional[int] = None, flash_attention: bool = True) -> MemoryEstimate:
    """Bytes per device and per host for each ZeRO stage x offload choice, and what fits.

    ``num_gpus`` is devices per node. ``device_memory`` / ``host_memory`` default to what this
    machine has (device memory stays unknown on a CPU-only machine). Invalid combinations
    (offload at stage 0, parameter offload below stage 3) are left out.
    """
    for name, value in (("num_gpus", num_gpus), ("num_nodes", num_nodes), ("micro_batch", micro_batch),
                        ("seq_len", seq_len)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"estimate_memory: {name} must be a positive integer, got {value!r}")
    bad = [o for o in offload if o not in _OFFLOADS]
    if bad or any(s not in (0, 1, 2, 3) for s in stages):
        raise ConfigError(f"estimate_memory: stages must be within 0-3 and offload within "
                          f"{_OFFLOADS}; got stages={tuple(stages)}, offload={tuple(offload)}")
    _precision_bytes(precision)
    shape = model_shape(model_or_config)
    if device_memory is None or host_memory is None:
        detected_device, detected_host = _detected_limits()
        device_memory = device_memory if device_memory is not None else detected_device
        host_memory = host_memory if host_memory is not None else detected_host
    result = MemoryEstimate(shape, num_gpus, num_nodes, precision, micro_batch, seq_len, activation_checkpointing,
                            device_memory, host_memory)
    act = estimate_activations(shape, micro_batch, seq_len, precision, activation_checkpointing, flash_attention)
    for stage in stages:
        for choice in offload:
            if not _valid(stage, choice):
                continue
            row = _row(shape, stage, choice, num_gpus, num_nodes, precision, act)
            fits = None
            if device_memory is not None:
                fits = row.device_total <= device_memory and (host_memory is None or row.host <= host_memory)
            result.rows.append(EstimateRow(**{**row.__dict__, "fits": fits}))
    return result
