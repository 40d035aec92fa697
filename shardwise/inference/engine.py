"""``InferenceEngine``: the module placed, converted, optionally sharded/quantized, plus the
fast decode path; ``init_inference`` builds it (DeepSpeed's signature).

The engine exposes ``module`` (the Hugging Face model), ``generate`` (Hugging Face's
signature), ``forward`` / ``__call__`` and ``dtype``. With kernel injection (or tensor
parallelism) and a supported decoder, ``generate`` runs ``decode.decode_loop`` on the static
cache; anything the fast path does not cover runs the module's own ``generate``, with one
warning naming the part.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Optional

import torch
from torch import nn

from shardwise.accelerator import get_accelerator
from shardwise.errors import ConfigError
from shardwise.utils.logging import log_dist, warn_once

from .arch import Unsupported, describe_model
from .config import DTYPES, InferenceConfig, load_inference_config
from .decode import FastDecoder, decode_loop, hf_positions
from .generation import resolve
from .loading import load_into
from .quant import quantize_linears
from .tp import TPPlan, make_plan
from .weight_store import LayerWeights
from .zero_inference import (attach, host_device, layerwise_checkpoint, offload_kv_cache,
                             place_model)


def _device(plan: TPPlan) -> torch.device:
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        return torch.device("cpu")
    import os
    return acc.device(int(os.environ.get("LOCAL_RANK", "0")))


def _compute_dtype(cfg: InferenceConfig, model: nn.Module, device: torch.device) -> Optional[torch.dtype]:
    """The activation/weight dtype; None keeps the model's own."""
    if device.type == "cpu" and not cfg.dtype_given:
        warn_once("init_inference: dtype not given; on CPU the model keeps its own dtype "
                  "(DeepSpeed's fp16 default is meant for GPUs). Pass dtype=\"bf16\"/\"fp16\" to convert.")
        return None
    if cfg.int8:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[cfg.dtype]


class InferenceEngine(nn.Module):
    """A model ready for inference; see the module docstring."""

    def __init__(self, model: nn.Module, config: InferenceConfig,
                 layer_weights: Optional[LayerWeights] = None) -> None:
        """``layer_weights``: with ZeRO-Inference, where a meta model's weights come from
        layer by layer (default: the config's safetensors ``checkpoint``); e.g.
        ``weight_store.RandomWeights()`` for benchmarks."""
        super().__init__()
        start = time.perf_counter()
        self._config = config
        self.plan = make_plan(config.tp_size, config.tensor_parallel.tp_group,
                              config.tensor_parallel.mpu)
        self.device = _device(self.plan)
        self.dtype = _compute_dtype(config, model, self.device)
        if layer_weights is not None and not config.wants_param_offload:
            raise ConfigError("layer_weights fills a meta model layer by layer while ZeRO-Inference "
                              "streams it; it needs \"zero\": {\"stage\": 3, \"offload_param\": "
                              "{\"device\": \"cpu\" or \"nvme\"}} in the config.")
        layerwise = layer_weights if layer_weights is not None \
            else layerwise_checkpoint(model, config)  # ZeRO-Inference reads it per layer
        if layerwise is not None and config.int8:
            raise ConfigError("dtype \"int8\" quantizes a model's weights in place once they are "
                              "loaded, but this ZeRO-Inference model is filled layer by layer from "
                              "its checkpoint as it streams (a meta model with zero stage 3 + "
                              "offload_param), so there is nothing to quantize up front. For int8 "
                              "weights streamed this way use \"weight_quantization\": "
                              "{\"quantized_initialization\": {\"num_bits\": 8, \"group_size\": 64}} "
                              "with dtype \"bf16\" or \"fp16\"; or build the model with real "
                              "weights (not on meta) to keep dtype \"int8\".")
        if config.checkpoint is not None and layerwise is None:
            load_into(model, config.checkpoint, config.base_dir, host_device(config, self.device),
                      self.dtype)
        model = place_model(model.eval(), config, self.device, self.dtype)
        self.dtype = self.dtype or next(model.parameters()).dtype
        if config.int8:
            quantize_linears(model, self.dtype, head=config.quant.lm_head)
        self.module = model
        self.decoder: Optional[FastDecoder] = None
        self.fast_path_reason: Optional[str] = None
        if config.replace_with_kernel_inject or self.plan.active:
            self.rebuild_fast_path()
        self._note_cuda_graph()
        self.streamer = attach(model, self.decoder, config, self.device, self.dtype, layerwise)
        offload_kv_cache(self.decoder, config)
        if self.streamer is not None and self.decoder is not None:
            mismatch = self._probe(self.decoder)  # on the device, layers streamed
            if mismatch:
                self.decoder, self.fast_path_reason = None, mismatch
                warn_once(f"replace_with_kernel_inject: the fast decode path does not reproduce "
                          f"this model ({mismatch}); it runs as a plain module with Hugging Face "
                          f"generate.")
        self.stats: Dict[str, float] = {"build_s": time.perf_counter() - start}

    # --- the fast path -------------------------------------------------------------------
    @property
    def cuda_graph(self) -> bool:
        """Whether decode steps are captured in CUDA graphs (on by default on CUDA with injection)."""
        graph = self._config.enable_cuda_graph
        return self.device.type == "cuda" and (graph is None or bool(graph))

    def _note_cuda_graph(self) -> None:
        if not self._config.enable_cuda_graph:
            return
        if self.device.type != "cuda":
            warn_once("enable_cuda_graph: no CUDA device; the decode path runs eagerly.")
        elif self.decoder is None:
            warn_once("enable_cuda_graph applies to the fast decode path "
                      "(replace_with_kernel_inject=True on a supported model); this engine runs "
                      "the plain module without graphs.")
        elif self._config.wants_param_offload or self._config.kv_offload:
            warn_once("enable_cuda_graph: not used with ZeRO-Inference offload_param / kv_offload "
                      "(the decode step copies layers from Python hooks, so it runs eagerly).")
        elif self.plan.active:
            warn_once("enable_cuda_graph: not used with tensor parallelism (the decode step is "
                      "compiled without CUDA graphs, as DeepSpeed does not graph TP either).")

    def rebuild_fast_path(self) -> None:
        """(Re)build the fused / sharded projections from the module's current weights.

        Needed after replacing the module's parameter objects (in-place updates such as
        ``load_state_dict`` are seen without it: the module's weights are views of the fused ones).
        """
        self.decoder = None
        try:
            spec = describe_model(self.module, self._config.max_out_tokens)
        except Unsupported as why:
            self.fast_path_reason = str(why)
            if self.plan.active:
                raise ConfigError(f"tensor_parallel.tp_size = {self.plan.size}: AutoTP needs a "
                                  f"decoder layout it recognises, but {why}. Use tp_size 1, or "
                                  f"pass injection_policy for this model.") from None
            warn_once(f"replace_with_kernel_inject: the fast decode path does not support this "
                      f"model ({why}); it runs as a plain module with Hugging Face generate.")
            return
        intermediate = spec.layers[0].up.weight.shape[0]
        self.plan.check(spec.n_heads, spec.n_kv_heads, intermediate)
        decoder = FastDecoder(spec, self.plan, self._config.max_out_tokens)
        if not self.plan.active and not self._config.wants_param_offload:  # streamed: after attach
            mismatch = self._probe(decoder)
            if mismatch:
                self.fast_path_reason = mismatch
                warn_once(f"replace_with_kernel_inject: the fast decode path does not reproduce "
                          f"this model ({mismatch}); it runs as a plain module with Hugging Face "
                          f"generate.")
                return
        self.decoder = decoder
        eager = self._config.wants_param_offload or self._config.kv_offload  # Python per layer
        if self.device.type == "cuda" and not eager:
            self.decoder.compile_step(self.cuda_graph and not self.plan.active)
        log_dist(f"init_inference: fast decode path for the {spec.family} layout "
                 f"({len(spec.layers)} layers, tp={self.plan.size}, dtype={self.dtype}, "
                 f"cuda_graph={self.cuda_graph and not self.plan.active and not eager})")

    @torch.no_grad()
    def _probe(self, decoder: FastDecoder) -> Optional[str]:
        """Compare the fast prefill with the module's forward on 8 tokens; a text if they differ.

        Catches what the structure does not show (e.g. an embedding scaled inside forward).
        """
        vocab = decoder.embed.weight.shape[0]
        device = decoder.embed.weight.device
        ids = (torch.arange(8, device=device) * 7 + 3).remainder(vocab)[None]
        mask = torch.ones_like(ids)
        decoder.ensure_cache(1, 8, self.dtype, device)
        fast = decoder.prefill(ids, mask, hf_positions(mask), all_logits=True).float()
        decoder.cache = None
        ref = self.module(ids, attention_mask=mask).logits.float()
        err = ((fast - ref).norm() / ref.norm().clamp(min=1e-6)).item()
        # a real mismatch (a missed scale, norm or activation) is O(1); rounding is far below
        limit = 1e-3 if self.dtype == torch.float32 and not self._config.int8 else 0.1
        if not err <= limit:
            return f"its logits differ from the module's forward by {err:.2e} (relative; limit {limit:g})"
        return None

    # --- forward -------------------------------------------------------------------------
    def _to_device(self, value: Any) -> Any:
        return value.to(self.device) if isinstance(value, torch.Tensor) else value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward (under TP: the sharded decoder's full-sequence logits)."""
        args = tuple(self._to_device(a) for a in args)
        kwargs = {k: self._to_device(v) for k, v in kwargs.items()}
        if self.plan.active:
            return self._sharded_forward(*args, **kwargs)
        with torch.no_grad():
            return self.module(*args, **kwargs)

    @torch.no_grad()
    def _sharded_forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                         **unused: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutput
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        self.decoder.ensure_cache(input_ids.shape[0], input_ids.shape[1], self.dtype, self.device)
        logits = self.decoder.prefill(input_ids, mask, hf_positions(mask), all_logits=True)
        return CausalLMOutput(logits=logits)

    # --- generate ------------------------------------------------------------------------
    def _attention_mask(self, ids: torch.Tensor, kwargs: Dict[str, Any]) -> torch.Tensor:
        mask = kwargs.get("attention_mask")
        if mask is not None:
            return mask
        gen = getattr(self.module, "generation_config", None)
        pad, eos = getattr(gen, "pad_token_id", None), getattr(gen, "eos_token_id", None)
        eos = [eos] if isinstance(eos, int) else (eos or [])
        if pad is not None and pad not in eos and bool((ids == pad).any()):
            return (ids != pad).long()
        return torch.ones_like(ids)

    @torch.no_grad()
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Hugging Face's ``generate``; the fast path for greedy/sampling when available."""
        ids = args[0] if args else kwargs.pop("input_ids", None)
        if ids is None:
            ids = kwargs.pop("inputs", None)
        kwargs = {k: self._to_device(v) for k, v in kwargs.items()}
        ids = self._to_device(ids)
        if self.decoder is None:
            return self.module.generate(ids, *args[1:], **kwargs)
        plan = resolve(self.module, ids, kwargs)
        if plan.fallback or args[1:]:
            reason = plan.fallback or "positional generate arguments"
            if self.plan.active:
                raise ConfigError(f"generate with {reason} is not supported under tensor "
                                  f"parallelism (the fast path does greedy and sampling only).")
            warn_once(f"generate: {reason} is not implemented by the fast decode path; this "
                      f"call uses the module's own Hugging Face generate.")
            return self.module.generate(ids, *args[1:], **kwargs)
        stopping = plan.stopping
        if stopping is not None and not callable(stopping):
            from transformers import StoppingCriteriaList
            stopping = StoppingCriteriaList(list(stopping))
        mask = self._attention_mask(ids, kwargs).to(self.device)
        return decode_loop(self.decoder, ids, mask, plan.max_new, plan.pick, self.dtype,
                           eos=plan.eos, pad=plan.pad, stopping=stopping, streamer=plan.streamer)


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """Wrap ``model`` for inference (DeepSpeed's ``init_inference``).

    ``config``: a dict, a JSON file path or None; ``kwargs``: the same keys (merged with
    ``config``; one key given both ways with different values is an error).
    """
    cfg = load_inference_config(config, **kwargs)
    return InferenceEngine(model, cfg)
