"""Inference: ``init_inference``, the ``InferenceEngine``, the fast decode path, AutoTP, int8.

One concern per file: ``config`` (the DeepSpeed-compatible config), ``engine``
(``init_inference`` and the engine), ``arch`` (finding a decoder's parts by structure),
``decode`` (the static-cache prefill/step/loop, compiled and graph-captured on CUDA),
``layers`` (fused / sharded / int8 projections), ``generation`` (Hugging Face generate
settings), ``tp`` (AutoTP), ``quant`` (weight-only int8 and the perplexity check),
``loading`` (``checkpoint=``), ``on_device`` (``OnDevice``), ``zero_inference`` (the
ZeRO-Inference seam), ``cli`` (``shardwise generate``). See docs/inference.md.
"""
from __future__ import annotations

from .config import InferenceConfig, load_inference_config
from .engine import InferenceEngine, init_inference
from .on_device import OnDevice

__all__ = ["init_inference", "InferenceEngine", "InferenceConfig", "load_inference_config",
           "OnDevice"]
