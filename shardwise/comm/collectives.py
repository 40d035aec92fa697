"""Flat-buffer collectives with fallbacks for backends that lack them.

NCCL has every collective; gloo gained reduce-scatter and all-gather-into-tensor only in
recent torch releases (and Windows builds may lack them). Each wrapper tries the native
call once per backend and remembers a failure, after which it uses the fallback:
reduce-scatter becomes all-reduce plus a slice copy, all-gather-into-tensor becomes
all-gather into views of the output. ``SHARDWISE_COMM_FALLBACK=1`` forces the fallbacks
(tests use it to cover both paths).
"""
from __future__ import annotations

import os
import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .comms_logger import COMMS_LOGGER

_unsupported: Dict[str, bool] = {}


def _force_fallback() -> bool:
    return os.environ.get("SHARDWISE_COMM_FALLBACK", "0") == "1"


def _backend(group: Optional[dist.ProcessGroup]) -> str:
    return str(dist.get_backend(group))


def _native(name: str) -> Optional[callable]:
    # torch 2.13 renamed the *_tensor collectives to *_single; older releases only have the former.
    new = {"all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single"}[name]
    old = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}[name]
    return getattr(dist, new, None) or getattr(dist, old, None)


class _Done:
    """A finished collective: lets callers treat sync and async results alike."""

    def wait(self) -> bool:
        return True


class _ThenCopy:
    """Waits for an all-reduce, then copies this rank's slice out (the reduce-scatter fallback).

    Waiting twice copies once (the comms logger waits before the caller does)."""

    def __init__(self, work, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.work, self.src, self.dst = work, src, dst
        self.done = False

    def wait(self) -> bool:
        if self.done:
            return True
        if self.work is not None:
            self.work.wait()
        self.dst.copy_(self.src)
        self.done = True
        return True


def _try_native(name: str, pg, fn, out: torch.Tensor, *args, **kwargs):
    key = f"{name}:{_backend(pg)}"
    if _force_fallback() or _unsupported.get(key):
        return None
    if out.is_cuda and _backend(pg) == "gloo":
        # gloo's newer reduce-scatter/all-gather-into-tensor on CUDA tensors gave wrong
        # results under side streams in our GPU tests; its all-reduce/all-gather are sound
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            return fn(out, *args, **kwargs) or _Done()
        except (RuntimeError, NotImplementedError, ValueError):
            _unsupported[key] = True
            return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def reduce_scatter_flat(output: torch.Tensor, input_flat: torch.Tensor,
                        group: Optional[dist.ProcessGroup] = None, async_op: bool = False):
    """Sum ``input_flat`` (length W·n) over ranks; rank r receives elements [r·n, (r+1)·n).

    The fallback all-reduces ``input_flat`` in place (it is scratch for the caller). Logged
    as ``reduce_scatter_tensor`` of ``input_flat``'s bytes (DeepSpeed's name and size).
    """
    if not COMMS_LOGGER.enabled:
        return _reduce_scatter_flat(output, input_flat, group, async_op)
    return COMMS_LOGGER.run("reduce_scatter_tensor", _nbytes(input_flat),
                            lambda: _reduce_scatter_flat(output, input_flat, group, async_op),
                            group)


def all_gather_flat(output_flat: torch.Tensor, input_chunk: torch.Tensor,
                    group: Optional[dist.ProcessGroup] = None, async_op: bool = False):
    """Concatenate every rank's ``input_chunk`` into ``output_flat`` (length W·n), in rank order.

    Logged as ``all_gather_into_tensor`` of ``input_chunk``'s bytes (DeepSpeed's name and size).
    """
    if not COMMS_LOGGER.enabled:
        return _all_gather_flat(output_flat, input_chunk, group, async_op)
    return COMMS_LOGGER.run("all_gather_into_tensor", _nbytes(input_chunk),
                            lambda: _all_gather_flat(output_flat, input_chunk, group, async_op),
                            group)


def _reduce_scatter_flat(output: torch.Tensor, input_flat: torch.Tensor,
                         group: Optional[dist.ProcessGroup], async_op: bool):
    world = dist.get_world_size(group)
    native = _native("reduce_scatter")
    work = None
    if native is not None:
        work = _try_native("reduce_scatter", group, native, output, input_flat, group=group,
                           async_op=async_op)
    if work is not None:
        return work
    rank = dist.get_rank(group)
    n = output.numel()
    if input_flat.numel() != n * world:
        raise ValueError(f"reduce_scatter_flat: input has {input_flat.numel()} elements, "
                         f"expected {n} x {world}")
    handle = dist.all_reduce(input_flat, group=group, async_op=async_op)
    result = _ThenCopy(handle if async_op else None, input_flat[rank * n:(rank + 1) * n], output)
    if not async_op:
        result.wait()
    return result


def _all_gather_flat(output_flat: torch.Tensor, input_chunk: torch.Tensor,
                     group: Optional[dist.ProcessGroup], async_op: bool):
    world = dist.get_world_size(group)
    native = _native("all_gather")
    if native is not None:
        work = _try_native("all_gather", group, native, output_flat, input_chunk, group=group,
                           async_op=async_op)
        if work is not None:
            return work
    n = input_chunk.numel()
    views: List[torch.Tensor] = [output_flat[r * n:(r + 1) * n] for r in range(world)]
    work = dist.all_gather(views, input_chunk, group=group, async_op=async_op)
    return work if async_op else _Done()
