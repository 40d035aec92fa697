"""The Windows job's Wine-gap scanner (scripts/windows/wine_gaps.py) on the messages Wine prints.

The message texts below are the forms Wine 8.0 and the programs under it print (the
OpenMP pair was captured from ``import torch`` without KMP_AFFINITY=disabled).
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.windows._helpers import REPO

pytestmark = pytest.mark.windows

SCANNER = REPO / "scripts" / "windows" / "wine_gaps.py"


def _scanner():
    spec = importlib.util.spec_from_file_location("wine_gaps", SCANNER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_gap_form_is_named_once() -> None:
    log = [
        "[W1202 16:40:17.000000000 socket.cpp:764] [c10d] The client socket has failed to connect"
        " to [::ffff:127.0.0.1]:38871 (system error: 10051 - unknown error).",  # noise, not a gap
        "wine: Unimplemented function KERNEL32.dll.GetNumaNodeProcessorMaskEx called at address "
        "00006FFFFFF8A2C4 (thread 0120), starting debugger...",
        "OMP: Error #179: Function GetNumaNodeProcessorMaskEx() failed:",
        "OMP: System error #120: Call not implemented.",
        "0024:err:module:import_dll Library bcryptprimitives.dll (which is needed by "
        "L\"Z:\\\\x\\\\_pydantic_core.pyd\") not found",
        "wine: Unimplemented function KERNEL32.dll.GetNumaNodeProcessorMaskEx called at address 0",
        "tests/windows/test_report_windows.py::test_x PASSED",
    ]
    assert _scanner().find_gaps(log) == [
        "KERNEL32.dll.GetNumaNodeProcessorMaskEx",
        "GetNumaNodeProcessorMaskEx (call not implemented)",
        "bcryptprimitives.dll (DLL missing)",
    ]


def test_clean_log_has_no_gap(tmp_path: Path) -> None:
    log = tmp_path / "pytest.log"
    log.write_text("collected 3 items\n3 passed in 1.0s\n", encoding="utf-8")
    out = subprocess.run([sys.executable, str(SCANNER), str(log)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == ""
    log.write_text("wine: Unimplemented function ucrtbase.dll.cacosh called at address 1\n",
                   encoding="utf-8")
    out = subprocess.run([sys.executable, str(SCANNER), str(log)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=60)
    assert out.stdout.strip() == "WINE GAP: ucrtbase.dll.cacosh"
