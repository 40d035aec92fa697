"""Per-parameter partitions for ZeRO stage 3: the record of each parameter and its owner.

Every partitioned parameter is flattened and padded to a multiple of the world size W;
rank r keeps the contiguous chunk ``[r·c, (r+1)·c)`` (``c = padded / W``) as its *shard*
(a :class:`~.storage.ShardStorage`). Outside a gather the parameter's ``.data`` is an empty
tensor of the compute dtype on the compute device; its :class:`PartitionedParam` record
keeps the full geometry. Gathering and releasing are in ``gather.py``.

A :class:`Partitioner` owns the records of the parameters it partitioned (one per engine, one
per ``zero.Init`` context) and nothing is stored on the parameters themselves. The one table
of the process, :func:`owner_of`, only says which partitioner holds a parameter (weakly, so
that ``GatheredParameters(params)`` finds the right engine's gather context); an engine
adopting a model built under ``zero.Init`` takes the records over.

Per-parameter (not per-module) partitions keep tied weights simple (one record per
Parameter object, whichever module uses it) and let ``zero.Init`` and the strategy share
one layout, so a model built under ``zero.Init`` is adopted without any communication.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from ...comm.topology import global_rank, group_world_rank  # noqa: F401 (re-exported)
from ...errors import ZeroError
from ...utils.hooks import weak_method
from .storage import ShardStorage, TensorShard

if TYPE_CHECKING:
    from .file_shard import ParamSwapper

RELEASED, INFLIGHT, GATHERED = "released", "inflight", "gathered"

OnModified = Callable[[torch.nn.Parameter], None]


@dataclass(eq=False)
class PartitionedParam:
    """The stage-3 state of one parameter, owned by its :class:`Partitioner`."""

    param_ref: "weakref.ref[torch.nn.Parameter]" = field(repr=False)
    """The parameter whose ``.data`` this record points at its gathered value or ``empty``
    (weakly: the parameter's lifetime is the model's)."""
    shape: torch.Size
    """The full, unpartitioned shape."""
    numel: int
    """Elements of the full parameter."""
    world: int
    rank: int
    group: Optional[dist.ProcessGroup]
    storage: ShardStorage
    """This rank's ``chunk`` elements (padding included), compute dtype, on the shard device
    (the accelerator, or the CPU under ``offload_param``); for a trained parameter of a
    one-rank engine without offload, its fp32 master itself (a gather casts it)."""
    compute_device: torch.device
    """Where the gathered parameter lives while a module uses it."""
    empty: torch.Tensor = field(repr=False, default=None)  # type: ignore[assignment]
    """The placeholder ``.data`` while released (numel 0, compute dtype and device)."""
    full: Optional[torch.Tensor] = field(repr=False, default=None)
    """Padded gather buffer (``chunk · world``); its storage has 0 bytes while released."""
    gathered: Optional[torch.Tensor] = field(repr=False, default=None)
    """``full[:numel]`` in the parameter's shape: made with ``full``, it follows the storage
    as that is released and refilled, so a gather only points ``.data`` at it."""
    status: str = RELEASED
    work: Any = field(repr=False, default=None)
    """The async all-gather handle while in flight."""
    staging: Optional[torch.Tensor] = field(repr=False, default=None)
    """Device copy of an offloaded shard while its all-gather runs."""
    fetched: Any = field(repr=False, default=None)
    """Event of an offloaded shard's copy to the device (world 1), until it is used."""
    active: int = 0
    """Forward calls / GatheredParameters contexts using the gathered value right now."""
    on_modified: Optional[OnModified] = field(repr=False, default=None)
    """Set by the strategy: refresh the fp32 master after the shard was overwritten."""

    @property
    def param(self) -> torch.nn.Parameter:
        return self.param_ref()

    @property
    def shard(self) -> torch.Tensor:
        """The chunk as a tensor (resident storages: their own memory)."""
        return self.storage.tensor()

    chunk: int = field(init=False)
    """Elements per rank (padding included): the shard's size (fixed at partition time)."""
    padded: int = field(init=False)
    """``chunk · world``: the gathered buffer's size (asked on every prefetch)."""

    def __post_init__(self) -> None:
        self.chunk = self.storage.numel
        self.padded = self.chunk * self.world

    @property
    def own_lo(self) -> int:
        """First element of the full parameter that this rank owns (clipped to numel)."""
        return min(self.rank * self.chunk, self.numel)

    @property
    def own_hi(self) -> int:
        return min((self.rank + 1) * self.chunk, self.numel)

    @property
    def own_len(self) -> int:
        return self.own_hi - self.own_lo

    def write_full_(self, full: torch.Tensor) -> None:
        """Store this rank's chunk of the full value ``full`` into the shard."""
        self.storage.write_(full.reshape(-1)[self.own_lo:self.own_hi])


def group_info(group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    """(world, rank) of ``group``; a process without torch.distributed is a world of one."""
    return group_world_rank(group)


# --- which partitioner holds a parameter ---------------------------------------------------
_OWNERS: Dict[int, "Partitioner"] = {}
"""id(parameter) -> its partitioner, while the parameter lives: a partitioner (and the
records it owns) lives as long as one of its parameters does, whether or not the
``zero.Init`` context or the engine that made it is still referenced."""


def _forget(pid: int, owner: "Partitioner") -> None:
    if _OWNERS.get(pid) is owner:
        del _OWNERS[pid]


def owner_of(p: Any) -> Optional["Partitioner"]:
    """The partitioner that holds ``p`` (partitioned, or whole but watched), if any."""
    owner = _OWNERS.get(id(p))
    if owner is None or not owner.holds(p):
        return None
    return owner


def record_of(p: Any) -> Optional[PartitionedParam]:
    """``p``'s partition record, or None for a whole (or foreign) tensor."""
    owner = owner_of(p)
    return owner.record(p) if owner is not None else None


def is_partitioned(p: Any) -> bool:
    return record_of(p) is not None


def full_shape(p: torch.Tensor) -> torch.Size:
    """The shape of ``p`` as the model sees it (the full shape of a partitioned one)."""
    rec = record_of(p)
    return rec.shape if rec is not None else p.shape


def full_numel(p: torch.Tensor) -> int:
    rec = record_of(p)
    return rec.numel if rec is not None else p.numel()


class Partitioner:
    """Splits parameters into this rank's shards and owns their records.

    ``gathers`` is the gather context (``gather.GatherContext``) that gathers and releases
    them: one per engine, so two engines in one process never touch each other's state.
    """

    def __init__(self, *, group: Optional[dist.ProcessGroup], shard_device: torch.device,
                 compute_device: torch.device, pin: bool = False,
                 swapper: Optional["ParamSwapper"] = None) -> None:
        from .gather import GatherContext
        self.swapper = swapper
        """``offload_param`` on NVMe: places the shards it takes in swap files."""
        self.group = group
        self.world, self.rank = group_info(group)
        self.shard_device = torch.device(shard_device)
        self.compute_device = torch.device(compute_device)
        self.pin = bool(pin)
        self.gathers = GatherContext()
        self._records: Dict[int, PartitionedParam] = {}
        self._whole: Dict[int, Tuple["weakref.ref[torch.nn.Parameter]", OnModified]] = {}

    # --- lookup ----------------------------------------------------------------------------
    def holds(self, p: Any) -> bool:
        rec = self._records.get(id(p))
        if rec is not None:
            return rec.param is p
        whole = self._whole.get(id(p))
        return whole is not None and whole[0]() is p

    def record(self, p: Any) -> Optional[PartitionedParam]:
        rec = self._records.get(id(p))
        return rec if rec is not None and rec.param is p else None

    def records(self) -> Iterator[PartitionedParam]:
        return iter(self._records.values())

    def whole_modified(self, p: torch.nn.Parameter) -> Optional[OnModified]:
        """The callback of a whole (persistent) parameter watched with :meth:`watch_whole`."""
        entry = self._whole.get(id(p))
        return entry[1] if entry is not None and entry[0]() is p else None

    def _claim(self, p: torch.nn.Parameter) -> None:
        if _OWNERS.get(id(p)) is not self:
            _OWNERS[id(p)] = self
            weakref.finalize(p, _forget, id(p), self)

    def watch_whole(self, p: torch.nn.Parameter, on_modified: OnModified) -> None:
        """A whole parameter whose fp32 master must follow a ``GatheredParameters`` edit
        (``on_modified`` held weakly when it is a bound method: this table outlives engines)."""
        self._whole[id(p)] = (weakref.ref(p), weak_method(on_modified))
        self._claim(p)

    # --- partition / adopt / unpartition ---------------------------------------------------
    def partition(self, p: torch.nn.Parameter, dtype: Optional[torch.dtype] = None) -> PartitionedParam:
        """Keep this rank's chunk of ``p`` (which holds its full value) and empty ``p.data``;
        a parameter another partitioner holds is adopted instead."""
        rec = record_of(p)
        if rec is not None:
            return self.adopt(p, dtype or rec.empty.dtype)
        dtype = dtype or p.dtype
        numel = p.numel()
        chunk = -(-numel // self.world) if numel else 0
        lo, hi = min(self.rank * chunk, numel), min((self.rank + 1) * chunk, numel)
        storage = self._store(p.detach().reshape(-1)[lo:hi], chunk, dtype, p.shape)
        rec = PartitionedParam(param_ref=weakref.ref(p), shape=torch.Size(p.shape), numel=numel, world=self.world,
                               rank=self.rank, group=self.group, storage=storage,
                               compute_device=self.compute_device)
        rec.empty = torch.empty(0, dtype=dtype, device=self.compute_device)
        p.data = rec.empty
        self._records[id(p)] = rec
        self._claim(p)
        return rec

    def _store(self, values: torch.Tensor, chunk: int, dtype: torch.dtype,
               shape: torch.Size) -> ShardStorage:
        """A new shard of ``chunk`` elements holding ``values`` (zero padded): in a swap file
        when the swapper takes it, else a tensor on the shard device."""
        if self.swapper is not None:
            shard = self.swapper.place(values, chunk, dtype, shape)
            if shard is not None:
                return shard
        storage = TensorShard.zeros(chunk, dtype, self.shard_device, self.pin)
        storage.write_(values)
        return storage

    def adopt(self, p: torch.nn.Parameter, dtype: torch.dtype) -> PartitionedParam:
        """Take over a parameter partitioned elsewhere (``zero.Init``), moved to this
        partitioner's placement."""
        old = owner_of(p)
        rec = old.record(p) if old is not None else None
        if rec is None:
            raise ZeroError("adopt(): the parameter is not partitioned")
        if old is self:
            return rec
        if rec.world != self.world:
            raise ZeroError(f"a parameter of shape {tuple(rec.shape)} was partitioned by zero.Init "
                            f"over {rec.world} ranks, but the engine's data-parallel group has "
                            f"{self.world}; build the model under zero.Init with the same group "
                            "(or data_parallel_group=None for the default group)")
        old.gathers.release(rec)
        old._records.pop(id(p), None)
        if (rec.storage.device != self.shard_device or rec.storage.dtype != dtype
                or self.swapper is not None):
            rec.storage = self._store(rec.shard, rec.chunk, dtype, rec.shape)
        rec.group = self.group
        rec.compute_device = self.compute_device
        rec.empty = torch.empty(0, dtype=dtype, device=self.compute_device)
        rec.full = rec.gathered = None
        p.data = rec.empty
        self._records[id(p)] = rec
        self._claim(p)
        return rec

    def unpartition(self, p: torch.nn.Parameter) -> None:
        """Make a partitioned parameter whole again on every rank (collective)."""
        owner = owner_of(p)
        rec = owner.record(p) if owner is not None else None
        if rec is None:
            return
        rec.active += 1
        owner.gathers.gather([rec])
        whole = p.data.clone()
        rec.active -= 1
        owner.gathers.release(rec)
        p.data = whole
        owner._records.pop(id(p), None)
        _forget(id(p), owner)
