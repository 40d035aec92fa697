"""Stage 3's eager CPU step under ``offload_optimizer``: step pieces while backward runs.

When nothing global changes the update (no clipping, no fp16 loss scale), a parameter's
update is known as soon as its last gradient of the boundary micro step is on the host. The
gradient accumulator's worker then calls :meth:`EagerSteps.finalizer`'s callback; once about
a tenth of ``reduce_bucket_size`` elements are ready they are stepped together (the inner
optimizer sees only their gradients: every other master's gradient is hidden for the window)
while backward still runs on earlier layers. At the engine's step the rest are stepped, then
the persistent parameters (device masters) with their gradients given back.

Parameters are named by key (``id(param)``); ``pieces`` maps a key to its fp32 master piece
and ``grads()`` to its gradient partition.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Set

import torch

from .step_subset import HiddenGrads, step_subset

WriteBack = Callable[[List[int]], None]


class EagerSteps:
    """The eager window of one stage-3 engine (opened at a boundary backward)."""

    def __init__(self, *, pieces: Dict[int, torch.Tensor],
                 grads: Callable[[], Dict[int, torch.Tensor]], batch_elems: int,
                 prescale: Callable[[], float], write_back: Optional[WriteBack]) -> None:
        self.pieces = pieces
        self.grads = grads
        self.batch_elems = batch_elems
        self.prescale = prescale
        self.write_back = write_back
        """Called with the keys just stepped (their updated pieces into the host shards)."""
        self.inner: Optional[torch.optim.Optimizer] = None
        self.open = False
        self.stepped: Set[int] = set()
        self._hidden = HiddenGrads()
        self._ready: List[int] = []
        self._ready_elems = 0

    def reset(self) -> None:
        """A new boundary backward: nothing stepped or ready yet."""
        self.stepped = set()
        self._ready, self._ready_elems = [], 0

    def start(self, other_masters: Iterable[torch.Tensor]) -> None:
        """Open the window: the worker's steps must see only the pieces they update."""
        self.open = True
        self._hidden.hide(other_masters)
        self._hidden.hide(self.pieces.values())

    def finalizer(self, key: int) -> Callable[[], None]:
        """Runs on the worker once ``key``'s last gradient is on the host."""
        def run() -> None:
            self._ready.append(key)
            self._ready_elems += self.grads()[key].numel()
            if self._ready_elems >= self.batch_elems:
                self.step(self._ready)
                self._ready, self._ready_elems = [], 0
        return run

    def step(self, keys: List[int]) -> None:
        """One inner-optimizer step over just these pieces."""
        prescale = self.prescale()
        grads = self.grads()
        subset = []
        for key in keys:
            g = grads[key]
            if prescale != 1.0:
                g.mul_(prescale)
            subset.append((self.pieces[key], g))
        step_subset(self.inner.step, subset)
        self.stepped.update(keys)
        if self.write_back is not None:
            self.write_back(keys)

    def finish(self, keys: List[int], step_others: Callable[[], None]) -> None:
        """The engine's step: the pieces not stepped yet, then (their gradients given back)
        the other masters, then the pieces' gradients back; the window closes."""
        rest = [k for k in keys if k in self.pieces and k not in self.stepped]
        if rest:
            self.step(rest)
        self.restore(pieces=False)
        step_others()
        self.restore(pieces=True)

    def restore(self, pieces: bool) -> None:
        """Give the hidden gradients back (the other masters', or the pieces' which closes
        the window)."""
        piece_ids = {id(pc) for pc in self.pieces.values()}
        self._hidden.restore(only=lambda m: (id(m) in piece_ids) == pieces)
        if pieces:
            self.open = False
