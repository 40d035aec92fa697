"""ZeRO-Inference: ``zero.stage = 3`` + ``offload_param`` in an ``init_inference`` config.

The weights of the decoder layers live off the device (pinned host memory, or NVMe swap files
through ``shardwise.io``), optionally group-quantized to int8/int4 (``weight_quantization``),
and are streamed to the device one layer at a time with a prefetch window
(``streaming.LayerStreamer``); small persistent tensors, the embeddings and the LM head stay on
the device. The section is read under DeepSpeed's inference key ``zero`` or the seed article's
``zero_optimization``. See docs/zero_inference.md.

The engine calls two functions here:

* ``place_model(model, cfg, device, dtype)`` before the fast path is built: without parameter
  offload the whole model goes to ``device``; with it the model stays on the host (in
  ``dtype``), so the fast path fuses its projections there;
* ``attach(model, decoder, cfg, device, dtype)`` once the module is final (int8, fast path):
  builds the ``LayerStreamer`` (None without parameter offload);
* ``offload_kv_cache(decoder, cfg)``: ``kv_offload: true`` puts the fast path's KV cache in
  pinned host memory (``kv_offload.py``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from shardwise.accelerator import get_accelerator
from shardwise.errors import ConfigError
from shardwise.utils.logging import log_dist, warn_once

from .config import InferenceConfig
from .streaming import LayerStreamer, StreamSettings
from .weight_store import CheckpointTensors, LayerWeights


def host_device(cfg: InferenceConfig, device: torch.device) -> torch.device:
    """Where weights are loaded/placed before streaming starts (the host with offload)."""
    return torch.device("cpu") if cfg.wants_param_offload else device


def layerwise_checkpoint(model: nn.Module, cfg: InferenceConfig) -> Optional[CheckpointTensors]:
    """For a meta model with parameter offload and a Hugging Face safetensors ``checkpoint``:
    random access to its tensors, so ``attach`` reads one layer at a time (the model is never
    whole in host memory). None otherwise (the engine loads the checkpoint to the host first)."""
    if not cfg.wants_param_offload or cfg.checkpoint is None or isinstance(cfg.checkpoint, dict):
        return None
    if not any(p.is_meta for p in model.parameters()):
        return None
    from pathlib import Path

    from .loading import _safetensor_files
    root = Path(cfg.base_dir) / cfg.checkpoint if cfg.base_dir else Path(cfg.checkpoint)
    files = _safetensor_files(root) if root.is_dir() else []
    return CheckpointTensors([str(f) for f in files]) if files else None


def _check(cfg: InferenceConfig) -> None:
    if cfg.tp_size > 1:
        raise ConfigError(f"zero.offload_param (ZeRO-Inference) with tensor_parallel.tp_size = "
                          f"{cfg.tp_size} is not supported: use tp_size 1 with offload, or drop "
                          f"offload_param to run AutoTP.")
    if cfg.zero.offload_param.device == "nvme" and not cfg.zero.offload_param.nvme_path:
        raise ConfigError("zero.offload_param.device is \"nvme\" but nvme_path is not set.")


def settings_from(cfg: InferenceConfig) -> StreamSettings:
    """The streaming settings a config asks for."""
    z, off = cfg.zero, cfg.zero.offload_param
    return StreamSettings(
        persistence_threshold=int(z.param_persistence_threshold),
        max_live_parameters=int(z.max_live_parameters),
        prefetch_bucket_size=int(z.prefetch_bucket_size),
        quant=cfg.weight_quantization.spec(),
        nvme_path=off.nvme_path if off.device == "nvme" else None,
        pin_memory=bool(off.pin_memory) or off.device == "nvme",
        aio_kwargs=cfg.aio.handle_kwargs(),
        rank=dist.get_rank() if _distributed() else 0,
        world=dist.get_world_size() if _distributed() else 1)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def place_model(model: nn.Module, cfg: InferenceConfig, device: torch.device,
                dtype: Optional[torch.dtype]) -> nn.Module:
    """Put ``model`` where inference runs: on ``device``, or on the host for ZeRO-Inference."""
    if cfg.wants_param_offload:
        _check(cfg)
    elif cfg.weight_quantization.quantized_initialization is not None:
        raise ConfigError("weight_quantization.quantized_initialization quantizes the weights "
                          "ZeRO-Inference streams; it needs \"zero\": {\"stage\": 3, "
                          "\"offload_param\": {\"device\": \"cpu\" or \"nvme\"}}. For int8 "
                          "weights on the device use \"dtype\": \"int8\".")
    if dtype is not None:
        model = model.to(dtype=dtype)
    if any(p.is_meta for p in model.parameters()):
        return model  # ZeRO-Inference reads its weights layer by layer in attach()
    return model.to(host_device(cfg, device))


def attach(model: nn.Module, decoder: Optional[nn.Module], cfg: InferenceConfig,
           device: torch.device, dtype: torch.dtype,
           checkpoint: Optional[LayerWeights] = None) -> Optional[LayerStreamer]:
    """Start streaming ``model``'s decoder layers (None without parameter offload); a meta
    model's weights come from ``checkpoint`` (``layerwise_checkpoint``), one layer at a time."""
    if not cfg.wants_param_offload:
        return None
    if decoder is not None:  # hooks run in Python: the decode step stays eager
        decoder._step, decoder._graphs = decoder.step, False
    streamer = LayerStreamer(model, decoder, device, settings_from(cfg), dtype, checkpoint)
    quant = streamer.settings.quant
    log_dist(f"ZeRO-Inference: {len(streamer.images)} layers streamed from "
             f"{cfg.zero.offload_param.device}"
             f"{f' as int{quant.num_bits} (groups of {quant.group_size})' if quant else ''}, "
             f"{streamer.bytes_per_pass / 2**20:.1f} MiB per forward pass, prefetch window "
             f"{streamer.window}")
    return streamer


def offload_kv_cache(decoder: Optional[nn.Module], cfg: InferenceConfig) -> None:
    """``kv_offload: true``: the fast path's KV cache goes to pinned host memory
    (``kv_offload.OffloadedKVCache``); its decode step runs eagerly (the per-layer copies are
    Python). Without the fast path there is nothing to offload: said once."""
    if not cfg.kv_offload:
        return
    if decoder is None:
        warn_once("kv_offload: the KV cache is offloaded by the fast decode path "
                  "(replace_with_kernel_inject=True on a supported decoder); this engine runs "
                  "Hugging Face generate, whose cache stays on the device.")
        return
    decoder.kv_offload = True
    decoder._step, decoder._graphs = decoder.step, False
    log_dist("ZeRO-Inference: KV cache in pinned host memory (kv_offload), streamed to the "
             "device one layer ahead")


def _free_bytes(device: torch.device) -> int:
    """Bytes a batch may still take: the device's free memory plus what torch's caching
    allocator holds unused (the host's available memory on CPU)."""
    if device.type != "cuda":
        import psutil
        return int(psutil.virtual_memory().available)
    free, _ = get_accelerator().mem_get_info(device)
    return int(free) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def bytes_per_sequence(config: object, prompt_tokens: int, new_tokens: int,
                       dtype: torch.dtype, kv_offload: bool = False) -> int:
    """Device bytes one more sequence costs: its static KV cache (cache length rounded up
    to 128 as the fast path does; with ``kv_offload`` only the two layers' device slots)
    plus the prefill's largest activations and fp32 logits."""
    from .decode import ROUND
    hidden = int(getattr(config, "hidden_size"))
    heads = int(getattr(config, "num_attention_heads"))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    layers = int(getattr(config, "num_hidden_layers"))
    inter = int(getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", 4 * hidden))
    vocab = int(getattr(config, "vocab_size"))
    size = torch.empty((), dtype=dtype).element_size()
    length = -(-(prompt_tokens + new_tokens) // ROUND) * ROUND
    cache = 2 * (2 if kv_offload else layers) * kv_heads * head_dim * length * size
    prefill = prompt_tokens * (4 * hidden + 3 * inter + (heads + 2 * kv_heads) * head_dim) * size
    return cache + prefill + 2 * vocab * 4


def auto_batch_size(engine: nn.Module, prompt_tokens: int, new_tokens: int,
                    headroom: float = 0.9) -> int:
    """The largest batch whose KV cache and activations fit next to the streamed model
    (ZeRO-Inference's ``max_batch_size="auto"``): free device memory now (slots and resident
    weights already allocated) x ``headroom`` / ``bytes_per_sequence``; at least 1."""
    kv_offload = bool(getattr(getattr(engine, "decoder", None), "kv_offload", False))
    per_seq = bytes_per_sequence(engine.module.config, prompt_tokens, new_tokens, engine.dtype,
                                 kv_offload)
    return max(1, int(_free_bytes(engine.device) * headroom) // per_seq)
