"""The consolidated (gathered) module state dict Accelerate asks a ZeRO-3 engine for.

It reuses the gathering of ``engine.save_16bit_model`` (checkpoint/engine_io.py): each
rank contributes the slice it owns, rank 0 receives whole tensors in the compute dtype.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ..checkpoint.async_save import wait_pending
from ..checkpoint.engine_io import _gather_full, _views
from ..checkpoint.engine_state import _aliases, _persistent_buffers, _stage


def consolidated_state_dict(engine: Any, exclude_frozen_parameters: bool = False
                            ) -> Optional[Dict[str, torch.Tensor]]:
    """Rank 0: every parameter (tied names included, as ``module.state_dict()`` lists them)
    and persistent buffer, whole, on the CPU. Other ranks: None. All ranks must call it."""
    wait_pending(engine)  # an async checkpoint still reading the weights finishes first
    stage = _stage(engine)
    rank = int(getattr(engine, "global_rank", 0))
    views = {v.name: v for v in _views(engine)}
    state: Dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        if exclude_frozen_parameters and not p.requires_grad:
            continue
        full = _gather_full(engine, name, p, views.get(name), stage)
        if rank == 0:
            state[name] = full
    if rank != 0:
        return None
    for first, others in _aliases(engine.module).items():
        for other in others:
            if first in state:
                state[other] = state[first]
    for name, buf in _persistent_buffers(engine.module):
        state[name] = buf.detach().cpu()
    return state
