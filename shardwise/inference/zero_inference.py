"""The ZeRO-Inference seam: where ``zero.stage = 3`` + ``offload_param`` will place weights.

ZeRO-Inference (parameters partitioned over ranks and offloaded to CPU/NVMe, streamed to
the device layer by layer during generation) is the next issue; it will stand on stage 3's
placement layer without an optimizer. Until it exists, every inference config goes through
``place_model`` here: it puts the whole model on the inference device and, when the config
asks for parameter offload, says once that the offload is not applied yet. Replacing this
one function is all the engine needs to gain ZeRO-Inference.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from shardwise.utils.logging import warn_once

from .config import InferenceConfig


def offload_note(cfg: InferenceConfig) -> Optional[str]:
    """The one-time warning for a ZeRO-Inference config (None when the config has none)."""
    if not cfg.wants_param_offload:
        return None
    off = cfg.zero.offload_param
    return (f"zero.stage = 3 with offload_param.device = \"{off.device}\" asks for ZeRO-Inference "
            f"(weights offloaded and streamed per layer); it comes with the ZeRO-Inference "
            f"feature and is not applied yet: the whole model is placed on the inference device. "
            f"Remove zero/zero_optimization from the inference config to silence this.")


def place_model(model: nn.Module, cfg: InferenceConfig, device: torch.device,
                dtype: Optional[torch.dtype]) -> nn.Module:
    """Put ``model`` where inference runs (today: all of it on ``device``, in ``dtype``)."""
    note = offload_note(cfg)
    if note:
        warn_once(note)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model.to(device)
