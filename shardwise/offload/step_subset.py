"""Step some of an optimizer's tensors: attach their gradients, hide the others'.

A torch optimizer steps every tensor whose ``.grad`` is set. The offload schedules step a
subset at a time (one bucket as soon as its gradients are on the host, the pieces whose last
gradient arrived, the persistent parameters apart from a background step), so they attach
the subset's gradients and hide every other gradient of the same optimizer for the call.
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch

GradPair = Tuple[torch.Tensor, Optional[torch.Tensor]]


class HiddenGrads:
    """Gradients taken off their tensors until :meth:`restore` gives them back."""

    def __init__(self) -> None:
        self._pairs: List[GradPair] = []

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def hide(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self._pairs.append((t, t.grad))
            t.grad = None

    def restore(self, only: Optional[Callable[[torch.Tensor], bool]] = None) -> None:
        """Give the hidden gradients back (those whose tensor ``only`` accepts, or all)."""
        keep: List[GradPair] = []
        for t, g in self._pairs:
            if only is None or only(t):
                t.grad = g
            else:
                keep.append((t, g))
        self._pairs = keep


def step_subset(step: Callable[[], None], grads: Sequence[GradPair],
                hide: Iterable[torch.Tensor] = ()) -> None:
    """Run ``step`` with gradients on exactly the tensors of ``grads`` (plus those already
    visible and not in ``hide``); afterwards the subset's gradients are detached again and
    the hidden ones restored."""
    hidden = HiddenGrads()
    hidden.hide(hide)
    for t, g in grads:
        t.grad = g
    try:
        step()
    finally:
        for t, _ in grads:
            t.grad = None
        hidden.restore()
