"""What the foreach-based optimizers (Lamb, Lion) share: gathering one group's tensors."""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch


def collect_group(optimizer: torch.optim.Optimizer, group: dict,
                  state_keys: Sequence[str]) -> Dict[str, List[torch.Tensor]]:
    """The group's parameters with gradients, their gradients, their ``step`` counters and
    each of ``state_keys`` (created as zeros, torch-Adam style, on first use)."""
    out: Dict[str, List[torch.Tensor]] = {"params": [], "grads": [], "step": [],
                                          **{k: [] for k in state_keys}}
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"{type(optimizer).__name__} does not support sparse gradients; "
                               "use Adam or SparseAdam.")
        state = optimizer.state[p]
        if not state:
            # the same state layout as torch's Adam, so tools that read exp_avg keep working
            state["step"] = torch.tensor(0.0)
            for key in state_keys:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        out["params"].append(p)
        out["grads"].append(p.grad)
        out["step"].append(state["step"])
        for key in state_keys:
            out[key].append(state[key])
    return out
