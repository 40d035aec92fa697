"""``shardwise report``: keys, probes, warnings and the command line."""
import copy
import json
import subprocess
import sys

import pytest
import torch

from shardwise import report, report_checks
from shardwise.report import collect_report, format_report, warnings_for


@pytest.fixture(scope="module")
def full_report():
    return collect_report()


def test_report_sections_and_keys(full_report):
    assert set(full_report) == {"versions", "accelerators", "communication", "ops", "warnings"}
    v = full_report["versions"]
    assert v["torch"] == torch.__version__ and v["torch_cuda"] == torch.version.cuda
    assert {"shardwise", "python", "driver", "driver_cuda", "cudnn", "torch_hip"} <= set(v)
    assert {"system", "release", "platform", "wsl"} <= set(v["os"])
    c = full_report["communication"]
    assert {"nccl", "gloo", "mpi", "ucc", "libuv_store", "default_backend"} <= set(c)
    assert c["gloo"] == torch.distributed.is_gloo_available()
    assert full_report["accelerators"]["cuda_available"] == torch.cuda.is_available()
    devices = full_report["accelerators"]["devices"]
    if torch.cuda.is_available():
        assert [d["index"] for d in devices] == list(range(torch.cuda.device_count()))
    elif not torch.backends.mps.is_available() and not torch.xpu.is_available():
        assert devices == []
    names = [op["name"] for op in full_report["ops"]]
    for wanted in ("fused AdamW (cuda)", "fused AdamW (cpu)", "fused Adam (cpu)", "fused SGD (cpu)",
                   "Triton", "pinned memory", "O_DIRECT file IO", "kvikio", "GPUDirect Storage",
                   "CPU SIMD AVX2", "CPU SIMD AVX-512", "CPU AMX (bf16 matmul)", "/dev/shm"):
        assert wanted in names
    assert sum(n.startswith("SDPA ") for n in names) == 3
    assert any(n.startswith("torch.compile") for n in names)
    for op in full_report["ops"]:
        assert set(op) == {"name", "available", "fallback", "detail"}
        assert isinstance(op["available"], bool) and op["fallback"]
    json.dumps(full_report)  # serialisable as is


def test_probes_agree_with_reality(tmp_path):
    assert report_checks.fused_optimizer_available("cpu", "adamw") is True  # torch >= 2.4 CPU
    assert report_checks.fused_optimizer_available("cpu", "lamb") is False
    assert report_checks.fused_optimizer_available("cuda", "adamw") == torch.cuda.is_available()
    assert report_checks.sdpa_backend_available("cpu", "math") is True
    assert report_checks.pinned_memory_available() == torch.cuda.is_available()
    result = report_checks.o_direct_available(str(tmp_path))
    assert isinstance(result, bool) and list(tmp_path.iterdir()) == []  # probe cleans up
    simd = report_checks.cpu_simd_level()
    assert simd["torch_capability"] == torch.backends.cpu.get_cpu_capability()


def _fake(full_report, **versions):
    fake = copy.deepcopy(full_report)
    fake["versions"].update(versions)
    return fake


def test_warnings(full_report, monkeypatch):
    monkeypatch.setattr(report, "shm_size", lambda: None)
    base = _fake(full_report, torch_cuda=None, driver_cuda=None, torch="2.6.0")
    base["accelerators"]["cuda_available"] = False
    assert warnings_for(base) == []

    no_driver = _fake(base, torch_cuda="12.4", driver=None)
    (msg,) = warnings_for(no_driver)
    assert "CUDA 12.4 build" in msg and "no NVIDIA driver found" in msg

    mismatch = _fake(base, torch_cuda="12.8", driver_cuda="12.2")
    mismatch["accelerators"]["cuda_available"] = True
    (msg,) = warnings_for(mismatch)
    assert "supports CUDA 12.2" in msg and "built for CUDA 12.8" in msg
    ok = _fake(base, torch_cuda="12.1", driver_cuda="12.4")
    ok["accelerators"]["cuda_available"] = True
    assert warnings_for(ok) == []

    assert "older than 2.4" in warnings_for(_fake(base, torch="2.1.2+cu118"))[0]

    monkeypatch.setattr(report, "shm_size", lambda: 64 * 2**20)
    (msg,) = warnings_for(base)
    assert "/dev/shm is only 64 MiB" in msg and "--shm-size" in msg


def test_text_format_hides_sections(full_report):
    text = format_report(full_report)
    assert "ops (capability" in text and "warnings" in text and "communication backends" in text
    short = format_report(full_report, hide_ops=True, hide_warnings=True)
    assert "ops (capability" not in short and "\nwarnings" not in short and "versions" in short


def test_cli_json_module_entry():
    out = subprocess.run([sys.executable, "-m", "shardwise.report", "--json",
                          "--hide_operator_status"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert "ops" not in data and {"versions", "accelerators", "communication", "warnings"} <= set(data)
    assert data["versions"]["torch"] == torch.__version__
