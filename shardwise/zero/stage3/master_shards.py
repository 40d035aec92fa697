"""Stage 3: the updated fp32 masters into the compute-dtype shards, and back.

After a step (or an eager piece step, or a load) each trained parameter's fp32 piece is
written into its shard's storage; a checkpoint loaded weights-only goes the other way. With
the delayed update (DPU) and host shards, the background step writes its result into a
second set of *spare* shards, which are swapped in at the next boundary, so the step's
critical path holds no pass over the model on the CPU.

Parameters are named by key (``id(param)``), as in ``shardwise.offload.host_pieces``.
"""
from __future__ import annotations

from typing import AbstractSet, Dict, Iterable, List, Optional, Tuple

import torch

from ...accelerator import get_accelerator
from ...monitor.copy_timers import H2D, OffloadCopyTimer, copy_span
from .params import Stage3Params
from .partition import PartitionedParam
from .storage import TensorShard


class MasterShards:
    """Writes ``pieces`` (fp32 masters) into the storages of their partition records."""

    def __init__(self, *, params: Stage3Params, rec: Dict[int, PartitionedParam],
                 pieces: Dict[int, torch.Tensor], device: torch.device, spare: bool,
                 pin: bool, masters_on_host: bool) -> None:
        """``spare``: keep spare shards for DPU's background writes (host shards only);
        ``masters_on_host``: the masters are host memory and the shards device memory (the
        writes are timed copies to the device)."""
        self.params = params
        self.rec = rec
        self.pieces = pieces
        self.device = device
        self.masters_on_host = masters_on_host
        self.copy_timer: Optional[OffloadCopyTimer] = None
        """``wall_clock_breakdown``: times the master-to-shard copies (None: off)."""
        shard_device = params.partitioner.shard_device
        self.spare: Dict[int, TensorShard] = {
            key: TensorShard.copy_of(rec[key].shard, shard_device, params.compute_dtype, pin)
            for key in pieces} if spare else {}
        """DPU: the shards the background step writes, swapped in at the next boundary."""

    def write(self, skip: AbstractSet[int] = frozenset()) -> None:
        """Every master into its shard (but those in ``skip``, which an eager step wrote)."""
        self.params.before_shard_write()
        timed = self.copy_timer if self.masters_on_host else None
        stream = (get_accelerator().current_stream(self.device)
                  if timed is not None and self.device.type == "cuda" else None)
        with copy_span(timed, H2D, stream):
            for key, piece in self.pieces.items():
                storage = self.rec[key].storage
                if key not in skip and not (storage.resident and storage.tensor() is piece):
                    storage.write_(piece, non_blocking=True)  # (a master that is its shard: no copy)
        if self.masters_on_host and self.device.type == "cuda":
            # the shards were DMA'd from the pinned masters, which the next CPU step rewrites
            get_accelerator().current_stream(self.device).synchronize()

    def write_keys(self, keys: Iterable[int]) -> None:
        """offload_param: the pieces an eager step just updated, into their host shards."""
        for key in keys:
            self.rec[key].storage.write_(self.pieces[key])

    def spare_writes(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``(master, spare shard)`` pairs for the background step to copy (DPU)."""
        return [(self.pieces[key], spare.tensor()) for key, spare in self.spare.items()]

    def swap_spares(self) -> None:
        """The shards the background step wrote become the weights; the others (no copy to
        the device may still read them) receive the next background step's result."""
        self.params.before_shard_write()
        for key, spare in self.spare.items():
            self.rec[key].storage.swap(spare)

    def spare_bytes(self) -> int:
        return sum(s.numel * s.tensor().element_size() for s in self.spare.values())

    def load(self, weights_only: bool) -> None:
        """A checkpoint wrote into the views: shards from masters, or (``weights_only``: the
        masters were not loaded) masters from shards."""
        self.params.before_shard_write()
        with torch.no_grad():
            for key, piece in self.pieces.items():
                storage = self.rec[key].storage
                if weights_only:
                    piece.copy_(storage.tensor()[:piece.numel()])
                else:
                    storage.write_(piece)


def shards_from_masters(rec: Dict[int, PartitionedParam], pieces: Dict[int, torch.Tensor]) -> None:
    """One rank, everything on the device: each trained parameter's fp32 master becomes its
    shard, and a gather casts it into the compute-dtype buffer (FSDP2's mixed precision does
    the same), so no compute-dtype copy of the whole model stays resident beside the masters:
    2 bytes a parameter under bf16 (2 GiB at 1.1B). The gathers read 4 bytes a parameter
    instead of 2, and :meth:`MasterShards.write` has nothing left to copy."""
    for key, piece in pieces.items():
        if rec[key].chunk == piece.numel() and rec[key].storage.resident:
            rec[key].storage = TensorShard(piece)
