"""``Proj``: one (possibly fused, possibly sharded, possibly int8) projection of the fast path.

``fuse(pieces, ...)`` builds one weight from several projections of the Hugging Face module
(q/k/v or gate/up) *once* and points the module's own parameters at views of it, so there is
a single copy of every weight and the module stays in sync: an in-place update of the module
(``load_state_dict``, ``copy_``) is seen by the fast path. Assigning new ``Parameter`` objects
to the module breaks the link; call ``InferenceEngine.rebuild_fast_path()`` after that.

Under tensor parallelism the same call keeps only this rank's rows (column-parallel) or
columns (row-parallel) and points the module at those, so each rank holds its share only.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .arch import Linear
from .quant import GEMV_ROWS, gemv, int8_linear, realized
from .tp import TPPlan, all_reduce


class Proj(nn.Module):
    """y = x W^T (+ b), with an optional int8 W, and an all-reduce for row-parallel layers."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 scale: Optional[torch.Tensor], plan: Optional[TPPlan] = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.plan = plan  # set for row-parallel layers: all-reduce, then add the bias
        self.reduce_gemv = False  # DecodeOptions.gemv == "reduction" (compiled CUDA decode step)
        self.int8_kernel = "reduction"  # DecodeOptions.int8 (CUDA, int8 weights)
        self.realize_input = False  # DecodeOptions.realize_inputs (reduction GEMVs)
        self.realize_output = False  # DecodeOptions.realize_outputs (reduction GEMVs)

    def reduces(self, x: torch.Tensor) -> bool:
        """True where ``x @ W.T`` runs as a reduction GEMV: a compiled CUDA decode step of at
        most ``GEMV_ROWS`` rows, with ``gemv="reduction"`` (float W) or int8 W's reduction."""
        if not (x.is_cuda and torch.compiler.is_compiling() and x.numel() // x.shape[-1] <= GEMV_ROWS):
            return False
        return self.reduce_gemv if self.scale is None else self.int8_kernel == "reduction"

    def halves(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The two halves of a column-parallel output (gate and up) as two reductions over the
        one input (``DecodeOptions.act_epilogue``). Where ``reduces(x)``, inductor fuses the
        sibling reductions into one kernel, and whatever combines the two halves elementwise
        (SiLU(gate) * up) becomes its epilogue instead of a kernel of its own."""
        if self.realize_input:
            x = realized(x)
        n = self.weight.shape[0] // 2
        out = []
        for rows in (slice(0, n), slice(n, None)):
            y = gemv(x, self.weight[rows], None if self.scale is None else self.scale[rows])
            out.append(y if self.bias is None else y + self.bias[rows])
        return out[0], out[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias_now = None if self.plan is not None else self.bias
        if self.scale is None and self.reduces(x):
            y = gemv(x, self.weight, realize_input=self.realize_input,
                     realize_output=self.realize_output)
            y = y if bias_now is None else y + bias_now
        elif self.scale is None:
            y = F.linear(x, self.weight, bias_now)
        else:
            y = int8_linear(x, self.weight, self.scale, bias_now, self.int8_kernel,
                            self.realize_input, self.realize_output)
        if self.plan is not None:
            y = all_reduce(y, self.plan)
            if self.bias is not None:
                y = y + self.bias
        return y


# --- rebinding the Hugging Face module to views of the fused tensors ---------------------
def _rebind(piece: Linear, weight: torch.Tensor, bias: Optional[torch.Tensor],
            scale: Optional[torch.Tensor]) -> None:
    module = piece.module
    if piece.scale is not None:
        module.int8_weight = weight
        module.scale = scale
    else:
        module.weight.data = weight.t() if piece.transposed else weight
    if bias is not None and module.bias is not None:
        module.bias.data = bias


def _take(t: Optional[torch.Tensor], rows: Optional[Tuple[int, int]], dim: int = 0):
    if t is None or rows is None:
        return t
    return t.narrow(dim, rows[0], rows[1] - rows[0])


def _cat(parts: Sequence[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    if any(p is None for p in parts):
        return None
    return parts[0] if len(parts) == 1 else torch.cat([p.contiguous() for p in parts])


def column_parallel(pieces: List[Linear], row_ranges: List[List[Tuple[int, int]]]) -> Proj:
    """Fuse ``pieces`` along the output dim, keeping only ``row_ranges`` of each (None: all).

    ``row_ranges[i]`` is a list of [start, end) row ranges of piece i (several for a fused
    q/k/v weight split by heads), or an empty list for all rows.
    """
    weights, biases, scales, sizes = [], [], [], []
    for piece, ranges in zip(pieces, row_ranges):
        take = ranges or [None]
        w = _cat([_take(piece.weight, r) for r in take])
        weights.append(w)
        biases.append(_cat([_take(piece.bias, r) for r in take]))
        scales.append(_cat([_take(piece.scale, r) for r in take]))
        sizes.append(w.shape[0])
    weight = _cat(weights)
    if weight is weights[0] and ranges and len(pieces) == 1:
        weight = weight.contiguous()  # a sharded copy of its own
    bias = _cat(biases) if all(b is not None for b in biases) else None
    scale = _cat(scales) if pieces[0].scale is not None else None
    offset = 0
    for piece, n in zip(pieces, sizes):  # the module's tensors become views of the fused ones
        _rebind(piece, weight[offset:offset + n], None if bias is None else bias[offset:offset + n],
                None if scale is None else scale[offset:offset + n])
        offset += n
    return Proj(weight, bias, scale)


def row_parallel(piece: Linear, cols: Optional[Tuple[int, int]], plan: TPPlan) -> Proj:
    """The input-column slice ``cols`` of ``piece`` (None: all), all-reduced when sharded."""
    weight = piece.weight if cols is None else _take(piece.weight, cols, dim=1).contiguous()
    _rebind(piece, weight, piece.bias, piece.scale)
    return Proj(weight, piece.bias, piece.scale, plan if plan.active else None)


def head_rows(n_heads: int, head_dim: int, plan: TPPlan, offset: int = 0,
              per_head: int = 1) -> List[Tuple[int, int]]:
    """Row range of this rank's heads in a weight whose rows are ``per_head`` x head_dim per head."""
    if not plan.active:
        return []
    first, last = plan.chunk(n_heads)
    unit = per_head * head_dim
    return [(offset + first * unit, offset + last * unit)]


def reduction_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: Optional[float]) -> torch.Tensor:
    """Decode attention as reductions: q (B, H, G, D) over k/v (B, H, S, D), bool mask (B, 1, G, S).

    Written for inductor (compiled step only): q.k is a reduction over D with B*H*G*S rows,
    so the cache length is spread over many blocks instead of one block per head; softmax
    and p.v follow in fp32. Every row must have a visible key (decode: its own position).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.unsqueeze(-2).float() * k.unsqueeze(-3).float()).sum(-1) * scale  # (B, H, G, S)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = (probs.unsqueeze(-1) * v.unsqueeze(-3).float()).sum(-2)  # (B, H, G, D)
    return out.to(q.dtype)


def flex_attention_available() -> bool:
    """True where this torch has ``torch.nn.attention.flex_attention`` (2.5 and later)."""
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flex_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                          scale: Optional[float]) -> torch.Tensor:
    """Decode attention through PyTorch's FlexAttention: q (B, H, G, D) over k/v (B, H, S, D),
    bool mask (B, 1, G, S) applied as a score modification (masked scores become -inf).

    Compiled, inductor lowers it to its flex-decoding template, which splits the cache over the
    SMs (flash-decoding) in one kernel plus a small combine, rather than one block per head.
    Every row must have a visible key (decode: its own position).
    """
    from torch.nn.attention.flex_attention import flex_attention

    def masked(score, b, h, q_idx, kv_idx):
        return torch.where(mask[b, 0, q_idx, kv_idx], score, -float("inf"))

    return flex_attention(q, k, v, score_mod=masked, scale=scale)


#: keys per block of ``split_kv_attention`` (one key block of the efficient kernel at D = 128)
SPLIT_KV_CHUNK = 64


def efficient_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                     scale: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of PyTorch's memory-efficient attention kernel (CUDA)."""
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, scale=scale)[:2]
    return out, lse[..., :q.shape[2]]  # the kernel pads the log-sum-exp rows to 32


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: Optional[float], chunk: int = SPLIT_KV_CHUNK,
                       chunks_fn: Callable = efficient_chunks) -> torch.Tensor:
    """Flash-decoding with PyTorch's own kernel: q (B, H, G, D) over k/v (B, H, S, D).

    The cache is cut into S / ``chunk`` blocks that attend in parallel (one kernel launch over
    B * H * S / chunk blocks instead of B * H), each returning its log-sum-exp; the blocks
    are then combined exactly (softmax rescaling). ``mask`` is bool (B, 1, G, S); a block
    with no visible key contributes nothing. ``S`` must be a multiple of ``chunk``.
    """
    b, h, g, d = q.shape
    s = k.shape[2]
    n = s // chunk
    kc, vc = k.reshape(b, h * n, chunk, d), v.reshape(b, h * n, chunk, d)
    qc = q.unsqueeze(2).expand(b, h, n, g, d).reshape(b, h * n, g, d)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    bias = bias.view(b, 1, g, n, chunk).transpose(2, 3).expand(b, h, n, g, chunk)
    out, lse = chunks_fn(qc, kc, vc, bias.reshape(b, h * n, g, chunk).contiguous(), scale)
    # A block with no visible key gets no weight, whatever the kernel returns for it: CUDA's
    # efficient kernel gives such a block a log-sum-exp of +inf (measured on an H100, 12-05),
    # a math reference gives -inf and a NaN output. Decide from the mask, not the values.
    seen = mask.reshape(b, 1, g, n, chunk).any(-1).transpose(2, 3)  # (B, 1, n, G)
    # the kernel's output is a transposed view and its log-sum-exp a slice: reshape, not view
    out = torch.where(seen.unsqueeze(-1), out.float().reshape(b, h, n, g, d), 0.0)
    lse = torch.where(seen, lse.float().reshape(b, h, n, g), float("-inf"))
    weight = torch.exp(lse - lse.amax(dim=2, keepdim=True))  # (B, H, n, G)
    out = (weight.unsqueeze(-1) * out).sum(2) / weight.sum(2).unsqueeze(-1)
    return out.to(q.dtype)
