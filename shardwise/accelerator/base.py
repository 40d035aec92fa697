"""One small class covers every device kind: torch exposes the same calls per backend."""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Any, Optional

import torch

from ..errors import ConfigError

_KINDS = ("cuda", "xpu", "mps", "cpu")


class Accelerator:
    """A device kind (``cuda``, ``xpu``, ``mps`` or ``cpu``) and its runtime calls."""

    def __init__(self, kind: str) -> None:
        if kind not in _KINDS:
            raise ConfigError(f"unknown accelerator {kind!r}: valid are {', '.join(_KINDS)}")
        self.kind = kind
        self._module: Any = getattr(torch, kind, None) if kind != "cpu" else None

    # --- identity -------------------------------------------------------------------
    def device_name(self, index: Optional[int] = None) -> str:
        if self.kind in ("cpu", "mps") or index is None:
            return self.kind
        return f"{self.kind}:{index}"

    def device(self, index: Optional[int] = None) -> torch.device:
        return torch.device(self.device_name(index))

    def is_available(self) -> bool:
        if self.kind == "cpu":
            return True
        if self.kind == "mps":
            return torch.backends.mps.is_available()
        return bool(self._module is not None and self._module.is_available())

    def device_count(self) -> int:
        if self.kind in ("cpu", "mps"):
            return 1
        return self._module.device_count()

    def set_device(self, index: int) -> None:
        if self.kind in ("cuda", "xpu"):
            self._module.set_device(index)

    def communication_backend_name(self) -> str:
        """NCCL on CUDA Linux (RCCL on ROCm answers to the same name), XCCL on XPU, else gloo."""
        import torch.distributed as dist
        if self.kind == "cuda" and sys.platform.startswith("linux") and dist.is_nccl_available():
            return "nccl"
        if self.kind == "xpu" and hasattr(dist, "is_xccl_available") and dist.is_xccl_available():
            return "xccl"
        return "gloo"

    # --- precision ------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        if self.kind == "cuda":
            return torch.cuda.is_bf16_supported()
        return True

    def is_fp16_supported(self) -> bool:
        return True  # torch computes fp16 on every backend, CPU included

    def supports_fused_optimizer(self) -> bool:
        """torch's fused Adam/AdamW/SGD kernels exist for CUDA, XPU, MPS and (torch>=2.4) CPU."""
        return True

    # --- streams and sync -------------------------------------------------------------
    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize()
        elif self.kind == "xpu":
            torch.xpu.synchronize()
        elif self.kind == "mps":
            torch.mps.synchronize()

    def has_streams(self) -> bool:
        return self.kind in ("cuda", "xpu")

    def Stream(self, device: Any = None) -> Any:  # noqa: N802 - mirrors torch.cuda.Stream
        """A new side stream on ``device`` (the current device when None); None without streams."""
        if not self.has_streams():
            return None
        return self._module.Stream(device=device) if device is not None else self._module.Stream()

    def current_stream(self, device: Any = None) -> Any:
        return self._module.current_stream(device) if self.has_streams() else None

    def stream(self, stream: Any) -> Any:
        if stream is None or not self.has_streams():
            return contextlib.nullcontext()
        return self._module.stream(stream)

    def Event(self, **kwargs: Any) -> Any:  # noqa: N802
        return self._module.Event(**kwargs) if self.has_streams() else None

    # --- memory -----------------------------------------------------------------------
    def pin_memory_supported(self) -> bool:
        return self.kind in ("cuda", "xpu") and self.is_available()

    def pinned_empty(self, shape: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised CPU tensor allocated page-locked (pageable where pinning is
        unsupported).

        Allocated pinned in place, never pinned by copying: offload's flat buffers (gradient
        partitions, masters, swap rings) are several GB each, and a buffer that is first
        allocated pageable and then copied into pinned memory needs twice its size at once,
        which is what decides the largest model under a host-memory cap. Large buffers are
        exact-size with SHARDWISE_EXACT_PIN=1 (``pinned.py``); otherwise the first call lets
        large pinned blocks keep their exact size where torch has the setting (see
        :func:`exact_large_pinned_blocks`): the host allocator's power-of-two rounding would
        turn a 4.4 GB buffer into 8 GiB of locked RAM."""
        if not self.pin_memory_supported():
            return torch.empty(shape, dtype=dtype)
        if self.kind == "cuda":
            from .pinned import exact_pin_requested, exact_pinned_empty
            exact = exact_pinned_empty(shape, dtype) if exact_pin_requested() else None
            if exact is not None:
                return exact
        exact_large_pinned_blocks(self.kind)
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of ``tensor`` (``tensor`` itself where pinning is unsupported),
        from :meth:`pinned_empty`."""
        if not self.pin_memory_supported():
            return tensor
        return self.pinned_empty(tensor.shape, tensor.dtype).copy_(tensor)

    def host_zeros(self, numel: int, dtype: torch.dtype, device: torch.device,
                   pin: bool) -> torch.Tensor:
        """``numel`` zeros on ``device``; on the host and with ``pin``, allocated page-locked
        in place (:meth:`pinned_empty`)."""
        if pin and torch.device(device).type == "cpu":
            return self.pinned_empty(numel, dtype).zero_()
        return torch.zeros(numel, dtype=dtype, device=device)

    def memory_allocated(self) -> int:
        if self.kind in ("cuda", "xpu"):
            return self._module.memory_allocated()
        if self.kind == "mps":
            return torch.mps.current_allocated_memory()
        return 0

    def max_memory_allocated(self) -> int:
        if self.kind in ("cuda", "xpu"):
            return self._module.max_memory_allocated()
        return self.memory_allocated()

    def memory_reserved(self) -> int:
        if self.kind in ("cuda", "xpu"):
            return self._module.memory_reserved()
        return self.memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        if self.kind in ("cuda", "xpu"):
            self._module.reset_peak_memory_stats()

    def mem_get_info(self, device: Any = None) -> tuple:
        """(free, total) bytes of ``device``'s memory (the host's for CPU and MPS)."""
        if self.kind in ("cuda", "xpu"):
            return self._module.mem_get_info(device)
        import psutil
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    def total_memory(self, index: int = 0) -> int:
        if self.kind in ("cuda", "xpu"):
            return self._module.get_device_properties(index).total_memory
        import psutil
        return psutil.virtual_memory().total

    def empty_cache(self) -> None:
        if self.kind in ("cuda", "xpu", "mps"):
            self._module.empty_cache()

    def __repr__(self) -> str:
        return f"Accelerator({self.kind!r})"


_current: Optional[Accelerator] = None


def _detect() -> str:
    forced = os.environ.get("SHARDWISE_ACCELERATOR") or os.environ.get("DS_ACCELERATOR")
    if forced:
        return forced.strip().lower()
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def get_accelerator() -> Accelerator:
    """The accelerator this process uses (detected once, then cached)."""
    global _current
    if _current is None:
        _current = Accelerator(_detect())
    return _current


def set_accelerator(accelerator: Accelerator) -> None:
    """Force the accelerator (tests, or a user who wants CPU on a GPU machine)."""
    global _current
    _current = accelerator


#: Pinned blocks above this many MiB are allocated at their exact size (not rounded up).
PINNED_ROUND_THRESHOLD_MB = 64
_PINNED_ROUNDING_DONE: dict = {}


def exact_large_pinned_blocks(kind: str = "cuda") -> bool:
    """Ask the host (pinned) allocator not to round blocks above PINNED_ROUND_THRESHOLD_MB up
    to a power of two; true when this torch applied it.

    Why: the caching host allocator rounds every pinned block up to a power of two so freed
    blocks can be reused. Offload keeps a handful of huge long-lived buffers, where rounding
    wastes up to half of the locked RAM (measured: 1.1B-parameter ZeRO-3 offload held
    ~8 GiB more host memory than its model states), and host RAM is what bounds the model
    size under offload. Recent torch has the ``pinned_max_round_threshold_mb`` setting;
    older versions reject the key and keep rounding, which stays correct. A threshold the
    user set in PYTORCH_CUDA_ALLOC_CONF wins."""
    if kind in _PINNED_ROUNDING_DONE:
        return _PINNED_ROUNDING_DONE[kind]
    applied = False
    if "pinned_max_round_threshold" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + \
            os.environ.get("PYTORCH_ALLOC_CONF", ""):
        setting = f"pinned_max_round_threshold_mb:{PINNED_ROUND_THRESHOLD_MB}"
        setters = [getattr(torch._C, "_accelerator_setAllocatorSettings", None)]
        if kind == "cuda":
            setters.append(getattr(torch.cuda.memory, "_set_allocator_settings", None))
        for setter in setters:
            if setter is None:
                continue
            try:
                with warnings.catch_warnings():  # the cuda spelling is deprecated in torch 2.11
                    warnings.simplefilter("ignore")
                    setter(setting)
                applied = True
                break
            except (RuntimeError, TypeError, ValueError):
                continue  # this torch has no such key: keep the default rounding
    _PINNED_ROUNDING_DONE[kind] = applied
    return applied
