"""Page-aligned host buffers and byte views of tensors, the memory the IO layer reads into
and writes from.

``O_DIRECT`` needs the buffer address, the file offset and the length to be multiples of the
device's logical block size; :data:`ALIGN` (4 KiB, a page) satisfies every common device.
"""
from __future__ import annotations

import torch

from ..errors import StorageError

#: Alignment of buffer addresses, file offsets and lengths for ``O_DIRECT`` transfers.
ALIGN = 4096


def is_aligned(value: int, align: int = ALIGN) -> bool:
    return value % align == 0


def alloc_aligned(nbytes: int, dtype: torch.dtype = torch.uint8, pin: bool = False) -> torch.Tensor:
    """A flat CPU tensor of ``nbytes`` bytes (``nbytes // itemsize`` elements of ``dtype``)
    whose first byte is :data:`ALIGN`-aligned; pinned when ``pin`` and the accelerator can
    (pinning is an optimisation: it silently stays pageable when it cannot)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = None
    if pin:
        try:
            from ..accelerator import get_accelerator
            if get_accelerator().pin_memory_supported():
                raw = get_accelerator().pinned_empty(nbytes + ALIGN, torch.uint8)
        except Exception:  # e.g. the pinned-memory limit is reached
            raw = None
    if raw is None:
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes].view(dtype)[: nbytes // itemsize]


def byte_view(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor as a flat uint8 tensor sharing its memory."""
    if not tensor.is_contiguous():
        raise StorageError(f"{what}: the tensor (shape {list(tensor.shape)}, strides "
                           f"{list(tensor.stride())}) is not contiguous; IO goes straight into "
                           "its memory, so pass tensor.contiguous() (and copy back after a read).")
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
