"""``HybridEngine``: DeepSpeed's RLHF Hybrid Engine — one engine that trains and generates.

``initialize`` returns it instead of a ``ShardwiseEngine`` when ``hybrid_engine.enabled`` is
set. Training is unchanged (same strategy, same ZeRO layout). ``generate`` switches to the
inference layout for one call:

1. gather: under ZeRO stage 3 the sharded weights are gathered once per call
   (``GatheredParameters`` over all layers, or ``tp_gather_partition_size`` layers at a time
   with ``pin_parameters: false``), never once per token;
2. remap: the first call builds the inference copy (``hybrid_weights.InferenceCopy``: the fast
   decode path's fused q/k/v and gate/up projections, static KV cache of ``max_out_tokens``,
   on CUDA a compiled decode step replayed as CUDA graphs); every later call copies the
   current training weights into it in place, so generation always sees the weights after
   the last optimizer step and compiled graphs stay valid. LoRA adapters are fused into the
   copy; the training weights stay unfused;
3. release: the gathered training values are released before decoding starts; the copy
   (weights + KV cache) is kept for the next call, or freed after each call with
   ``release_inference_cache: true`` so training memory is exactly what it was;
4. decode: the whole generation runs on the copy.

With ``inference_tp_size`` N > 1, groups of N ranks decode their all-gathered prompts together
on AutoTP shards of the gathered weights (rebuilt per call) and each rank keeps its rows.

Models the fast path does not cover, and ``generate`` settings it does not implement (beam
search, ...), run the module's own Hugging Face ``generate`` inside one
``GatheredParameters`` instead (one warning names why).

DeepSpeed's extras: ``eval()`` prints the iteration's latency breakdown (E2E, gather,
generate, training, others) from the second call on, ``_generate_latency``,
``_gather_latency``, ``_training_latency`` and ``_total_latency`` counters,
``fuse_lora_weight()`` / ``unfuse_lora_weight()``, ``is_lora_fused``.
"""
from __future__ import annotations

import gc
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .. import comm
from ..accelerator import get_accelerator
from ..errors import ConfigError
from ..utils.logging import log_dist, warn_once
from ..inference.options import DecodeOptions
from ..inference.tp import TPPlan, make_plan
from ..zero import GatheredParameters
from .engine import ShardwiseEngine
from .hybrid_weights import OTHER, InferenceCopy, hf_model, lora_layers, lora_params


class HybridEngine(ShardwiseEngine):
    """A training engine with a fast ``generate``; see the module docstring."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        he = self.config.hybrid_engine
        self._hybrid = he
        self._tp: Optional[TPPlan] = None
        if he.inference_tp_size > 1:  # AutoTP groups of consecutive ranks for generation
            try:
                self._tp = make_plan(he.inference_tp_size)
            except ConfigError as err:
                raise ConfigError(f"hybrid_engine.inference_tp_size = {he.inference_tp_size}: "
                                  f"{err}".replace("tensor_parallel.tp_size", "inference_tp_size")) from None
        self._copy: Optional[InferenceCopy] = None
        self._fast_reason: Optional[str] = None
        # DeepSpeed's performance counters (seconds)
        self._t_start: Optional[float] = None
        self._total_latency = 0.0
        self._iters = 0
        self._training_start_time: Optional[float] = None
        self._generate_latency = 0.0
        self._training_latency = 0.0
        self._gather_latency = 0.0
        self._total_batch_size: Optional[int] = None
        self.is_lora_fused = False
        self.generate_stats: Dict[str, float] = {}
        """Ours: the last ``generate``'s gather_s, decode_s, new_tokens and copy_bytes."""
        self.decode_options: Optional[DecodeOptions] = None
        """Ours: how the inference copy's compiled decode step is built (``DecodeOptions``;
        None: its defaults). Read when the copy is built, i.e. before the first ``generate``."""

    # --- the switch: gather, build or refresh the inference copy --------------------------
    def _all_params(self) -> List[torch.nn.Parameter]:
        return list(self.module.parameters())

    def _group_batches(self, copy: InferenceCopy) -> List[List[int]]:
        if self._hybrid.pin_parameters:
            return [copy.groups]
        layers = [g for g in copy.groups if g != OTHER]
        size = self._hybrid.tp_gather_partition_size
        return [[OTHER]] + [layers[i:i + size] for i in range(0, len(layers), size)]

    def _refresh(self, copy: InferenceCopy) -> None:
        for batch in self._group_batches(copy):
            params = {id(p): p for g in batch for p in copy.params_of(g)}
            with GatheredParameters(list(params.values())):
                for g in batch:
                    copy.refresh(g)

    def _inference_copy(self) -> Optional[InferenceCopy]:
        """The copy holding the current weights (built on first use); None: not supported."""
        if self._fast_reason is not None:
            return None
        if self._copy is not None and self._tp is None:
            self._refresh(self._copy)
            return self._copy
        from ..inference.arch import Unsupported
        self._copy = None  # under AutoTP the shards are rebuilt per call
        try:
            with GatheredParameters(self._all_params()):
                self._copy = InferenceCopy.build(self.module, self._hybrid.max_out_tokens, self._tp)
        except ConfigError as err:
            raise ConfigError(str(err).replace("tensor_parallel.tp_size",
                                               "hybrid_engine.inference_tp_size")) from None
        except Unsupported as why:
            self._fast_reason = str(why)
            warn_once(f"hybrid_engine: the fast decode path does not support this model ({why}); "
                      f"generate() gathers the weights once per call and runs the module's own "
                      f"Hugging Face generate.")
            return None
        if self.decode_options is not None:
            self._copy.decoder.set_options(self.decode_options)
        if self.device.type == "cuda" and self._tp is None:
            self._copy.decoder.compile_step(cuda_graph=True)
        log_dist(f"hybrid_engine: inference copy built ({self._copy.nbytes() / 2**20:.1f} MiB, "
                 f"{self._copy.decoder.spec.family} layout, max_out_tokens "
                 f"{self._hybrid.max_out_tokens})", ranks=[0])
        return self._copy

    def release_inference_copy(self) -> None:
        """Free the inference copy (weights and KV cache); the next ``generate`` rebuilds it."""
        self._copy = None
        gc.collect()
        get_accelerator().empty_cache()

    # --- generate ---------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, *inputs: Any, **kwargs: Any) -> torch.Tensor:
        """Hugging Face's ``generate`` on the current training weights (module docstring)."""
        ids = inputs[0] if inputs else kwargs.pop("input_ids", kwargs.pop("inputs", None))
        if ids is None:
            raise ConfigError("HybridEngine.generate() needs input_ids (a (batch, length) tensor)")
        ids = ids.to(self.device)
        kwargs = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v)
                  for k, v in kwargs.items()}
        if self._total_batch_size is None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            self._total_batch_size = ids.shape[0] * world
        t0 = time.perf_counter()
        copy = self._inference_copy() if not inputs[1:] else None
        self._gather_latency = time.perf_counter() - t0
        out = None
        if copy is not None:
            out = (self._fast_generate(copy, ids, kwargs) if self._tp is None
                   else self._tp_generate(copy, ids, kwargs))
        if out is None:
            with GatheredParameters(self._all_params()):
                out = self.module.generate(ids, *inputs[1:], **kwargs)
        if self._hybrid.release_inference_cache or self._tp is not None:
            self.release_inference_copy()  # (AutoTP shards are rebuilt per call anyway)
        self._generate_latency = time.perf_counter() - t0 - self._gather_latency
        self.generate_stats = {"gather_s": self._gather_latency, "decode_s": self._generate_latency,
                               "new_tokens": float(out.shape[1] - ids.shape[1]),
                               "copy_bytes": float(copy.nbytes() if copy is not None else 0),
                               "tp_size": float(self._tp.size if self._tp is not None else 1),
                               "proj_rows": float(copy.decoder.blocks[0].qkv.weight.shape[0]
                                                  if copy is not None else 0)}
        return out

    def _fast_generate(self, copy: InferenceCopy, ids: torch.Tensor,
                       kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
        from ..inference.decode import decode_loop
        from ..inference.generation import resolve
        model = hf_model(self.module)
        plan = resolve(model, ids, kwargs)
        if plan.fallback:
            warn_once(f"hybrid_engine: generate with {plan.fallback} is not implemented by the "
                      f"fast decode path; such calls run the module's own Hugging Face generate.")
            return None
        stopping = plan.stopping
        if stopping is not None and not callable(stopping):
            from transformers import StoppingCriteriaList
            stopping = StoppingCriteriaList(list(stopping))
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        dtype = copy.decoder.spec.embed.weight.dtype
        return decode_loop(copy.decoder, ids, mask, plan.max_new, plan.pick, dtype,
                           eos=plan.eos, pad=plan.pad, stopping=stopping, streamer=plan.streamer)

    def _tp_generate(self, copy: InferenceCopy, ids: torch.Tensor,
                     kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
        """AutoTP: the group's prompts decoded together on the sharded copy; this rank's rows."""
        tp = self._tp
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        shape = torch.tensor(ids.shape, device=ids.device)
        shapes = [torch.empty_like(shape) for _ in range(tp.size)]
        comm.all_gather(shapes, shape, group=tp.group)
        if any(not torch.equal(s, shape) for s in shapes):
            raise ConfigError(f"hybrid_engine.inference_tp_size = {tp.size}: every rank of a "
                              f"tensor-parallel group must pass prompts of the same shape; got "
                              f"{[tuple(s.tolist()) for s in shapes]}. Pad the prompts to one length "
                              f"and use the same batch size on every rank.")
        all_ids = [torch.empty_like(ids) for _ in range(tp.size)]
        all_mask = [torch.empty_like(mask) for _ in range(tp.size)]
        comm.all_gather(all_ids, ids.contiguous(), group=tp.group)
        comm.all_gather(all_mask, mask.contiguous(), group=tp.group)
        seed = torch.randint(0, 2**62, (1,), device=ids.device)  # one sampling stream per group
        comm.broadcast(seed, src=dist.get_global_rank(tp.group, 0) if tp.group is not None else 0,
                       group=tp.group)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(int(seed))
            group_kwargs = dict(kwargs, attention_mask=torch.cat(all_mask))
            out = self._fast_generate(copy, torch.cat(all_ids), group_kwargs)
        if out is None:
            return None
        b = ids.shape[0]
        return out[tp.rank * b:(tp.rank + 1) * b]

    # --- LoRA -----------------------------------------------------------------------------------
    def _merge_lora(self, merge: bool) -> None:
        layers = [layer for _, _, layer in lora_layers(self.module)]
        if not layers:
            return
        params = [p for layer in layers for p in [layer.base_layer.weight] + lora_params(layer)]
        stage3 = self.zero_optimization_stage() == 3
        with GatheredParameters(params, modifier_rank=0 if stage3 else None), torch.no_grad():
            for layer in layers:
                if merge and not layer.merged:
                    layer.merge()
                elif not merge and layer.merged:
                    layer.unmerge()
        if not stage3 and self.strategy is not None:
            self.refresh_after_load(weights_only=True)  # the masters follow the edited weights
        self.is_lora_fused = merge

    def fuse_lora_weight(self) -> None:
        """Merge the active LoRA adapters into the training base weights in place (DeepSpeed's
        name). ``generate`` does not need it: it fuses into its inference copy only."""
        self._merge_lora(True)

    def unfuse_lora_weight(self) -> None:
        """Undo ``fuse_lora_weight`` (subtracts the adapters' delta again)."""
        self._merge_lora(False)

    # --- DeepSpeed's latency bookkeeping ---------------------------------------------------------
    def eval(self) -> "HybridEngine":
        now = time.perf_counter()
        if self._t_start is not None:
            latency = now - self._t_start
            self._total_latency += latency
            self._iters += 1
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(self._latency_line(latency), flush=True)
        self._t_start = now
        self._training_latency = 0.0
        return super().eval()

    def _latency_line(self, latency: float) -> str:
        def pct(x: float) -> str:
            return f"{x:.2f}s ({x / latency * 100:.2f}%)" if latency > 0 else f"{x:.2f}s"
        others = latency - self._generate_latency - self._training_latency - self._gather_latency
        line = (f"|E2E latency={latency:.2f}s |Gather latency={pct(self._gather_latency)} "
                f"|Generate time={pct(self._generate_latency)} "
                f"|Training time={pct(self._training_latency)} |Others={pct(others)}")
        if self._total_batch_size is not None and latency > 0:
            avg = self._total_latency / self._iters
            line += (f" |CurSamplesPerSec={self._total_batch_size / latency:.2f} "
                     f"|AvgSamplesPerSec={self._total_batch_size / avg:.2f}")
        return line

    def train(self, mode: bool = True) -> "HybridEngine":
        super().train(mode)
        if mode:
            self._training_start_time = time.perf_counter()
        return self

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        super().step(lr_kwargs=lr_kwargs)
        if self._training_start_time is not None:
            now = time.perf_counter()
            self._training_latency += now - self._training_start_time
            self._training_start_time = now

    def destroy(self) -> None:
        """DeepSpeed's ``engine.destroy()``, and the inference copy is freed."""
        self._copy = None
        super().destroy()

    def __repr__(self) -> str:
        return "Hybrid" + super().__repr__()
