"""``FusedLion`` / ``DeepSpeedCPULion``: shardwise's foreach Lion with DeepSpeed's defaults."""
from __future__ import annotations

from typing import Any, Iterable, Tuple

from ..optim.lion import Lion


def FusedLion(params: Iterable[Any], lr: float = 1e-3,  # noqa: N802
              betas: Tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0) -> Lion:
    return Lion(params, lr=lr, betas=betas, weight_decay=weight_decay)


DeepSpeedCPULion = FusedLion
