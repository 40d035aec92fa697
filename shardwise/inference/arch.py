"""Find a Hugging Face decoder's parts by structure, for the fast decode path.

``describe_model(model)`` walks the module tree and returns a ``DecoderSpec`` (embeddings,
per-layer norms and projections, final norm, head, rotary module) or raises ``Unsupported``
naming the part it could not map. Four layouts are recognised by their attribute
structure, not by class names, so any model that shares a layout works:

* "llama":  ``model.layers[i].self_attn.{q,k,v,o}_proj`` + ``mlp.{gate,up,down}_proj`` +
  ``input_layernorm`` / ``post_attention_layernorm`` + ``model.rotary_emb`` (Llama, Mistral,
  Qwen2, Qwen3 with its q/k norms, and the many clones);
* "opt":    ``model.decoder.layers[i].self_attn.{q,k,v,out}_proj`` + ``fc1`` / ``fc2`` + learned
  positions with offset 2;
* "gpt2":   ``transformer.h[i].attn.c_attn`` (fused Conv1D) + ``mlp.c_fc`` / ``mlp.c_proj``;
* "neox":   ``gpt_neox.layers[i].attention.query_key_value`` (per-head interleaved) +
  ``mlp.dense_h_to_4h`` / ``dense_4h_to_h``, partial rotary, parallel residual.

Config switches that change the math and that the fast path does not model (logit
soft-capping, scaled embeddings, ALiBi, sliding windows shorter than the cache, ...) make
the model unsupported, with the switch named.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
from torch import nn


class Unsupported(Exception):
    """The fast path cannot run this model; the message names the part."""


@dataclass
class Linear:
    """One projection as (out, in) weight + bias, plus the module that owns the tensors."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    module: nn.Module
    transposed: bool = False
    """True for GPT-2's Conv1D, whose weight is stored (in, out)."""
    scale: Optional[torch.Tensor] = None
    """Per-output-channel scales when ``weight`` is int8 (weight-only quantization)."""


@dataclass
class LayerSpec:
    """One decoder layer's parts."""

    attn_norm: Optional[nn.Module]
    mlp_norm: Optional[nn.Module]
    qkv: List[Linear]
    """[q, k, v] separate projections, or one fused projection."""
    o: Linear
    up: Linear
    """gate/up: the gate (for gated MLPs) or fc1."""
    down: Linear
    act: Callable[[torch.Tensor], torch.Tensor]
    gate: Optional[Linear] = None
    """The gated MLP's gate projection (None for a plain MLP)."""
    q_norm: Optional[nn.Module] = None
    k_norm: Optional[nn.Module] = None


@dataclass
class DecoderSpec:
    """A decoder-only LM as the fast path sees it."""

    family: str
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    embed: nn.Embedding
    layers: List[LayerSpec]
    final_norm: Optional[nn.Module]
    lm_head: nn.Module
    qkv_layout: str = "concat"
    """"concat" ([q; k; v] rows) or "interleaved" (GPT-NeoX: per head [q, k, v])."""
    pos_embed: Optional[nn.Embedding] = None
    pos_offset: int = 0
    rotary: Optional[nn.Module] = None
    """Called as ``rotary(x, position_ids) -> (cos, sin)`` (the model's own rotary module)."""
    pre_norm: bool = True
    parallel_residual: bool = False
    prescale_q: bool = False
    """OPT multiplies q by the scale before the product (and uses scale 1 inside)."""
    attn_scale: Optional[float] = None
    project_in: Optional[nn.Module] = None
    project_out: Optional[nn.Module] = None
    notes: List[str] = field(default_factory=list)


# --- helpers ------------------------------------------------------------------------------
def _lin(module: nn.Module) -> Linear:
    if hasattr(module, "int8_weight"):  # shardwise's WeightOnlyInt8Linear
        return Linear(module.int8_weight, module.bias, module, scale=module.scale)
    if isinstance(module, nn.Linear):
        return Linear(module.weight, module.bias, module)
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and weight is not None and weight.dim() == 2:
        return Linear(weight.t(), getattr(module, "bias", None), module, transposed=True)
    raise Unsupported(f"{type(module).__name__} is not a linear layer")


def _get(root: nn.Module, path: str) -> nn.Module:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise Unsupported(f"missing '{path}'")
    return obj


def _head(model: nn.Module) -> nn.Module:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise Unsupported("no output embeddings (get_output_embeddings() is None)")
    return head


#: config switches that change the math, with the values that leave it unchanged.
_MATH_SWITCHES = {"final_logit_softcapping": (None, 0, 0.0), "attn_logit_softcapping": (None, 0, 0.0),
                  "query_pre_attn_scalar": (None,), "embedding_multiplier": (None, 1, 1.0),
                  "logits_scaling": (None, 1, 1.0), "alibi": (None, False), "use_alibi": (None, False),
                  "scale_attn_by_inverse_layer_idx": (None, False),
                  "reorder_and_upcast_attn": (None, False)}


def _neutral(value: object, allowed: tuple) -> bool:
    """``value`` is one of ``allowed`` (bools compared by identity: True is not 1.0 here)."""
    return any(value is a or (type(value) is type(a) and value == a) for a in allowed)


def _check_config(config: object, max_tokens: int) -> None:
    for name, allowed in _MATH_SWITCHES.items():
        value = getattr(config, name, None)
        if not _neutral(value, allowed):
            raise Unsupported(f"config.{name} = {value!r}")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < max_tokens:
        raise Unsupported(f"config.sliding_window = {window} is shorter than max_out_tokens = "
                          f"{max_tokens} (the static cache keeps every position)")
    if getattr(config, "layer_types", None) and any(t != "full_attention" for t in config.layer_types):
        if window and window < max_tokens:
            raise Unsupported(f"config.layer_types has sliding-window layers ({window} tokens)")


def _heads(config: object, hidden: int) -> tuple:
    n_heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head")
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or hidden // n_heads
    return int(n_heads), int(n_kv), int(head_dim)


# --- the four layouts ---------------------------------------------------------------------
def _llama(model: nn.Module) -> DecoderSpec:
    base = _get(model, "model")
    layers = []
    for layer in _get(base, "layers"):
        attn, mlp = _get(layer, "self_attn"), _get(layer, "mlp")
        layers.append(LayerSpec(
            attn_norm=_get(layer, "input_layernorm"), mlp_norm=_get(layer, "post_attention_layernorm"),
            qkv=[_lin(_get(attn, n)) for n in ("q_proj", "k_proj", "v_proj")], o=_lin(_get(attn, "o_proj")),
            gate=_lin(_get(mlp, "gate_proj")), up=_lin(_get(mlp, "up_proj")),
            down=_lin(_get(mlp, "down_proj")), act=_get(mlp, "act_fn"),
            q_norm=getattr(attn, "q_norm", None), k_norm=getattr(attn, "k_norm", None)))
        extra = {"pre_feedforward_layernorm", "post_feedforward_layernorm"} & set(dict(layer.named_children()))
        if extra:
            raise Unsupported(f"layer norms {sorted(extra)}")
    hidden = base.embed_tokens.weight.shape[1]
    n_heads, n_kv, head_dim = _heads(model.config, hidden)
    return DecoderSpec("llama", hidden, n_heads, n_kv, head_dim, _get(base, "embed_tokens"), layers,
                       _get(base, "norm"), _head(model), rotary=_get(base, "rotary_emb"),
                       attn_scale=getattr(_get(base, "layers")[0].self_attn, "scaling", None))


def _opt(model: nn.Module) -> DecoderSpec:
    dec = _get(model, "model.decoder")
    layers = []
    for layer in _get(dec, "layers"):
        attn = _get(layer, "self_attn")
        layers.append(LayerSpec(
            attn_norm=_get(layer, "self_attn_layer_norm"), mlp_norm=_get(layer, "final_layer_norm"),
            qkv=[_lin(_get(attn, n)) for n in ("q_proj", "k_proj", "v_proj")], o=_lin(_get(attn, "out_proj")),
            up=_lin(_get(layer, "fc1")), down=_lin(_get(layer, "fc2")), act=_get(layer, "activation_fn")))
    cfg = model.config
    hidden = cfg.hidden_size
    n_heads, n_kv, head_dim = _heads(cfg, hidden)
    pos = _get(dec, "embed_positions")
    return DecoderSpec("opt", hidden, n_heads, n_kv, head_dim, _get(dec, "embed_tokens"), layers,
                       getattr(dec, "final_layer_norm", None), _head(model),
                       pos_embed=pos, pos_offset=int(getattr(pos, "offset", 2)),
                       pre_norm=bool(cfg.do_layer_norm_before), prescale_q=True,
                       project_in=getattr(dec, "project_in", None),
                       project_out=getattr(dec, "project_out", None))


def _gpt2(model: nn.Module) -> DecoderSpec:
    tr = _get(model, "transformer")
    layers = []
    for block in _get(tr, "h"):
        attn, mlp = _get(block, "attn"), _get(block, "mlp")
        if getattr(attn, "is_cross_attention", False):
            raise Unsupported("cross-attention blocks")
        layers.append(LayerSpec(
            attn_norm=_get(block, "ln_1"), mlp_norm=_get(block, "ln_2"),
            qkv=[_lin(_get(attn, "c_attn"))], o=_lin(_get(attn, "c_proj")),
            up=_lin(_get(mlp, "c_fc")), down=_lin(_get(mlp, "c_proj")), act=_get(mlp, "act")))
    cfg = model.config
    hidden = tr.wte.weight.shape[1]
    n_heads, n_kv, head_dim = _heads(cfg, hidden)
    scale = None if getattr(cfg, "scale_attn_weights", True) else 1.0
    return DecoderSpec("gpt2", hidden, n_heads, n_kv, head_dim, _get(tr, "wte"), layers,
                       _get(tr, "ln_f"), _head(model), pos_embed=_get(tr, "wpe"),
                       attn_scale=scale)


def _neox(model: nn.Module) -> DecoderSpec:
    base = _get(model, "gpt_neox")
    layers = []
    for layer in _get(base, "layers"):
        attn, mlp = _get(layer, "attention"), _get(layer, "mlp")
        layers.append(LayerSpec(
            attn_norm=_get(layer, "input_layernorm"), mlp_norm=_get(layer, "post_attention_layernorm"),
            qkv=[_lin(_get(attn, "query_key_value"))], o=_lin(_get(attn, "dense")),
            up=_lin(_get(mlp, "dense_h_to_4h")), down=_lin(_get(mlp, "dense_4h_to_h")),
            act=_get(mlp, "act")))
    cfg = model.config
    hidden = cfg.hidden_size
    n_heads, n_kv, head_dim = _heads(cfg, hidden)
    return DecoderSpec("neox", hidden, n_heads, n_kv, head_dim, _get(base, "embed_in"), layers,
                       _get(base, "final_layer_norm"), _head(model),
                       qkv_layout="interleaved", rotary=_get(base, "rotary_emb"),
                       parallel_residual=bool(cfg.use_parallel_residual))


_LAYOUTS = (("model.layers", _llama), ("model.decoder.layers", _opt), ("transformer.h", _gpt2),
            ("gpt_neox.layers", _neox))


def describe_model(model: nn.Module, max_tokens: int = 1024) -> DecoderSpec:
    """The ``DecoderSpec`` of ``model``; raises ``Unsupported`` naming what does not fit."""
    config = getattr(model, "config", None)
    if config is None:
        raise Unsupported("the module has no Hugging Face .config")
    if getattr(config, "is_encoder_decoder", False):
        raise Unsupported("encoder-decoder models")
    for path, build in _LAYOUTS:
        try:
            _get(model, path)
        except Unsupported:
            continue
        _check_config(config, max_tokens)
        spec = build(model)
        if spec.n_heads % spec.n_kv_heads:
            raise Unsupported(f"{spec.n_heads} heads are not a multiple of {spec.n_kv_heads} KV heads")
        return spec
    raise Unsupported(f"{type(model).__name__}: no known decoder layout (expected one of "
                      f"{', '.join(p for p, _ in _LAYOUTS)})")
