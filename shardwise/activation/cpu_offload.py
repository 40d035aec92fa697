"""Moving activations to host memory and back: pinned buffers, side-stream copies, accounting.

Two users share this file:

* ``cpu_checkpointing``: a checkpoint's saved *inputs* go to the host after the forward and
  come back just before the recompute (``HostCopy``), with the next-needed checkpoint
  prefetched while the current one recomputes.
* the ``offload`` policy: every tensor autograd saves inside a wrapped module goes to the
  host as it is saved, and comes back in backward (``OffloadSavedTensors``), like
  ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` but with the device-to-host copy on
  a side stream so it overlaps the forward compute.

``SavedTensorStats`` counts what was kept where, so tests can prove that nothing stayed on
the compute device without a GPU.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from ..accelerator import get_accelerator
from ..utils.logging import warn_once


@dataclass
class SavedTensorStats:
    """Counts of tensors (and their bytes) that offload hooks saw, by where they were kept."""

    offloaded_count: int = 0
    """Tensors copied from the compute device to host memory."""
    offloaded_bytes: int = 0
    """Bytes of those copies."""
    host_count: int = 0
    """Tensors that were already in host memory (nothing to move)."""
    host_bytes: int = 0
    """Bytes of those."""
    kept_on_device_count: int = 0
    """Tensors that stayed on the compute device (must be 0 when offload works)."""
    kept_on_device_bytes: int = 0
    """Bytes of those."""
    restored_count: int = 0
    """Tensors brought back for backward / recompute."""

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _CopyEngine:
    """One side stream per process for host<->device copies (``None`` on stream-less devices)."""

    _lock = threading.Lock()
    _stream: Any = None

    @classmethod
    def stream(cls) -> Any:
        accel = get_accelerator()
        if not accel.has_streams() or not accel.is_available():
            return None
        with cls._lock:
            if cls._stream is None:
                cls._stream = accel.Stream()
        return cls._stream


def _to_host(t: torch.Tensor) -> Tuple[torch.Tensor, Any]:
    """Start copying ``t`` into a (pinned, where possible) host buffer; return (buffer, event)."""
    accel = get_accelerator()
    pin = accel.pin_memory_supported()
    host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, device="cpu", pin_memory=pin)
    stream = _CopyEngine.stream() if t.device.type != "cpu" else None
    if stream is None:
        host.copy_(t)
        return host, None
    # The copy must wait for whatever produced ``t``, and ``t`` must not be freed and reused
    # by the compute stream before the copy has read it: record_stream says so.
    stream.wait_stream(accel.current_stream())
    with accel.stream(stream):
        host.copy_(t, non_blocking=True)
    t.record_stream(stream)
    event = accel.Event()
    event.record(stream)
    return host, event


def _to_device(host: torch.Tensor, device: torch.device, event: Any) -> torch.Tensor:
    """Bring ``host`` back to ``device``; waits on ``event`` (the device->host copy) first."""
    if event is not None:
        event.synchronize()
    if device.type == "cpu":
        return host
    return host.to(device, non_blocking=host.is_pinned())


class HostCopy:
    """A host copy of one tensor that can be prefetched back to its device asynchronously."""

    def __init__(self, t: torch.Tensor) -> None:
        self.device = t.device
        self.requires_grad = t.requires_grad
        self.nbytes = tensor_bytes(t)
        self.host, self._d2h_event = _to_host(t.detach())
        self._prefetched: Optional[torch.Tensor] = None
        self._h2d_event: Any = None

    def prefetch(self) -> None:
        """Start the host->device copy on the side stream (no-op on CPU or if already done)."""
        if self._prefetched is not None or self.device.type == "cpu":
            return
        stream = _CopyEngine.stream()
        accel = get_accelerator()
        if stream is None:
            self._prefetched = _to_device(self.host, self.device, self._d2h_event)
            return
        if self._d2h_event is not None:
            stream.wait_event(self._d2h_event)
        with accel.stream(stream):
            self._prefetched = self.host.to(self.device, non_blocking=True)
            self._h2d_event = accel.Event()
            self._h2d_event.record(stream)

    def restore(self) -> torch.Tensor:
        """The tensor on its device again, detached, with its original ``requires_grad``."""
        if self._prefetched is not None:
            t = self._prefetched
            if self._h2d_event is not None:
                accel = get_accelerator()
                accel.current_stream().wait_event(self._h2d_event)
                t.record_stream(accel.current_stream())
            self._prefetched, self._h2d_event = None, None
        else:
            t = _to_device(self.host, self.device, self._d2h_event)
        if self.device.type == "cpu":
            # A restore may run more than once (retain_graph); never hand out the stash itself.
            t = t.clone()
        return t.detach().requires_grad_(self.requires_grad)


class OffloadSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep autograd's saved activations in host memory.

    Parameters (``nn.Parameter``) are left alone: they live on the device anyway, so copying
    them would only cost bandwidth. Tensors already on the host are kept as they are.
    """

    def __init__(self, stats: Optional[SavedTensorStats] = None, min_bytes: int = 0) -> None:
        self.stats = stats if stats is not None else SavedTensorStats()
        self.min_bytes = min_bytes
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        nbytes = tensor_bytes(t)
        if isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
            return ("keep", t)
        if t.device.type == "cpu":
            self.stats.host_count += 1
            self.stats.host_bytes += nbytes
            return ("keep", t)
        if nbytes < self.min_bytes:
            self.stats.kept_on_device_count += 1
            self.stats.kept_on_device_bytes += nbytes
            return ("keep", t)
        self.stats.offloaded_count += 1
        self.stats.offloaded_bytes += nbytes
        return ("host", t.device, *_to_host(t))

    def _unpack(self, packed: Any) -> torch.Tensor:
        self.stats.restored_count += 1
        if packed[0] == "keep":
            return packed[1]
        _, device, host, event = packed
        return _to_device(host, device, event)


def warn_if_host_only(what: str, consequence: str = "nothing is moved") -> None:
    """Say once why offloading to host memory gains nothing on a CPU-only run."""
    if get_accelerator().kind == "cpu":
        warn_once(f"{what}: the compute device is the CPU, so activations are already in host "
                  f"memory; {consequence} (the setting saves memory on GPU/XPU/MPS)")
