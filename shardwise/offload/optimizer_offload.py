"""Optimizer offload (ZeRO-Offload) for stages 1 and 2: fp32 masters, optimizer states and
the optimizer step on the CPU, with the copies and the CPU work overlapped with the GPU.

The pipeline, per optimizer step:

1. During the boundary backward, as each bucket's gradients are final (and reduced), its
   fp32 gradient slice is copied to pinned CPU memory on a side stream (no host sync).
   With *host accumulation* (``DataParallelStrategy.host_accumulate``) this also happens on
   every earlier micro step of the window: the pinned partition is brought back, added on
   the device and copied out again, so the device's gradient buffer can be freed between
   micro steps.
2. *Eager mode* (no clipping, no fp16 — the update is known as soon as a bucket's
   gradients are): a worker thread steps that bucket on the CPU right away, while the GPU is
   still running backward for earlier layers. Otherwise the step runs once every gradient
   has arrived.
3. The updated fp32 masters (pinned) are copied to the device through a staging
   buffer and cast to the compute dtype there, on the side stream: the CPU does no casting,
   and each bucket's copy starts as soon as its CPU step is done.

*Delayed parameter update* (DPU, ZeRO-Offload paper §4.3, opt-in): after
``delayed_update_warmup`` normal steps, step ``t``'s CPU update runs in the background during
step ``t+1``'s forward and backward, and its result reaches the GPU at the end of step
``t+1``: ``w[t+1] = w[t] - u(g(w[t-1]))`` — parameters are one step stale.

Pinned buffers and the staging buffer are allocated once, at construction, and reused. The
staging buffer holds STAGING_ELEMS fp32 elements, not a whole bucket: copies go through it
chunk by chunk (in order on the side stream), so it costs 64 MiB of device memory however
large ``reduce_bucket_size`` is.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

import torch

from ..accelerator import get_accelerator
from ..monitor.copy_timers import D2H, H2D, OffloadCopyTimer, copy_span
from .buffers import HostBucket
from .cpu_worker import detached_step
from .step_schedule import StepSchedule
from .step_subset import step_subset

if TYPE_CHECKING:
    from .nvme_states import NvmeOptimizerStates

#: fp32 elements of the device staging buffer (64 MiB).
STAGING_ELEMS = 16 * 1024 * 1024


def _chunks(n: int):
    """``(lo, hi)`` ranges of at most STAGING_ELEMS elements covering ``[0, n)``."""
    for lo in range(0, n, STAGING_ELEMS):
        yield lo, min(n, lo + STAGING_ELEMS)


class OptimizerOffload:
    def __init__(self, buckets: Sequence[HostBucket], *, device: torch.device,
                 compute_dtype: torch.dtype, pin: bool, delayed: bool, warmup: int) -> None:
        self.buckets = list(buckets)
        self.resident: List[torch.Tensor] = []
        """Masters that stay on the device (``ratio`` < 1): hidden from the CPU step."""
        self.device = device
        self.accel = get_accelerator()  # streams and events
        self.cuda = device.type == "cuda"
        self.stream = self.accel.Stream(device) if self.cuda else None
        self.schedule: StepSchedule[HostBucket] = StepSchedule(
            delayed=delayed, warmup=warmup, name="shardwise-offload")
        """Eager bucket steps, the delayed update's warmup and its background step."""
        self.copy_timer: Optional[OffloadCopyTimer] = None
        """``wall_clock_breakdown``: times the copies (set by the engine; None: off)."""
        self.nvme: Optional["NvmeOptimizerStates"] = None
        """``offload_optimizer.device`` "nvme": the buckets' masters and states live in swap
        files, one sub-group per bucket, streamed through at the step (nvme_states.py)."""
        self._grad_events: dict = {}
        self._h2d_events: dict = {}
        """Per bucket: the last host-to-device copy that reads its masters. A CPU step waits
        only for its own buckets' copies: waiting for the latest copy of any bucket chained
        every eager step behind the previous bucket's copy, which itself waits for the
        compute stream (measured: 115 ms idle, then ~14 ms per bucket instead of ~10)."""
        largest = max((b.hi - b.lo for b in self.buckets), default=0)
        # one buffer suffices: every copy and cast runs in order on the side stream
        self._staging = (torch.empty(min(largest, STAGING_ELEMS), dtype=torch.float32,
                                     device=device) if self.cuda else None)
        for b in self.buckets:
            for slot in b.slots:
                if slot.master is not None:
                    slot.master.grad = None  # attached only while that bucket is stepped

    # --- 1. gradients to the CPU ------------------------------------------------------------
    def grad_ready(self, bucket: HostBucket, reduced: torch.Tensor, work,
                   accumulate: bool = False) -> None:
        """Queue the device-to-host copy of a bucket's reduced gradient slice.

        ``accumulate``: the host already holds this window's earlier gradients of the
        bucket (streamed on earlier micro steps). They are brought back and added into
        ``reduced`` on the device first, so ``reduced`` ends up holding the window's total
        (what the norm and overflow checks read) and the host gets the total back."""
        if not self.cuda:
            if work is not None:
                work.wait()
            with copy_span(self.copy_timer, D2H):
                if accumulate:
                    reduced.add_(bucket.master_grad.to(reduced.dtype))
                bucket.master_grad.copy_(reduced)
            self._grad_events[bucket.index] = None
            return
        current = self.accel.current_stream(self.device)
        self.stream.wait_stream(current)
        with self.accel.stream(self.stream):
            if work is not None:
                work.wait()  # NCCL: makes the copy stream wait for the collective, not the host
            with copy_span(self.copy_timer, D2H, self.stream):
                self._copy_grads_out(bucket.master_grad, reduced, accumulate)
            event = self.accel.Event()
            event.record(self.stream)
        self._grad_events[bucket.index] = event

    def _copy_grads_out(self, host: torch.Tensor, reduced: torch.Tensor,
                        accumulate: bool) -> None:
        """On the side stream: ``host (+)= reduced`` chunk by chunk through the staging buffer."""
        for lo, hi in _chunks(reduced.numel()):
            part = reduced[lo:hi]
            if accumulate:
                earlier = self._staging[:hi - lo]
                earlier.copy_(host[lo:hi], non_blocking=True)
                part.add_(earlier)
            if part.dtype != host.dtype:
                # low-precision accumulation: widen on the device, then DMA (stream-ordered)
                staged = self._staging[:hi - lo]
                staged.copy_(part)
                part = staged
            host[lo:hi].copy_(part, non_blocking=True)

    def wait_grads(self) -> None:
        for event in self._grad_events.values():
            if event is not None:
                event.synchronize()

    def protect_device_grads(self) -> None:
        """The compute stream must not zero the device gradients before the copies read them."""
        if self.cuda:
            self.accel.current_stream(self.device).wait_stream(self.stream)

    # --- 2. the CPU step ------------------------------------------------------------------------
    def _step_buckets(self, step: Callable[[], None], buckets: Sequence[HostBucket],
                      prescale: Optional[float]) -> None:
        subset = []
        for b in buckets:
            copy = self._h2d_events.get(b.index)
            if copy is not None:
                copy.synchronize()  # the previous copy to the device still reads these masters
            event = self._grad_events.get(b.index)
            if event is not None:
                event.synchronize()
            if prescale is not None and prescale != 1.0:
                b.master_grad.mul_(prescale)
            for slot in b.slots:
                if slot.master is not None:
                    subset.append((slot.master, b.master_grad[slot.offset + slot.own_lo - b.lo:
                                                              slot.offset + slot.own_hi - b.lo]))
        step_subset(step, subset, hide=self.resident)

    def eager_step_bucket(self, inner: torch.optim.Optimizer, bucket: HostBucket,
                          prescale: float) -> None:
        """Step one bucket in the background as soon as its gradients are on their way."""
        self.schedule.submit_eager(bucket, self._step_buckets, inner.step, [bucket], prescale)

    def step(self, inner: torch.optim.Optimizer, eager: bool,
             factor_fn: Callable[[], Optional[float]]) -> None:
        """Run (or finish) this step's CPU update. ``factor_fn`` gives the multiply the engine
        computed (unscale, averaging, clipping), or None when nothing needs scaling."""
        if self.nvme is not None:  # --- NVMe: the buckets streamed through the swap ring
            self.schedule.begin_step()  # counts the step (no delayed update with NVMe)
            self._nvme_step(inner, factor_fn())
            return
        delayed = self.schedule.begin_step()
        if eager and not delayed:
            # each bucket's host-to-device copy starts as soon as its CPU step is done, while
            # the CPU steps the next one
            for bucket in self.schedule.finish_eager():
                self._copy_params_to_device([bucket])
            return
        self.wait_tasks()  # DPU: the previous step's update, normally long finished
        if delayed:
            # that update reaches the device; this one runs in the background until the next
            # step, on a snapshot (the scheduler changes the rates as soon as this returns)
            self._copy_params_to_device()
            self.schedule.submit_delayed(self._step_buckets, detached_step(inner),
                                         self.buckets, factor_fn())
            return
        self._step_buckets(inner.step, self.buckets, factor_fn())
        self._copy_params_to_device()

    def _nvme_step(self, inner: torch.optim.Optimizer, factor: Optional[float]) -> None:
        """Each bucket in turn from its swap file: step it, copy its masters to the device."""
        def step(i: int) -> None:
            self._step_buckets(inner.step, [self.buckets[i]], factor)

        def to_device(i: int):
            bucket = self.buckets[i]
            self._copy_params_to_device([bucket])
            event = self._h2d_events.get(bucket.index) if self.cuda else None
            return event.synchronize if event is not None else None

        self.nvme.step_groups(step, to_device)

    def wait_tasks(self) -> None:
        self.schedule.wait()

    # compatibility: the schedule's settings as they were named here
    delayed = property(lambda self: self.schedule.delayed)
    warmup = property(lambda self: self.schedule.warmup)
    steps_done = property(lambda self: self.schedule.steps_done)
    pool = property(lambda self: self.schedule.pool)

    # --- 3. parameters back to the device -------------------------------------------------------
    def _copy_params_to_device(self, buckets: Optional[Sequence[HostBucket]] = None) -> None:
        buckets = self.buckets if buckets is None else buckets
        with torch.no_grad():
            if not self.cuda:
                with copy_span(self.copy_timer, H2D):
                    for b in buckets:
                        b.param_buf[b.lo:b.hi].copy_(b.master)
                return
            current = self.accel.current_stream(self.device)
            self.stream.wait_stream(current)  # backward may still be reading the parameters
            with self.accel.stream(self.stream), copy_span(self.copy_timer, H2D, self.stream):
                for b in buckets:
                    for lo, hi in _chunks(b.hi - b.lo):
                        staging = self._staging[:hi - lo]
                        staging.copy_(b.master[lo:hi], non_blocking=True)
                        b.param_buf[b.lo + lo:b.lo + hi].copy_(staging)
                done = self.accel.Event()
                done.record(self.stream)
                for b in buckets:
                    self._h2d_events[b.index] = done
            current.wait_stream(self.stream)  # the next forward reads what was just written

    def flush(self) -> None:
        """Bring a pending delayed update onto the device (before saving or evaluating)."""
        if self.schedule.busy:
            self.wait_tasks()
            self._copy_params_to_device()
            if self.cuda:
                for done in set(self._h2d_events.values()):
                    done.synchronize()

    def close(self) -> None:
        self.schedule.close()
        if self.nvme is not None:
            self.nvme.close()
