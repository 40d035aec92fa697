"""``shardwise report``: DeepSpeed's ``ds_report`` for a library that compiles nothing.

Instead of "which ops are built", it shows what this machine offers the engine and what the
engine falls back to when something is missing: versions, accelerators and their memory,
communication backends, an ops table (one probe per capability, from ``report_checks``) and
the warnings a user has to act on. ``--json`` prints the same data as JSON.

Also ``python -m shardwise.report``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import psutil
import torch

from . import report_checks as checks
from .report_checks import (comm_backends, cpu_simd_level, fused_optimizer_available,  # noqa: F401
                            gds_available, kvikio_available, o_direct_available,
                            pinned_memory_available, sdpa_backend_available, shm_size,
                            torch_compile_available, triton_available)
from .version import __version__

GIB = 2**30
MIN_TORCH = (2, 4)


def _version_tuple(text: Optional[str]) -> tuple:
    parts = []
    for piece in (text or "").split("+")[0].split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def wsl_detected() -> bool:
    try:
        return "microsoft" in Path("/proc/version").read_text().lower()
    except OSError:
        return False


def os_info() -> Dict[str, Any]:
    info: Dict[str, Any] = {"system": platform.system(), "release": platform.release(),
                            "platform": platform.platform(), "machine": platform.machine(),
                            "wsl": wsl_detected()}
    if hasattr(sys, "getwindowsversion"):
        win = sys.getwindowsversion()
        info["windows_build"] = win.build
        info["windows_version"] = f"{win.major}.{win.minor}.{win.build}"
    return info


def nvidia_smi_driver() -> Optional[str]:
    """The NVIDIA driver version from nvidia-smi, None when it is not installed or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def driver_cuda_version() -> Optional[str]:
    """The newest CUDA version the installed driver supports (e.g. "12.4")."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return None
    try:
        raw = int(torch._C._cuda_getDriverVersion())
    except Exception:
        return None
    return f"{raw // 1000}.{(raw % 1000) // 10}"


def versions() -> Dict[str, Any]:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"shardwise": __version__, "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "torch_hip": getattr(torch.version, "hip", None),
            "cudnn": cudnn, "driver": nvidia_smi_driver(), "driver_cuda": driver_cuda_version(),
            "python": platform.python_version(), "python_executable": sys.executable,
            "os": os_info()}


def accelerators() -> Dict[str, Any]:
    vm = psutil.virtual_memory()
    result: Dict[str, Any] = {
        "cpu": {"logical_cores": psutil.cpu_count(logical=True),
                "physical_cores": psutil.cpu_count(logical=False),
                "memory_total_gib": round(vm.total / GIB, 2),
                "memory_available_gib": round(vm.available / GIB, 2)},
        "cuda_available": torch.cuda.is_available(), "devices": []}
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
            result["devices"].append({"index": index, "kind": "cuda", "name": props.name,
                                      "capability": f"{props.major}.{props.minor}",
                                      "memory_total_gib": round(total / GIB, 2),
                                      "memory_free_gib": round(free / GIB, 2)})
    elif hasattr(torch, "xpu") and torch.xpu.is_available():
        for index in range(torch.xpu.device_count()):
            props = torch.xpu.get_device_properties(index)
            result["devices"].append({"index": index, "kind": "xpu", "name": props.name,
                                      "memory_total_gib": round(props.total_memory / GIB, 2)})
    elif hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        result["devices"].append({"index": 0, "kind": "mps", "name": "Apple MPS",
                                  "memory_total_gib": round(vm.total / GIB, 2)})
    return result


def _op(name: str, available: bool, fallback: str, detail: str = "") -> Dict[str, Any]:
    return {"name": name, "available": bool(available), "fallback": fallback, "detail": detail}


def ops_table() -> List[Dict[str, Any]]:
    """Each capability: available here?, and what the engine uses when it is not."""
    gpu = "cuda" if torch.cuda.is_available() else None
    attention_device = gpu or "cpu"
    rows: List[Dict[str, Any]] = []
    for device in ("cuda", "cpu"):
        for name in ("adamw", "adam", "sgd"):
            label = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}[name]
            rows.append(_op(f"fused {label} ({device})", fused_optimizer_available(device, name),
                            "foreach (multi-tensor) kernels" if device != "cuda" or gpu
                            else "no CUDA device: CPU optimizer"))
    for backend, label in (("flash", "flash"), ("efficient", "memory-efficient"),
                           ("cudnn", "cuDNN")):
        rows.append(_op(f"SDPA {label} attention ({attention_device})",
                        sdpa_backend_available(attention_device, backend),
                        "math attention (PyTorch reference kernel)"))
    rows.append(_op("Triton", triton_available(), "PyTorch eager kernels",
                    "installed" if importlib.util.find_spec("triton") else "not installed"))
    compile_device = gpu or "cpu"
    rows.append(_op(f"torch.compile ({compile_device})", torch_compile_available(compile_device),
                    "eager mode (shardwise never requires compilation)",
                    f"C++ compiler: {checks.cpu_compiler() or 'none'}" if compile_device == "cpu"
                    else ""))
    rows.append(_op("pinned memory", pinned_memory_available(),
                    "pageable host memory (offload copies are synchronous)"))
    rows.append(_op("O_DIRECT file IO", o_direct_available(), "buffered file IO (page cache)"))
    rows.append(_op("kvikio", kvikio_available(), "torch file IO through host memory"))
    rows.append(_op("GPUDirect Storage", gds_available(), "torch file IO through host memory"))
    simd = cpu_simd_level()
    rows.append(_op("CPU SIMD AVX2", simd["avx2"], "default (non-vectorised) CPU kernels",
                    f"torch dispatches {simd['torch_capability']} on {simd['machine']}"))
    rows.append(_op("CPU SIMD AVX-512", simd["avx512"], "AVX2 kernels"))
    rows.append(_op("CPU AMX (bf16 matmul)", simd["amx"], "AVX-512/AVX2 matmul"))
    shm = shm_size()
    rows.append(_op("/dev/shm", shm is not None and shm >= checks.SHM_WARN_BYTES,
                    "file-backed sharing (slower DataLoader workers)" if shm is not None
                    else "not applicable on this OS",
                    f"{shm / GIB:.2f} GiB" if shm is not None else "none"))
    return rows


def warnings_for(report: Dict[str, Any]) -> List[str]:
    """The problems a user must act on, each with its fix."""
    found: List[str] = []
    v = report["versions"]
    if v["torch_cuda"] and not report["accelerators"]["cuda_available"]:
        found.append(f"torch {v['torch']} is a CUDA {v['torch_cuda']} build but no CUDA device is "
                     f"usable ({'driver ' + v['driver'] if v['driver'] else 'no NVIDIA driver found'}"
                     f"); install/repair the NVIDIA driver, or install the CPU build of torch")
    if v["driver_cuda"] and v["torch_cuda"] and \
            _version_tuple(v["driver_cuda"]) < _version_tuple(v["torch_cuda"]):
        found.append(f"the NVIDIA driver supports CUDA {v['driver_cuda']} but torch was built for "
                     f"CUDA {v['torch_cuda']}; update the driver or install a torch built for "
                     f"CUDA <= {v['driver_cuda']}")
    if _version_tuple(v["torch"])[:2] < MIN_TORCH:
        found.append(f"torch {v['torch']} is older than {'.'.join(map(str, MIN_TORCH))}, the "
                     f"oldest shardwise supports; upgrade torch")
    shm = shm_size()
    if shm is not None and shm < checks.SHM_WARN_BYTES:
        found.append(f"/dev/shm is only {shm / 2**20:.0f} MiB (< {checks.SHM_WARN_BYTES >> 20} "
                     f"MiB): DataLoader workers and NCCL may fail; in Docker pass --shm-size=8g "
                     f"or --ipc=host")
    if v["os"]["system"] == "Windows" and os.environ.get("USE_LIBUV") == "1":
        found.append("USE_LIBUV=1 on Windows: Windows builds of torch have no libuv and the "
                     "rendezvous fails; unset it or set USE_LIBUV=0")
    if not report["communication"].get("gloo", False):
        found.append("torch has no gloo backend: CPU and Windows multi-process runs cannot start; "
                     "install an official torch wheel")
    return found


def collect_report(include_ops: bool = True) -> Dict[str, Any]:
    """Everything ``shardwise report`` shows, as a JSON-serialisable dict.

    ``include_ops=False`` skips the ops probes (the fused-optimizer probe alone imports
    torch's compiler stack, ~2 s).
    """
    from .accelerator import get_accelerator
    report: Dict[str, Any] = {"versions": versions(), "accelerators": accelerators()}
    comm = comm_backends()
    report["communication"] = dict(comm, default_backend=get_accelerator()
                                   .communication_backend_name())
    if include_ops:
        report["ops"] = ops_table()
    report["warnings"] = warnings_for(report)
    return report


def _line(name: str, value: Any, width: int = 34) -> str:
    return f"  {name:<{width}} {value}"


def format_report(report: Dict[str, Any], hide_ops: bool = False,
                  hide_warnings: bool = False) -> str:
    v, a, c = report["versions"], report["accelerators"], report["communication"]
    os_ = v["os"]
    os_text = os_["platform"] + (f" (Windows build {os_['windows_build']})"
                                 if "windows_build" in os_ else "") + (" [WSL]" if os_["wsl"] else "")
    out = ["-" * 72, "shardwise environment report (nothing to compile: this is what it uses)",
           "-" * 72, "versions"]
    out += [_line("shardwise", v["shardwise"]), _line("torch", v["torch"]),
            _line("CUDA runtime (torch build)", v["torch_cuda"] or "none"),
            _line("ROCm/HIP runtime (torch build)", v["torch_hip"] or "none"),
            _line("cuDNN", v["cudnn"] or "none"), _line("NVIDIA driver", v["driver"] or "none"),
            _line("driver supports CUDA", v["driver_cuda"] or "n/a"),
            _line("Python", f"{v['python']} ({v['python_executable']})"),
            _line("OS", f"{os_['system']}: {os_text}")]
    out += ["accelerators"]
    cpu = a["cpu"]
    out.append(_line("CPU", f"{cpu['logical_cores']} logical / {cpu['physical_cores']} physical "
                     f"cores, {cpu['memory_available_gib']:.1f} of {cpu['memory_total_gib']:.1f} "
                     f"GiB free"))
    for d in a["devices"]:
        free = f"{d['memory_free_gib']:.1f} of " if "memory_free_gib" in d else ""
        out.append(_line(f"{d['kind']}:{d['index']}", f"{d['name']}, {free}"
                         f"{d['memory_total_gib']:.1f} GiB"))
    if not a["devices"]:
        out.append(_line("GPU", "none (CPU-only: workers are processes, backend gloo)"))
    out += ["communication backends"]
    for name in ("nccl", "gloo", "mpi", "ucc", "xccl", "libuv_store"):
        if name in c:
            out.append(_line(name, "yes" if c[name] else "no"))
    out.append(_line("default backend here", c["default_backend"]))
    if not hide_ops:
        out += ["ops (capability: available -> fallback when not)"]
        for op in report.get("ops", []):
            state = "[YES]" if op["available"] else "[NO] "
            tail = "" if op["available"] else f" -> {op['fallback']}"
            detail = f" ({op['detail']})" if op["detail"] else ""
            out.append(_line(op["name"], f"{state}{detail}{tail}", width=40))
    if not hide_warnings:
        out += ["warnings"]
        out += [f"  ! {w}" for w in report["warnings"]] or ["  none"]
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise report",
                                     description="environment report (DeepSpeed's ds_report)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--hide_operator_status", action="store_true", help="omit the ops table")
    parser.add_argument("--hide_errors_and_warnings", action="store_true", help="omit warnings")
    args = parser.parse_args(argv)
    report = collect_report(include_ops=not args.hide_operator_status)
    if args.json:
        if args.hide_errors_and_warnings:
            report.pop("warnings")
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_report(report, args.hide_operator_status, args.hide_errors_and_warnings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
