"""``AsyncIOBuilder``: DeepSpeed's op builder for ``async_io``, with nothing to compile."""
from __future__ import annotations

import importlib
from types import ModuleType


class AsyncIOBuilder:
    """``AsyncIOBuilder().load()`` returns the module holding ``aio_handle``. Always
    compatible: the handle is pure Python (no libaio, no compiler)."""

    BUILD_VAR = "DS_BUILD_AIO"
    NAME = "async_io"

    def __init__(self) -> None:
        self.name = self.NAME

    def absolute_name(self) -> str:
        return "shardwise.ops.aio"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = True) -> ModuleType:
        return importlib.import_module(self.absolute_name())

    def jit_load(self, verbose: bool = True) -> ModuleType:
        return self.load(verbose)
