"""Per-checkpoint time and memory records (the ``profile`` key of ``activation_checkpointing``).

Each checkpointed call records its forward time, its recompute time in backward, the bytes
of inputs it kept and the accelerator memory in use before and after. Records are kept in
order, logged at INFO level as they complete and available from ``get_profile()``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional

from ..accelerator import get_accelerator
from ..utils.logging import log_dist


@dataclass
class CheckpointRecord:
    """What one checkpointed call cost."""

    index: int
    """Order of the call since the last ``reset()`` (0-based)."""
    forward_s: float = 0.0
    """Wall time of the forward under no saved activations."""
    recompute_s: Optional[float] = None
    """Wall time of the recompute in backward (None until backward reaches it)."""
    saved_input_bytes: int = 0
    """Bytes of inputs this checkpoint keeps for its recompute (after partition/offload)."""
    device_mem_before: int = 0
    """Accelerator bytes allocated when the forward started (0 on CPU)."""
    device_mem_after: int = 0
    """Accelerator bytes allocated when the forward ended (0 on CPU)."""


_MAX_RECORDS = 4096  # long runs with profile on keep only the most recent records


class Profiler:
    """Collects ``CheckpointRecord``s; timing synchronizes the device so numbers are real."""

    def __init__(self) -> None:
        self.records: List[CheckpointRecord] = []
        self.total = 0

    def reset(self) -> None:
        self.records = []
        self.total = 0

    def start_forward(self) -> "tuple[CheckpointRecord, float]":
        accel = get_accelerator()
        accel.synchronize()
        record = CheckpointRecord(index=self.total, device_mem_before=accel.memory_allocated())
        self.total += 1
        self.records.append(record)
        if len(self.records) > _MAX_RECORDS:
            del self.records[: len(self.records) - _MAX_RECORDS]
        return record, time.perf_counter()

    def end_forward(self, record: CheckpointRecord, t0: float, saved_bytes: int) -> None:
        accel = get_accelerator()
        accel.synchronize()
        record.forward_s = time.perf_counter() - t0
        record.saved_input_bytes = saved_bytes
        record.device_mem_after = accel.memory_allocated()
        log_dist(f"checkpoint {record.index}: forward {record.forward_s * 1e3:.2f} ms, keeps "
                 f"{saved_bytes / 2**20:.2f} MiB of inputs, device memory "
                 f"{record.device_mem_before / 2**20:.1f} -> {record.device_mem_after / 2**20:.1f} MiB")

    def end_recompute(self, record: CheckpointRecord, t0: float) -> None:
        get_accelerator().synchronize()
        record.recompute_s = time.perf_counter() - t0
        log_dist(f"checkpoint {record.index}: recompute {record.recompute_s * 1e3:.2f} ms")

    def summary(self) -> str:
        """One line: count, total forward and recompute time, total kept bytes."""
        fwd = sum(r.forward_s for r in self.records)
        rec = sum(r.recompute_s or 0.0 for r in self.records)
        kept = sum(r.saved_input_bytes for r in self.records)
        return (f"{len(self.records)} checkpoints: forward {fwd * 1e3:.1f} ms, recompute "
                f"{rec * 1e3:.1f} ms, inputs kept {kept / 2**20:.2f} MiB")
