"""``offload_param: {device: "nvme"}``: stage-3 shards in per-rank swap files.

A :class:`FileShard` is a :class:`~.storage.ShardStorage` whose elements live in one swap
file (compute dtype, padded to an aligned size). The :class:`ParamSwapper` of an engine owns
the files (``shardwise.io.swap_files``: one folder per rank and run, probed at initialize,
removed by ``engine.destroy()`` or at exit) and a pool of ``buffer_count`` pinned, aligned
host buffers that shards are read into and written from:

- **Read ahead.** ``prefetch()`` starts reading a shard into a free buffer (the coordinator
  calls it along the recorded trace, beyond the modules it gathers; one buffer is always left
  for a demand read). ``staged()`` is the shard's memory for the copy to the device (waiting
  for the read, or reading now); ``unstage(event)`` gives the buffer back once that copy is
  done. A demand read with every buffer taken waits for the oldest copy or write, or takes
  back the buffer of the read-ahead that is needed last.
- **Write back.** ``write_`` (the optimizer step's masters into the shard) fills a buffer and
  writes it asynchronously; a later read of the same shard waits for that write first.
- ``tensor()`` is a host *copy* held until the next :meth:`ParamSwapper.commit_held` (which
  ``Stage3Params.before_shard_write`` calls): edits made to it in place (a checkpoint load
  into ``ShardView.weight``) are written back then, found by the tensor's version counter.
  An unedited copy is dropped at the shard's next gather (a checkpoint save's copies do not
  outlive the save in host memory).

Placement follows DeepSpeed: partitions under ``min_nvme_bytes`` (1 MiB) stay in host
memory, and with an optimizer the first ``max_in_cpu`` elements of the NVMe-sized ones too;
a partition larger than ``buffer_size`` elements is a ConfigError (it would not fit a buffer).
Every call may come from the offload worker thread (the eager CPU step writes back while
backward runs): the swapper's state is behind one lock.
"""
from __future__ import annotations

import threading
from typing import Any, List, Optional, Set

import torch

from ...errors import ConfigError, ZeroError
from ...io.aligned import alloc_aligned
from ...io.aio_handle import IORequest
from ...io.swap_files import SwapFile, SwapFiles
from ...utils.logging import log_dist

FREE, READ, STAGED, DRAINING, WRITING = "free", "read", "staged", "draining", "writing"


class _Slot:
    """One pinned buffer of the pool and what it holds."""

    __slots__ = ("buf", "state", "owner", "req", "event", "seq")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.state = FREE
        self.owner: Optional["FileShard"] = None
        self.req: Optional[IORequest] = None
        self.event: Any = None
        self.seq = 0

    def settled(self) -> bool:
        """A draining or writing buffer whose copy/write has finished."""
        if self.state == DRAINING:
            return self.event is None or bool(self.event.query())
        if self.state == WRITING:
            return self.req is None or self.req.done()
        return self.state == FREE


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class FileShard:
    """A stage-3 shard kept in a swap file (see the module docstring)."""

    resident = False
    """The shard's memory is not a tensor of its own: read it with staged()/tensor()."""

    def __init__(self, swapper: "ParamSwapper", target: SwapFile, numel: int,
                 dtype: torch.dtype) -> None:
        self._swapper = swapper
        self.target = target
        self._numel = numel
        self._dtype = dtype
        self._slot: Optional[_Slot] = None
        """The pool buffer holding (or reading) this shard, if any."""
        self._writing: Optional[_Slot] = None
        """The buffer of this shard's last write, while it may still be in flight."""
        self._held: Optional[torch.Tensor] = None
        self._held_version = 0

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return self._numel * _elsize(self._dtype)

    def tensor(self) -> torch.Tensor:
        return self._swapper.held_copy(self)

    def copy_to(self, dst: torch.Tensor) -> None:
        self._swapper.copy_to(self, dst)

    def write_(self, src: torch.Tensor, offset: int = 0, non_blocking: bool = False) -> None:
        self._swapper.write(self, src, offset)

    def swap(self, other: "Any") -> None:
        if not isinstance(other, FileShard) or other._swapper is not self._swapper:
            raise TypeError(f"cannot swap a FileShard with {type(other).__name__}")
        self._swapper.swap(self, other)

    def prefetch(self) -> bool:
        return self._swapper.prefetch(self)

    def staged(self) -> torch.Tensor:
        return self._swapper.staged(self)

    def unstage(self, event: Any = None) -> None:
        self._swapper.unstage(self, event)

    def __repr__(self) -> str:
        return f"FileShard({self.numel}, {self.dtype}, {self.target.path})"


class ParamSwapper:
    """The swap files and buffer pool of one engine's NVMe-offloaded shards."""

    def __init__(self, files: SwapFiles, *, buffer_count: int, buffer_elems: int,
                 cpu_budget: int, min_bytes: int) -> None:
        self.files = files
        self.buffer_count = int(buffer_count)
        self.buffer_elems = int(buffer_elems)
        self.cpu_left = int(cpu_budget)
        self.min_bytes = int(min_bytes)
        self._slots: List[_Slot] = []
        self._max_bytes = 0
        self._seq = 0
        self._lock = threading.RLock()
        self._holding: Set[FileShard] = set()
        self.on_nvme = 0
        """Shards (and their bytes, ``nvme_bytes``) placed in swap files."""
        self.nvme_bytes = 0
        self.in_cpu = 0
        """NVMe-sized shards kept in host memory by the ``max_in_cpu`` budget."""
        self.stats = {"demand_reads": 0, "read_ahead": 0, "read_ahead_used": 0, "writes": 0}
        """Counts of swap-file reads started on demand / ahead of use, read-aheads staged
        (found in memory when needed), and writes."""

    @classmethod
    def from_config(cls, config: Any, rank: int, training: bool) -> "ParamSwapper":
        off = config.zero_optimization.offload_param
        if off.buffer_count < 1 or off.buffer_size < 1:
            key = "buffer_count" if off.buffer_count < 1 else "buffer_size"
            raise ConfigError(f"zero_optimization.offload_param.{key} = {getattr(off, key)}: "
                              "device \"nvme\" reads parameters through buffer_count buffers of "
                              "buffer_size elements, both must be >= 1 (DeepSpeed's defaults: "
                              "5 and 1e8).")
        files = SwapFiles(off.nvme_path, rank, key="zero_optimization.offload_param.nvme_path",
                          aio_kwargs=config.aio.handle_kwargs())
        if config.aio.use_gds:
            log_dist("aio.use_gds: offload_param reads its swap files into pinned host buffers "
                     "(the gather copies them to the device); GPUDirect Storage is not used "
                     "for parameters", ranks=[0])
        # DeepSpeed: max_in_cpu sizes the host copy of the trainable partitions (with an
        # optimizer); a parameters-only engine sends every NVMe-sized partition to the disk
        return cls(files, buffer_count=off.buffer_count, buffer_elems=off.buffer_size,
                   cpu_budget=off.max_in_cpu if training else 0, min_bytes=off.min_nvme_bytes)

    # --- placement ---------------------------------------------------------------------------
    def place(self, values: torch.Tensor, chunk: int, dtype: torch.dtype,
              shape: torch.Size) -> Optional[FileShard]:
        """A FileShard holding ``values`` (zero padded to ``chunk`` elements), or None when the
        partition stays in host memory (too small for NVMe, or within ``max_in_cpu``)."""
        nbytes = chunk * _elsize(dtype)
        if nbytes < self.min_bytes or nbytes == 0:
            return None
        if chunk <= self.cpu_left:
            self.cpu_left -= chunk
            self.in_cpu += 1
            return None
        if chunk > self.buffer_elems:
            raise ConfigError(
                f"zero_optimization.offload_param.buffer_size = {self.buffer_elems} elements is "
                f"smaller than the partition of a parameter of shape {tuple(shape)} ({chunk} "
                f"elements on this rank): every NVMe partition is read through one buffer. Set "
                f"buffer_size to at least {chunk}.")
        with self._lock:
            target = self.files.file(f"param{self.on_nvme:06d}.swp", nbytes)
            shard = FileShard(self, target, chunk, dtype)
            self._max_bytes = max(self._max_bytes, target.nbytes)
            self._write_full(shard, values.detach().reshape(-1))
            self.on_nvme += 1
            self.nvme_bytes += target.nbytes
        return shard

    # --- the buffer pool ---------------------------------------------------------------------
    def _new_slot(self) -> _Slot:
        slot = _Slot(alloc_aligned(self._max_bytes, pin=True))
        self._slots.append(slot)
        return slot

    def _settle(self, slot: _Slot) -> None:
        """Wait for a draining copy or a write, then free the buffer."""
        if slot.state == DRAINING and slot.event is not None:
            slot.event.synchronize()
        if slot.state in (WRITING, READ) and slot.req is not None:
            slot.req.wait()
        if slot.owner is not None:
            if slot.owner._slot is slot:
                slot.owner._slot = None
            if slot.owner._writing is slot:
                slot.owner._writing = None
        slot.state, slot.owner, slot.req, slot.event = FREE, None, None, None

    def _free_slot(self) -> Optional[_Slot]:
        """A buffer usable now (allocated on first use), or None."""
        for slot in self._slots:
            if slot.state != FREE and slot.state in (DRAINING, WRITING) and slot.settled():
                self._settle(slot)
            if slot.state == FREE:
                return slot
        if len(self._slots) < self.buffer_count:
            return self._new_slot()
        return None

    def _available(self) -> int:
        done = sum(1 for s in self._slots if s.state == FREE
                   or (s.state in (DRAINING, WRITING) and s.settled()))
        return done + self.buffer_count - len(self._slots)

    def _acquire(self, nbytes: int) -> _Slot:
        """A buffer for a demand read or a write (waiting, or taking one back, if needed)."""
        while True:
            slot = self._free_slot()
            if slot is not None:
                break
            busy = [s for s in self._slots if s.state in (DRAINING, WRITING)]
            ahead = [s for s in self._slots if s.state == READ]
            if busy:
                self._settle(min(busy, key=lambda s: s.seq))
            elif ahead:  # the read-ahead needed last gives its buffer back
                self._settle(max(ahead, key=lambda s: s.seq))
            else:
                raise ZeroError(f"offload_param: all {self.buffer_count} NVMe buffers are "
                                "staged for copies at once; raise offload_param.buffer_count.")
        if slot.buf.numel() < nbytes:
            slot.buf = alloc_aligned(max(nbytes, self._max_bytes), pin=True)
        self._seq += 1
        slot.seq = self._seq
        return slot

    def _wait_write(self, shard: FileShard) -> None:
        slot = shard._writing
        if slot is not None and slot.owner is shard and slot.state == WRITING:
            self._settle(slot)
        shard._writing = None

    def _start_read(self, shard: FileShard, slot: _Slot) -> None:
        slot.req = self.files.read_request(slot.buf, shard.target)
        slot.state, slot.owner = READ, shard
        shard._slot = slot

    def _view(self, shard: FileShard, buf: torch.Tensor) -> torch.Tensor:
        return buf[:shard.nbytes].view(shard.dtype)

    # --- reads -------------------------------------------------------------------------------
    def prefetch(self, shard: FileShard) -> bool:
        """Start reading ``shard`` into a free buffer; False when none is free (one stays
        free for demand reads), True otherwise (started, resident, or busy being written)."""
        with self._lock:
            if shard._slot is not None or shard._held is not None:
                return True
            w = shard._writing
            if w is not None and w.owner is shard and w.state == WRITING and not w.settled():
                return True  # read it once its write is done (on demand, or a later read-ahead)
            if self._available() < 2:
                return False
            slot = self._acquire(shard.target.nbytes)
            self._start_read(shard, slot)
            self.stats["read_ahead"] += 1
            return True

    def staged(self, shard: FileShard) -> torch.Tensor:
        """The shard's elements in host memory for a copy (a pool buffer until unstage)."""
        with self._lock:
            if shard._held is not None:
                if shard._held._version != shard._held_version:
                    return shard._held  # edited in place, not committed yet: the newest values
                shard._held = None  # an unedited copy (a checkpoint save's): not kept past use
                self._holding.discard(shard)
            slot = shard._slot
            if slot is None:
                self._wait_write(shard)
                slot = self._acquire(shard.target.nbytes)
                self._start_read(shard, slot)
                self.stats["demand_reads"] += 1
            else:
                self.stats["read_ahead_used"] += 1
            if slot.req is not None:
                slot.req.wait()
                slot.req = None
            slot.state = STAGED
            return self._view(shard, slot.buf)

    def unstage(self, shard: FileShard, event: Any = None) -> None:
        """The copy out of the staged buffer is queued; the buffer is free once ``event``
        (None: now) has completed."""
        with self._lock:
            slot = shard._slot
            if slot is None or slot.state != STAGED:
                return
            shard._slot = None
            slot.owner, slot.event = None, event
            slot.state = FREE if event is None else DRAINING

    def _read_copy(self, shard: FileShard) -> torch.Tensor:
        """A fresh host tensor with the shard's elements (outside the pool)."""
        slot = shard._slot
        if slot is not None:
            if slot.req is not None:
                slot.req.wait()
                slot.req = None
            return self._view(shard, slot.buf).clone()
        self._wait_write(shard)
        buf = alloc_aligned(shard.target.nbytes)
        self.files.read_request(buf, shard.target).wait()
        return self._view(shard, buf)

    def held_copy(self, shard: FileShard) -> torch.Tensor:
        with self._lock:
            if shard._held is None:
                shard._held = self._read_copy(shard)
                shard._held_version = shard._held._version
                self._holding.add(shard)
            return shard._held

    def copy_to(self, shard: FileShard, dst: torch.Tensor) -> None:
        """The shard's first ``dst.numel()`` elements into ``dst`` (nothing is held)."""
        with self._lock:
            src = shard._held if shard._held is not None else self._read_copy(shard)
            dst.copy_(src[:dst.numel()])

    def commit_held(self) -> None:
        """Write back the held copies edited in place, and drop every held copy."""
        with self._lock:
            for shard in list(self._holding):
                held = shard._held
                if held is not None and held._version != shard._held_version:
                    self._write_full(shard, held)
                shard._held = None
            self._holding.clear()

    # --- writes ------------------------------------------------------------------------------
    def write(self, shard: FileShard, src: torch.Tensor, offset: int = 0) -> None:
        """``src`` into the shard at ``offset`` (asynchronously; reads of it wait)."""
        src = src.detach().reshape(-1)
        with self._lock:
            held = shard._held
            if offset == 0 and src.numel() == shard.numel:
                full = src
            else:  # read, modify, write: the file holds whole (padded) chunks
                full = held.clone() if held is not None else self._read_copy(shard)
                full[offset:offset + src.numel()].copy_(src)
            if held is not None:
                held[offset:offset + src.numel()].copy_(src)
                shard._held_version = held._version
            self._write_full(shard, full)

    def _write_full(self, shard: FileShard, values: torch.Tensor) -> None:
        """Write ``values`` (at most numel elements, zero padded) as the shard's file."""
        if shard._slot is not None and shard._slot.state == READ:
            self._settle(shard._slot)  # a read-ahead of the old values
        self._wait_write(shard)  # writes of one file stay in order
        slot = self._acquire(shard.target.nbytes)
        n = values.numel() * _elsize(shard.dtype)
        self._view(shard, slot.buf)[:values.numel()].copy_(values)
        slot.buf[n:shard.target.nbytes].zero_()
        slot.req = self.files.write_request(slot.buf, shard.target)
        slot.state, slot.owner = WRITING, shard
        shard._writing = slot
        self.stats["writes"] += 1

    def swap(self, a: FileShard, b: FileShard) -> None:
        with self._lock:
            for name in ("target", "_slot", "_writing", "_held", "_held_version"):
                va, vb = getattr(a, name), getattr(b, name)
                setattr(a, name, vb)
                setattr(b, name, va)
            for slot in self._slots:
                if slot.owner is a:
                    slot.owner = b
                elif slot.owner is b:
                    slot.owner = a
            self._holding = {({a: b, b: a}).get(s, s) for s in self._holding}

    # --- teardown ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for every write and copy in flight."""
        with self._lock:
            for slot in self._slots:
                if slot.state in (DRAINING, WRITING, READ):
                    self._settle(slot)

    @property
    def path(self) -> str:
        return self.files.path

    def close(self) -> None:
        """Finish pending IO and remove the swap files (idempotent)."""
        with self._lock:
            try:
                if not self.files.closed:
                    self.flush()
            finally:
                self._slots = []
                self._holding.clear()
                self.files.close()
