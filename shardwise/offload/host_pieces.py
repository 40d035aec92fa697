"""Stage 3's fp32 masters and gradient partitions: one flat buffer per optimizer group.

Each flat buffer holds this rank's owned elements of every partitioned trainable parameter
of its group; each parameter's *piece* is a view into it, so the optimizer's state maps onto
the checkpoint's ``ShardView``s one to one. Under ``offload_optimizer`` the buffers live in
(pinned) host memory.

The delayed update (DPU) steps one window's gradients in the background while the next
window writes its own: it keeps a second set of gradient buffers, and :meth:`swap_grads`
exchanges the two at every delayed step.

Parameters are named by key (``id(param)``), as in :class:`~.eager_steps.EagerSteps`.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .buffers import PieceSource
from .host_grads import alloc_host
from .nvme_states import placeholder


class HostPieces:
    """The masters (``flat_master``, ``piece``) and gradients (``flat_grad``, ``grad_of``)."""

    def __init__(self, groups: Sequence[Sequence[Tuple[int, PieceSource]]], *,
                 device: torch.device, pin: bool, double_grads: bool,
                 masters_on_nvme: bool = False, transient_grads: bool = False) -> None:
        """``masters_on_nvme``: no host masters, placeholders only; each piece gets its values
        while its sub-group is stepped (``offload/nvme_states.py``); ``transient_grads``: the
        gradient partitions' memory is freed between windows (:meth:`free_grads`)."""
        self.transient_grads = transient_grads
        self.flat_master: List[torch.Tensor] = []
        self.flat_grad: List[torch.Tensor] = []
        self.piece: Dict[int, torch.Tensor] = {}
        """fp32 master of each parameter with owned elements (a view into flat_master)."""
        self.grad_of: Dict[int, torch.Tensor] = {}
        """fp32 gradient partition of each such parameter (a view into flat_grad)."""
        self.spare_flat_grad: List[torch.Tensor] = []
        self.spare_grad_of: Dict[int, torch.Tensor] = {}
        """DPU: the other set of gradient partitions (empty without ``double_grads``)."""
        self.on_nvme = masters_on_nvme
        for group in groups:
            self._add_group(group, device, pin, 2 if double_grads else 1)
        self.free_grads()  # (transient ones) until the first gradient

    def _add_group(self, group: Sequence[Tuple[int, PieceSource]], device: torch.device,
                   pin: bool, grad_sets: int) -> None:
        total = sum(src.own_len for _, src in group)
        master = placeholder(total) if self.on_nvme else alloc_host(total, device, pin)
        grads = [alloc_host(total, device, pin) for _ in range(grad_sets)]
        off = 0
        for key, src in group:
            n = src.own_len
            view = master[off:off + n]
            if not self.on_nvme:
                view.copy_(src.shard[:n])
            view.grad = grads[0][off:off + n]
            if n:
                self.piece[key] = view
                self.grad_of[key] = view.grad
                if grad_sets == 2:
                    self.spare_grad_of[key] = grads[1][off:off + n]
            off += n
        self.flat_master.append(master)
        self.flat_grad.append(grads[0])
        if grad_sets == 2:
            self.spare_flat_grad.append(grads[1])

    def free_grads(self) -> None:
        """``transient_grads`` (partitions on the device), between two windows: their memory
        goes back until the next window's first gradient (:meth:`regrow_grads`), as FSDP2's
        sharded gradients do, so a training step's peak at the start of backward holds no
        gradient partitions (4 bytes a parameter over the ranks). Their values are dead: the first gradient of a
        window overwrites its partition, and the step zeroes those that got none."""
        for g in self.flat_grad if self.transient_grads else ():
            g.untyped_storage().resize_(0)

    def regrow_grads(self) -> None:
        for g in self.flat_grad if self.transient_grads else ():
            storage, nbytes = g.untyped_storage(), g.numel() * g.element_size()
            if storage.size() < nbytes:
                storage.resize_(nbytes)

    def grads(self) -> List[torch.Tensor]:
        """The non-empty flat gradient buffers (what the norm and the step read)."""
        return [g for g in self.flat_grad if g.numel()]

    def scale_grads(self, factor: Optional[torch.Tensor]) -> None:
        """``grads *= factor`` (None: nothing to scale)."""
        if factor is None:
            return
        for g in self.grads():
            g.mul_(factor.to(g.device))

    def attach_grads(self, on: bool) -> None:
        """Each piece's ``.grad``: its current gradient partition, or None (hidden from a
        step that must not touch the pieces)."""
        for key, piece in self.piece.items():
            piece.grad = self.grad_of[key] if on else None

    def swap_grads(self) -> None:
        """DPU: the next window accumulates into the other gradient partitions."""
        self.flat_grad, self.spare_flat_grad = self.spare_flat_grad, self.flat_grad
        self.grad_of, self.spare_grad_of = self.spare_grad_of, self.grad_of

    def spare_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.spare_flat_grad)
