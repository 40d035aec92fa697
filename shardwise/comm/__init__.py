"""A ``torch.distributed``-like facade: process-group setup plus the collectives shardwise uses.

``init_distributed()`` makes a plain ``python train.py`` (no launcher, no environment
variables) a world of one, with an in-memory store: nothing to connect to, nothing to
configure, the same on every platform.
"""
from __future__ import annotations

import atexit
import datetime
import os
import sys
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp  # noqa: F401  (re-exported for users)

from ..accelerator import get_accelerator
from ..errors import DistributedError
from ..utils.logging import logger
from .collectives import all_gather_flat, reduce_scatter_flat

__all__ = ["init_distributed", "is_initialized", "get_rank", "get_world_size", "get_local_rank",
           "barrier", "all_reduce", "broadcast", "all_gather", "all_gather_object",
           "broadcast_object_list", "reduce_scatter_flat", "all_gather_flat", "ReduceOp",
           "destroy_process_group", "get_backend"]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                     init_method: Optional[str] = None, dist_init_required: Optional[bool] = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Create the default process group unless one exists (DeepSpeed's signature).

    With RANK/WORLD_SIZE in the environment (the launcher, torchrun, SLURM-style wrappers)
    the group rendezvouses through ``env://``; without them the process is a world of one.
    """
    if dist.is_initialized():
        _register_shutdown_at_exit()
        return
    if dist_init_required is False:
        return
    backend = dist_backend or get_accelerator().communication_backend_name()
    env_world = _env_int("WORLD_SIZE", world_size if world_size > 0 else 1)
    env_rank = _env_int("RANK", rank if rank >= 0 else 0)
    if sys.platform == "win32":
        # Windows torch wheels are built without libuv; the TCPStore must not ask for it
        # (a user's USE_LIBUV=1 can never work there).
        os.environ["USE_LIBUV"] = "0"
    if env_world == 1 and init_method is None and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        try:
            dist.init_process_group(backend, init_method=init_method or "env://", rank=env_rank,
                                    world_size=env_world, timeout=timeout)
        except (RuntimeError, ValueError) as exc:
            raise DistributedError(
                f"could not start the {backend} process group (rank {env_rank} of {env_world}, "
                f"MASTER_ADDR={os.environ.get('MASTER_ADDR')}, MASTER_PORT="
                f"{os.environ.get('MASTER_PORT')}): {exc}. Launch with `shardwise` or torchrun, "
                "or unset WORLD_SIZE/RANK to run as a single process.") from exc
    _register_shutdown_at_exit()
    if verbose and dist.get_rank() == 0:
        logger.debug(f"process group: backend={backend} world_size={dist.get_world_size()}")


def _shutdown_at_exit() -> None:
    """Destroy the default group at interpreter exit if the script did not (no barrier).

    Most DeepSpeed scripts never call ``destroy_process_group()``. The group's C++ threads
    (gloo's workers and store connections) are then torn down by static destructors during
    interpreter teardown, which sometimes aborts the process with ``terminate called without
    an active exception`` (exit -6) after the work succeeded. Destroying it here, while the
    interpreter is still whole, joins them in order. It only tears down this rank's objects:
    a rank that exits early (an error) does not wait for the others.
    """
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # the process is exiting; a failed teardown must not mask its result
        pass


def _register_shutdown_at_exit() -> None:
    """Register :func:`_shutdown_at_exit` once. atexit runs handlers last-in first-out, so it
    runs before the handlers torch registered at import (the DataLoader's exit flag) and after
    any registered later (persistent DataLoader workers are stopped before the group goes)."""
    atexit.unregister(_shutdown_at_exit)
    atexit.register(_shutdown_at_exit)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_initialized() else _env_int("RANK", 0)


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else _env_int("WORLD_SIZE", 1)


def get_local_rank() -> int:
    return _env_int("LOCAL_RANK", 0)


def get_backend(group: Any = None) -> Optional[str]:
    return str(dist.get_backend(group)) if is_initialized() else None


def barrier(group: Any = None) -> None:
    if is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False):
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False):
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False):
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: List[Any], obj: Any, group: Any = None) -> None:
    dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: List[Any], src: int = 0, group: Any = None) -> None:
    dist.broadcast_object_list(object_list, src=src, group=group)


def destroy_process_group(group: Any = None) -> None:
    if is_initialized():
        dist.destroy_process_group(group)
