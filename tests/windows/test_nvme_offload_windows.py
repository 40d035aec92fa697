"""NVMe optimizer offload on Windows: the swap files go through the IO layer's Windows path
(per-thread handles, no pread, no O_DIRECT). One process: ZeRO-2 with the optimizer states in
swap files matches torch AdamW, and the swap folder is gone after ``destroy()``."""
from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.windows


def test_zero2_nvme_offload_matches_torch_and_cleans_up(tmp_path: Path) -> None:
    import shardwise
    from tests.distributed._parity import (engine_config, global_batches, make_model,
                                           max_rel_diff, reference_params)

    cfg = engine_config(2, 2, 2, 0.05, 1e-2, zero_optimization={"offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3}})
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    assert list(tmp_path.glob("shardwise_swap/*/group*.swp"))
    for x, y in global_batches(4, 4):
        for k in range(2):
            engine.backward(engine(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2]))
            engine.step()
    got = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    assert not max_rel_diff(got, reference_params(4, 4, 1e-2, 0.05))
    engine.destroy()
    assert not (tmp_path / "shardwise_swap").exists()
