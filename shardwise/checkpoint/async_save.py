"""``checkpoint.async_save``: copy to CPU memory now, write to disk while training goes on.

The copy of this rank's tensors to (pinned) CPU memory blocks, because training would
otherwise change them under the writer; the write, the checksums and the commit then run on
a background thread. The thread never calls collectives (they would race the training
step's collectives on the same group): rank 0's thread instead waits for every rank's index
file to appear in the staging folder before it writes the metadata and moves ``latest``.

The next ``save_checkpoint``, ``load_checkpoint`` or ``save_16bit_model`` (or an explicit
:func:`wait_pending`) joins the thread and re-raises its error, so a failed background save
is never silent.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, List, Optional

import torch

from ..accelerator import get_accelerator
from ..errors import CheckpointError
from .contract import CheckpointableEngine
from .format import TensorItem


#: How long rank 0's writer waits for the other ranks' files before giving up.
WAIT_TIMEOUT_S = 3600.0


class _Pending:
    def __init__(self, fn: Callable[[List[TensorItem]], None], items: List[TensorItem]) -> None:
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(fn, items), daemon=False,
                                       name="shardwise-async-save")

    def _run(self, fn: Callable[[List[TensorItem]], None], items: List[TensorItem]) -> None:
        try:
            fn(items)
        except BaseException as exc:  # handed to the training thread by wait_pending
            self.error = exc


def enabled(engine: CheckpointableEngine) -> bool:
    return engine.checkpoint_settings().async_save


def _pinned_empty(shape: Any, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor, allocated pinned when ``pin`` (falls back to pageable).

    Allocating pinned directly matters: ``torch.empty(...).pin_memory()`` allocates twice
    and copies the whole (garbage) tensor once more before the real copy."""
    if pin:
        try:
            return get_accelerator().pinned_empty(shape, dtype)
        except RuntimeError:  # pinned memory exhausted or refused: pageable still works
            pass
    return torch.empty(shape, dtype=dtype)


def stage_items(items: List[TensorItem]) -> List[TensorItem]:
    """Snapshot every tensor into (pinned) CPU memory; returns items pointing at the copies.

    Device tensors are copied asynchronously into pinned memory and synchronised once at the
    end, so the copies queue back to back on the DMA engine; the background writer then
    writes the host copies straight from their memory (no further copy)."""
    try:
        from ..accelerator import get_accelerator
        accel = get_accelerator()
        pin = accel.pin_memory_supported()
    except Exception:  # pinning is an optimisation only
        accel, pin = None, False
    staged = []
    pending = False
    for item in items:
        src = (item.source() if callable(item.source) else item.source).detach()
        copy = _pinned_empty(src.shape, src.dtype, pin and src.device.type != "cpu")
        copy.copy_(src, non_blocking=copy.is_pinned())
        pending = pending or copy.is_pinned()
        staged.append(TensorItem(item.key, item.dtype, item.shape, copy, item.info))
    if pending:  # the snapshot must be complete before training changes the tensors
        accel.synchronize()
    return staged


def start(engine: CheckpointableEngine, items: List[TensorItem],
          fn: Callable[[List[TensorItem]], None]) -> None:
    pending = _Pending(fn, items)
    engine.pending_save = pending
    pending.thread.start()


def wait_pending(engine: CheckpointableEngine) -> None:
    """Finish a background save (all ranks call this at the same point); re-raise its error."""
    pending = engine.pending_save
    if pending is None:
        return
    pending.thread.join()
    engine.pending_save = None
    # every rank's writer is done; rank 0 may still be committing until this barrier
    from .engine_io import _barrier
    _barrier(engine)
    if pending.error is not None:
        raise CheckpointError(f"the background checkpoint save failed: {pending.error!r}") \
            from pending.error


def wait_for_files(folder: Path, names: List[str], active: bool,
                   timeout_s: float = WAIT_TIMEOUT_S) -> None:
    """Rank 0's writer: poll until every rank's index file exists (others return at once)."""
    if not active:
        return
    deadline = time.monotonic() + timeout_s
    missing = names
    while missing:
        missing = [n for n in missing if not (folder / n).is_file()]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(f"async checkpoint save: after {timeout_s:.0f} s the files "
                                  f"{missing[:4]} never appeared in {folder}; a rank died or the "
                                  "folder is not on a filesystem shared by all ranks.")
        time.sleep(0.05)
