"""Exact-size pinned host memory on a CUDA machine: cudaHostRegister through torch's cudart
page-locks exactly the bytes asked for, async copies run from it, and freeing unregisters."""
from __future__ import annotations

import gc

import psutil
import pytest
import torch

from shardwise.accelerator.pinned import ExactPinAllocator, cudart_registrar

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MIB = 1 << 20


def test_cudart_binding_is_there() -> None:
    registrar, reason = cudart_registrar()
    assert registrar is not None, reason


def test_exact_size_pin_async_copy_and_rss() -> None:
    alloc = ExactPinAllocator()
    torch.zeros(1, device="cuda")  # the CUDA context's own host memory is not ours to count
    alloc.empty(MIB // 4)  # nor the first registration's driver setup
    nbytes = 300 * MIB + 12_345 * 4  # far from a power of two (torch would lock 512 MiB)
    rss0 = psutil.Process().memory_info().rss
    host = alloc.empty(nbytes // 4, torch.float32)
    grown = psutil.Process().memory_info().rss - rss0
    assert alloc.registrar is not None and host.is_pinned()
    # registering locks (and so faults in) exactly the range: ~300 MiB, never 512
    assert 0.9 * nbytes <= grown <= nbytes + 8 * MIB, grown / MIB
    host.copy_(torch.arange(host.numel(), dtype=torch.float32))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dev = host.to("cuda", non_blocking=True)
    stream.synchronize()
    assert torch.equal(dev.cpu(), host)
    back = alloc.empty(host.numel(), torch.float32)
    back.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, host)
    del host, back
    gc.collect()
    # freed: the registration and the mapping are gone (RSS falls back near the start)
    assert psutil.Process().memory_info().rss - rss0 < 0.5 * nbytes


def test_accelerator_pin_memory_is_exact_under_the_switch(monkeypatch) -> None:
    from shardwise.accelerator import get_accelerator
    from shardwise.accelerator import pinned

    src = torch.randn(40 * MIB // 4 + 7)
    monkeypatch.setenv(pinned.EXACT_PIN_ENV, "1")
    out = get_accelerator().pin_memory(src)
    assert out.is_pinned() and torch.equal(out, src)
    # exact registration: the base is our own mapping, not a torch pinned block
    assert out.untyped_storage().nbytes() < 64 * MIB
    monkeypatch.setenv(pinned.EXACT_PIN_ENV, "0")
    assert get_accelerator().pin_memory(src).is_pinned()
