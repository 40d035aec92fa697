"""One probe per capability the engine can use: does this machine have it?

Each probe *tries* the thing where trying is cheap (a fused optimizer step on a one-element
tensor, an attention call on a tiny batch, an O_DIRECT write of one block) instead of
trusting version numbers, and caches its answer for the process. The engine calls the same
functions (``fused_optimizer_available("cuda", "adamw")``) that ``shardwise report`` prints.
"""
from __future__ import annotations

import functools
import importlib.util
import mmap
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional

import torch

SHM_WARN_BYTES = 512 * 2**20  # below this, DataLoader workers and NCCL's shm transport fail
_OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def device_usable(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    if device_type == "mps":
        return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    module = getattr(torch, device_type, None)
    return bool(module is not None and module.is_available())


@functools.lru_cache(maxsize=None)
def fused_optimizer_available(device_type: str, name: str = "adamw") -> bool:
    """Whether ``torch.optim.<name>(fused=True)`` steps on ``device_type`` here."""
    if name not in _OPTIMIZERS or not device_usable(device_type):
        return False
    try:
        param = torch.zeros(1, device=device_type, requires_grad=True)
        param.grad = torch.ones_like(param)
        _OPTIMIZERS[name]([param], lr=0.1, fused=True).step()
        return bool(param.detach().cpu().item() != 0.0)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False


@functools.lru_cache(maxsize=None)
def foreach_optimizer_available(device_type: str) -> bool:
    """The multi-tensor (foreach) path: the fallback when fused kernels are missing."""
    if not device_usable(device_type):
        return False
    try:
        param = torch.zeros(1, device=device_type, requires_grad=True)
        param.grad = torch.ones_like(param)
        torch.optim.AdamW([param], lr=0.1, foreach=True).step()
        return True
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False


@functools.lru_cache(maxsize=None)
def sdpa_backend_available(device_type: str, backend: str) -> bool:
    """Whether ``scaled_dot_product_attention`` runs with only ``backend`` allowed.

    ``backend`` is one of ``flash``, ``efficient``, ``cudnn``, ``math``.
    """
    if not device_usable(device_type):
        return False
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return backend == "math"
    names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "cudnn": "CUDNN_ATTENTION", "math": "MATH"}
    chosen = getattr(SDPBackend, names[backend], None)
    if chosen is None:
        return False
    dtype = torch.float16 if device_type == "cuda" else torch.float32
    q = torch.randn(1, 2, 8, 16, device=device_type, dtype=dtype)
    try:
        with sdpa_kernel([chosen]):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def triton_available() -> bool:
    """Triton is installed and a CUDA/ROCm/XPU device exists for it to compile for."""
    return importlib.util.find_spec("triton") is not None and (
        torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()))


def cpu_compiler() -> Optional[str]:
    """A C++ compiler torch.compile's CPU backend could use (inductor generates C++)."""
    for name in ("cl", "g++", "c++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def torch_compile_available(device_type: str) -> bool:
    """torch.compile can produce kernels for ``device_type`` (not tried: it is slow)."""
    try:
        import torch._dynamo
        if not torch._dynamo.is_dynamo_supported():
            return False
    except Exception:
        return False
    if device_type == "cpu":
        return cpu_compiler() is not None
    return triton_available()


@functools.lru_cache(maxsize=None)
def pinned_memory_available() -> bool:
    """Page-locked host memory (needs a CUDA/XPU runtime)."""
    if not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())):
        return False
    try:
        return bool(torch.empty(8).pin_memory().is_pinned())
    except RuntimeError:
        return False


def o_direct_available(folder: Optional[str] = None) -> bool:
    """Whether a file in ``folder`` (default: the temp folder) can be written with O_DIRECT."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:  # Windows and macOS have no O_DIRECT flag
        return False
    folder = folder or tempfile.gettempdir()
    path = Path(folder) / f".shardwise_odirect_probe_{os.getpid()}"
    block = 4096
    buffer = mmap.mmap(-1, block)  # page aligned, as O_DIRECT requires
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flag, 0o600)
        try:
            return os.write(fd, buffer) == block
        finally:
            os.close(fd)
    except OSError:  # tmpfs and some filesystems refuse O_DIRECT
        return False
    finally:
        buffer.close()
        path.unlink(missing_ok=True)


def kvikio_available() -> bool:
    return importlib.util.find_spec("kvikio") is not None


def gds_available() -> bool:
    """GPUDirect Storage: kvikio installed and the nvidia-fs kernel driver loaded."""
    return kvikio_available() and Path("/proc/driver/nvidia-fs").exists()


def cpu_simd_level() -> Dict[str, object]:
    """What torch's CPU kernels dispatch to, plus AMX from the CPU flags (Linux)."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:
        capability = "unknown"
    flags: set = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {"torch_capability": capability, "machine": platform.machine(),
            "avx2": "avx2" in flags if flags else capability.upper().startswith(("AVX2", "AVX512")),
            "avx512": "avx512f" in flags if flags else capability.upper().startswith("AVX512"),
            "amx": bool({"amx_tile", "amx_bf16"} & flags)}


def shm_size() -> Optional[int]:
    """Total bytes of /dev/shm (None where there is none: Windows, macOS)."""
    if not sys.platform.startswith("linux") or not Path("/dev/shm").exists():
        return None
    return shutil.disk_usage("/dev/shm").total


def libuv_store_available() -> bool:
    """The libuv TCPStore backend (missing from Windows builds of torch)."""
    try:
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True,
                              wait_for_workers=False)
        return bool(getattr(store, "libuvBackend", False))
    except Exception:
        return False


def comm_backends() -> Dict[str, bool]:
    import torch.distributed as dist
    if not dist.is_available():
        return {"distributed": False}
    return {
        "nccl": dist.is_nccl_available(),
        "gloo": dist.is_gloo_available(),
        "mpi": dist.is_mpi_available(),
        "ucc": bool(getattr(dist, "is_ucc_available", lambda: False)()),
        "xccl": bool(getattr(dist, "is_xccl_available", lambda: False)()),
        "libuv_store": libuv_store_available(),
    }
