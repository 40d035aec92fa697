"""Run a function in N real processes (spawn start method, gloo) and collect results.

Used by the distributed tests: each worker gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* in its
environment and an initialised gloo process group; whatever the function returns is saved
by the worker and handed back to the test, one entry per rank.
"""
from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple,
            backend: str) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    })
    os.environ.pop("USE_LIBUV", None)
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The rank's work is saved and every rank passed the barrier: leave without the
    # interpreter's teardown, where gloo's worker threads once aborted a finished rank in CI
    # ("terminate called without an active exception", SIGABRT; torch PR 179291 describes it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable, world_size: int, *args: Any, backend: str = "gloo") -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    ``fn`` must be a module-level function (spawn pickles it by name). Returns the list of
    per-rank return values; any worker exception fails the call with its traceback.
    """
    for attempt in range(3):
        with tempfile.TemporaryDirectory() as out_dir:
            try:
                mp.start_processes(_worker, args=(fn, world_size, free_port(), out_dir, args, backend),
                                   nprocs=world_size, join=True, start_method="spawn")
            except mp.ProcessRaisedException as exc:
                # another test grabbed the port between free_port() and the store's bind
                if attempt < 2 and ("address already in use" in str(exc).lower()
                                    or "EADDRINUSE" in str(exc)):
                    continue
                raise
            return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
                    for r in range(world_size)]
    raise RuntimeError("unreachable")
