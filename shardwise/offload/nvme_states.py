"""Optimizer states on NVMe (ZeRO-Infinity's ``offload_optimizer: {device: "nvme"}``).

The fp32 masters and every per-element state the CPU optimizer keeps for them (AdamW:
``exp_avg``, ``exp_avg_sq``) live in per-rank swap files (:class:`~shardwise.io.swap.SwapStore`,
one file per *sub-group*); host memory holds only a small ring of pinned buffers and the
gradients. The optimizer step streams the sub-groups through the ring::

    read sub-group i+1   |   step i on the CPU, copy its masters to the device   |   write i-1

What the strategies give (:class:`SubGroup`): the tensors the inner optimizer steps (its
"keys": a bucket's slot masters at stages 1-2, the parameters' master pieces at stage 3) and
where each sits in the sub-group's flat master. While a sub-group is in the ring its keys'
``.data`` and their optimizer states are views of the ring buffer; outside it they are
placeholders of the right shape (a zero-stride zero: reading gives zeros, writing raises),
and the tensor states are not in ``inner.state`` (scalars such as ``step`` stay there).

Checkpoints: :meth:`NvmeOptimizerStates.materialize` reads every sub-group back into fresh
host tensors (what ``shard_views`` hands the checkpoint writer and reader), and
:meth:`~NvmeOptimizerStates.dematerialize` writes them back (after a load) and frees them.
"""
from __future__ import annotations

import inspect
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..errors import ConfigError
from ..io.swap import SwapStore, TensorSpec
from ..io.swap_dir import SwapDir
from ..utils.logging import log_dist

#: A wait for the device copy that reads a ring buffer (None: the copy is already done).
CopyWait = Optional[Callable[[], None]]

NVME_PATH_KEY = "zero_optimization.offload_optimizer.nvme_path"
BUFFER_COUNT_KEY = "zero_optimization.offload_optimizer.buffer_count"
#: Stage-3 sub-group elements when the config does not set ``sub_group_size``.
NVME_DEFAULT_SUB_GROUP = 100_000_000


def placeholder(numel: int) -> torch.Tensor:
    """``numel`` fp32 zeros in 4 bytes: a swapped-out master's ``.data`` (right shape, so
    gradients can stay attached; an in-place write of more than one element raises)."""
    return torch.zeros(1, dtype=torch.float32).expand(numel)


@dataclass(frozen=True)
class SubGroup:
    """One swap file's worth of masters: the keys the optimizer steps and their offsets in
    the sub-group's flat fp32 master of ``numel`` elements (gaps are padding)."""

    keys: Tuple[torch.Tensor, ...]
    offsets: Tuple[int, ...]
    numel: int

    @classmethod
    def packed(cls, keys: Sequence[torch.Tensor]) -> "SubGroup":
        """Keys laid end to end."""
        offsets, pos = [], 0
        for key in keys:
            offsets.append(pos)
            pos += key.numel()
        return cls(tuple(keys), tuple(offsets), pos)

    def spans(self) -> List[Tuple[torch.Tensor, int, int]]:
        return [(k, o, o + k.numel()) for k, o in zip(self.keys, self.offsets)]


def split_sub_groups(keys: Sequence[torch.Tensor], max_elems: int) -> List[SubGroup]:
    """Consecutive keys packed into sub-groups of at most ``max_elems`` elements (a key
    larger than that gets a sub-group of its own)."""
    out: List[SubGroup] = []
    run: List[torch.Tensor] = []
    size = 0
    for key in keys:
        if run and size + key.numel() > max_elems:
            out.append(SubGroup.packed(run))
            run, size = [], 0
        run.append(key)
        size += key.numel()
    if run:
        out.append(SubGroup.packed(run))
    return out


def optimizer_state_names(inner: torch.optim.Optimizer) -> Tuple[str, ...]:
    """The per-element state tensors ``inner`` keeps for a parameter (AdamW: ``exp_avg``,
    ``exp_avg_sq``), found by one step of a throwaway twin on a 2-element tensor."""
    probe = torch.zeros(2, dtype=torch.float32)
    try:
        twin = type(inner)([probe], **_init_kwargs(type(inner), inner.defaults))
        probe.grad = torch.full_like(probe, 1e-3)
        twin.step()
    except Exception as err:  # any optimizer the user brings: say which and why
        raise ConfigError(f"offload_optimizer device \"nvme\": cannot find the per-element state "
                          f"of optimizer {type(inner).__name__} (a probe step of a copy failed: "
                          f"{err}); use \"device\": \"cpu\" with this optimizer.") from err
    state = twin.state.get(probe, {})
    return tuple(k for k, v in state.items() if torch.is_tensor(v) and v.shape == probe.shape)


def _init_kwargs(cls: type, defaults: Dict[str, Any]) -> Dict[str, Any]:
    """The ``defaults`` that ``cls.__init__`` accepts (torch's AdamW keeps a
    ``decoupled_weight_decay`` default its constructor does not take)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


class NvmeOptimizerStates:
    """The swap files and the streamed step of one strategy's offloaded masters."""

    def __init__(self, groups: Sequence[SubGroup], initial: Callable[[int], torch.Tensor], *,
                 nvme_path: str, rank: int, aio_kwargs: Dict[str, Any], buffer_count: int,
                 on_flat: Optional[Callable[[int, torch.Tensor], None]] = None) -> None:
        """``initial(i)``: sub-group i's starting flat master (read once, at :meth:`bind`);
        ``on_flat(i, t)``: told whenever sub-group i's flat master changes place."""
        if isinstance(buffer_count, bool) or not isinstance(buffer_count, int) or buffer_count < 2:
            raise ConfigError(f"{BUFFER_COUNT_KEY} = {buffer_count!r}: NVMe offload streams the "
                              "optimizer states through at least 2 pinned buffers (3 or more "
                              "overlap reading, stepping and writing back); e.g. 4.")
        self.groups = list(groups)
        self._initial: Optional[Callable[[int], torch.Tensor]] = initial
        self._on_flat = on_flat
        self._aio_kwargs = dict(aio_kwargs)
        self._buffer_count = buffer_count
        run = f"{time.strftime('%Y%m%d-%H%M%S')}-pid{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # checked now (initialize): a bad path fails here with its name, not at step 1
        self.dir = SwapDir(nvme_path, rank, key=NVME_PATH_KEY, run_id=run)
        self.store: Optional[SwapStore] = None
        self.inner: Optional[torch.optim.Optimizer] = None
        self.names: Tuple[str, ...] = ()
        self._stateful: Set[int] = set()
        """ids of the keys whose optimizer state exists (in the swap files)."""
        self.resident = False
        """Every sub-group is in fresh host tensors (:meth:`materialize`)."""
        self._dirty = False
        """The resident values changed since they were read (a checkpoint was loaded)."""
        self._closed = False

    # --- setup -------------------------------------------------------------------------
    def bind(self, inner: torch.optim.Optimizer) -> None:
        """Lay out the swap files for ``inner``'s state and write the initial masters."""
        if self.store is not None:
            self.inner = inner
            return
        self.inner = inner
        self.names = optimizer_state_names(inner)
        specs = [[TensorSpec(name, g.numel, torch.float32) for name in ("master",) + self.names]
                 for g in self.groups]
        need = sum(len(s) * g.numel * 4 for s, g in zip(specs, self.groups))
        self.dir._check_space(need)  # the files' size is known only now (the state names)
        self.store = SwapStore(self.dir, specs, aio_kwargs=self._aio_kwargs,
                               buffer_count=self._buffer_count)
        for i, group in enumerate(self.groups):
            master = self._initial(i).detach().reshape(-1).float()
            zeros = [torch.zeros(group.numel) for _ in self.names]
            self.store.write_group(i, [master] + zeros)
            self._release(i)
        self._initial = None
        ring = self.store.buffer_count * max((lay.nbytes for lay in self.store.layouts), default=0)
        log_dist(f"NVMe optimizer offload: {len(self.groups)} sub-group(s), "
                 f"{need / 2**30:.2f} GiB of masters and {', '.join(self.names) or 'no states'} "
                 f"in {self.dir.path}; ring of {self.store.buffer_count} pinned buffers, "
                 f"{ring / 2**20:.1f} MiB", ranks=[0])

    # --- keys <-> buffers ------------------------------------------------------------------
    def _bind(self, i: int, views: List[torch.Tensor]) -> None:
        """Point sub-group i's keys (and their states) at ``views`` (master, then states)."""
        for key, lo, hi in self.groups[i].spans():
            key.data = views[0][lo:hi]
            if id(key) in self._stateful:
                state = self.inner.state[key]
                for name, view in zip(self.names, views[1:]):
                    state[name] = view[lo:hi]
        if self._on_flat is not None:
            self._on_flat(i, views[0])

    def _adopt(self, i: int, views: List[torch.Tensor]) -> None:
        """After a step: state the optimizer made (first step) or replaced goes into
        ``views``; what it wrote in place is there already."""
        for key, lo, hi in self.groups[i].spans():
            if key.data.data_ptr() != views[0][lo:hi].data_ptr():
                views[0][lo:hi].copy_(key.data.reshape(-1))
            state = self.inner.state.get(key)
            if not state:
                continue
            for name, view in zip(self.names, views[1:]):
                value = state.get(name)
                if torch.is_tensor(value) and value.data_ptr() != view[lo:hi].data_ptr():
                    view[lo:hi].copy_(value.reshape(-1))
            if all(torch.is_tensor(state.get(name)) for name in self.names):
                self._stateful.add(id(key))

    def _release(self, i: int) -> None:
        """Sub-group i leaves host memory: placeholders for its keys, no tensor states."""
        group = self.groups[i]
        for key, lo, hi in group.spans():
            key.data = placeholder(hi - lo)
            state = self.inner.state.get(key) if self.inner is not None else None
            for name in self.names:
                if state:
                    state.pop(name, None)
        if self._on_flat is not None:
            self._on_flat(i, placeholder(group.numel))

    def _current(self, i: int) -> List[torch.Tensor]:
        """Sub-group i's values as the keys and ``inner.state`` hold them now (resident)."""
        group = self.groups[i]
        flats = [torch.zeros(group.numel) for _ in range(1 + len(self.names))]
        for key, lo, hi in group.spans():
            flats[0][lo:hi].copy_(key.data.reshape(-1))
            state = self.inner.state.get(key) or {}
            values = [state.get(name) for name in self.names]
            if all(torch.is_tensor(v) for v in values):
                for flat, value in zip(flats[1:], values):
                    flat[lo:hi].copy_(value.reshape(-1))
                self._stateful.add(id(key))
            else:
                self._stateful.discard(id(key))
        return flats

    # --- the streamed step -------------------------------------------------------------------
    def step_groups(self, step: Callable[[int], None], to_device: Callable[[int], CopyWait],
                    order: Optional[Sequence[int]] = None) -> None:
        """For each sub-group, with i+1 read ahead and i-1 written behind: bring it into a
        ring buffer, ``step(i)`` (attach the gradients and step the inner optimizer),
        ``to_device(i)`` (start copying its masters into the device parameters), then let
        it go. A buffer is read into again only after the copy that reads it finished."""
        self.dematerialize(write=self._dirty)
        lag = 1 if self.store.buffer_count >= 3 else 0
        copies: Deque[CopyWait] = deque()

        def run(i: int, views: List[torch.Tensor]) -> None:
            self._bind(i, views)
            try:
                step(i)
                self._adopt(i, views)
                copies.append(to_device(i))
            finally:
                self._release(i)
            while len(copies) > lag:
                _wait(copies.popleft())

        try:
            self.store.stream(run, order=order)
        finally:
            while copies:
                _wait(copies.popleft())

    # --- checkpoints and edits ---------------------------------------------------------------
    def materialize(self) -> None:
        """Every sub-group into fresh host tensors (for a checkpoint); idempotent."""
        if self.resident:
            return
        for i in range(len(self.groups)):
            self._bind(i, self.store.read_group(i))
        self.resident, self._dirty = True, False

    def dematerialize(self, write: bool) -> None:
        """Back to swap-only: with ``write``, the resident values are written first."""
        if not self.resident:
            return
        for i in range(len(self.groups)):
            if write:
                self.store.write_group(i, self._current(i))
            self._release(i)
        self.resident, self._dirty = False, False

    def edit(self, key: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> None:
        """Run ``fn(key)`` with ``key``'s sub-group in host memory and store the result
        (``GatheredParameters`` with a modifier rank rewrote a master)."""
        if self.resident:
            fn(key)
            self._dirty = True
            return
        for i, group in enumerate(self.groups):
            if any(k is key for k in group.keys):
                self._bind(i, self.store.read_group(i))
                try:
                    fn(key)
                    self.store.write_group(i, self._current(i))
                finally:
                    self._release(i)
                return

    def close(self) -> None:
        """Stop the IO threads and remove the swap folder (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.store is not None:
            self.store.close()
        else:
            self.dir.close()


def _wait(copy: CopyWait) -> None:
    if copy is not None:
        copy()


def nvme_sub_group_elems(zero: Any) -> int:
    """Elements per stage-3 sub-group: ``sub_group_size`` when the config sets it, else
    100M (DeepSpeed's default of 1e9 would make each pinned ring buffer 12 GB for AdamW)."""
    fields = getattr(zero, "model_fields_set", set())
    size = int(zero.sub_group_size) if "sub_group_size" in fields else NVME_DEFAULT_SUB_GROUP
    return max(size, 1)


def states_from_config(config: Any, groups: Sequence[SubGroup],
                       initial: Callable[[int], torch.Tensor], rank: int,
                       on_flat: Optional[Callable[[int, torch.Tensor], None]] = None
                       ) -> NvmeOptimizerStates:
    """An :class:`NvmeOptimizerStates` for ``config``'s ``offload_optimizer`` and ``aio``."""
    oo = config.zero_optimization.offload_optimizer
    return NvmeOptimizerStates(groups, initial, nvme_path=oo.nvme_path, rank=rank,
                               aio_kwargs=config.aio.handle_kwargs(),
                               buffer_count=int(oo.buffer_count), on_flat=on_flat)


def _global_rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def for_buckets(config: Any, buckets: Sequence[Any]) -> NvmeOptimizerStates:
    """Stages 1-2: one sub-group per offloaded flat bucket (``offload.buffers.HostBucket``):
    its slots' masters at their places in the bucket's owned range ``[lo, hi)``; the
    bucket's ``master`` follows the sub-group's flat master."""
    groups = []
    for b in buckets:
        slots = [s for s in b.slots if s.master is not None]
        groups.append(SubGroup(tuple(s.master for s in slots),
                               tuple(s.offset + s.own_lo - b.lo for s in slots), b.hi - b.lo))

    def on_flat(i: int, flat: torch.Tensor) -> None:
        buckets[i].master = flat

    return states_from_config(config, groups, lambda i: buckets[i].master, _global_rank(),
                              on_flat=on_flat)


def pieces_on_nvme(config: Any, pieces: Sequence[Tuple[torch.Tensor, torch.Tensor]]
                   ) -> NvmeOptimizerStates:
    """Stage 3: ``(master piece, its shard)`` pairs packed into sub-groups of
    :func:`nvme_sub_group_elems`; the masters start from the shards' values."""
    groups = split_sub_groups([piece for piece, _ in pieces], nvme_sub_group_elems(
        config.zero_optimization))
    shard_of = {id(piece): shard for piece, shard in pieces}

    def initial(i: int) -> torch.Tensor:
        group = groups[i]
        flat = torch.zeros(group.numel)
        for key, lo, hi in group.spans():
            flat[lo:hi].copy_(shard_of[id(key)].reshape(-1))
        return flat

    return states_from_config(config, groups, initial, _global_rank())
