"""How the compiled decode step is built: ``DecodeOptions`` and the two choices derived from it.

The options pick kernels, compilation and how much of the cache a step reads, never the
tokens (the unit and GPU tests compare each with the plain model's ``generate``).
``benchmarks/decode_probe.py`` and ``infer_bench.py``'s ``@key=value`` units compare their
speed on a GPU; RESULTS.md holds what each measured.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Union

from shardwise.errors import ConfigError

from .layers import SPLIT_KV_CHUNK
from .quant import INT8_KERNELS

REGIONAL_LAYER_BYTES = 256 * 2**20
"""``DecodeOptions.regional = "auto"`` compiles per layer from this many weight bytes a layer."""


@dataclass(frozen=True)
class DecodeOptions:
    """How the compiled decode step is built (``benchmarks/decode_probe.py`` compares them).

    Only the compiled CUDA step reads ``gemv`` and ``attention``; eager and CPU runs use
    ``F.linear`` and SDPA whatever they say, so tokens do not depend on them there.
    """

    gemv: str = "cublas"
    """Projections of a decode step with at most ``quant.GEMV_ROWS`` rows: "cublas"
    (``F.linear``, a cuBLAS GEMV) or "reduction" (multiply + sum, which inductor turns into one
    Triton reduction with the neighbouring elementwise ops fused into it)."""
    attention: str = "auto"
    """Decode attention: "sdpa" (``F.scaled_dot_product_attention`` with a mask: one block of
    the efficient kernel per KV head), "split" (flash-decoding: the cache in 64-key blocks
    through the same kernel, combined by their log-sum-exp; ``layers.split_kv_attention``;
    only while batch x KV heads < 2 x the SM count, beyond that "sdpa" fills the GPU),
    "reduction" (q.k, softmax and p.v as reductions over the cache, fp32 accumulation),
    "flex" (``torch.nn.attention.flex_attention`` with the mask as a score modification;
    inductor's flex-decoding template splits the cache over the SMs; torch >= 2.5) or
    "auto": "split" while batch x KV heads <= SMs / 8, else "sdpa". Measured on one H100
    (132 SMs, RESULTS.md sixteenth session): split was 1.10x sdpa for the 1.1B Llama at batch
    1 (4 KV heads), 0.92x for the 7B at batch 1 (32), 0.77x at batch 8 (256)."""
    int8: str = "reduction"
    """int8 weights (``dtype: "int8"``) in the compiled CUDA step: "reduction" (multiply + sum
    over the int8 weight, one inductor reduction per projection) or "int8pack" (PyTorch's
    ``torch._weight_int8pack_mm`` kernel, where this torch has it on CUDA; ``set_options``
    raises where it does not). On one H100 (torch 2.11) int8pack decoded the 7B at 18.8
    tokens/s at batch 1, a tenth of the reduction's speed: opt-in only."""
    realize_inputs: Union[bool, str] = "auto"
    """Write each reduction GEMV's input (``gemv="reduction"``, or int8 weights) to memory
    before the GEMV reads it (``quant.realized``): True, False, or "auto" (int8 weights only).
    Left to itself, inductor fuses the RMS norm (and residual add) into the q/k/v and gate/up
    GEMVs and SiLU(gate) * up into the down GEMV, and each block of output rows recomputes
    them: on one H100 (RESULTS.md twentieth session) the 7B int8 step's fused GEMVs took
    139 us a layer against 78 us alone. Written first (twenty-first session) the int8 step
    went from 5.13 to 3.60 ms, 279.5 tokens/s against 185.8 for bf16 (1.50x, from 1.05-1.23x);
    the bf16 reduction GEMV with it is not measured yet, so "auto" leaves it fused."""
    realize_outputs: bool = False
    """Write each reduction GEMV's output as it is (``quant.realized``), so the residual add
    after the down projection runs in the next layer's RMS-norm kernel instead of as the
    GEMV's epilogue. Two profiles of the 7B int8 step on one H100 (RESULTS.md twenty-fourth
    session) had the down GEMV with the add fused at 21.5-26.3 us against 16.9-18.2 us for the
    same GEMV alone; off until measured (``device_plan.sh issue20t``)."""
    act_epilogue: bool = False
    """A gated MLP's gate and up projections as two reduction GEMVs over the one input
    (``Proj.halves``) instead of one over the fused weight: inductor fuses sibling reductions
    into one kernel, with SiLU(gate) * up as its epilogue, so the step loses a kernel a layer
    (the fused weight's output is split in half, which no epilogue can read). Reduction GEMVs
    only (int8 weights, or ``gemv="reduction"``); off until measured (``device_plan.sh
    issue20t``)."""
    regional: Union[bool, str] = "auto"
    """Compile each decoder layer instead of the whole step (regional compilation): dynamo
    traces one layer and every identical layer reuses its graph, so the cold start no longer
    grows with the layer count; the step around the layers runs eagerly and is captured as
    one CUDA graph by ``accelerator.graphs.GraphedCallable`` (no fusion across layers).
    True, False, or "auto": regional where one layer's projection weights (on this rank)
    reach ``REGIONAL_LAYER_BYTES``. Measured on one H100 (RESULTS.md eighteenth and nineteenth
    sessions), the 7B Llama (405 MB a layer) decoded at least as fast either way (184.2-190.1
    against 183.5 tokens/s at batch 1, 3,480-3,494 against 3,498 at batch 32) and
    cold-started in 25.4-40.8 s instead of 59-92 s; smaller layers, where the lost
    cross-layer fusion weighs more, keep the whole-step compile until measured."""
    kv_bucket: int = 0
    """Attend to the written prefix of the static KV cache, rounded up to a multiple of this
    many positions, instead of the whole cache (0, the default: the whole cache every step).
    A masked step otherwise reads every cache position, written or not: at batch 32, prompt
    512 + 128 new tokens, the 7B's cache is 10.7 GB a step, as large as its weights, and
    32-position buckets read 7.5% less of it (half of it for prompt 64 + 1024 new). The
    compiled step is traced once with the length dynamic; each bucket gets its own CUDA
    graph (a capture, not a compile). A positive multiple of 16. On one H100 (RESULTS.md
    twentieth session) 32 took the 7B batch-32 step from 9.58 to 9.37 ms and the hybrid
    engine's 7B generation up 3.6%; off by default, as a long generation captures a graph for
    every bucket it passes."""
    coordinate_descent: bool = True
    """inductor's ``coordinate_descent_tuning`` (gpt-fast's setting) for the step's kernels."""
    max_autotune: bool = False
    """inductor's ``max_autotune``: each matmul shape benchmarked against Triton templates
    (cuBLAS is one of the choices); longer compile."""

    @classmethod
    def parse(cls, text: str) -> "DecodeOptions":
        """``"gemv=reduction+attention=split"`` (``"base"`` or "": the defaults)."""
        kwargs: Dict[str, Any] = {}
        for item in filter(None, text.split("+")):
            if item == "base":
                continue
            key, _, value = item.partition("=")
            if key not in cls.__dataclass_fields__:
                raise ConfigError(f"DecodeOptions: unknown setting {key!r} in {text!r}; known: "
                                  f"{', '.join(cls.__dataclass_fields__)}.")
            kwargs[key] = int(value) if value.isdigit() else \
                {"true": True, "false": False}.get(value.lower(), value)
        return cls(**kwargs)

    def __post_init__(self) -> None:
        for name, allowed in (("gemv", ("cublas", "reduction")), ("int8", INT8_KERNELS),
                              ("attention", ("auto", "sdpa", "split", "reduction", "flex")),
                              ("regional", (True, False, "auto")),
                              ("realize_inputs", (True, False, "auto")),
                              ("realize_outputs", (True, False)),
                              ("act_epilogue", (True, False))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"DecodeOptions.{name} = {getattr(self, name)!r}; expected one of "
                                  f"{', '.join(map(str, allowed))}.")
        bucket = self.kv_bucket
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 0 or bucket % 16:
            raise ConfigError(f"DecodeOptions.kv_bucket = {bucket!r}; expected 0 (attend to the "
                              f"whole cache) or a positive multiple of 16, e.g. 32.")


def regional_compile(option: Union[bool, str], layer_bytes: int) -> bool:
    """Whether ``DecodeOptions.regional`` = ``option`` compiles per layer, for decoder layers
    of ``layer_bytes`` projection weight bytes each."""
    return layer_bytes >= REGIONAL_LAYER_BYTES if option == "auto" else bool(option)


def decode_attention_kind(option: str, groups: int, length: int, sms: int) -> str:
    """The attention a decode step runs for ``DecodeOptions.attention`` = ``option``, with
    ``groups`` = batch x KV heads (one block of the plain kernel each), a cache of ``length``
    keys and ``sms`` SMs (0: not a GPU). "split" needs whole 64-key blocks and pays only while
    the plain kernel has under 2 blocks per SM; "auto" splits up to SMs / 8 groups."""
    if option == "auto":
        option = "split" if groups <= sms // 8 else "sdpa"
    if option == "split" and (length % SPLIT_KV_CHUNK or groups >= 2 * sms):
        return "sdpa"
    return option
