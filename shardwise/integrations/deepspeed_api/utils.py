"""``deepspeed.utils``: the logger and the helpers Hugging Face code imports from it."""
from __future__ import annotations

from typing import Any, List

import torch

from ...errors import ShardwiseError
from ...utils.logging import log_dist, logger

__all__ = ["logger", "log_dist", "set_z3_leaf_modules"]


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: List[Any]) -> List[Any]:
    """DeepSpeed marks MoE blocks as ZeRO-3 leaves (gathered whole). shardwise's stage 3 gathers
    per module and has no leaf mode yet: say so instead of training a different way."""
    raise ShardwiseError(
        "deepspeed.utils.set_z3_leaf_modules (Accelerate's transformer_moe_cls_names / "
        "DeepSpeedPlugin(transformer_moe_cls_names=...)) is not supported by shardwise: remove "
        "that option; stage 3 gathers each module's parameters when it runs.")
