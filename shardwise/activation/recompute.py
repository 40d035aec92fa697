"""The checkpoint mechanism behind ``checkpoint()``, ``non_reentrant_checkpoint()`` and policies.

It rides on ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (so it composes with
``torch.autograd.grad``, inputs that need no grad, keyword arguments and selective
``context_fn``s) but does not hand the inputs to torch: torch would keep them alive for the
recompute. Instead a ``_Holder`` keeps them, and after the forward it may replace each
floating-point input by a *stash entry*: this rank's slice of it (``partition_activations``),
a slot of one preallocated buffer (``contiguous_memory_optimization``) and/or a host copy
(``cpu_checkpointing``). The recompute rebuilds the inputs from the stash.

RNG states (CPU, current CUDA device and every ``CudaRNGStatesTracker`` stream) are captured
before the forward and reinstalled for the recompute, so dropout draws the same masks.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from .. import comm
from ..accelerator import get_accelerator
from ..errors import ConfigError
from .cpu_offload import HostCopy, tensor_bytes
from .profile import Profiler
from .rng import get_cuda_rng_tracker, get_rng_state, set_rng_state
from .selective import RebuiltInput


@dataclass(frozen=True)
class CheckpointingSettings:
    """The validated ``activation_checkpointing`` values that the runtime uses."""

    partition_activations: bool = False
    """Split each saved input across the model-parallel group."""
    contiguous_memory_optimization: bool = False
    """Keep saved slices in one preallocated buffer (needs partition_activations)."""
    cpu_checkpointing: bool = False
    """Keep saved inputs in pinned host memory until the recompute."""
    number_checkpoints: Optional[int] = None
    """Checkpointed calls per forward; required by contiguous_memory_optimization."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronize the device at each checkpoint's boundaries."""
    profile: bool = False
    """Log forward/recompute time and memory per checkpoint."""


@dataclass
class CheckpointState:
    """Module-level settings and counters (what ``configure()`` sets and ``reset()`` clears)."""

    configured: bool = False
    """``configure()`` (or the engine) has run."""
    mpu: Any = None
    """Model-parallel unit: ``get_model_parallel_{group,rank,world_size}()``; None = no MP."""
    settings: CheckpointingSettings = field(default_factory=CheckpointingSettings)
    """The validated ``activation_checkpointing`` values in force."""
    sync_calls: int = 0
    """How many boundary synchronizations ran (observable effect of the key)."""
    calls: int = 0
    """Checkpointed calls since the last ``reset()``."""
    profiler: Profiler = field(default_factory=Profiler)
    buffers: Dict[Tuple[int, torch.dtype, str], "_SlotBuffer"] = field(default_factory=dict)
    live: List["weakref.ref[_Holder]"] = field(default_factory=list)

    def mp_world_size(self) -> int:
        return self.mpu.get_model_parallel_world_size() if self.mpu is not None else 1

    def stashing(self) -> bool:
        """Whether inputs are transformed after the forward (else kept as they are)."""
        s = self.settings
        return s.cpu_checkpointing or (s.partition_activations and
                                       (self.mp_world_size() > 1 or s.contiguous_memory_optimization))


STATE = CheckpointState()


# --- RNG ---------------------------------------------------------------------------------
def _capture_rng() -> Tuple[torch.Tensor, Optional[torch.Tensor], Dict[str, torch.Tensor]]:
    cuda_state = get_rng_state("cuda") if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda_state, get_cuda_rng_tracker().get_states()


@contextlib.contextmanager
def _replayed_rng(states: Tuple[torch.Tensor, Optional[torch.Tensor], Dict[str, torch.Tensor]]):
    """Install the captured states for the block, then put the current ones back."""
    tracker = get_cuda_rng_tracker()
    now = _capture_rng()
    cpu, cuda, tracked = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        set_rng_state("cuda", cuda)
    tracker.set_states(tracked)
    try:
        yield
    finally:
        torch.set_rng_state(now[0])
        if now[1] is not None:
            set_rng_state("cuda", now[1])
        tracker.set_states(now[2])


def _boundary_sync() -> None:
    if STATE.settings.synchronize_checkpoint_boundary:
        get_accelerator().synchronize()
        STATE.sync_calls += 1


# --- stash entries -----------------------------------------------------------------------
class _SlotBuffer:
    """``number_checkpoints`` equal slots in one allocation; a slot is busy while its stash lives."""

    def __init__(self, slots: int, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cpu" and get_accelerator().pin_memory_supported()
        self.data = torch.empty(slots, numel, dtype=dtype, device=device, pin_memory=pin)
        self.busy = [False] * slots

    def take(self, input_index: int) -> Tuple[int, torch.Tensor]:
        for slot, busy in enumerate(self.busy):
            if not busy:
                self.busy[slot] = True
                return slot, self.data[slot]
        raise ConfigError(
            f"activation_checkpointing.number_checkpoints={len(self.busy)} is smaller than the "
            f"number of checkpointed calls in one forward (input #{input_index} needs slot "
            f"{len(self.busy) + 1}); set number_checkpoints to the number of checkpointed layers, "
            f"or call shardwise.checkpointing.reset() between forwards that have no backward")

    def release(self, slot: int) -> None:
        self.busy[slot] = False


class _Partitioned:
    """This rank's 1/mp slice of a flattened tensor (maybe in a contiguous slot, maybe on host)."""

    def __init__(self, t: torch.Tensor, input_index: int) -> None:
        world = STATE.mp_world_size()
        rank = STATE.mpu.get_model_parallel_rank() if STATE.mpu is not None else 0
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.requires_grad = t.requires_grad
        self.numel = t.numel()
        self.chunk = -(-self.numel // world)
        flat = t.detach().reshape(-1)
        mine = flat[rank * self.chunk:(rank + 1) * self.chunk]
        self._slot: Optional[Tuple[_SlotBuffer, int]] = None
        host = STATE.settings.cpu_checkpointing
        if STATE.settings.contiguous_memory_optimization:
            target_device = torch.device("cpu") if host else t.device
            buf = _slot_buffer(input_index, self.chunk, t.dtype, target_device)
            slot, view = buf.take(input_index)
            view[: mine.numel()].copy_(mine)
            self._slot = (buf, slot)
            weakref.finalize(self, buf.release, slot)
            self.part: Any = view
        elif host:
            self.part = HostCopy(mine)
        else:
            self.part = mine.clone()
        self.nbytes = self.chunk * t.element_size()

    def prefetch(self) -> None:
        if isinstance(self.part, HostCopy):
            self.part.prefetch()

    def restore(self) -> torch.Tensor:
        part = self.part.restore() if isinstance(self.part, HostCopy) else self.part
        part = part.to(self.device, non_blocking=True)
        if part.numel() < self.chunk:  # the last rank's slice is short: pad to equal sizes
            part = torch.cat([part, part.new_zeros(self.chunk - part.numel())])
        world = STATE.mp_world_size()
        if world > 1:
            pieces = [torch.empty_like(part) for _ in range(world)]
            comm.all_gather(pieces, part.contiguous(), group=STATE.mpu.get_model_parallel_group())
            part = torch.cat(pieces)
        full = part[: self.numel].view(self.shape).clone()
        return full.requires_grad_(self.requires_grad)


def _slot_buffer(input_index: int, numel: int, dtype: torch.dtype, device: torch.device) -> _SlotBuffer:
    key = (input_index, dtype, str(device))
    buf = STATE.buffers.get(key)
    if buf is None or buf.data.shape[1] != numel:
        if buf is not None and any(buf.busy):
            raise ConfigError(
                f"contiguous_memory_optimization: checkpointed input #{input_index} changed size "
                f"({buf.data.shape[1]} -> {numel} elements) while earlier checkpoints still hold "
                f"their slots; contiguous buffers need every checkpointed layer to take inputs of "
                f"one size (turn contiguous_memory_optimization off for this model)")
        buf = _SlotBuffer(STATE.settings.number_checkpoints, numel, dtype, device)
        STATE.buffers[key] = buf
    return buf


def _is_activation(x: Any) -> bool:
    return (isinstance(x, torch.Tensor) and x.is_floating_point()
            and not isinstance(x, torch.nn.Parameter) and x.device.type != "meta")


def _is_stashed(x: Any) -> bool:
    return isinstance(x, (_Partitioned, HostCopy, RebuiltInput))


class _Holder:
    """Keeps one checkpoint's inputs (as given, or as stash entries) for its recompute."""

    def __init__(self, flat: List[Any], spec: Any) -> None:
        self.flat = flat
        self.spec = spec
        self.ran = False
        self.record: Any = None
        self.stashed_bytes = sum(tensor_bytes(x) for x in flat if isinstance(x, torch.Tensor))

    def stash(self) -> None:
        for i, x in enumerate(self.flat):
            if not _is_activation(x):
                continue
            if STATE.settings.partition_activations and (STATE.mp_world_size() > 1
                                                or STATE.settings.contiguous_memory_optimization):
                self.flat[i] = _Partitioned(x, i)
            elif STATE.settings.cpu_checkpointing:
                self.flat[i] = HostCopy(x)
        self.stashed_bytes = sum(
            x.nbytes if isinstance(x, (_Partitioned, HostCopy)) else tensor_bytes(x)
            for x in self.flat if isinstance(x, (torch.Tensor, _Partitioned, HostCopy)))

    def prefetch(self) -> None:
        for x in self.flat:
            if _is_stashed(x):
                x.prefetch()

    def rebuild(self, rebuild_input: Callable[[Any], Any]) -> None:
        """Replace inputs that another recompute can rebuild (see ``run_checkpoint``)."""
        for i, x in enumerate(self.flat):
            if isinstance(x, torch.Tensor):
                rebuilt = rebuild_input(x)
                if rebuilt is not None:
                    self.flat[i] = rebuilt

    def inputs(self) -> Tuple[tuple, dict]:
        flat = [x.restore() if _is_stashed(x) else x for x in self.flat]
        return tree_unflatten(flat, self.spec)


def _prefetch_previous(holder: _Holder) -> None:
    """Backward runs layers in reverse: start bringing back the checkpoint before this one."""
    STATE.live = [ref for ref in STATE.live if ref() is not None]
    holders = [ref() for ref in STATE.live]
    if holder in holders:
        index = holders.index(holder)
        if index > 0:
            holders[index - 1].prefetch()


def _noop_context_fn() -> Tuple[Any, Any]:
    return contextlib.nullcontext(), contextlib.nullcontext()


def run_checkpoint(function: Callable[..., Any], args: tuple, kwargs: dict,
                   context_fn: Optional[Callable[[], Tuple[Any, Any]]] = None,
                   recompute_function: Optional[Callable[..., Any]] = None,
                   rebuild_input: Optional[Callable[[torch.Tensor], Any]] = None) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute in backward.

    ``recompute_function`` (default ``function``) is what the recompute calls; module
    policies pass the module's ``__call__`` so its hooks (e.g. ZeRO-3 gathers) run again.
    ``rebuild_input(tensor)`` may return, for an input, an object whose ``restore()`` rebuilds
    it in backward (the ``selective`` policy: a norm's output, recomputed by the norm); the
    checkpoint then keeps that object instead of the tensor.
    """
    if not torch.is_grad_enabled():  # nothing will be recomputed, so there is nothing to save
        return function(*args, **kwargs)
    flat, spec = tree_flatten((args, kwargs))
    holder = _Holder(flat, spec)
    rng = _capture_rng()
    profiler = STATE.profiler if STATE.settings.profile else None

    def run(*_device_marker: Any) -> Any:
        if not holder.ran:  # the real forward
            holder.ran = True
            fwd_args, fwd_kwargs = tree_unflatten(list(flat), spec)
            return function(*fwd_args, **fwd_kwargs)
        # The recompute, inside backward. torch may stop it early once it has every saved
        # tensor it needs (by raising), hence the try/finally around the bookkeeping.
        _boundary_sync()
        t0 = time.perf_counter()
        try:
            re_args, re_kwargs = holder.inputs()
            _prefetch_previous(holder)
            with _replayed_rng(rng):
                return (recompute_function or function)(*re_args, **re_kwargs)
        finally:
            if profiler is not None and holder.record is not None:
                profiler.end_recompute(holder.record, t0)
            _boundary_sync()

    _boundary_sync()
    if profiler is not None:
        holder.record, t0 = profiler.start_forward()
    # torch infers the device (whose autocast state it replays) from the tensor arguments; an
    # empty tensor on the inputs' device says which one without keeping any input alive.
    device = next((x.device for x in flat if isinstance(x, torch.Tensor)), None)
    marker = () if device is None else (torch.empty(0, device=device),)
    out = _torch_checkpoint(run, *marker, use_reentrant=False, preserve_rng_state=False,
                            context_fn=context_fn or _noop_context_fn)
    if rebuild_input is not None:
        holder.rebuild(rebuild_input)
    if STATE.stashing():
        holder.stash()
        if len(STATE.live) > 256:  # forwards without backward leave dead references behind
            STATE.live = [ref for ref in STATE.live if ref() is not None]
        STATE.live.append(weakref.ref(holder))
    STATE.calls += 1
    if profiler is not None:
        profiler.end_forward(holder.record, t0, holder.stashed_bytes)
    _boundary_sync()
    return out
