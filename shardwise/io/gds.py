"""GPUDirect Storage through NVIDIA's ``kvikio`` (detected, never required).

kvikio moves bytes between a file and CUDA memory with cuFile when the system supports it
(and through its own host bounce buffers when not). shardwise uses it only for CUDA tensors
of a handle made with ``use_gds=True``; everything else takes the thread path.
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Callable, Optional

import torch

INSTALL_HINT = "pip install kvikio-cu12 (or kvikio-cu13, matching your CUDA)"


def kvikio_module() -> Optional[Any]:
    """The ``kvikio`` module when it imports, else None."""
    try:
        return importlib.import_module("kvikio")
    except Exception:  # ImportError, or a broken CUDA install under it
        return None


def gds_transfer(kvikio: Any, tensor: torch.Tensor, path: str, offset: int,
                 write: bool) -> Callable[[], int]:
    """Start one cuFile transfer of all of ``tensor``; returns a function that waits for it
    and gives the bytes moved."""
    if write and not os.path.exists(path):
        open(path, "ab").close()  # "r+" does not create; "w" would truncate other ranges
    f = kvikio.CuFile(path, "r+" if write else "r")
    nbytes = tensor.numel() * tensor.element_size()
    future = (f.pwrite if write else f.pread)(tensor, nbytes, offset)

    def finish() -> int:
        try:
            return int(future.get())
        finally:
            f.close()
    return finish
