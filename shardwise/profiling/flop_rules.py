"""The counting rules the flops profiler adds to ``torch.utils.flop_counter.FlopCounterMode``.

PyTorch's counter knows the matrix-multiply family (mm, addmm, bmm, baddbmm, convolutions,
the fused attention kernels) and counts each as 2 x its multiply-accumulates. Two gaps are
filled here, following DeepSpeed's profiler:

* scaled-dot-product attention on every backend (the CPU and "overrideable" kernels are not
  in PyTorch's table, and older releases reject grouped-query shapes): 2 matmuls, QK^T and
  AV, over the query heads and the full s_q x s_k matrix (not halved for a causal mask);
* elementwise work, one flop per output element: activations, softmax, add / sub / mul /
  div, pow / sqrt / rsqrt / exp / reciprocal; normalisations as DeepSpeed estimates them
  (layer/group norm 5 per element with an affine weight, 4 without; batch norm 5/4 when
  training, 2/1 in eval); pooling one per input element. These carry no MACs.

Linear layers are mm/addmm at this level: MACs = input numel x out_features, the bias add
is not counted, FLOPs = 2 x MACs, exactly DeepSpeed's rule. Embedding lookups, dropout,
copies and reductions outside a norm count nothing.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, Iterable

import torch
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

FlopFormula = Callable[..., int]


def _raw(fn: FlopFormula) -> FlopFormula:
    """Mark a formula as taking the real arguments and ``out_val`` (not their shapes)."""
    fn._get_raw = True  # FlopCounterMode's convention for custom formulas
    return fn


def _first_tensor(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return next((v for v in value if torch.is_tensor(v)), None)
    return value if torch.is_tensor(value) else None


def _numel_of_output(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    out = _first_tensor(out_val)
    return int(out.numel()) if out is not None else 0


def _numel_of_input(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    first = _first_tensor(args[0]) if args else None
    return int(first.numel()) if first is not None else 0


def _per_element(factor_affine: int, factor_plain: int, weight_index: int) -> FlopFormula:
    """A normalisation: ``factor`` flops per input element, more with an affine weight."""

    def formula(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        weight = args[weight_index] if len(args) > weight_index else kwargs.get("weight")
        factor = factor_affine if weight is not None else factor_plain
        return factor * _numel_of_input(*args)

    return _raw(formula)


def _batch_norm(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    # native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    training = bool(args[5]) if len(args) > 5 else bool(kwargs.get("training", False))
    factor = (5 if weight is not None else 4) if training else (2 if weight is not None else 1)
    return factor * _numel_of_input(*args)


def _batch_norm_legit(training: bool) -> FlopFormula:
    def formula(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        factor = (5 if weight is not None else 4) if training else (2 if weight is not None else 1)
        return factor * _numel_of_input(*args)

    return _raw(formula)


def sdpa_macs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """MACs of attention: q·k^T over the query heads plus scores·v (DeepSpeed's formula).

    Grouped-query attention (fewer key/value heads) is broadcast to the query heads, as the
    kernel does; the mask or causality does not change the count.
    """
    s_k = key.shape[-2]
    q_elems = 1
    for d in query.shape:
        q_elems *= int(d)
    rows = q_elems // int(query.shape[-1])
    return q_elems * int(s_k) + rows * int(s_k) * int(value.shape[-1])


@_raw
def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
          out_val: Any = None, **kwargs: Any) -> int:
    return 2 * sdpa_macs(query, key, value)


_SDPA_FORWARD = [name for name in ("_scaled_dot_product_flash_attention",
                                   "_scaled_dot_product_efficient_attention",
                                   "_scaled_dot_product_cudnn_attention",
                                   "_scaled_dot_product_flash_attention_for_cpu",
                                   "_scaled_dot_product_fused_attention_overrideable",
                                   "_scaled_dot_product_attention_math_for_mps")
                 if hasattr(aten, name)]

_ELEMENTWISE = ["relu", "relu_", "gelu", "gelu_", "silu", "silu_", "sigmoid", "sigmoid_",
                "tanh", "tanh_", "elu", "elu_", "leaky_relu", "leaky_relu_", "hardtanh",
                "hardtanh_", "_prelu_kernel", "mish", "hardswish", "hardsigmoid",
                "_softmax", "_log_softmax",
                "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_",
                "pow", "pow_", "sqrt", "sqrt_", "rsqrt", "rsqrt_", "exp", "exp_",
                "reciprocal", "reciprocal_"]

_POOLING = ["avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool2d_with_indices",
            "max_pool3d_with_indices", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d",
            "adaptive_max_pool2d", "adaptive_max_pool3d", "max_pool1d", "max_pool2d"]

_UPSAMPLE = ["upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
             "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d",
             "upsample_trilinear3d"]


def _packets(names: Iterable[str]) -> list:
    return [getattr(aten, n) for n in names if hasattr(aten, n)]


def custom_mapping() -> Dict[Any, FlopFormula]:
    """Formulas to pass as ``FlopCounterMode(custom_mapping=...)``."""
    rules: Dict[Any, FlopFormula] = {}
    for op in _packets(_SDPA_FORWARD):
        rules[op] = _sdpa
    for op in _packets(_ELEMENTWISE + _UPSAMPLE):
        rules[op] = _raw(_numel_of_output)
    for op in _packets(_POOLING):
        rules[op] = _raw(_numel_of_input)
    # native_layer_norm(input, normalized_shape, weight, bias, eps)
    rules[aten.native_layer_norm] = _per_element(5, 4, weight_index=2)
    # native_group_norm(input, weight, bias, N, C, HxW, group, eps)
    rules[aten.native_group_norm] = _per_element(5, 4, weight_index=1)
    if hasattr(aten, "_fused_rms_norm"):  # (input, normalized_shape, weight, eps)
        rules[aten._fused_rms_norm] = _per_element(5, 4, weight_index=2)
    rules[aten.native_batch_norm] = _raw(_batch_norm)
    rules[aten._native_batch_norm_legit] = _batch_norm_legit(True)
    rules[aten._native_batch_norm_legit_no_training] = _batch_norm_legit(False)
    return rules


def mac_ops() -> FrozenSet[Any]:
    """Ops whose flops are 2 x MACs: PyTorch's own table (the matmul family) and attention."""
    return frozenset(flop_registry) | frozenset(_packets(_SDPA_FORWARD))


def split_counts(per_op: Dict[Any, int], macs_from: FrozenSet[Any]) -> tuple:
    """(flops, macs) of one module's per-op flop counts."""
    flops = sum(per_op.values())
    macs = sum(v for op, v in per_op.items() if op in macs_from) // 2
    return int(flops), int(macs)
