"""Exact-size page-locked host buffers: ordinary memory registered with ``cudaHostRegister``.

torch's caching host allocator rounds pinned blocks up to powers of two (a 5.1B-parameter
ZeRO-3 offload run held 116 GiB of host RAM for 86 GiB of states). For the few huge,
long-lived host buffers of offload (flat parameter shards, fp32 masters and optimizer
states, the delayed update's second gradient set) this module maps exactly the bytes asked
for (rounded to a 4 KiB page; 2 MiB-aligned and advised for transparent huge pages where the
OS has them), page-locks them with ``cudaHostRegister`` through ``torch.cuda.cudart()``
(torch's own libcudart bindings; nothing compiled) and unregisters them when the last tensor
viewing the memory is freed.

    from shardwise.accelerator.pinned import pinned_empty
    flat = pinned_empty((numel,), torch.float32)     # exact size, page-locked where possible
    gpu.copy_(flat, non_blocking=True)               # a real async H2D copy

``Accelerator.pinned_empty`` (the one pinning path of offload, stage 3 and the IO layer; its
``pin_memory`` copies into one) uses it for tensors of 16 MiB and more when
``SHARDWISE_EXACT_PIN=1`` is set (opt-in while it is measured).

Where registration is impossible (no CUDA, a ROCm/XPU build without the binding, the driver
refuses, e.g. RLIMIT_MEMLOCK) the buffer comes from torch's pinned allocator instead, and on
a machine without pinning from plain memory; each fallback reason is logged once per
allocator.
"""
from __future__ import annotations

import logging
import mmap
import sys
import weakref
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence, Set, Tuple, Union

import torch

logger = logging.getLogger("shardwise")

PAGE = mmap.PAGESIZE
#: Buffers of at least this size start on a 2 MiB boundary (one transparent huge page).
HUGE_PAGE = 2 << 20


class HostRegistrar(Protocol):
    """Page-locks and releases host address ranges (``cudaHostRegister`` and its inverse)."""

    def register(self, ptr: int, nbytes: int) -> Optional[str]:
        """Page-lock ``[ptr, ptr + nbytes)``; None on success, else the reason it failed."""

    def unregister(self, ptr: int) -> None:
        """Undo ``register(ptr, ...)``."""


class CudartRegistrar:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through ``torch.cuda.cudart()``."""

    FLAGS = 0  # cudaHostRegisterDefault: with unified addressing the range is portable anyway

    def __init__(self, cudart: object) -> None:
        self._cudart = cudart

    def _error(self, code: object) -> Optional[str]:
        if code == self._cudart.cudaError.success:
            return None
        try:
            return str(self._cudart.cudaGetErrorString(code))
        except Exception:  # an odd binding: the code is still informative
            return str(code)

    def register(self, ptr: int, nbytes: int) -> Optional[str]:
        return self._error(self._cudart.cudaHostRegister(ptr, nbytes, self.FLAGS))

    def unregister(self, ptr: int) -> None:
        error = self._error(self._cudart.cudaHostUnregister(ptr))
        if error is not None:
            logger.warning(f"cudaHostUnregister of a pinned host buffer failed: {error}")


def cudart_registrar() -> Tuple[Optional[CudartRegistrar], str]:
    """The registrar of this process, or None and why there is none."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    if torch.version.hip is not None:
        return None, "ROCm build (cudaHostRegister binding not used there)"
    try:
        cudart = torch.cuda.cudart()
    except Exception as exc:  # CUDA present but the runtime bindings cannot load
        return None, f"torch.cuda.cudart() failed: {exc}"
    if not all(hasattr(cudart, n) for n in ("cudaHostRegister", "cudaHostUnregister", "cudaError")):
        return None, "this torch's cudart bindings lack cudaHostRegister/cudaHostUnregister"
    return CudartRegistrar(cudart), ""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _release(registrar: HostRegistrar, ptr: int, block: mmap.mmap) -> None:
    """Storage finalizer: unregister first, then give the mapping back."""
    registrar.unregister(ptr)
    try:
        block.close()
    except BufferError:  # still exported somewhere: the mapping goes when that reference does
        pass


@dataclass
class ExactPinAllocator:
    """Allocates exact-size page-locked host tensors; owns the log-once state of its fallbacks."""

    registrar: Optional[HostRegistrar] = None
    """Who page-locks the memory; None: look up torch's cudart on first use."""
    unavailable_reason: str = ""
    """Why there is no registrar (filled on lookup)."""
    _looked_up: bool = False
    _logged: Set[str] = field(default_factory=set)

    def _registrar(self) -> Optional[HostRegistrar]:
        if self.registrar is None and not self._looked_up:
            self.registrar, self.unavailable_reason = cudart_registrar()
        self._looked_up = True
        return self.registrar

    def _log_once(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info(f"exact-size pinned host memory unavailable ({reason}); using "
                        f"torch's pinned allocator (or plain memory where nothing pins)")

    def empty(self, shape: Union[int, Sequence[int]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape``/``dtype`` in exact-size pinned memory."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        numel = 1
        for dim in shape:
            numel *= int(dim)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        registrar = self._registrar()
        if registrar is not None and nbytes > 0:
            tensor, reason = self._registered(registrar, nbytes)
            if tensor is not None:
                return tensor.view(dtype).view(shape)
        else:
            reason = self.unavailable_reason or "empty buffer"
        self._log_once(reason)
        return self._fallback(numel, dtype).view(shape)

    def _registered(self, registrar: HostRegistrar, nbytes: int) -> Tuple[Optional[torch.Tensor], str]:
        length = _round_up(nbytes, PAGE)
        align = HUGE_PAGE if length >= HUGE_PAGE else PAGE
        # Over-map by the alignment: pages never touched are never resident.
        block = mmap.mmap(-1, length + align - PAGE)
        skip = -torch.frombuffer(block, dtype=torch.uint8).data_ptr() % align
        if align == HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE") and sys.platform.startswith("linux"):
            try:
                block.madvise(mmap.MADV_HUGEPAGE, skip, length)
            except (OSError, ValueError):
                pass  # THP off or unsupported: 4 KiB pages are fine
        # The storage starts at the aligned, registered address (a view at an offset of a
        # storage at the mapping's start looked pageable to ``is_pinned()``, which asks the
        # driver about the storage's pointer, so ``pin_memory()`` would have copied it again).
        tensor = torch.frombuffer(memoryview(block)[skip:skip + nbytes], dtype=torch.uint8)
        ptr = tensor.data_ptr()
        error = registrar.register(ptr, length)
        if error is not None:
            del tensor
            block.close()
            return None, f"cudaHostRegister failed: {error}"
        # The finalizer runs when the storage's last user (any view) is gone; it holds the
        # mapping, so the memory stays mapped until it is unregistered.
        weakref.finalize(tensor.untyped_storage(), _release, registrar, ptr, block)
        return tensor, ""

    @staticmethod
    def _fallback(numel: int, dtype: torch.dtype) -> torch.Tensor:
        from .base import exact_large_pinned_blocks, get_accelerator

        acc = get_accelerator()
        if acc.pin_memory_supported():
            try:
                exact_large_pinned_blocks(acc.kind)  # keep large blocks unrounded where torch can
                return torch.empty(numel, dtype=dtype, pin_memory=True)
            except RuntimeError:  # the pinned allocator is out of lockable memory
                pass
        return torch.empty(numel, dtype=dtype)


_DEFAULT = ExactPinAllocator()

#: Opt-in switch: ``Accelerator.pinned_empty`` page-locks large tensors with exact-size
#: registration instead of torch's pinned allocator ("1"/"true"/"yes" turn it on).
EXACT_PIN_ENV = "SHARDWISE_EXACT_PIN"
#: Below this size torch's pinned allocator is used anyway: its rounding costs little there,
#: and each cudaHostRegister call costs about a millisecond.
EXACT_PIN_MIN_BYTES = 16 << 20


def exact_pin_requested() -> bool:
    """True when SHARDWISE_EXACT_PIN asks for exact-size pinning."""
    import os

    return os.environ.get(EXACT_PIN_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def exact_pinned_empty(shape: Union[int, Sequence[int]], dtype: torch.dtype = torch.float32,
                       allocator: Optional[ExactPinAllocator] = None) -> Optional[torch.Tensor]:
    """An exact-size page-locked CPU tensor of at least EXACT_PIN_MIN_BYTES; None when it
    would be smaller (the caller then uses torch's pinned allocator)."""
    numel = 1
    for n in ((shape,) if isinstance(shape, int) else shape):
        numel *= int(n)
    if numel * torch.empty((), dtype=dtype).element_size() < EXACT_PIN_MIN_BYTES:
        return None
    return (allocator or _DEFAULT).empty(shape, dtype)


def pinned_empty(shape: Union[int, Sequence[int]], dtype: torch.dtype = torch.float32,
                 allocator: Optional[ExactPinAllocator] = None) -> torch.Tensor:
    """An exact-size page-locked CPU tensor (see the module docstring for the fallbacks)."""
    return (allocator or _DEFAULT).empty(shape, dtype)


__all__ = ["CudartRegistrar", "EXACT_PIN_ENV", "ExactPinAllocator", "HostRegistrar",
           "cudart_registrar", "exact_pin_requested", "exact_pinned_empty", "pinned_empty"]
