"""Per-parameter partitions for ZeRO stage 3: split, gather, release.

Every partitioned parameter is flattened and padded to a multiple of the world size W;
rank r keeps the contiguous chunk ``[r·c, (r+1)·c)`` (``c = padded / W``) as its *shard*.
Outside a gather the parameter's ``.data`` is an empty tensor of the compute dtype on the
compute device, and ``param.sw_shape`` / ``param.sw_numel`` keep the full geometry.

Gathering all-gathers the shards into one padded *full* buffer and points ``.data`` at a
view of it. Releasing points ``.data`` back at the empty tensor **and** shrinks the full
buffer's storage to zero bytes: autograd may hold views of the gathered weights (saved
for backward) and those would otherwise keep the whole model alive until backward ends.
The next gather re-grows the same storage and fills it again, so those saved views see
valid values when backward runs (the technique FSDP1 used for its flat parameters).

Per-parameter (not per-module) partitions keep tied weights simple (one state per
Parameter object, whichever module uses it) and let ``zero.Init`` and the strategy share
one layout, so a model built under ``zero.Init`` is adopted without any communication.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from ...accelerator import get_accelerator
from ...comm import all_gather_flat
from ...errors import ZeroError

RELEASED, INFLIGHT, GATHERED = "released", "inflight", "gathered"


@dataclass(eq=False)
class PartitionedParam:
    """The stage-3 state of one parameter (stored as ``param.sw_meta``)."""

    shape: torch.Size
    """The full, unpartitioned shape."""
    numel: int
    """Elements of the full parameter."""
    world: int
    rank: int
    group: Optional[dist.ProcessGroup]
    shard: torch.Tensor
    """This rank's ``chunk`` elements (padding included), compute dtype, on the shard device
    (the accelerator, or the CPU under ``offload_param``)."""
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
    staging: Optional[torch.Tensor] = field(repr=False, default=None)
    """Device copy of an offloaded shard while its all-gather runs."""
    fetched: Any = field(repr=False, default=None)
    """CUDA event of an offloaded shard's copy to the device (world 1), until it is used."""
    active: int = 0
    """Forward calls / GatheredParameters contexts using the gathered value right now."""
    on_modified: Optional[Callable[[torch.nn.Parameter], None]] = field(repr=False, default=None)
    """Set by the strategy: refresh the fp32 master after the shard was overwritten."""

    @property
    def chunk(self) -> int:
        return self.shard.numel()

    @property
    def padded(self) -> int:
        return self.chunk * self.world

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


# Every gathered or in-flight partitioned parameter of this process, in gather order, so
# sweeps (end of forward/backward) and the max_live_parameters budget see one picture.
_LIVE: Dict[int, torch.nn.Parameter] = {}
_LIVE_NUMEL = [0]  # padded elements of _LIVE, kept as it changes (asked on every prefetch)


def live_params() -> List[torch.nn.Parameter]:
    return list(_LIVE.values())


def live_numel() -> int:
    return _LIVE_NUMEL[0]


def is_partitioned(p: Any) -> bool:
    return isinstance(getattr(p, "sw_meta", None), PartitionedParam)


def group_info(group: Optional[dist.ProcessGroup]) -> tuple:
    """(world, rank) of ``group``; a process without torch.distributed is a world of one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    return 1, 0


def global_rank(group: Optional[dist.ProcessGroup], rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def place_shard(t: torch.Tensor, device: torch.device, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Copy ``t`` to its shard home; CPU shards are pinned when asked and an accelerator exists."""
    out = t.to(device=device, dtype=dtype, copy=True).contiguous()
    if pin and out.device.type == "cpu":
        out = get_accelerator().pin_memory(out)
    return out


def partition_param(p: torch.nn.Parameter, *, world: int, rank: int,
                    group: Optional[dist.ProcessGroup], shard_device: torch.device,
                    compute_device: torch.device, dtype: Optional[torch.dtype] = None,
                    pin: bool = False) -> PartitionedParam:
    """Keep this rank's chunk of ``p`` (which holds its full value) and empty ``p.data``."""
    if is_partitioned(p):
        return p.sw_meta
    dtype = dtype or p.dtype
    numel = p.numel()
    chunk = -(-numel // world) if numel else 0
    flat = p.detach().reshape(-1)
    lo, hi = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
    shard = torch.zeros(chunk, dtype=dtype, device=shard_device)
    if pin and shard.device.type == "cpu":
        shard = get_accelerator().pin_memory(shard)
    with torch.no_grad():
        shard[:hi - lo].copy_(flat[lo:hi])
    meta = PartitionedParam(shape=torch.Size(p.shape), numel=numel, world=world, rank=rank,
                            group=group, shard=shard, compute_device=torch.device(compute_device))
    meta.empty = torch.empty(0, dtype=dtype, device=compute_device)
    p.data = meta.empty
    p.sw_meta = meta
    p.sw_shape = meta.shape
    p.sw_numel = numel
    return meta


def adopt(p: torch.nn.Parameter, *, shard_device: torch.device, compute_device: torch.device,
          dtype: torch.dtype, pin: bool, world: int) -> PartitionedParam:
    """Move an already partitioned parameter (``zero.Init``) to the strategy's placement."""
    meta: PartitionedParam = p.sw_meta
    if meta.world != world:
        raise ZeroError(f"a parameter of shape {tuple(meta.shape)} was partitioned by zero.Init "
                        f"over {meta.world} ranks, but the engine's data-parallel group has "
                        f"{world}; build the model under zero.Init with the same group (or "
                        "data_parallel_group=None for the default group)")
    release(p)
    if meta.shard.device != shard_device or meta.shard.dtype != dtype:
        meta.shard = place_shard(meta.shard, shard_device, dtype, pin)
    meta.compute_device = torch.device(compute_device)
    meta.empty = torch.empty(0, dtype=dtype, device=compute_device)
    meta.full = meta.gathered = None
    p.data = meta.empty
    return meta


def unpartition(p: torch.nn.Parameter) -> None:
    """Make a partitioned parameter whole again on every rank (collective)."""
    meta: PartitionedParam = p.sw_meta
    meta.active += 1
    gather([p])
    whole = p.data.clone()
    meta.active -= 1
    release(p)
    p.data = whole
    for attr in ("sw_meta", "sw_shape", "sw_numel"):
        delattr(p, attr)


# --- gather / release --------------------------------------------------------------------
def _fetch_stream(device: torch.device):
    """The side stream that copies offloaded shards to ``device`` (one per device)."""
    stream = _FETCH_STREAMS.get(device)
    if stream is None:
        stream = _FETCH_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


_FETCH_STREAMS: Dict[torch.device, Any] = {}


def sync_fetches() -> None:
    """Block until every host-to-device shard copy is done: the host may overwrite shards
    (optimizer step, checkpoint load) only when no copy still reads them."""
    for stream in _FETCH_STREAMS.values():
        stream.synchronize()


def start_gather(p: torch.nn.Parameter) -> None:
    """Launch the all-gather of ``p`` (asynchronous where the backend allows)."""
    start_gathers([p])


def start_gathers(params: Iterable[torch.nn.Parameter]) -> None:
    """Launch the all-gathers of ``params`` (asynchronous where the backend allows).

    Under ``offload_param`` on CUDA the shards' copies to the device run on a side stream, so
    a prefetch overlaps the compute of the modules before it; the compute stream waits for
    the copies' event only when a parameter is used (``wait_gather``) or dropped. One batch
    shares one stream wait and one event: the host cost of a fetch is then its copy call.
    """
    side: List[torch.nn.Parameter] = []
    for p in params:
        meta: PartitionedParam = p.sw_meta
        if meta.status != RELEASED:
            continue  # already gathered, or earlier in this batch (a tied weight)
        if meta.full is None:
            meta.full = torch.empty(meta.padded, dtype=meta.shard.dtype, device=meta.compute_device)
            meta.gathered = meta.full[:meta.numel].view(meta.shape)
        storage = meta.full.untyped_storage()
        nbytes = meta.padded * meta.full.element_size()
        if storage.size() < nbytes:
            # allocated on the compute stream: its earlier uses of this memory come first there
            storage.resize_(nbytes)
        meta.work = None
        if meta.shard.device != meta.compute_device and meta.compute_device.type == "cuda":
            side.append(p)
        elif meta.world == 1:
            meta.full.copy_(meta.shard)
        else:
            src = meta.shard
            if src.device != meta.compute_device:
                meta.staging = src.to(meta.compute_device)
                src = meta.staging
            meta.work = all_gather_flat(meta.full, src, group=meta.group, async_op=True)
        meta.status = INFLIGHT
        _LIVE[id(p)] = p
        _LIVE_NUMEL[0] += meta.padded
    if side:
        _fetch_to_device(side)


def _fetch_to_device(params: List[torch.nn.Parameter]) -> None:
    """offload_param on CUDA: the copies wait only for what the compute stream queued so far
    (the release of the memory they reuse), then run beside the compute."""
    device = params[0].sw_meta.compute_device
    compute = torch.cuda.current_stream(device)
    fetch = _fetch_stream(device)
    fetch.wait_stream(compute)
    with torch.cuda.stream(fetch):
        for p in params:
            meta = p.sw_meta
            dst = meta.full
            if meta.world > 1:
                meta.staging = torch.empty(meta.chunk, dtype=meta.shard.dtype, device=device)
                dst = meta.staging
            dst.copy_(meta.shard, non_blocking=True)
        fetched = torch.cuda.Event()
        fetched.record(fetch)
    for p in params:
        meta = p.sw_meta
        meta.fetched = fetched
        if meta.world > 1:
            compute.wait_event(fetched)
            meta.fetched = None
            meta.work = all_gather_flat(meta.full, meta.staging, group=meta.group, async_op=True)


def _finish_inflight(meta: "PartitionedParam") -> None:
    """Make the compute stream (or the host) wait for an in-flight fetch or gather."""
    if meta.work is not None:
        meta.work.wait()
    if meta.fetched is not None:
        torch.cuda.current_stream(meta.compute_device).wait_event(meta.fetched)
    meta.work = None
    meta.fetched = None
    meta.staging = None


def wait_gather(p: torch.nn.Parameter) -> None:
    meta: PartitionedParam = p.sw_meta
    if meta.status == RELEASED:
        start_gather(p)
    if meta.status == INFLIGHT:
        _finish_inflight(meta)
        p.data = meta.gathered
        meta.status = GATHERED


def gather(params: Iterable[torch.nn.Parameter]) -> None:
    """Gather every partitioned parameter in ``params``: launch all, then wait for all."""
    todo = [p for p in params if is_partitioned(p)]
    start_gathers(todo)
    for p in todo:
        wait_gather(p)


def release(p: torch.nn.Parameter) -> None:
    """Drop the gathered value of ``p`` (waits for an in-flight gather first)."""
    meta: PartitionedParam = p.sw_meta
    if meta.status == RELEASED:
        return
    if meta.status == INFLIGHT:
        # the memory is about to be reused: nothing may still be writing into it
        _finish_inflight(meta)
    p.data = meta.empty
    if meta.full is not None:
        meta.full.untyped_storage().resize_(0)
    meta.status = RELEASED
    if _LIVE.pop(id(p), None) is not None:
        _LIVE_NUMEL[0] -= meta.padded


def write_full_(p: torch.nn.Parameter, full: torch.Tensor) -> None:
    """Store this rank's chunk of the full value ``full`` into the shard."""
    meta: PartitionedParam = p.sw_meta
    if meta.shard.device.type == "cpu":
        sync_fetches()
    with torch.no_grad():
        meta.shard[:meta.own_len].copy_(full.reshape(-1)[meta.own_lo:meta.own_hi])
