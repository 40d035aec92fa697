"""The data-parallel loader ``initialize(training_data=...)`` returns.

Each rank reads its own ``1/world`` of the data set through a ``DistributedSampler``, one
micro batch at a time. The loader remembers its epoch and position so a checkpoint can
resume mid-epoch (``state_dict`` / ``load_state_dict``).

Worker processes (``num_workers > 0``, e.g. ``--dataloader_num_workers 2``) start with the
platform's default method, as a plain PyTorch ``DataLoader``: ``fork`` on Linux (Python
3.13 and older), so a DeepSpeed-style script without an ``if __name__ == "__main__":`` guard
works there; ``spawn`` on Windows (its only method) and macOS, and ``forkserver`` on Linux
from Python 3.14, where such a script needs the guard, as with any PyTorch DataLoader. A ``multiprocessing.set_start_method`` of the script's own is honoured.

Worker seeds: every epoch draws its workers' base seed from a generator seeded by
``(seed, rank, epoch)``; PyTorch gives worker ``i`` the seed ``base + i`` and seeds
``random``, NumPy and torch with it. So seeds differ between workers, ranks and epochs, and
a run resumed from a checkpoint gets the same seeds as the original run.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Callable, Dict, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def worker_base_seed(seed: int, rank: int, epoch: int) -> int:
    """A well-mixed 63-bit seed for one rank's data loader workers in one epoch."""
    digest = hashlib.sha256(f"shardwise-dataloader/{seed}/{rank}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class ShardwiseDataLoader:
    def __init__(self, dataset: Dataset, *, batch_size: int, rank: int, world_size: int,
                 collate_fn: Optional[Callable] = None, num_workers: Optional[int] = None,
                 pin_memory: Optional[bool] = None, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False) -> None:
        if num_workers is None:
            num_workers = int(os.environ.get("SHARDWISE_DATALOADER_NUM_WORKERS", "0"))
        if pin_memory is None:
            pin_memory = os.environ.get("SHARDWISE_PIN_MEMORY", "0") == "1"
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                          shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler,
                                 collate_fn=collate_fn, num_workers=num_workers,
                                 pin_memory=pin_memory and torch.cuda.is_available(),
                                 drop_last=drop_last,
                                 generator=torch.Generator().manual_seed(seed))
        self.seed = seed
        self.rank = rank
        self.epoch = 0
        self.position = 0
        self._skip = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        # Its own generator: making an iterator must not draw from the global RNG (a resumed
        # run would drift from the original), and the workers' seeds follow (seed, rank, epoch).
        self.loader.generator = torch.Generator().manual_seed(
            worker_base_seed(self.seed, self.rank, self.epoch))
        skip, self._skip = self._skip, 0
        self.position = 0
        for i, batch in enumerate(self.loader):
            if i < skip:
                continue
            self.position = i + 1
            yield batch
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self._skip = self.position = int(state["position"])
