"""``GDSBuilder``: DeepSpeed's op builder for GPUDirect Storage, backed by kvikio when present."""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from ...io.gds import kvikio_module


class GDSBuilder:
    """``GDSBuilder().load().gds_handle(...)``: an aio handle that moves CUDA tensors with
    kvikio (cuFile). Compatible where CUDA and kvikio are present; without kvikio the handle
    still works, through host memory, after a warning."""

    BUILD_VAR = "DS_BUILD_GDS"
    NAME = "gds"

    def __init__(self) -> None:
        self.name = self.NAME

    def absolute_name(self) -> str:
        return "shardwise.ops.gds"

    def is_compatible(self, verbose: bool = False) -> bool:
        return torch.cuda.is_available() and kvikio_module() is not None

    def load(self, verbose: bool = True) -> ModuleType:
        return importlib.import_module(self.absolute_name())

    def jit_load(self, verbose: bool = True) -> ModuleType:
        return self.load(verbose)
