"""``hybrid_engine``: DeepSpeed's RLHF Hybrid Engine section (one engine that trains and generates).

Keys and defaults are DeepSpeed's (``runtime/config.py``'s ``HybridEngineConfig``); what each
one does in shardwise is said in its docstring (``runtime/hybrid_engine.py`` applies them).
"""
from __future__ import annotations

from pydantic import Field

from .base import ConfigModel


class HybridEngineConfig(ConfigModel):
    """``hybrid_engine``: ``initialize`` returns a ``HybridEngine`` with ``generate()`` when enabled."""

    enabled: bool = False
    """Give the training engine a fast ``generate()`` over its (sharded) training weights."""
    max_out_tokens: int = Field(512, ge=1)
    """Length of the static KV cache: prompt + new tokens of one ``generate`` call at most."""
    inference_tp_size: int = Field(1, ge=1)
    """Tensor-parallel degree of generation: groups of this many consecutive ranks decode their
    prompts together on AutoTP shards of the gathered weights (training stays ZeRO)."""
    release_inference_cache: bool = False
    """Free the static KV cache after every ``generate`` (True) or keep it for the next call
    of the same batch shape (False, DeepSpeed's default)."""
    pin_parameters: bool = True
    """Stage 3: gather all layers at once for a ``generate`` (True), or gather and fuse
    ``tp_gather_partition_size`` layers at a time to lower the gather's peak (False)."""
    tp_gather_partition_size: int = Field(8, ge=1)
    """Layers gathered together when parameters are not gathered all at once."""
    enable_cuda_graph: bool = False
    """DeepSpeed's switch for CUDA-graph decode. shardwise's fast path always compiles the decode
    step and replays it as a CUDA graph on CUDA, so this key changes nothing."""
