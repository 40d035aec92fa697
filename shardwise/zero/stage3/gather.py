"""Gathering and releasing partitioned parameters: one :class:`GatherContext` per engine.

Gathering all-gathers the shards into one padded *full* buffer and points ``.data`` at a
view of it. Releasing points ``.data`` back at the empty tensor **and** shrinks the full
buffer's storage to zero bytes: autograd may hold views of the gathered weights (saved
for backward) and those would otherwise keep the whole model alive until backward ends.
The next gather re-grows the same storage and fills it again, so those saved views see
valid values when backward runs (the technique FSDP1 used for its flat parameters).

A record moves RELEASED -> INFLIGHT (``start``: buffer grown, copy/all-gather launched) ->
GATHERED (``wait``: ``.data`` points at the full value) -> RELEASED (``release``). The
context keeps its own live set (for sweeps at the end of forward/backward and for the
``max_live_parameters`` budget) and its own side streams, so a sweep never touches another
engine's parameters.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

import torch

from ...accelerator import get_accelerator
from ...comm import all_gather_flat
from ...monitor.copy_timers import H2D, OffloadCopyTimer, copy_span
from .partition import GATHERED, INFLIGHT, RELEASED, PartitionedParam


class GatherContext:
    """The live set, fetch streams and gather/release transitions of one engine."""

    def __init__(self) -> None:
        self.live: Dict[int, PartitionedParam] = {}
        """Every gathered or in-flight record, in gather order."""
        self.live_numel = 0
        """Padded elements of ``live``, kept as it changes (asked on every prefetch)."""
        self._fetch_streams: Dict[torch.device, Any] = {}
        self.copy_timer: Optional[OffloadCopyTimer] = None
        """``wall_clock_breakdown`` with ``offload_param``: times the shard fetches (None: off)."""

    # --- host-to-device copies of offloaded shards ------------------------------------------
    def _fetch_stream(self, device: torch.device) -> Any:
        """The side stream that copies offloaded shards to ``device`` (one per device)."""
        stream = self._fetch_streams.get(device)
        if stream is None:
            stream = self._fetch_streams[device] = get_accelerator().Stream(device)
        return stream

    def sync_fetches(self) -> None:
        """Block until every host-to-device shard copy is done: the host may overwrite shards
        (optimizer step, checkpoint load) only when no copy still reads them."""
        for stream in self._fetch_streams.values():
            stream.synchronize()

    # --- transitions -------------------------------------------------------------------------
    def start(self, recs: Iterable[PartitionedParam]) -> None:
        """Launch the all-gathers of ``recs`` (asynchronous where the backend allows).

        Under ``offload_param`` on CUDA the shards' copies to the device run on a side stream,
        so a prefetch overlaps the compute of the modules before it; the compute stream waits
        for the copies' event only when a parameter is used (``wait``) or dropped. One batch
        shares one stream wait and one event: the host cost of a fetch is then its copy call.
        """
        recs = list(recs)
        for rec in recs:  # NVMe: the batch's reads in flight together, then staged in order
            if rec.status == RELEASED and not rec.storage.resident:
                rec.storage.prefetch()
        side: List[PartitionedParam] = []
        for rec in recs:
            if rec.status != RELEASED:
                continue  # already gathered, or earlier in this batch (a tied weight)
            if rec.full is None:
                # the compute dtype: a shard that is the fp32 master is cast on the way in
                rec.full = torch.empty(rec.padded, dtype=rec.empty.dtype,
                                       device=rec.compute_device)
                rec.gathered = rec.full[:rec.numel].view(rec.shape)
            storage = rec.full.untyped_storage()
            nbytes = rec.padded * rec.full.element_size()
            if storage.size() < nbytes:
                # allocated on the compute stream: its earlier uses of this memory come first there
                storage.resize_(nbytes)
            rec.work = None
            if rec.storage.device != rec.compute_device and rec.compute_device.type == "cuda":
                side.append(rec)
            elif rec.world == 1:
                with copy_span(self.copy_timer, H2D):  # offload_param without streams: the fetch
                    rec.full.copy_(rec.storage.staged())
                rec.storage.unstage()
            else:
                rec.work = all_gather_flat(rec.full, self._stage_for_gather(rec), group=rec.group,
                                           async_op=True)
            rec.status = INFLIGHT
            self.live[id(rec)] = rec
            self.live_numel += rec.padded
        if side:
            self._fetch_to_device(side)

    @staticmethod
    def _stage_for_gather(rec: PartitionedParam) -> torch.Tensor:
        """This rank's shard on the compute device for its all-gather (kept in
        ``rec.staging`` while the gather may still read it)."""
        shard = rec.storage.staged()
        if shard.device != rec.compute_device or shard.dtype != rec.full.dtype:
            rec.staging = shard.to(rec.compute_device, rec.full.dtype)
        elif not rec.storage.resident:  # a lent read buffer: the async gather gets a copy
            rec.staging = shard.clone()
        else:
            return shard
        rec.storage.unstage()
        return rec.staging

    def _fetch_to_device(self, recs: List[PartitionedParam]) -> None:
        """offload_param on CUDA: the copies wait only for what the compute stream queued so
        far (the release of the memory they reuse), then run beside the compute."""
        acc = get_accelerator()
        device = recs[0].compute_device
        compute = acc.current_stream(device)
        fetch = self._fetch_stream(device)
        fetch.wait_stream(compute)
        with acc.stream(fetch), copy_span(self.copy_timer, H2D, fetch):
            for rec in recs:
                dst = rec.full
                if rec.world > 1:
                    rec.staging = torch.empty(rec.chunk, dtype=rec.full.dtype, device=device)
                    dst = rec.staging
                dst.copy_(rec.storage.staged(), non_blocking=True)
                if not rec.storage.resident:  # NVMe: the read buffer is free after this copy
                    copied = acc.Event()
                    copied.record(fetch)
                    rec.storage.unstage(copied)
            fetched = acc.Event()
            fetched.record(fetch)
        for rec in recs:
            rec.fetched = fetched
            if rec.world > 1:
                compute.wait_event(fetched)
                rec.fetched = None
                rec.work = all_gather_flat(rec.full, rec.staging, group=rec.group, async_op=True)

    @staticmethod
    def _finish_inflight(rec: PartitionedParam) -> None:
        """Make the compute stream (or the host) wait for an in-flight fetch or gather."""
        if rec.work is not None:
            rec.work.wait()
        if rec.fetched is not None:
            get_accelerator().current_stream(rec.compute_device).wait_event(rec.fetched)
        rec.work = None
        rec.fetched = None
        rec.staging = None

    def wait(self, rec: PartitionedParam) -> None:
        if rec.status == RELEASED:
            self.start([rec])
        if rec.status == INFLIGHT:
            self._finish_inflight(rec)
            rec.param.data = rec.gathered
            rec.status = GATHERED

    def gather(self, recs: Iterable[PartitionedParam]) -> None:
        """Gather every record in ``recs``: launch all, then wait for all."""
        recs = list(recs)
        self.start(recs)
        for rec in recs:
            self.wait(rec)

    def release(self, rec: PartitionedParam) -> None:
        """Drop the gathered value (waits for an in-flight gather first)."""
        if rec.status == RELEASED:
            return
        if rec.status == INFLIGHT:
            # the memory is about to be reused: nothing may still be writing into it
            self._finish_inflight(rec)
        rec.param.data = rec.empty
        if rec.full is not None:
            rec.full.untyped_storage().resize_(0)
        rec.status = RELEASED
        if self.live.pop(id(rec), None) is not None:
            self.live_numel -= rec.padded

    def sweep(self, keep: Iterable[int] = ()) -> None:
        """Release every gathered record that no forward or context is using (but those
        whose id is in ``keep``)."""
        keep = set(keep)
        for rec in list(self.live.values()):
            if rec.active == 0 and id(rec) not in keep:
                self.release(rec)

    def write_shard(self, rec: PartitionedParam, full: torch.Tensor) -> None:
        """Store this rank's chunk of ``full`` into the shard (after any copy reading it)."""
        if rec.storage.device.type == "cpu":
            self.sync_fetches()
        rec.write_full_(full)
