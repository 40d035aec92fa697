"""When an offloaded optimizer step runs, for every ZeRO stage: one schedule object.

Under ``offload_optimizer`` the fp32 masters live on the host and the CPU steps them. Three
timings exist, and every stage uses the same ones:

1. **Eager** (no clipping, no fp16 loss scale: nothing global changes the update): a piece
   of the model is stepped on the worker as soon as its last gradient is on the host, while
   backward still runs on earlier layers; the engine's step only finishes the rest and waits
   for the worker (:meth:`StepSchedule.submit_eager`, :meth:`StepSchedule.finish_eager`).
2. **At the step**: every gradient has arrived, the engine's scale factor is known, the CPU
   steps everything, the result is copied back into the weights.
3. **Delayed** (DPU, ZeRO-Offload paper section 4.3, opt-in): after ``warmup`` normal steps,
   step ``t``'s CPU update runs in the background during step ``t+1``'s forward and
   backward and reaches the weights at step ``t+1``'s boundary, so the weights are one
   step stale: ``w[t+1] = w[t] - u(g(w[t-1]))`` (:meth:`StepSchedule.begin_step`,
   :meth:`StepSchedule.submit_delayed`, :meth:`StepSchedule.finish_delayed`).

What a step reads and writes (flat buckets for stages 1-2, per-parameter pieces for stage 3)
and how its result is copied back (a DMA into the device bucket, a write into the shards) is
the buffers' business; the schedule owns the timing: the warmup count, the worker thread,
the futures in flight and which of them must finish before what.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generic, Iterator, List, Optional, Tuple, TypeVar

from .cpu_worker import cpu_step_pool

T = TypeVar("T")


class StepSchedule(Generic[T]):
    """The offloaded step's timing for one engine. ``T`` names what an eager step covers (a
    bucket for stages 1-2), handed back in order by :meth:`finish_eager`."""

    def __init__(self, *, delayed: bool, warmup: int, name: str, worker: bool = True) -> None:
        """``worker``: start the worker thread's pool (False: this engine's steps all run
        elsewhere, e.g. stage 3 without DPU, whose eager steps follow the gradient copies on
        the gradient accumulator's worker)."""
        self.delayed = bool(delayed)
        """``offload_optimizer.delayed_update``: DPU once the warmup is over."""
        self.warmup = max(int(warmup), 0)
        """``offload_optimizer.delayed_update_warmup``: normal steps before DPU starts."""
        self.steps_done = 0
        self.delayed_now = False
        """The step begun last is delayed (its update reaches the weights one step late)."""
        self.pool: Optional[ThreadPoolExecutor] = cpu_step_pool(name) if worker else None
        self._eager: List[Tuple[T, Future]] = []
        self._pending: Optional[Future] = None
        """The delayed step in the background, not yet in the weights."""

    # --- which kind of step ------------------------------------------------------------------
    def next_delayed(self) -> bool:
        """The next optimizer step will be delayed (DPU on and its warmup over)."""
        return self.delayed and self.steps_done >= self.warmup

    def begin_step(self) -> bool:
        """An optimizer step begins: returns (and remembers) whether it is delayed."""
        self.delayed_now = self.next_delayed()
        self.steps_done += 1
        return self.delayed_now

    # --- eager steps during backward ---------------------------------------------------------
    def submit_eager(self, covers: T, work: Callable[..., None], *args) -> None:
        """Run ``work(*args)`` on the worker now; ``covers`` comes back from finish_eager."""
        self._eager.append((covers, self.pool.submit(work, *args)))

    def finish_eager(self) -> Iterator[T]:
        """Each eager step in submission order, as soon as it is done (its copy back can start
        while the worker steps the next)."""
        eager, self._eager = self._eager, []
        for covers, fut in eager:
            fut.result()
            yield covers

    # --- the delayed step --------------------------------------------------------------------
    def submit_delayed(self, work: Callable[..., None], *args) -> None:
        """Queue the delayed step's background work (the previous one must be finished)."""
        self._pending = self.pool.submit(work, *args)

    @property
    def pending(self) -> Optional[Future]:
        """The delayed step still in the background (None: its update is in the weights)."""
        return self._pending

    def finish_delayed(self) -> bool:
        """Wait for the delayed step in the background; True when there was one (its result
        is then due in the weights)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        pending.result()
        return True

    # --- everything --------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Some step (eager or delayed) was handed to the worker and not collected yet."""
        return bool(self._eager) or self._pending is not None

    def wait(self) -> bool:
        """Finish every step handed to the worker; True when a delayed one was among them."""
        for _ in self.finish_eager():
            pass
        return self.finish_delayed()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
