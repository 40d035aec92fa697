"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``."""
from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """Copy every tensor in a (nested) state dict to ``device`` so that ``torch.save`` writes
    only each tensor's own storage, not views into flat buffers."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item
