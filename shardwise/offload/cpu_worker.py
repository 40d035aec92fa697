"""The background thread that runs offloaded optimizer steps on the CPU.

The CPU step (fused AdamW: about 28 bytes of host memory traffic per parameter) is bound by
host memory bandwidth, which it shares with the DMA of gradients and weights, while the
thread that drives the GPU keeps launching backward kernels beside it. Fewer step threads
leave that thread a core of its own but take bandwidth from the step; measured end to end on
one H200 host with 16 cores (1.1B Llama, 4 micro steps, tokens/s), all 16 threads win:
ZeRO-2 offload 44,441 against 42,731 with 12, ZeRO-3 full offload 41,610 against 39,860.
So the worker uses torch's intra-op thread count unless ``SHARDWISE_OFFLOAD_THREADS`` says
otherwise (for a host shared with other work, e.g. several ranks per node). Setting it also
sets the count that threads started later begin with (``torch.set_num_threads`` does both).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from ..errors import ConfigError

THREADS_ENV = "SHARDWISE_OFFLOAD_THREADS"
"""Environment variable: intra-op threads of the offload worker (default: torch's count)."""


def offload_threads() -> Optional[int]:
    """The worker's intra-op threads from ``SHARDWISE_OFFLOAD_THREADS``; None when unset
    (torch's own count, left untouched)."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{THREADS_ENV}={raw!r}: expected a whole number of threads >= 1; "
                          f"unset it to use torch's {torch.get_num_threads()}")
    return value


def cpu_step_pool(name: str) -> ThreadPoolExecutor:
    """One worker thread for the CPU step, with ``offload_threads()`` intra-op threads."""
    threads = offload_threads()
    if threads is None:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                              initializer=torch.set_num_threads, initargs=(threads,))


def detached_step(inner: torch.optim.Optimizer) -> Callable[[], None]:
    """``inner.step`` with the hyperparameters ``inner.param_groups`` hold *now*, safe to
    run on another thread while the caller goes on changing them.

    A delayed (DPU) update runs in the background while the engine steps the LR scheduler,
    which writes ``group["lr"]`` at once: a background ``inner.step()`` would read the next
    step's rate. This steps a shallow twin of ``inner`` instead: its own copies of the
    groups (same parameter lists), everything else shared, so optimizer state lands in
    ``inner.state``. The class's ``step`` is called directly because a scheduler replaces
    the instance's ``step`` with a wrapper bound to ``inner``; ``_opt_called`` is set as that
    wrapper would, so the scheduler does not warn that the optimizer never stepped.
    """
    twin = object.__new__(type(inner))
    twin.__dict__.update(inner.__dict__)
    twin.param_groups = [dict(group) for group in inner.param_groups]
    inner._opt_called = True  # type: ignore[attr-defined]
    step = type(inner).step
    return lambda: step(twin)
