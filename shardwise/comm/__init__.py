"""A ``torch.distributed``-like facade: process-group setup plus the collectives shardwise uses.

``init_distributed()`` makes a plain ``python train.py`` (no launcher, no environment
variables) a world of one, with an in-memory store: nothing to connect to, nothing to
configure, the same on every platform.
"""
from __future__ import annotations

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
from .comms_logger import COMMS_LOGGER, CommsLogger

__all__ = ["init_distributed", "is_initialized", "get_rank", "get_world_size", "get_local_rank",
           "barrier", "all_reduce", "broadcast", "all_gather", "all_gather_object",
           "broadcast_object_list", "reduce_scatter_flat", "all_gather_flat", "ReduceOp",
           "destroy_process_group", "get_backend", "reduce", "all_gather_into_tensor",
           "reduce_scatter_tensor", "configure", "log_summary", "reset_log", "has_comm_data",
           "comms_logger", "CommsLogger"]


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
    if verbose and dist.get_rank() == 0:
        logger.debug(f"process group: backend={backend} world_size={dist.get_world_size()}")


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


def _nbytes(tensor: Any) -> int:
    if isinstance(tensor, (list, tuple)):
        return sum(_nbytes(t) for t in tensor)
    return tensor.numel() * tensor.element_size() if torch.is_tensor(tensor) else 0


# Each collective below records itself in the comms logger when ``comms_logger`` is on
# (comms_logger.py); off, the only cost is the ``enabled`` test. ``prof`` and ``log_name``
# are DeepSpeed's: record this call even when ``prof_all`` is off / under this name.

def barrier(group: Any = None, prof: bool = False, log_name: Optional[str] = None) -> None:
    if not (is_initialized() and dist.get_world_size(group) > 1):
        return
    if not COMMS_LOGGER.enabled:
        dist.barrier(group=group)
        return
    COMMS_LOGGER.run("barrier", 0, lambda: dist.barrier(group=group), group, prof, log_name)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False, prof: bool = False, log_name: Optional[str] = None):
    if not COMMS_LOGGER.enabled:
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return COMMS_LOGGER.run("all_reduce", _nbytes(tensor), lambda: dist.all_reduce(
        tensor, op=op, group=group, async_op=async_op), group, prof, log_name)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None,
           async_op: bool = False, prof: bool = False, log_name: Optional[str] = None):
    if not COMMS_LOGGER.enabled:
        return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)
    return COMMS_LOGGER.run("reduce", _nbytes(tensor), lambda: dist.reduce(
        tensor, dst=dst, op=op, group=group, async_op=async_op), group, prof, log_name)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False,
              prof: bool = False, log_name: Optional[str] = None):
    if not COMMS_LOGGER.enabled:
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op)
    return COMMS_LOGGER.run("broadcast", _nbytes(tensor), lambda: dist.broadcast(
        tensor, src=src, group=group, async_op=async_op), group, prof, log_name)


def all_gather(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False, prof: bool = False, log_name: Optional[str] = None):
    if not COMMS_LOGGER.enabled:
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    return COMMS_LOGGER.run("all_gather", _nbytes(tensor), lambda: dist.all_gather(
        tensor_list, tensor, group=group, async_op=async_op), group, prof, log_name)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False):
    """DeepSpeed's name for ``all_gather_flat`` (every rank's ``tensor``, in rank order)."""
    return all_gather_flat(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor,
                          op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False):
    """DeepSpeed's name for ``reduce_scatter_flat`` (sum only; ``tensor`` is used as scratch
    by the fallback)."""
    if op != ReduceOp.SUM:
        raise DistributedError(f"reduce_scatter_tensor: only ReduceOp.SUM is supported, got {op}")
    return reduce_scatter_flat(output_tensor, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: List[Any], obj: Any, group: Any = None) -> None:
    if not COMMS_LOGGER.enabled:
        dist.all_gather_object(object_list, obj, group=group)
        return
    COMMS_LOGGER.run("all_gather_object", 0,
                     lambda: dist.all_gather_object(object_list, obj, group=group), group)


def broadcast_object_list(object_list: List[Any], src: int = 0, group: Any = None) -> None:
    if not COMMS_LOGGER.enabled:
        dist.broadcast_object_list(object_list, src=src, group=group)
        return
    COMMS_LOGGER.run("broadcast_object_list", 0,
                     lambda: dist.broadcast_object_list(object_list, src=src, group=group), group)


# --- the comms logger's public calls (DeepSpeed's deepspeed.comm names) ------------------------
comms_logger = COMMS_LOGGER


def configure(deepspeed_config: Any = None, enabled: Optional[bool] = None,
              prof_all: Optional[bool] = None, prof_ops: Optional[List[str]] = None,
              verbose: Optional[bool] = None, debug: Optional[bool] = None) -> None:
    """Set the comms logger from a config (its ``comms_logger`` section, when enabled) and/or
    arguments."""
    section = getattr(deepspeed_config, "comms_logger", None)
    if section is not None and section.enabled:
        COMMS_LOGGER.configure(enabled=section.enabled, verbose=section.verbose,
                               prof_all=section.prof_all, prof_ops=section.prof_ops,
                               debug=section.debug)
    COMMS_LOGGER.configure(enabled=enabled, verbose=verbose, prof_all=prof_all,
                           prof_ops=prof_ops, debug=debug)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Optional[dict]:
    """Print the table of recorded collectives on rank 0 (every rank syncs at a barrier
    first and after); with ``return_dict`` every rank gets its own numbers back.

    ``show_straggler`` (DeepSpeed: the spread of latencies across ranks) is not computed;
    it is accepted so DeepSpeed calls run, and says so once."""
    if show_straggler:
        from ..utils.logging import warn_once
        warn_once("comm.log_summary(show_straggler=True): the straggler breakdown is not "
                  "computed by shardwise; the table shows this rank's latencies")
    synced = is_initialized() and dist.get_world_size() > 1
    if synced:
        dist.barrier()  # not recorded: the table is about the training's collectives
    if get_rank() == 0:
        print(COMMS_LOGGER.table(), flush=True)
    if synced:
        dist.barrier()
    if not return_dict:
        return None
    return {"summary": COMMS_LOGGER.summary(), "straggler_analysis": None,
            "metadata": {"world_size": get_world_size(), "rank": get_rank()}}


def reset_log() -> None:
    """Forget every recorded collective."""
    COMMS_LOGGER.reset_data()


def has_comm_data() -> bool:
    """Whether any collective has been recorded."""
    return COMMS_LOGGER.has_data()


def destroy_process_group(group: Any = None) -> None:
    if is_initialized():
        dist.destroy_process_group(group)
