"""``AsyncIOHandle``: DeepSpeed's ``aio_handle`` in pure Python.

Same constructor (``block_size, queue_depth, single_submit, overlap_events,
intra_op_parallelism``) and methods (``sync_pread``, ``async_pwrite``, ``wait``, ...) as
``deepspeed.ops.op_builder.AsyncIOBuilder().load().aio_handle``, so code that drives aio
directly runs unchanged. Each request (a tensor, a file, an offset) is cut into
``block_size`` blocks (:mod:`shardwise.io.file_ops`) that a pool of
``intra_op_parallelism * queue_depth`` threads moves with GIL-free positional system calls
straight into the tensor's memory: ``queue_depth`` blocks in flight per unit of parallelism,
as libaio keeps ``queue_depth`` requests queued per DeepSpeed thread.

Differences from DeepSpeed's C++ handle, on purpose:
- errors raise :class:`~shardwise.errors.StorageError` naming the file (DeepSpeed prints and
  returns -1, or asserts); a request's size need not divide by ``intra_op_parallelism``.
- ``single_submit`` and ``overlap_events`` are kept and reported by the getters but change
  nothing: a thread issuing one blocking call per block has no separate submit/reap step to
  batch or overlap.
- tensors on an accelerator go through a host bounce buffer (as DeepSpeed's unpinned path
  does), or through kvikio (GPUDirect Storage) with ``use_gds=True`` when it is installed.
"""
from __future__ import annotations

import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Union

import torch

from ..errors import StorageError
from ..utils.logging import logger
from .aligned import ALIGN, alloc_aligned, byte_view
from .file_ops import (DirectFallback, RequestFiles, default_positional, file_size, plan_blocks,
                       read_descriptor)
from .gds import INSTALL_HINT, gds_transfer, kvikio_module

#: Most threads one handle starts (intra_op_parallelism * queue_depth is capped here).
MAX_THREADS = 64

PathOrFd = Union[str, os.PathLike, int]


@dataclass(eq=False)
class _Request:
    """One submitted read or write and what its completion must do."""

    write: bool
    tensor: torch.Tensor          # the caller's tensor
    host: torch.Tensor            # its bytes on the host (itself, or a bounce copy)
    path: str
    offset: int
    validate: bool
    fd: Optional[int] = None      # the caller's open descriptor, where it gave one
    files: Optional[RequestFiles] = None
    futures: List["Future[None]"] = field(default_factory=list)
    gds_wait: Optional[Callable[[], int]] = None
    finished: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def finish(self) -> None:
        """Wait for every block, close the files, copy a bounce buffer back; raise the first
        error after all blocks are done (none still writes into the buffer)."""
        with self.lock:  # a second caller returns once the first has finished
            if self.finished:
                return
            self.finished = True
            try:
                wait_futures(self.futures)
                for fut in self.futures:
                    fut.result()
                if self.gds_wait is not None:
                    self.gds_wait()
            finally:
                if self.files is not None:
                    self.files.close()
            if not self.write and self.host.data_ptr() != self.tensor.data_ptr():
                byte_view(self.tensor, self.path).copy_(self.host)
            if self.validate:
                _validate(self)


def _validate(req: _Request) -> None:
    """DeepSpeed's ``validate``: compare the buffer with the file read back plainly."""
    nbytes = req.host.numel()
    if req.fd is None:
        with open(req.path, "rb") as f:
            f.seek(req.offset)
            on_disk = f.read(nbytes)
    else:
        on_disk = read_descriptor(req.fd, req.offset, nbytes)
    if on_disk != req.host.numpy().tobytes():
        raise StorageError(f"{req.path}: validation failed: the {nbytes} bytes at offset "
                           f"{req.offset} differ from the tensor after the "
                           f"{'write' if req.write else 'read'}.")


class AsyncIOHandle:
    """DeepSpeed's ``aio_handle``: ``aio_handle(block_size, queue_depth, single_submit,
    overlap_events, intra_op_parallelism)`` plus shardwise's keywords ``use_gds`` (kvikio
    for CUDA tensors), ``direct`` (None: O_DIRECT where the OS and filesystem allow it;
    False: always buffered) and ``positional`` (None: pread/pwrite where the OS has them;
    False: per-thread handles with seek, the Windows path)."""

    def __init__(self, block_size: int = 1024 * 1024, queue_depth: int = 128,
                 single_submit: bool = False, overlap_events: bool = False,
                 intra_op_parallelism: int = 1, *, use_gds: bool = False,
                 direct: Optional[bool] = None, positional: Optional[bool] = None) -> None:
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth),
                            ("intra_op_parallelism", intra_op_parallelism)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise StorageError(f"aio_handle: {name}={value!r} must be a positive integer.")
        self._block_size, self._queue_depth = block_size, queue_depth
        self._single_submit, self._overlap_events = bool(single_submit), bool(overlap_events)
        self._parallel = intra_op_parallelism
        self._direct = direct is not False
        self._positional = default_positional() if positional is None else positional
        self._fallback = DirectFallback(logger.info)
        self._kvikio = self._load_kvikio() if use_gds else None
        self._threads = min(MAX_THREADS, intra_op_parallelism * queue_depth)
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="shardwise-aio")
        self._lock = threading.Lock()
        self._pending: List[_Request] = []

    @staticmethod
    def _load_kvikio() -> Optional[Any]:
        mod = kvikio_module()
        if mod is None:
            warnings.warn(f"aio use_gds=true: kvikio is not installed ({INSTALL_HINT}); "
                          "GPUDirect Storage is off and IO goes through host memory threads.",
                          stacklevel=3)
        return mod

    # --- DeepSpeed's getters ---------------------------------------------------------
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._parallel

    def get_alignment(self) -> int:
        """Address, offset and length alignment under which a block goes O_DIRECT unbounced."""
        return ALIGN

    @property
    def thread_count(self) -> int:
        """Threads of this handle (intra_op_parallelism * queue_depth, at most MAX_THREADS)."""
        return self._threads

    @property
    def direct_refused(self) -> bool:
        """True once the filesystem refused O_DIRECT and the handle went buffered."""
        return self._fallback.refused

    # --- requests ----------------------------------------------------------------------
    def async_pread(self, buffer: torch.Tensor, filename: PathOrFd, file_offset: int = 0) -> int:
        """Start reading ``buffer``'s size in bytes at ``file_offset`` into it; 0 (wait() counts it)."""
        self._submit(False, buffer, filename, file_offset, validate=False)
        return 0

    def async_pwrite(self, buffer: torch.Tensor, filename: PathOrFd, file_offset: int = 0) -> int:
        """Start writing ``buffer`` at ``file_offset`` (a path or an open descriptor); 0."""
        self._submit(True, buffer, filename, file_offset, validate=False)
        return 0

    def sync_pread(self, buffer: torch.Tensor, filename: PathOrFd, file_offset: int = 0) -> int:
        """Read and wait; the count of requests completed (this one and any pending)."""
        self._submit(False, buffer, filename, file_offset, validate=False)
        return self.wait()

    def sync_pwrite(self, buffer: torch.Tensor, filename: PathOrFd, file_offset: int = 0) -> int:
        """Write and wait; the count of requests completed (this one and any pending)."""
        self._submit(True, buffer, filename, file_offset, validate=False)
        return self.wait()

    def pread(self, buffer: torch.Tensor, filename: PathOrFd, validate: bool = False,
              async_op: bool = False, file_offset: int = 0, **kw: Any) -> int:
        """DeepSpeed's ``pread(buffer, filename, validate, async, file_offset)``."""
        async_op = bool(kw.pop("async", async_op))
        self._submit(False, buffer, filename, file_offset, validate)
        return 0 if async_op else self.wait()

    def pwrite(self, buffer: torch.Tensor, filename: PathOrFd, validate: bool = False,
               async_op: bool = False, file_offset: int = 0, **kw: Any) -> int:
        """DeepSpeed's ``pwrite(buffer, filename, validate, async, file_offset)``."""
        async_op = bool(kw.pop("async", async_op))
        self._submit(True, buffer, filename, file_offset, validate)
        return 0 if async_op else self.wait()

    def read(self, buffer: torch.Tensor, filename: PathOrFd, validate: bool = False,
             file_offset: int = 0) -> int:
        """DeepSpeed's synchronous ``read``; returns 0 as DeepSpeed's does."""
        self.pread(buffer, filename, validate, False, file_offset)
        return 0

    def write(self, buffer: torch.Tensor, filename: PathOrFd, validate: bool = False,
              file_offset: int = 0) -> int:
        """DeepSpeed's synchronous ``write``; returns 0 as DeepSpeed's does."""
        self.pwrite(buffer, filename, validate, False, file_offset)
        return 0

    def wait(self) -> int:
        """Wait for every pending request; the number completed. Raises the first failure
        (as a StorageError naming the file) after all of them are done. Requests already
        finished through their own :meth:`IORequest.wait` are not counted."""
        with self._lock:
            pending, self._pending = self._pending, []
        error: Optional[BaseException] = None
        count = 0
        for req in pending:
            count += not req.finished
            try:
                req.finish()
            except BaseException as exc:  # finish the others before raising
                error = error or exc
        if error is not None:
            raise error
        return count

    # --- shardwise's per-request API (for pipelines that wait for one request) ------------
    def read_request(self, buffer: torch.Tensor, filename: PathOrFd, file_offset: int = 0) -> "IORequest":
        """Start a read like :meth:`async_pread`; the returned request can be waited alone."""
        return IORequest(self, self._submit(False, buffer, filename, file_offset, False))

    def write_request(self, buffer: torch.Tensor, filename: PathOrFd, file_offset: int = 0) -> "IORequest":
        """Start a write like :meth:`async_pwrite`; the returned request can be waited alone."""
        return IORequest(self, self._submit(True, buffer, filename, file_offset, False))

    def _finish_one(self, req: _Request) -> None:
        with self._lock:
            if req in self._pending:
                self._pending.remove(req)
        req.finish()

    # --- pinned buffers ----------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A page-aligned host tensor of ``num_elem`` elements of ``example_tensor``'s dtype,
        pinned when the accelerator can (so O_DIRECT and DMA both take it without a copy)."""
        itemsize = example_tensor.element_size()
        return alloc_aligned(int(num_elem) * itemsize, example_tensor.dtype, pin=True)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Nothing to free by hand: the memory goes when the tensor does."""
        return True

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        return buffer.device.type == "cpu" and buffer.is_pinned()

    def close(self) -> None:
        """Wait for pending requests and stop the threads."""
        try:
            if self._pending:
                self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> "AsyncIOHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- internals ---------------------------------------------------------------------
    def _submit(self, write: bool, tensor: torch.Tensor, target: PathOrFd, offset: int,
                validate: bool) -> _Request:
        fd = target if isinstance(target, int) else None
        path = f"<fd {fd}>" if fd is not None else os.fspath(target)
        if not isinstance(tensor, torch.Tensor):
            raise StorageError(f"{path}: aio needs a torch.Tensor buffer, got {type(tensor).__name__}.")
        if int(offset) < 0:
            raise StorageError(f"{path}: file_offset={offset} must be >= 0.")
        nbytes = tensor.numel() * tensor.element_size()
        if not write and fd is None and file_size(path) < offset + nbytes:
            raise StorageError(f"{path}: reading {nbytes} bytes at offset {offset} needs "
                               f"{offset + nbytes} bytes but the file has {file_size(path)}.")
        if self._kvikio is not None and tensor.is_cuda and fd is None:
            req = _Request(write, tensor, tensor, path, int(offset), validate)
            req.gds_wait = gds_transfer(self._kvikio, tensor, path, int(offset), write)
        else:
            req = self._thread_request(write, tensor, path, fd, int(offset), validate)
        with self._lock:
            self._pending.append(req)
        return req

    def _thread_request(self, write: bool, tensor: torch.Tensor, path: str, fd: Optional[int],
                        offset: int, validate: bool) -> _Request:
        if tensor.device.type == "cpu":
            host = byte_view(tensor, path)
        else:  # a bounce copy: the whole tensor, so the device copy is one transfer
            host = alloc_aligned(tensor.numel() * tensor.element_size(), pin=True)
            if write:
                host.copy_(byte_view(tensor, path))
        req = _Request(write, tensor, host, path, offset, validate, fd)
        req.files = RequestFiles(path, write, self._direct, self._fallback, self._positional, fd)
        if host.numel() == 0:
            return req
        if write:
            req.files.preallocate(offset, host.numel())
        view = memoryview(host.numpy())
        base = host.data_ptr()
        for block in plan_blocks(offset, host.numel(), self._block_size, req.files.direct):
            piece = view[block.buf_offset:block.buf_offset + block.length]
            req.futures.append(self._pool.submit(req.files.move, block,
                                                 base + block.buf_offset, piece))
        return req


class IORequest:
    """One submitted request of an :class:`AsyncIOHandle`, waitable on its own."""

    def __init__(self, handle: AsyncIOHandle, req: _Request) -> None:
        self._handle, self._req = handle, req

    def done(self) -> bool:
        """True when every block has moved (the buffer may still need :meth:`wait`)."""
        return all(f.done() for f in self._req.futures)

    def wait(self) -> None:
        """Wait for this request alone (idempotent); raises its error naming the file."""
        self._handle._finish_one(self._req)
