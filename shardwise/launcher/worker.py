"""The worker-side shim: what must happen inside each worker before the user's script runs.

The elastic agent starts every worker with the same argv, so per-worker work happens here:
``python -m shardwise.launcher.worker [--bind] --python -- train.py ...`` then runs the real
script in this same process (``runpy``, as torchrun's ``--run-path`` does), so the agent's
signals and exit codes reach it directly. The launcher uses it only when needed:

* ``--bind`` (``--bind_cores_to_rank``): pin this local rank to its own share of the cores
  through psutil (Linux and Windows; macOS has no affinity API, so only the thread count).
* ``USE_LIBUV=0`` (always on Windows): torch's env:// rendezvous creates the worker's client
  ``TCPStore`` of the agent's store *without* reading USE_LIBUV, i.e. with libuv, which
  Windows builds of torch lack; the shim makes that store honour the variable.

``python -m`` imports the ``shardwise`` package (and so torch) first, so OMP_NUM_THREADS
alone would come too late: the thread count is also set with ``torch.set_num_threads``.
"""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
from typing import List, Optional, Sequence


def cores_for_rank(cores: Sequence[int], local_rank: int, local_world_size: int) -> List[int]:
    """Contiguous, equal shares (the first ranks get one more when it does not divide)."""
    cores = list(cores)
    if local_world_size <= 0 or not cores:
        return cores
    if local_world_size > len(cores):
        return [cores[local_rank % len(cores)]]
    base, extra = divmod(len(cores), local_world_size)
    start = local_rank * base + min(local_rank, extra)
    return cores[start:start + base + (1 if local_rank < extra else 0)]


def bind_this_process(local_rank: int, local_world_size: int) -> Optional[List[int]]:
    """Set affinity and OMP_NUM_THREADS for this rank; returns the cores, None if unsupported."""
    try:
        import psutil
        process = psutil.Process()
        available = process.cpu_affinity()
    except (ImportError, AttributeError, OSError):
        available = None  # macOS (no affinity API) or a restricted container
    if available is None:
        count = os.cpu_count() or 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, count // max(1, local_world_size)))
        return None
    mine = cores_for_rank(sorted(available), local_rank, local_world_size)
    process.cpu_affinity(mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(len(mine))
    return mine


def libuv_respecting_store(store_class):
    """A TCPStore factory that honours USE_LIBUV=0 (torch's own default is libuv)."""
    def make(*args, **kwargs):
        if os.environ.get("USE_LIBUV") == "0":
            kwargs.setdefault("use_libuv", False)
        return store_class(*args, **kwargs)
    make.__wrapped__ = store_class
    return make


def patch_worker_store() -> None:
    """Make env:// rendezvous (``torch.distributed.rendezvous``) obey USE_LIBUV=0."""
    import importlib
    # importlib, not "import ... as": torch.distributed.rendezvous is also a function name
    # on the package, which the attribute lookup of "import as" would return.
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    if not hasattr(rendezvous.TCPStore, "__wrapped__"):
        rendezvous.TCPStore = libuv_respecting_store(rendezvous.TCPStore)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bind = bool(argv) and argv[0] == "--bind"
    if bind:
        argv.pop(0)
    mode = argv.pop(0) if argv and argv[0] in ("--python", "--exec") else "--python"
    if argv and argv[0] == "--":
        argv.pop(0)
    if bind:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        cores = bind_this_process(local_rank, world)
        if cores is not None:
            print(f"[shardwise] local rank {local_rank} bound to cores {cores}", file=sys.stderr)
    if os.environ.get("USE_LIBUV") == "0":
        patch_worker_store()
    if mode == "--exec":
        return subprocess.call(argv)  # affinity is inherited by the child on Linux and Windows
    if argv and argv[0] == "-u":
        argv.pop(0)
    if argv and argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
