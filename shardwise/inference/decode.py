"""The fast decode path ("kernel injection"), in one file: gpt-fast's shape on HF weights.

``FastDecoder`` is built once from a ``DecoderSpec`` (``arch.py``): it reuses the Hugging
Face module's embeddings, norms, activations and rotary tables, and holds the projections as
``Proj`` layers (fused q/k/v and gate/up, optionally sharded by AutoTP, optionally int8).

    prefill(ids, mask)      one call over the whole (left-padded) prompt, SDPA attention,
                            fills the static KV cache, returns the last position's logits
    step(tok, pos, ...)     one token per sequence with fixed shapes: writes the cache at
                            ``pos``, attends over the whole cache under a mask, returns
                            logits for that position only; compiled with torch.compile and
                            replayed as a CUDA graph when asked (``compile_step``)
    generate(...)           prefill, then step until max_new_tokens / EOS / stopping criteria

The static cache is preallocated per (batch size, cache length) bucket; the length is the
prompt plus new tokens rounded up to 128 and at most ``max_out_tokens``. Positions follow
Hugging Face's ``generate`` (cumulative sum of the attention mask), so tokens equal the
plain model's ``generate`` on CPU in fp32.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.accelerator import get_accelerator
from shardwise.accelerator.graphs import GraphedCallable
from shardwise.errors import ConfigError

from .arch import DecoderSpec, LayerSpec
from .layers import (Proj, column_parallel, flex_attention_available,
                     flex_decode_attention, head_rows, reduction_attention,
                     row_parallel, split_kv_attention)
from .options import DecodeOptions, decode_attention_kind, regional_compile
from .quant import WeightOnlyInt8Linear, int8pack_available
from .tp import TPPlan

ROUND = 128  # cache lengths are rounded up to this, so few shapes get compiled
EOS_LAG = 4  # with EOS / stopping criteria, the host looks at "all finished" this many steps late


class StaticCache(nn.Module):
    """Per-layer K and V buffers of shape (batch, kv_heads, length, head_dim)."""

    def __init__(self, n_layers: int, batch: int, kv_heads: int, length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = (batch, kv_heads, length, head_dim)
        for i in range(n_layers):
            self.register_buffer(f"k{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"v{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.batch, self.length, self.dtype, self.device = batch, length, dtype, device

    def kv(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"k{i}"), getattr(self, f"v{i}")

    # the pass protocol of kv_offload.OffloadedKVCache (nothing to move here)
    def begin_pass(self, prompt: Optional[int]) -> None:
        pass

    def written(self, i: int) -> None:
        pass

    def end_pass(self) -> None:
        pass


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos/sin: (B, T, R) with R <= D (partial rotary keeps the rest)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, keep = x[..., :r], x[..., r:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, keep), dim=-1)


class Block(nn.Module):
    """One decoder layer: attention over the static cache, then the MLP."""

    def __init__(self, spec: DecoderSpec, layer: LayerSpec, plan: TPPlan) -> None:
        super().__init__()
        self.heads = spec.n_heads // plan.size
        self.kv_heads = spec.n_kv_heads // plan.size
        self.head_dim, self.layout = spec.head_dim, spec.qkv_layout
        self.attn_norm, self.mlp_norm = layer.attn_norm, layer.mlp_norm
        self.q_norm, self.k_norm = layer.q_norm, layer.k_norm
        self.act = layer.act
        self.pre_norm, self.parallel = spec.pre_norm, spec.parallel_residual
        self.scale = spec.attn_scale
        self.prescale_q = spec.prescale_q
        self.decode_attention = "auto"  # DecodeOptions.attention (CUDA decode steps)
        self.act_epilogue = False  # DecodeOptions.act_epilogue (reduction GEMVs)
        self.sms = 0  # the SM count of the weights' GPU (set_options); 0: never split
        self.qkv = self._qkv(spec, layer, plan)
        self.o = row_parallel(layer.o, plan.chunk(spec.n_heads * spec.head_dim) if plan.active else None, plan)
        if layer.gate is not None:
            rows = [plan.chunk(layer.up.weight.shape[0])] if plan.active else []
            self.up = column_parallel([layer.gate, layer.up], [rows, rows])
        else:
            self.up = column_parallel([layer.up], [[plan.chunk(layer.up.weight.shape[0])] if plan.active else []])
        self.gated = layer.gate is not None
        width = layer.down.weight.shape[1]
        self.down = row_parallel(layer.down, plan.chunk(width) if plan.active else None, plan)

    @staticmethod
    def _qkv(spec: DecoderSpec, layer: LayerSpec, plan: TPPlan) -> Proj:
        d, hq, hkv = spec.head_dim, spec.n_heads, spec.n_kv_heads
        if spec.qkv_layout == "interleaved":  # GPT-NeoX: rows are [q k v] per head
            return column_parallel(layer.qkv, [head_rows(hq, d, plan, per_head=3)])
        if len(layer.qkv) == 3:
            return column_parallel(layer.qkv, [head_rows(hq, d, plan), head_rows(hkv, d, plan),
                                               head_rows(hkv, d, plan)])
        rows = head_rows(hq, d, plan) + head_rows(hkv, d, plan, hq * d) + \
            head_rows(hkv, d, plan, (hq + hkv) * d)
        return column_parallel(layer.qkv, [rows])

    def _split(self, qkv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = qkv.shape
        d = self.head_dim
        if self.layout == "interleaved":
            q, k, v = qkv.view(b, t, self.heads, 3 * d).chunk(3, dim=-1)
            return q, k, v
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        return q.view(b, t, self.heads, d), k.view(b, t, self.kv_heads, d), v.view(b, t, self.kv_heads, d)

    def attention(self, x: torch.Tensor, rope: Optional[Tuple[torch.Tensor, torch.Tensor]],
                  cache: Tuple[torch.Tensor, torch.Tensor], pos: Optional[torch.Tensor],
                  mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Prefill when ``pos`` is None (attend to the new keys), else one cached step."""
        b, t, _ = x.shape
        q, k, v = self._split(self.qkv(x))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        scale = self.scale
        if self.prescale_q:
            q, scale = q * (self.head_dim ** -0.5), 1.0
        k_cache, v_cache = cache
        if pos is None:
            k_cache[:, :, :t] = k
            v_cache[:, :, :t] = v
            keys, values = k, v
        else:  # the mask covers the visible prefix: the whole cache, or kv_bucket's rounding
            k_cache.index_copy_(2, pos, k)
            v_cache.index_copy_(2, pos, v)
            seen = k_cache.shape[2] if mask is None else mask.shape[-1]
            keys, values = k_cache[:, :, :seen], v_cache[:, :, :seen]
        g = self.heads // self.kv_heads
        if pos is None:  # prefill: K/V repeated per query head, causal (flash) when unpadded
            if g > 1:
                keys, values = keys.repeat_interleave(g, dim=1), values.repeat_interleave(g, dim=1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                                 is_causal=mask is None and t > 1)
        else:  # decode, GQA without copying K/V: a KV head's G query heads become G query rows
            q = q.reshape(b, self.kv_heads, g * t, self.head_dim)
            kind = decode_attention_kind(self.decode_attention if q.is_cuda else "sdpa",
                                         b * self.kv_heads, keys.shape[2], self.sms)
            if kind == "split":
                out = split_kv_attention(q, keys, values, mask, scale)
            elif kind == "reduction" and torch.compiler.is_compiling():
                out = reduction_attention(q, keys, values, mask, scale)
            elif kind == "flex" and torch.compiler.is_compiling():
                out = flex_decode_attention(q, keys, values, mask, scale)
            else:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        out = out.reshape(b, self.heads, t, self.head_dim).transpose(1, 2).reshape(b, t, -1)
        return self.o(out)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.down(self.act(self.up(x)))
        if self.act_epilogue and self.up.reduces(x):
            gate, up = self.up.halves(x)
        else:
            gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)

    def forward(self, x, rope, cache, pos, mask):
        if self.parallel:
            return x + self.attention(self.attn_norm(x), rope, cache, pos, mask) + self.mlp(self.mlp_norm(x))
        if self.pre_norm:
            x = x + self.attention(self.attn_norm(x), rope, cache, pos, mask)
            return x + self.mlp(self.mlp_norm(x))
        x = self.attn_norm(x + self.attention(x, rope, cache, pos, mask))  # OPT-350m: post-norm
        return self.mlp_norm(x + self.mlp(x))


class FastDecoder(nn.Module):
    """The whole decoder over a static KV cache. Build with ``FastDecoder(spec, plan, max_tokens)``."""

    def __init__(self, spec: DecoderSpec, plan: TPPlan, max_tokens: int) -> None:
        super().__init__()
        self.spec, self.plan, self.max_tokens = spec, plan, max_tokens
        self.embed, self.pos_embed, self.pos_offset = spec.embed, spec.pos_embed, spec.pos_offset
        self.project_in, self.project_out = spec.project_in, spec.project_out
        self.blocks = nn.ModuleList(Block(spec, layer, plan) for layer in spec.layers)
        self.final_norm, self.lm_head = spec.final_norm, spec.lm_head
        self.cache: Optional[StaticCache] = None
        self.kv_offload = False
        """Keep the cache in pinned host memory (``kv_offload.OffloadedKVCache``)."""
        # the rotary tables over every cache position, built once; buffers, so a CUDA graph
        # reads them in place (a plain tensor attribute would be copied in before every replay)
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        self.options = DecodeOptions()
        self._step: Callable = self.step
        self._graphs = False

    # --- pieces --------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, x: torch.Tensor):
        if self.spec.rotary is None:
            return None
        if self.rope_cos is None or self.rope_cos.dtype != x.dtype or self.rope_cos.device != x.device:
            ids = torch.arange(self.max_tokens, device=x.device)[None]
            cos, sin = self.spec.rotary(x, ids)
            self.rope_cos, self.rope_sin = cos[0].contiguous(), sin[0].contiguous()
            self._graphs_read_stale_buffers()
        return self.rope_cos[positions], self.rope_sin[positions]

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if self.project_in is not None:
            x = self.project_in(x)
        if self.pos_embed is not None:
            x = x + nn.functional.embedding(positions + self.pos_offset, self.pos_embed.weight)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return self.lm_head(x)

    def _group_rows(self, mask: torch.Tensor) -> torch.Tensor:
        """(B, 1, T, S) -> (B, 1, G*T, S): the same mask for each query head of a KV head."""
        g = self.spec.n_heads // self.spec.n_kv_heads
        return mask if g == 1 else mask.repeat(1, 1, g, 1)

    # --- the cache -----------------------------------------------------------------------
    def ensure_cache(self, batch: int, needed: int, dtype: torch.dtype, device: torch.device) -> int:
        if needed > self.max_tokens:
            raise ConfigError(
                f"prompt + new tokens = {needed} exceeds max_out_tokens = {self.max_tokens} (the "
                f"static KV cache's bound). Raise max_out_tokens in the init_inference config "
                f"(e.g. \"max_out_tokens\": {-(-needed // ROUND) * ROUND}) or generate fewer tokens.")
        length = min(self.max_tokens, -(-needed // ROUND) * ROUND)
        c = self.cache
        if c is None or c.batch != batch or c.length < needed or c.dtype != dtype \
                or c.device != device or getattr(c, "offloaded", False) != self.kv_offload:
            self.cache = None  # free the old one first
            kv_heads = self.spec.n_kv_heads // self.plan.size
            kind = StaticCache
            if self.kv_offload:
                from .kv_offload import OffloadedKVCache as kind
            self.cache = kind(len(self.blocks), batch, kv_heads, length, self.spec.head_dim,
                              dtype, device)
            self._graphs_read_stale_buffers()
        return self.cache.length

    # --- prefill and step ----------------------------------------------------------------
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                all_logits: bool = False) -> torch.Tensor:
        """Run the prompt; fills cache positions [0, T). Returns (B, V) or (B, T, V) logits."""
        b, t = ids.shape
        attn_mask = None
        if not bool(mask.all()):
            keep = mask.bool()[:, None, None, :]
            causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
            attn_mask = (causal & keep) | torch.eye(t, dtype=torch.bool, device=ids.device)
        x = self._embed(ids, positions)
        rope = self._rope(positions, x)
        cache = self.cache
        cache.begin_pass(t)
        for i, block in enumerate(self.blocks):
            # hooks and forward, never a regional compile's code: prompt lengths vary
            x = block._call_impl(x, rope, cache.kv(i), None, attn_mask)
            cache.written(i)
        cache.end_pass()
        return self._logits(x if all_logits else x[:, -1])

    def step(self, ids: torch.Tensor, pos: torch.Tensor, positions: torch.Tensor,
             key_mask: torch.Tensor) -> torch.Tensor:
        """One token per sequence at cache index ``pos``; fixed shapes. Returns (B, V) fp32 logits.

        ``key_mask`` covers the cache positions the step attends to: all of them, or with
        ``DecodeOptions.kv_bucket`` a prefix (its length dynamic to the compiler)."""
        length = key_mask.shape[-1]
        visible = key_mask & (torch.arange(length, device=ids.device) <= pos)
        mask = self._group_rows(visible[:, None, None, :])
        if self.options.kv_bucket and not torch.compiler.is_compiling():
            torch._dynamo.maybe_mark_dynamic(mask, mask.dim() - 1)  # regional: one layer graph, every bucket
        x = self._embed(ids, positions)
        rope = self._rope(positions, x)
        cache = self.cache
        cache.begin_pass(None)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, cache.kv(i), pos, mask)
            cache.written(i)
        cache.end_pass()
        return self._logits(x)[:, -1].float()  # the cast fused into the graph, not a launch more

    def set_options(self, options: DecodeOptions) -> None:
        """Use ``options`` for the next ``compile_step`` (the layers read them at trace time)."""
        device = self.embed.weight.device
        if options.int8 == "int8pack" and not int8pack_available(device.type):
            raise ConfigError(f"DecodeOptions.int8 = 'int8pack' but this torch "
                              f"({torch.__version__}) has no torch._weight_int8pack_mm for "
                              f"{device.type}; use int8='reduction' (the default)")
        if options.attention == "flex" and not flex_attention_available():
            raise ConfigError(f"DecodeOptions.attention = 'flex' but this torch ({torch.__version__}) "
                              f"has no torch.nn.attention.flex_attention (torch >= 2.5); use "
                              f"attention='auto' (the default)")
        self.options = options
        sms = torch.cuda.get_device_properties(device).multi_processor_count \
            if self.embed.weight.is_cuda else 0
        for module in self.modules():
            if isinstance(module, Proj):
                module.reduce_gemv = options.gemv == "reduction"
                module.int8_kernel = options.int8
                module.realize_input = (module.scale is not None if options.realize_inputs == "auto"
                                        else bool(options.realize_inputs))
                module.realize_output = options.realize_outputs
            elif isinstance(module, WeightOnlyInt8Linear):  # an int8 LM head, called as it is
                module.int8_kernel = options.int8
                module.realize_input = options.realize_inputs in ("auto", True)
            elif isinstance(module, Block):
                module.decode_attention = options.attention
                module.act_epilogue = options.act_epilogue
                module.sms = sms

    def compile_step(self, cuda_graph: bool) -> None:
        """Compile ``step`` (fullgraph); with ``cuda_graph`` its replays are CUDA graphs. The
        options are applied again first: the layers read the SM count of the weights' device
        now, after the engine placed them."""
        self.set_options(self.options)
        regional = regional_compile(self.options.regional, self.layer_bytes())
        options = {"triton.cudagraphs": bool(cuda_graph) and not regional,
                   "coordinate_descent_tuning": self.options.coordinate_descent,
                   "max_autotune": self.options.max_autotune, "epilogue_fusion": True}
        int8_head = isinstance(self.lm_head, WeightOnlyInt8Linear)
        for module in (*self.blocks, self.lm_head):
            module._compiled_call_impl = None  # an earlier regional compile
        if regional:
            for block in self.blocks:  # one graph: the blocks share Block.forward's code
                block.compile(fullgraph=True, dynamic=False, options=options)
            if int8_head:  # eager, an int8 head would write its weight out in bf16 every step
                self.lm_head.compile(fullgraph=True, dynamic=False, options=options)
            self._step = GraphedCallable(self.step) if cuda_graph else self.step
            self._graphs = False  # our own graphs: no cudagraph_mark_step_begin
            return
        self._step = torch.compile(self.step, fullgraph=True, dynamic=False, options=options)
        self._graphs = bool(cuda_graph)

    def layer_bytes(self) -> int:
        """Bytes of the first decoder layer's projection weights (and int8 scales) here."""
        return sum(t.numel() * t.element_size() for m in self.blocks[0].modules()
                   if isinstance(m, Proj) for t in (m.weight, m.scale) if t is not None)

    def _graphs_read_stale_buffers(self) -> None:
        """The KV cache or the rotary tables were reallocated: our captured graphs (regional
        compilation) read the old addresses. Inductor's graphs check their inputs themselves."""
        if isinstance(self._step, GraphedCallable):
            self._step.reset()

    def run_step(self, ids, pos, positions, key_mask) -> torch.Tensor:
        """The (compiled) step. Under CUDA graphs the logits live in the graph's memory and are
        valid until the next call: the loop consumes them first, so no copy is made."""
        if self._graphs:
            torch.compiler.cudagraph_mark_step_begin()
        if self.options.kv_bucket:
            torch._dynamo.maybe_mark_dynamic(key_mask, 1)  # one trace for every bucket
        return self._step(ids, pos, positions, key_mask)

    def visible_keys(self, key_mask: torch.Tensor, needed: int) -> torch.Tensor:
        """The part of ``key_mask`` a step attends to when ``needed`` positions are written:
        all of it, or with ``DecodeOptions.kv_bucket`` the prefix rounded up to the bucket."""
        bucket = self.options.kv_bucket
        if not bucket:
            return key_mask
        return key_mask[:, :min(key_mask.shape[-1], -(-needed // bucket) * bucket)]


# --- the generation loop -------------------------------------------------------------------
Picker = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(sequences so far, float logits (B, V)) -> next tokens (B,): greedy or sampling."""


def hf_positions(mask: torch.Tensor) -> torch.Tensor:
    """Hugging Face's generate rule: cumulative sum of the mask minus one, 0 on padding."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


class FinishWatch:
    """When every row has finished (EOS or stopping criteria), without a host sync per token.

    On CUDA each step's "any row unfinished" flag is copied to pinned host memory
    asynchronously; the host reads it once the copy has landed, at most ``EOS_LAG`` steps
    later, so it keeps queuing steps ahead of the GPU. The answer is still exact: the first
    step whose flag says "all finished" ends the output, as in Hugging Face's ``generate``
    (the few extra steps computed meanwhile are cut off). ``exact=True`` (a streamer, which
    must not see the extra steps; or CPU) reads every flag at once.
    """

    def __init__(self, device: torch.device, exact: bool) -> None:
        self.lazy = device.type == "cuda" and not exact
        self.pending: List[Tuple[int, Any, int]] = []
        if self.lazy:
            self.flags = torch.zeros(EOS_LAG + 2, dtype=torch.bool, pin_memory=True)

    def push(self, step: int, unfinished: torch.Tensor) -> Optional[int]:
        """Record step ``step``'s flags; the number of steps to keep, once all rows are known done."""
        if not self.lazy:
            return None if bool(unfinished.any()) else step + 1
        slot = step % self.flags.numel()
        self.flags[slot].copy_(unfinished.any(), non_blocking=True)
        event = get_accelerator().Event()
        event.record()
        self.pending.append((step, event, slot))
        return self._read(block=len(self.pending) > EOS_LAG)

    def drain(self) -> Optional[int]:
        """Read every pending flag (the end of the loop)."""
        return self._read(block=True, everything=True) if self.lazy else None

    def _read(self, block: bool, everything: bool = False) -> Optional[int]:
        while self.pending and (block or self.pending[0][1].query()):
            step, event, slot = self.pending.pop(0)
            event.synchronize()
            if not bool(self.flags[slot]):
                self.pending.clear()
                return step + 1
            block = everything
        return None


@torch.no_grad()
def decode_loop(dec: FastDecoder, ids: torch.Tensor, mask: torch.Tensor, max_new: int,
                pick: Picker, cache_dtype: torch.dtype, eos: Optional[torch.Tensor] = None,
                pad: int = 0, stopping: Any = None, streamer: Any = None) -> torch.Tensor:
    """Prefill ``ids`` then generate up to ``max_new`` tokens; returns (B, T + generated).

    No host sync per token: positions advance on the device, and with EOS / stopping
    criteria ``FinishWatch`` reads "all finished" a few steps late (exactly, see there).
    """
    b, t = ids.shape
    length = dec.ensure_cache(b, t + max_new, cache_dtype, ids.device)
    positions = hf_positions(mask)
    logits = dec.prefill(ids, mask, positions)
    key_mask = torch.ones(b, length, dtype=torch.bool, device=ids.device)
    key_mask[:, :t] = mask.bool()
    seq = torch.empty(b, t + max_new, dtype=ids.dtype, device=ids.device)
    seq[:, :t] = ids
    next_pos = positions[:, -1:] + 1
    pos = torch.tensor([t], device=ids.device)
    unfinished = torch.ones(b, dtype=torch.bool, device=ids.device)
    watch = eos is not None or stopping is not None
    finish = FinishWatch(ids.device, exact=streamer is not None)
    if streamer is not None:
        streamer.put(ids.cpu())
    done: Optional[int] = None
    for i in range(max_new):
        if i > 0:
            logits = dec.run_step(tok, pos, next_pos, dec.visible_keys(key_mask, t + i))
            pos += 1
            next_pos += 1
        scores = logits.float()
        new = pick(seq[:, :t + i], scores)
        if watch:
            new = torch.where(unfinished, new, torch.full_like(new, pad))
        seq[:, t + i] = new
        tok = new[:, None]
        if streamer is not None:
            streamer.put(new.cpu())
        if watch:
            if eos is not None:
                unfinished &= ~torch.isin(new, eos)
            if stopping is not None:
                unfinished &= ~stopping(seq[:, :t + i + 1], scores)
            done = finish.push(i, unfinished)
            if done is not None:
                break
    if done is None and watch:
        done = finish.drain()
    if streamer is not None:
        streamer.end()
    return seq[:, :t + (max_new if done is None else done)]
