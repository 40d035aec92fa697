"""Host-memory helpers for stage-3 offload: pinned buffers and gradient streaming to the CPU.

``offload_param`` keeps each parameter's shard in (pinned) CPU memory; ``zero/stage3/gather.py``
copies it to the accelerator on a side stream right before the module needs it (or earlier,
as a prefetch), so fetching a module costs one host-to-device copy of this rank's chunk.

``offload_optimizer`` keeps the fp32 masters and their gradients on the CPU.
:class:`HostGradAccumulator` moves each reduced gradient chunk there during backward
without ever blocking the thread that runs backward, and without CPU arithmetic:

1. on a side stream (one of two; each partition always on the same one), the first
   gradient of a window is widened to fp32 on the device and
   DMA'd straight into the pinned fp32 partition (no zeroing pass needed);
2. later micro steps bring the partition back to the device, add the new gradient there
   and DMA the sum back (what DeepSpeed calls accumulating "via the GPU"): an add on the
   CPU would run at memory speed on a few cores and fall behind backward, while the two
   copies overlap the compute;
3. work that must follow a gradient's last copy (its squared norm, an eager CPU optimizer
   step, writing updated shards) goes to a worker thread that first waits for the copy's
   event, so it runs in order after it.

On a CPU-only machine the worker does the adds itself, so the CPU tests exercise the same
ordering.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from ..accelerator import get_accelerator
from ..monitor.copy_timers import D2H, OffloadCopyTimer, copy_span
from .cpu_worker import cpu_step_pool


COPY_STREAMS = 2
"""Side streams for the gradient round trips (see HostGradAccumulator.streams)."""


def alloc_host(numel: int, device: torch.device, pin: bool) -> torch.Tensor:
    """A zeroed fp32 buffer on ``device``; pinned in place when it is host memory and
    pinning helps (never a pageable buffer and its pinned copy at once)."""
    return get_accelerator().host_zeros(numel, torch.float32, device, pin)


class HostGradAccumulator:
    """``dst = src`` or ``dst += src`` into fp32 partitions, off the compute thread.

    ``asynchronous`` is true when the partitions live on the host; with masters on the
    accelerator everything runs in stream order on the compute stream instead."""

    def __init__(self, device: torch.device, master_device: torch.device) -> None:
        self.device = torch.device(device)
        self.accel = get_accelerator()  # streams and events
        self.asynchronous = torch.device(master_device).type == "cpu"
        self.copies = self.asynchronous and self.device.type == "cuda"
        # two copy streams, each partition always on the same one: one stream runs its copy
        # in, add and copy back in order, so alone it never overlaps a copy back with the
        # next gradient's copy in; two keep both copy directions busy
        self.streams = ([self.accel.Stream(self.device) for _ in range(COPY_STREAMS)]
                        if self.copies else [])
        self._stream_of: Dict[int, int] = {}
        """Partition data pointer -> its stream: a partition's adds stay in order."""
        self.pool = cpu_step_pool("shardwise-grads") if self.asynchronous else None
        self._futures: List[Future] = []
        self._sumsq_host: List[float] = []
        self._sumsq_device: List[torch.Tensor] = []
        """One running sum per copy stream (each written only by its own stream)."""
        self.copy_timer: Optional[OffloadCopyTimer] = None
        """``wall_clock_breakdown``: times the gradient copies to the host (None: off)."""

    # --- squared norm of the final gradients -----------------------------------------------
    def reset_sumsq(self) -> None:
        self._sumsq_host = []
        self._sumsq_device = []
        for stream in self.streams:
            # made and written on its copy stream: its memory belongs to that stream's pool
            with self.accel.stream(stream):
                self._sumsq_device.append(torch.zeros((), dtype=torch.float32, device=self.device))

    @property
    def stream(self) -> Any:
        """The copy stream that side work runs on (after the other one), None without copies."""
        return self.streams[0] if self.streams else None

    def sumsq(self) -> torch.Tensor:
        """Sum of squares of every ``final=True`` result since ``reset_sumsq`` (a device
        tensor, ordered after the copy streams' work; host results need :meth:`wait` first)."""
        if self.asynchronous and not self.copies:
            self.wait()  # the worker measures host gradients as it adds them
        host = sum(self._sumsq_host)
        if not self.streams:
            return torch.tensor(host, dtype=torch.float32).to(self.device)
        # written on the copy streams: the reader's stream waits for them there, not the host
        # (and the host part is added as a Python number: copying a host tensor to the
        # device would block the host until the reader's stream drained)
        reader = self.accel.current_stream(self.device)
        total = None
        for stream, part in zip(self.streams, self._sumsq_device):
            if reader != stream:
                reader.wait_stream(stream)
                part.record_stream(reader)
            total = part + host if total is None else total + part
        return total

    @contextlib.contextmanager
    def on_side_stream(self) -> Iterator["SideWork"]:
        """Run the block on a copy stream, after what the compute stream queued so far:
        work that reads the final gradients then waits for their copies there, and the
        compute stream does not queue behind them. Yields a :class:`SideWork` whose
        ``wait()`` blocks the host until the block's work is done."""
        work = SideWork(self.stream)
        if self.stream is None:
            yield work
            return
        self.stream.wait_stream(self.accel.current_stream(self.device))
        with self.accel.stream(self.stream):
            yield work
            work.event = self.accel.Event()
            work.event.record(self.stream)

    # --- adding ------------------------------------------------------------------------------
    def add_into(self, dst: torch.Tensor, src: torch.Tensor, overwrite: bool, final: bool = False,
                 after: Optional[Callable[[], Any]] = None) -> None:
        """``dst (+)= src``; with ``final`` the result's squared norm is added to
        :meth:`sumsq`; then ``after()`` runs on the worker once ``dst`` holds the result."""
        if not self.asynchronous:
            _accumulate(None, dst, src.to(dst.device), overwrite)
            if final:
                self._sumsq_host.append(float(torch.dot(dst, dst)))
            if after is not None:
                after()
            return
        if not self.copies:
            # host gradients: nothing to copy; the arithmetic itself goes to the worker
            self.submit(_timed_accumulate, self.copy_timer, dst, src, overwrite)
            if final:
                self.submit(lambda: self._sumsq_host.append(float(torch.dot(dst, dst))))
            if after is not None:
                self.submit(after)
            return
        index = self._stream_of.setdefault(dst.data_ptr(), len(self._stream_of) % len(self.streams))
        stream = self.streams[index]
        stream.wait_stream(self.accel.current_stream(self.device))
        with self.accel.stream(stream), copy_span(self.copy_timer, D2H, stream):
            if overwrite:
                wide = src if src.dtype == dst.dtype else src.to(dst.dtype)
            else:
                wide = torch.empty(dst.shape, dtype=dst.dtype, device=self.device)
                wide.copy_(dst, non_blocking=True)
                wide.add_(src)
            dst.copy_(wide, non_blocking=True)
            if final:
                # the final gradient passes through the device anyway: measure it here
                self._sumsq_device[index].add_(
                    torch.dot(wide.reshape(-1), wide.reshape(-1)).float())
            done = self.accel.Event() if after is not None else None
            if done is not None:
                done.record(stream)
        src.record_stream(stream)
        if done is not None:
            self.submit(_after_event, done, after)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the worker after everything queued before it."""
        if self.pool is None:
            fut: Future = Future()
            fut.set_result(fn(*args))
            return fut
        fut = self.pool.submit(fn, *args)
        self._futures.append(fut)
        return fut

    def fence(self) -> Callable[[], None]:
        """A callable that blocks until everything queued so far is done, for another thread
        to wait on (the caller's thread goes on without waiting)."""
        events = []
        for stream in self.streams:
            events.append(self.accel.Event())
            events[-1].record(stream)
        futures = list(self._futures)

        def wait() -> None:
            for event in events:
                event.synchronize()
            for fut in futures:
                fut.result()
        return wait

    def wait(self) -> None:
        """Block until every queued copy, add and task is done (re-raising their errors)."""
        for stream in self.streams:
            stream.synchronize()
        futures, self._futures = self._futures, []
        for fut in futures:
            fut.result()

    def close(self) -> None:
        if self.pool is not None:
            self.wait()
            self.pool.shutdown(wait=True)


class SideWork:
    """Work queued on a side stream (None: none, it ran in order)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.event: Any = None

    def keep(self, tensors: List[torch.Tensor]) -> None:
        """``tensors`` (made on another stream) are read on the side stream: their memory is
        not reused before it has read them."""
        if self.stream is not None:
            for t in tensors:
                if t.device.type == "cuda":
                    t.record_stream(self.stream)

    def wait(self) -> None:
        """Block the host until the side stream has done the block's work."""
        if self.event is not None:
            self.event.synchronize()


def _accumulate(event: Optional[Any], dst: torch.Tensor, src: torch.Tensor, overwrite: bool) -> None:
    if event is not None:
        event.synchronize()
    if overwrite:
        dst.copy_(src)
    else:
        dst.add_(src)


def _timed_accumulate(timer: Optional[OffloadCopyTimer], dst: torch.Tensor, src: torch.Tensor,
                      overwrite: bool) -> None:
    """The worker's stand-in for the device-to-host copy (host gradients), timed."""
    with copy_span(timer, D2H):
        _accumulate(None, dst, src, overwrite)


def _after_event(event: Any, fn: Callable[[], Any]) -> None:
    event.synchronize()
    fn()
