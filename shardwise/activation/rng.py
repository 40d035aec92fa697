"""Named RNG streams (Megatron/DeepSpeed ``CudaRNGStatesTracker``) that also work on CPU.

Model-parallel code wants two kinds of randomness: dropout inside a tensor-parallel region
must differ between model-parallel ranks, dropout elsewhere must match. The tracker keeps
extra named generator states; ``with tracker.fork("model-parallel-rng"):`` swaps one in,
runs the block, and stores the advanced state back. Activation checkpointing saves and
restores every tracked state around a recompute, so dropout draws the same masks twice.

On a machine without CUDA the tracked states are CPU generator states, so the same code
(and the tests) run everywhere.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional

import torch

from ..errors import ConfigError

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


def _device_kind() -> str:
    """The device whose default generator the tracker manages: CUDA when present, else CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_rng_state(kind: str) -> torch.Tensor:
    """The current default-generator state of ``kind`` ('cuda' means the current device)."""
    return torch.cuda.get_rng_state() if kind == "cuda" else torch.get_rng_state()


def set_rng_state(kind: str, state: torch.Tensor) -> None:
    """Install ``state`` into the default generator of ``kind``."""
    if kind == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class CudaRNGStatesTracker:
    """Named generator states, swapped in and out of the default generator by ``fork``.

    The name says CUDA for compatibility with DeepSpeed and Megatron; on CPU-only machines
    it tracks the CPU generator.
    """

    def __init__(self) -> None:
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: set = set()
        self.kind = _device_kind()

    def reset(self) -> None:
        """Forget every tracked state and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of the name -> state map (the state tensors themselves are immutable bytes)."""
        return dict(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace the tracked states, e.g. with what ``get_states`` returned earlier."""
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Track a new stream ``name`` seeded with ``seed`` without disturbing the default one."""
        if seed in self.seeds_:
            raise ConfigError(f"RNG tracker: seed {seed} is already used by another stream; "
                              f"give stream {name!r} a different seed")
        if name in self.states_:
            raise ConfigError(f"RNG tracker: stream {name!r} already exists; call reset() "
                              f"first or pick another name")
        self.seeds_.add(seed)
        # Seed the default generator, read its state, then put the original state back.
        original = get_rng_state(self.kind)
        if self.kind == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states_[name] = get_rng_state(self.kind)
        set_rng_state(self.kind, original)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block with stream ``name`` as the default generator, then restore."""
        if name not in self.states_:
            raise ConfigError(f"RNG tracker: stream {name!r} is not tracked (known: "
                              f"{sorted(self.states_) or 'none'}); call add({name!r}, seed) or "
                              f"model_parallel_cuda_manual_seed(seed) first")
        original = get_rng_state(self.kind)
        set_rng_state(self.kind, self.states_[name])
        try:
            yield
        finally:
            # Keep the advanced state, so the next fork continues the stream.
            self.states_[name] = get_rng_state(self.kind)
            set_rng_state(self.kind, original)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide tracker (DeepSpeed's ``get_cuda_rng_tracker``)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int, mp_rank: Optional[int] = None) -> None:
    """Seed the default generator and the model-parallel stream (Megatron's recipe).

    The default generator gets ``seed`` on every model-parallel rank (so data-parallel
    dropout matches); the ``model-parallel-rng`` stream gets ``seed + 2718 + mp_rank`` so
    each tensor-parallel shard draws different masks. ``mp_rank`` defaults to the rank in the
    model-parallel group configured through ``configure(mpu_=...)``, else 0.
    """
    if mp_rank is None:
        from . import api
        mpu = api.STATE.mpu
        mp_rank = mpu.get_model_parallel_rank() if mpu is not None else 0
    model_parallel_seed = seed + 2718 + int(mp_rank)
    _TRACKER.reset()
    if _TRACKER.kind == "cuda":
        torch.cuda.manual_seed(seed)
    torch.manual_seed(seed)
    _TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, model_parallel_seed)
