"""``deepspeed.accelerator.get_accelerator()``: shardwise's accelerator plus DeepSpeed's
current-device queries (``current_device_name()``, ``current_device()``)."""
from __future__ import annotations

from typing import Any

import torch

from ...accelerator import Accelerator
from ...accelerator import get_accelerator as _shardwise_accelerator
from ...comm import get_local_rank

__all__ = ["get_accelerator"]


class DeepSpeedAcceleratorView:
    """DeepSpeed's accelerator names over shardwise's ``Accelerator`` (which it delegates to)."""

    def __init__(self, inner: Accelerator) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _current_index(self) -> Any:
        if self._inner.kind in ("cuda", "xpu") and self._inner.device_count() > 0:
            return get_local_rank() % self._inner.device_count()
        return None

    def current_device(self) -> torch.device:
        return self._inner.device(self._current_index())

    def current_device_name(self) -> str:
        return self._inner.device_name(self._current_index())

    def device_name(self, device_index: Any = None) -> str:
        return self._inner.device_name(None if device_index is None else int(device_index))


def get_accelerator() -> DeepSpeedAcceleratorView:
    return DeepSpeedAcceleratorView(_shardwise_accelerator())
