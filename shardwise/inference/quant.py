"""Weight-only int8: per-output-channel symmetric scales, PyTorch's own kernels.

``quantize_linears(module)`` replaces every ``nn.Linear`` (and GPT-2 ``Conv1D``) with
``WeightOnlyInt8Linear``: an int8 weight of shape (out, in) and one scale per output channel
(max |w| / 127). The LM head is quantized as well (``head=True``, the default: gpt-fast's and
torchao's choice; at the 7B Llama it is 262 MB of the 13.5 GB a bf16 decode step reads) unless
it shares its weight with the input embedding: a tied head stays in float, since an int8 copy
beside the embedding would add memory. Embeddings stay in float. The matmul is
``torch._weight_int8pack_mm`` on CPU where torch has it; elsewhere
``F.linear(x, w.to(x.dtype)) * scale``, which ``torch.compile`` fuses into one kernel that
reads the int8 weight (half the bytes of bf16). When torchao is installed,
``quantize_linears(..., use_torchao=True)`` hands the layers to torchao's int8 weight-only
scheme instead.

``perplexity`` and ``int8_perplexity_delta`` measure what quantization costs on a fixed text.
"""
from __future__ import annotations

import copy
import math
from typing import Callable, Dict, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ConfigError

#: A fixed English text for the perplexity check (any tokenizer; no download needed).
FIXED_TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
    "single step. To be, or not to be, that is the question: whether it is nobler in the mind "
    "to suffer the slings and arrows of outrageous fortune, or to take arms against a sea of "
    "troubles. It was the best of times, it was the worst of times, it was the age of wisdom, "
    "it was the age of foolishness. All happy families are alike; each unhappy family is "
    "unhappy in its own way. In the beginning the Universe was created. This has made a lot of "
    "people very angry and been widely regarded as a bad move.")


def quantize_weight(weight: torch.Tensor) -> tuple:
    """(int8 weight, fp32 per-row scale) for a float (out, in) weight: w ~= q * scale[:, None]."""
    w = weight.detach().float().contiguous()  # GPT-2's Conv1D hands in a transposed view
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


#: Under torch.compile on CUDA, at most this many rows use the reduction form (a GEMV).
GEMV_ROWS = 2


def realized(x: torch.Tensor) -> torch.Tensor:
    """``x``, which inductor must now write to memory: an optimisation barrier.

    A reduction GEMV otherwise inlines whatever elementwise work produced its input (the RMS
    norm, the residual add, SiLU(gate) * up), and every block of output rows recomputes it
    from its own loads. Requiring ``x``'s strides (``inductor_force_stride_order``, the prim
    inductor itself uses where a kernel needs a fixed layout) makes it a buffer computed once.
    Outside a compile, or where this torch lacks the prim, ``x`` is returned as it is.
    """
    if not torch.compiler.is_compiling():
        return x
    try:
        from torch._inductor.inductor_prims import force_stride_order
    except ImportError:
        return x
    return force_stride_order(x, x.stride())


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor] = None,
         realize_input: bool = False, realize_output: bool = False) -> torch.Tensor:
    """The reduction form of x @ (weight [* scale]).T, accumulated in fp32 (see int8_linear).

    Under torch.compile the (..., out, in) product is never materialised: inductor emits one
    reduction kernel that reads each weight element once. Eager, it would be: compiled only.
    ``realize_input``: ``x`` is written to memory first (``realized``), not recomputed inside.
    ``realize_output``: the result is written as it is, so what follows (a residual add) is
    not fused into the GEMV's kernel as an epilogue but into the next kernel.
    """
    if realize_input:
        x = realized(x)
    out = (x.unsqueeze(-2).float() * weight.float()).sum(dim=-1)
    out = (out if scale is None else out * scale.float()).to(x.dtype)
    return realized(out) if realize_output else out


def int8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              realize_input: bool = False, realize_output: bool = False) -> torch.Tensor:
    """The reduction form of x @ (weight * scale).T for an int8 weight."""
    return gemv(x, weight, scale, realize_input, realize_output)


INT8_KERNELS = ("reduction", "int8pack")
"""``DecodeOptions.int8``: how a compiled CUDA decode step multiplies by an int8 weight."""


def int8pack_available(device_type: str) -> bool:
    """True when this torch has ``_weight_int8pack_mm`` (CPU everywhere; CUDA in recent torch)."""
    if not hasattr(torch, "_weight_int8pack_mm"):
        return False
    if device_type == "cpu":
        return True
    try:  # a 1x32 @ 32x8 probe: the op raises NotImplementedError where a backend lacks it
        x = torch.zeros(1, 32, dtype=torch.bfloat16, device=device_type)
        w = torch.zeros(8, 32, dtype=torch.int8, device=device_type)
        torch._weight_int8pack_mm(x, w, torch.ones(8, dtype=torch.bfloat16, device=device_type))
        return True
    except (NotImplementedError, RuntimeError):
        return False


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: Optional[torch.Tensor] = None, kernel: str = "reduction",
                realize_input: bool = False, realize_output: bool = False) -> torch.Tensor:
    """x @ (weight * scale).T (+ bias) without materialising the float weight where possible.

    * CPU, eager, or ``kernel="int8pack"`` for a CUDA decode step of at most ``GEMV_ROWS``
      rows: ``torch._weight_int8pack_mm`` (PyTorch's int8 weight kernel);
    * compiled, CUDA, a decode step of at most ``GEMV_ROWS`` rows: written as a broadcast
      multiply + sum, which inductor turns into one reduction kernel that reads the int8
      weight once and converts it in registers (the float weight never exists);
    * otherwise: ``F.linear(x, weight.to(x.dtype)) * scale`` (inductor may fuse the cast as
      a prologue of its own matmul kernels under max-autotune).
    """
    rows = x.numel() // x.shape[-1]
    pack = (x.device.type == "cpu" and not torch.compiler.is_compiling()) or \
        (kernel == "int8pack" and x.device.type == "cuda" and rows <= GEMV_ROWS)
    if pack and hasattr(torch, "_weight_int8pack_mm"):
        shape = x.shape
        out = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).contiguous(), weight,
                                        scale.to(x.dtype))
        out = out.reshape(*shape[:-1], weight.shape[0])
    elif torch.compiler.is_compiling() and x.device.type == "cuda" and rows <= GEMV_ROWS:
        out = int8_gemv(x, weight, scale, realize_input, realize_output)
    else:
        out = F.linear(x, weight.to(x.dtype)) * scale.to(x.dtype)
    return out if bias is None else out + bias


class WeightOnlyInt8Linear(nn.Module):
    """A linear layer with an int8 (out, in) weight and per-output-channel scales."""

    def __init__(self, int8_weight: torch.Tensor, scale: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.in_features, self.out_features = int8_weight.shape[1], int8_weight.shape[0]
        self.register_buffer("int8_weight", int8_weight)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # the fast decode path's DecodeOptions (set_options), for a layer it calls as it is
        # (the LM head): which int8 kernel, and whether the GEMV's input is written first
        self.int8_kernel = "reduction"
        self.realize_input = False

    @classmethod
    def from_linear(cls, module: nn.Module, compute_dtype: torch.dtype) -> "WeightOnlyInt8Linear":
        weight = module.weight
        if type(module).__name__ == "Conv1D":  # GPT-2 stores (in, out)
            weight = weight.t()
        q, scale = quantize_weight(weight)
        bias = None if module.bias is None else module.bias.detach().to(compute_dtype)
        return cls(q, scale.to(compute_dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.int8_weight, self.scale, self.bias, self.int8_kernel,
                           self.realize_input)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def tied_head(model: nn.Module) -> bool:
    """True when the output head shares its weight with the input embedding."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = get_in() if callable(get_in) else None
    out = get_out() if callable(get_out) else None
    weight_in, weight_out = getattr(emb, "weight", None), getattr(out, "weight", None)
    if weight_in is None or weight_out is None:
        return False
    return weight_in is weight_out or \
        (not weight_in.is_meta and weight_in.data_ptr() == weight_out.data_ptr())  # meta: ptr 0


def _float_ids(model: nn.Module, head: bool) -> set:
    """ids of the linear modules left in float: the output head unless ``head`` and untied."""
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    if out is None or (head and not tied_head(model)):
        return set()
    return {id(out)}


def quantize_linears(model: nn.Module, compute_dtype: torch.dtype,
                     use_torchao: bool = False, head: bool = True) -> int:
    """Replace the linear layers of ``model`` in place; returns how many were quantized.

    ``head``: the output head too, where it does not share the input embedding's weight.
    """
    skip = _float_ids(model, head)
    if use_torchao:
        return _torchao_quantize(model, skip)
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_linear(child) and id(child) not in skip:
                setattr(parent, name, WeightOnlyInt8Linear.from_linear(child, compute_dtype))
                count += 1
    return count


def _torchao_quantize(model: nn.Module, skip: set) -> int:
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise ConfigError("use_torchao=True needs torchao: pip install torchao") from None
    quantize_(model, Int8WeightOnlyConfig(),
              filter_fn=lambda m, _fqn: isinstance(m, nn.Linear) and id(m) not in skip)
    return sum(1 for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in skip)


# --- accuracy -----------------------------------------------------------------------------
@torch.no_grad()
def perplexity(forward: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor) -> float:
    """exp(mean next-token cross-entropy) of ``forward(input_ids) -> logits`` on ``input_ids``."""
    logits = forward(input_ids).float()
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           input_ids[:, 1:].reshape(-1))
    return math.exp(loss.item())


def _logits_fn(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda ids: model(ids).logits


@torch.no_grad()
def int8_perplexity_delta(model: nn.Module, input_ids: torch.Tensor,
                          dtype: torch.dtype = torch.bfloat16, head: bool = True) -> Dict[str, float]:
    """Perplexity of ``model`` in ``dtype`` and with int8 weights on the same tokens.

    Works on a deep copy (the caller's model is not changed); ``head`` as in
    ``quantize_linears``. Returns ``{"ppl_float", "ppl_int8", "delta", "relative"}``.
    """
    ref = copy.deepcopy(model).to(dtype).eval()
    ppl_float = perplexity(_logits_fn(ref), input_ids)
    quantize_linears(ref, dtype, head=head)
    ppl_int8 = perplexity(_logits_fn(ref), input_ids)
    return {"ppl_float": ppl_float, "ppl_int8": ppl_int8, "delta": ppl_int8 - ppl_float,
            "relative": (ppl_int8 - ppl_float) / ppl_float}


def int8_layers(modules: Iterable[nn.Module]) -> int:
    """How many ``WeightOnlyInt8Linear`` layers are among ``modules``."""
    return sum(isinstance(m, WeightOnlyInt8Linear) for m in modules)
