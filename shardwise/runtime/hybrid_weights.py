"""The Hybrid Engine's inference copy: the fast decode path over its own copy of the weights.

``InferenceCopy.build(model, max_tokens)`` walks a Hugging Face decoder (``describe_model``)
and builds a ``FastDecoder`` over *copies* of its weights: fused q/k/v and gate/up tensors,
o/down, embeddings, norms and head, each in storage owned by the copy. The training module
is left exactly as it was (its parameters keep their storage, hooks and ZeRO state), and
every tensor of the copy remembers where it came from (a ``Binding``), so ``refresh()`` copies
the *current* training weights into the same storage in place:

* the weights generation sees are always the ones after the last optimizer step (no stale
  fused copy: every ``generate`` refreshes every tensor);
* the storage never moves, so a decode step compiled once and captured in a CUDA graph stays
  valid across ``generate`` calls;
* under ZeRO stage 3 the refresh runs inside ``GatheredParameters`` over one group of layers
  at a time (or all at once), and the gathered training values are released before decoding.

PEFT LoRA layers are seen through: their weight in the copy is ``base + scaling * B @ A`` of
the active adapters (fused for generation), while the training module keeps base and adapters
apart (unfused for training).
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..inference.arch import DecoderSpec, Linear, describe_model
from ..inference.decode import FastDecoder
from ..inference.tp import TPPlan, make_plan

OTHER = -1
"""Group of the tensors outside the decoder layers (embeddings, final norm, head)."""


@dataclass
class Binding:
    """One tensor of the inference copy and how to recompute it from the training module."""

    dst: torch.Tensor
    source: Callable[[], torch.Tensor]
    """Returns the current value (same shape as ``dst``), reading gathered parameters."""
    params: List[nn.Parameter]
    """The training parameters ``source`` reads (gathered around the refresh under stage 3)."""
    group: int = OTHER


# --- LoRA (PEFT) ----------------------------------------------------------------------------
def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer wrapping a base linear layer (``base_layer`` + ``lora_A``/``lora_B``)."""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")


def lora_layers(model: nn.Module) -> List[Tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, LoRA layer) for every PEFT LoRA layer in ``model``."""
    out = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if is_lora_layer(child):
                out.append((parent, name, child))
    return out


def lora_delta(layer: nn.Module) -> Optional[torch.Tensor]:
    """Sum of the active adapters' deltas in the base weight's shape (None: none active)."""
    if getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):
        return None  # disabled, or already merged into the base weight by the user
    delta = None
    for name in getattr(layer, "active_adapters", []):
        if name not in layer.lora_A:
            continue
        d = layer.get_delta_weight(name)
        delta = d if delta is None else delta + d
    return delta


def lora_params(layer: nn.Module) -> List[nn.Parameter]:
    return [p for n, p in layer.named_parameters() if "lora_" in n]


def hf_model(module: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT wrapper (the module itself otherwise)."""
    get = getattr(module, "get_base_model", None)
    return get() if callable(get) and hasattr(module, "peft_config") else module


# --- building the copy --------------------------------------------------------------------------
class _Holder(nn.Module):
    """Stands in for a projection's module while ``FastDecoder`` fuses it (it rebinds this)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


@dataclass
class _Builder:
    """Collects the bindings while the spec is rewritten onto owned copies."""

    bindings: List[Binding] = field(default_factory=list)
    clones: Dict[int, nn.Parameter] = field(default_factory=dict)
    lora_of: Dict[int, nn.Module] = field(default_factory=dict)
    """id(base linear module) -> its LoRA wrapper."""
    pending: List[Tuple[_Holder, nn.Module, bool, int]] = field(default_factory=list)

    def module(self, m: Optional[nn.Module], group: int) -> Optional[nn.Module]:
        """A hook-free shallow copy of ``m`` whose parameters are owned clones."""
        if m is None or not isinstance(m, nn.Module):
            return m
        c = copy.copy(m)
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
                     "_backward_pre_hooks", "_forward_hooks_with_kwargs",
                     "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
            if attr in c.__dict__:
                c.__dict__[attr] = OrderedDict()
        c._parameters = {k: (None if p is None else self._clone(p, group))
                         for k, p in m._parameters.items()}
        c._buffers = dict(m._buffers)
        c._modules = {k: self.module(v, group) for k, v in m._modules.items()}
        return c

    def _clone(self, p: nn.Parameter, group: int) -> nn.Parameter:
        if id(p) not in self.clones:
            clone = nn.Parameter(p.detach().clone(), requires_grad=False)
            self.clones[id(p)] = clone
            self.bindings.append(Binding(clone.data, lambda p=p: p.data, [p], group))
        return self.clones[id(p)]

    def linear(self, piece: Linear, group: int) -> Linear:
        """``piece`` over a holder of cloned tensors; bound once the decoder has fused them."""
        m = piece.module
        bias = None if piece.bias is None else piece.bias.detach().clone()
        holder = _Holder(m.weight.detach().clone(), bias)
        self.pending.append((holder, m, piece.transposed, group))
        weight = holder.weight.t() if piece.transposed else holder.weight
        return Linear(weight, holder.bias, holder, transposed=piece.transposed)

    def bind_linears(self) -> None:
        """After fusing: each holder's tensors are views of the decoder's storage."""
        for holder, m, _, group in self.pending:
            lora = self.lora_of.get(id(m))
            extra = lora_params(lora) if lora is not None else []
            self.bindings.append(Binding(holder.weight.data, _weight_source(m, lora),
                                         [m.weight] + extra, group))
            if holder.bias is not None:
                self.bindings.append(Binding(holder.bias.data, lambda m=m: m.bias.data,
                                             [m.bias], group))


def _weight_source(m: nn.Module, lora: Optional[nn.Module]) -> Callable[[], torch.Tensor]:
    if lora is None:
        return lambda: m.weight.data

    def fused() -> torch.Tensor:
        delta = lora_delta(lora)
        w = m.weight.data
        return w if delta is None else w + delta.to(w.dtype)
    return fused


def _rewrite(spec: DecoderSpec, b: _Builder) -> DecoderSpec:
    """The same spec over owned copies: nothing in it references the training module."""
    s = copy.copy(spec)
    for name in ("embed", "pos_embed", "final_norm", "lm_head", "project_in", "project_out",
                 "rotary"):
        setattr(s, name, b.module(getattr(spec, name, None), OTHER))
    layers = []
    for i, layer in enumerate(spec.layers):
        nl = copy.copy(layer)
        for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "act"):
            setattr(nl, name, b.module(getattr(layer, name), i))
        nl.qkv = [b.linear(p, i) for p in layer.qkv]
        nl.o, nl.up, nl.down = b.linear(layer.o, i), b.linear(layer.up, i), b.linear(layer.down, i)
        nl.gate = None if layer.gate is None else b.linear(layer.gate, i)
        layers.append(nl)
    s.layers = layers
    return s


def _describe_through_lora(model: nn.Module, max_tokens: int, b: _Builder) -> DecoderSpec:
    """``describe_model`` with each LoRA wrapper swapped for its base layer while it looks."""
    swapped = lora_layers(model)
    for parent, name, layer in swapped:
        b.lora_of[id(layer.base_layer)] = layer
        setattr(parent, name, layer.base_layer)
    try:
        return describe_model(model, max_tokens)
    finally:
        for parent, name, layer in swapped:
            setattr(parent, name, layer)


class InferenceCopy:
    """A ``FastDecoder`` over owned weights, refreshed in place from the training module."""

    def __init__(self, decoder: FastDecoder, bindings: List[Binding]) -> None:
        self.decoder = decoder
        self.bindings = bindings
        self.groups = sorted({bd.group for bd in bindings})

    @classmethod
    def build(cls, module: nn.Module, max_tokens: int, plan: Optional[TPPlan] = None) -> "InferenceCopy":
        """Build from ``module`` (its parameters must be gathered); raises ``Unsupported``.

        With an active tensor-parallel ``plan`` (AutoTP) each rank keeps its share of every
        projection; such a copy is not refreshable in place (rebuild it per call).
        """
        plan = plan or make_plan(1, None, None)
        b = _Builder()
        spec = _rewrite(_describe_through_lora(hf_model(module), max_tokens, b), b)
        with torch.no_grad():
            if plan.active:  # the shards are cut from the LoRA-fused values
                for holder, m, _, _ in b.pending:
                    holder.weight.copy_(_weight_source(m, b.lora_of.get(id(m)))())
                plan.check(spec.n_heads, spec.n_kv_heads, spec.layers[0].up.weight.shape[0])
            decoder = FastDecoder(spec, plan, max_tokens)
        if plan.active:
            return cls(decoder, [])
        b.bind_linears()
        built = cls(decoder, b.bindings)
        built.refresh()  # the clones hold the base weights: fuse the LoRA deltas in
        return built

    def params_of(self, group: int) -> List[nn.Parameter]:
        seen: Dict[int, nn.Parameter] = {}
        for bd in self.bindings:
            if bd.group == group:
                for p in bd.params:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    @torch.no_grad()
    def refresh(self, group: Optional[int] = None) -> None:
        """Copy the training module's current values into the copy (one group or all)."""
        for bd in self.bindings:
            if group is None or bd.group == group:
                bd.dst.copy_(bd.source())

    def nbytes(self) -> int:
        storages = {}
        for bd in self.bindings:
            s = bd.dst.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())
