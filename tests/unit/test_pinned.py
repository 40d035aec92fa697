"""Exact-size pinned host buffers on CPU: the registration path with a recording registrar
(exact page-rounded length, 2 MiB alignment, unregister exactly once when the last view
dies) and the fallbacks, which log once."""
from __future__ import annotations

import gc

import pytest
import torch

from shardwise.accelerator import pinned
from shardwise.accelerator.pinned import HUGE_PAGE, PAGE, ExactPinAllocator, pinned_empty


class Recorder:
    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def register(self, ptr: int, nbytes: int) -> str | None:
        self.registered.append((ptr, nbytes))
        return self.fail

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)


@pytest.mark.parametrize("shape, dtype, align", [((3, 1000), torch.float32, PAGE),
                                                 ((1_000_003,), torch.float32, HUGE_PAGE),
                                                 (5, torch.bfloat16, PAGE)])
def test_registered_buffer_is_exact_aligned_and_released_once(shape, dtype, align) -> None:
    rec = Recorder()
    t = ExactPinAllocator(registrar=rec).empty(shape, dtype)
    assert t.shape == torch.Size(shape if isinstance(shape, tuple) else (shape,))
    assert t.dtype == dtype and t.device.type == "cpu"
    nbytes = t.numel() * t.element_size()
    assert rec.registered == [(t.data_ptr(), -(-nbytes // PAGE) * PAGE)]  # exact, page-rounded
    assert t.data_ptr() % align == 0
    t.fill_(1)  # the memory is usable
    assert float(t.sum()) == t.numel()
    view = t.view(-1)[1:]
    del t
    gc.collect()
    assert rec.unregistered == []  # a view keeps the registration alive
    del view
    gc.collect()
    assert rec.unregistered == [rec.registered[0][0]]


def _capture_logs(monkeypatch) -> list[str]:
    # the "shardwise" logger may not propagate to caplog (utils/logging configures it)
    notes: list[str] = []
    monkeypatch.setattr(pinned.logger, "info", lambda msg, *a, **k: notes.append(str(msg)))
    return notes


def test_refused_registration_falls_back_and_logs_once(monkeypatch) -> None:
    notes = _capture_logs(monkeypatch)
    rec = Recorder(fail="cudaErrorHostMemoryAlreadyRegistered")
    alloc = ExactPinAllocator(registrar=rec)
    a = alloc.empty(1000, torch.float32)
    b = alloc.empty(2000, torch.float32)
    assert (a.numel(), b.numel()) == (1000, 2000)
    assert len(rec.registered) == 2 and rec.unregistered == []  # nothing to undo
    assert len(notes) == 1 and "AlreadyRegistered" in notes[0]


def test_cpu_only_machine_gets_plain_memory_and_one_log(monkeypatch) -> None:
    notes = _capture_logs(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    alloc = ExactPinAllocator()
    a = alloc.empty((4, 8), torch.float16)
    alloc.empty(3)
    assert a.shape == (4, 8) and a.dtype == torch.float16 and not a.is_pinned()
    assert alloc.registrar is None and alloc.unavailable_reason == "no CUDA device"
    assert len(notes) == 1 and "no CUDA device" in notes[0]


def test_default_pinned_empty_works_here() -> None:
    t = pinned_empty((2, 3), torch.float32)
    assert t.shape == (2, 3) and t.dtype == torch.float32


def test_cudart_registrar_maps_error_codes() -> None:
    class FakeCudart:
        class cudaError:  # noqa: N801 (torch's name)
            success = 0

        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def cudaHostRegister(self, ptr, size, flags):  # noqa: N802
            self.calls.append(("register", ptr, size, flags))
            return 0 if size else 1

        def cudaHostUnregister(self, ptr):  # noqa: N802
            self.calls.append(("unregister", ptr))
            return 0

        def cudaGetErrorString(self, code):  # noqa: N802
            return f"error {code}"

    fake = FakeCudart()
    reg = pinned.CudartRegistrar(fake)
    assert reg.register(4096, 8192) is None
    assert reg.register(4096, 0) == "error 1"
    reg.unregister(4096)
    assert fake.calls == [("register", 4096, 8192, 0), ("register", 4096, 0, 0),
                          ("unregister", 4096)]


def test_exact_pinned_empty_only_for_large_buffers(monkeypatch) -> None:
    monkeypatch.setattr(pinned, "EXACT_PIN_MIN_BYTES", 4096)
    rec = Recorder()
    alloc = ExactPinAllocator(registrar=rec)
    out = pinned.exact_pinned_empty((30, 100), torch.float32, alloc)
    assert out is not None and out.shape == (30, 100) and out.dtype == torch.float32
    assert rec.registered == [(out.data_ptr(), 12288)]
    assert pinned.exact_pinned_empty(10, torch.float32, alloc) is None  # small: torch's allocator
    assert len(rec.registered) == 1


@pytest.fixture
def fake_cuda_exact_pin(monkeypatch):
    """A CUDA accelerator whose large pinned buffers come from a recording registrar, and
    whose copy-into-pinned path (``pin_memory``) must not be used for new buffers."""
    from shardwise.accelerator import base
    monkeypatch.setattr(pinned, "EXACT_PIN_MIN_BYTES", 4096)
    monkeypatch.setenv(pinned.EXACT_PIN_ENV, "1")
    rec = Recorder()
    monkeypatch.setattr(pinned, "_DEFAULT", ExactPinAllocator(registrar=rec))
    accel = base.Accelerator("cuda")
    monkeypatch.setattr(accel, "pin_memory_supported", lambda: True)

    def copied(tensor):
        raise AssertionError(f"a pageable buffer of {tensor.numel()} elements was pinned by "
                             "copying: it existed twice at once")

    monkeypatch.setattr(accel, "pin_memory", copied)
    monkeypatch.setattr(base, "_current", accel)
    return rec


def test_offload_buffers_are_allocated_pinned_in_place(fake_cuda_exact_pin) -> None:
    """Regression (issue 21's scale run: NVMe offload fit 1.27x the CPU-offload model under a
    32 GiB cap, not 2x): the flat fp32 gradient partitions, stage-3 host shards, stage 1-2
    masters and the IO layer's buffers were allocated pageable and then copied into pinned
    memory, so each multi-GB buffer existed twice at initialize (and the IO layer's bypassed
    exact-size pinning). Stage 1-2's offloaded masters (``flat_buckets.build_bucket``) take
    the same two calls."""
    from shardwise.io.aligned import alloc_aligned
    from shardwise.io.pinned_ring import alloc_host as ring_buffer
    from shardwise.offload.host_grads import alloc_host
    from shardwise.zero.stage3.storage import TensorShard
    rec = fake_cuda_exact_pin
    cpu = torch.device("cpu")
    grads = alloc_host(5000, cpu, pin=True)
    assert grads.dtype == torch.float32 and not grads.any()
    shard = TensorShard.zeros(4096, torch.bfloat16, cpu, pin=True).tensor()
    src = torch.randn(64, 64)
    copy = TensorShard.copy_of(src, cpu, torch.bfloat16, pin=True).tensor()
    assert torch.equal(copy, src.to(torch.bfloat16)) and copy.shape == src.shape
    aligned = alloc_aligned(1 << 16, pin=True)
    ring = ring_buffer(1 << 16)
    starts = {ptr for ptr, _ in rec.registered}
    assert grads.data_ptr() in starts and shard.data_ptr() in starts
    assert copy.data_ptr() in starts and ring.data_ptr() in starts
    assert any(ptr <= aligned.data_ptr() < ptr + n for ptr, n in rec.registered)
    assert len(rec.registered) == 5
    unpinned = alloc_host(5000, cpu, pin=False)  # no pin asked: plain memory, not registered
    assert len(rec.registered) == 5 and not unpinned.any()


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("", False), ("0", False)])
def test_exact_pin_switch(monkeypatch, value, on) -> None:
    monkeypatch.setenv(pinned.EXACT_PIN_ENV, value)
    assert pinned.exact_pin_requested() is on
