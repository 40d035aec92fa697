"""``aio``: DeepSpeed's asynchronous file IO section, read by shardwise's IO layer
(``shardwise.io``: NVMe offload swap files, ``shardwise io-bench`` / ``nvme-tune``).

Keys and defaults are DeepSpeed's (``deepspeed/runtime/swap_tensor/constants.py``).
``thread_count`` is the old name of ``intra_op_parallelism``: DeepSpeed's docs still list it
but its config reader ignores it; shardwise accepts either and refuses two that disagree.
"""
from __future__ import annotations

from typing import Any, Dict

from pydantic import field_validator, model_validator

from shardwise.errors import ConfigError

from .base import ConfigModel

#: O_DIRECT transfers need block sizes in multiples of the device's logical block (512 B).
BLOCK_ALIGN = 512

_POSITIVE = ("block_size", "queue_depth", "intra_op_parallelism", "thread_count")


_DEFAULTS = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "thread_count": 1}


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"aio.{name} = {value!r}: expected a positive integer, "
                          f"e.g. \"{name}\": {_DEFAULTS[name]}.")
    return value


class AioConfig(ConfigModel):
    """``aio``: the asynchronous file IO used by NVMe offload and the IO tools."""

    block_size: int = 1048576
    """Bytes per read/write request (a positive multiple of 512)."""
    queue_depth: int = 8
    """Requests in flight per unit of intra_op_parallelism (shardwise: IO threads per unit)."""
    intra_op_parallelism: int = 1
    """Parallel units splitting one tensor's IO; shardwise runs intra_op_parallelism x
    queue_depth threads (at most 64). Old name: thread_count."""
    single_submit: bool = False
    """Submit requests one at a time instead of in batches (libaio only; shardwise's threads
    issue one system call per block either way)."""
    overlap_events: bool = True
    """Overlap submitting new requests with reaping finished ones (libaio only; always the
    case with shardwise's threads)."""
    thread_count: int = 1
    """Old name of intra_op_parallelism; after loading both hold the same value."""
    use_gds: bool = False
    """GPUDirect Storage through kvikio when it is installed; otherwise a warning and the
    host-memory thread path."""
    windows_io_optimization: bool = False
    """Seed key; no effect (see the warning it gives): the IO layer picks its Windows path by
    itself."""

    @model_validator(mode="before")
    @classmethod
    def _one_parallelism(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        new, old = raw.get("intra_op_parallelism"), raw.get("thread_count")
        for name, given in (("intra_op_parallelism", new), ("thread_count", old)):
            if given is not None:
                _check_positive(name, given)  # before copying: the error names the user's key
        if new is not None and old is not None and new != old:
            raise ConfigError(
                f"aio.intra_op_parallelism = {new!r} and aio.thread_count = {old!r} disagree; "
                "thread_count is the old name of intra_op_parallelism. Keep one: "
                f"\"intra_op_parallelism\": {new!r}.")
        value = new if new is not None else old
        if value is None:
            return raw
        return {**raw, "intra_op_parallelism": value, "thread_count": value}

    @field_validator(*_POSITIVE, mode="before")
    @classmethod
    def _positive_int(cls, value: Any, info: Any) -> int:
        return _check_positive(info.field_name, value)

    @field_validator("block_size")
    @classmethod
    def _aligned_block(cls, value: int) -> int:
        if value % BLOCK_ALIGN:
            raise ConfigError(f"aio.block_size = {value}: expected a multiple of {BLOCK_ALIGN} "
                              "bytes (O_DIRECT transfers move whole device blocks), e.g. "
                              "\"block_size\": 1048576 (1 MiB).")
        return value

    def handle_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for :class:`shardwise.io.aio_handle.AsyncIOHandle`."""
        return {"block_size": self.block_size, "queue_depth": self.queue_depth,
                "single_submit": self.single_submit, "overlap_events": self.overlap_events,
                "intra_op_parallelism": self.intra_op_parallelism, "use_gds": self.use_gds}


def aio_section(block_size: int, queue_depth: int, intra_op_parallelism: int,
                single_submit: bool = False, overlap_events: bool = True,
                use_gds: bool = False) -> Dict[str, Any]:
    """An ``aio`` section with the keys this config reads (what ``nvme-tune`` prints)."""
    section = AioConfig(block_size=block_size, queue_depth=queue_depth,
                        intra_op_parallelism=intra_op_parallelism, single_submit=single_submit,
                        overlap_events=overlap_events, use_gds=use_gds)
    keys = ("block_size", "queue_depth", "intra_op_parallelism", "single_submit",
            "overlap_events", "use_gds")
    return {key: getattr(section, key) for key in keys}
