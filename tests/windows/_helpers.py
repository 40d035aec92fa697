"""Helpers of the Windows subset: free ports, child Pythons, spawned ranks, Wine gaps.

The Windows tests run under a real Windows CPython (scripts/windows-ci.sh) and on Linux.
They import what they test plainly: a missing module or attribute fails the test.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import pytest

ON_WINDOWS = sys.platform == "win32"
REPO = Path(__file__).resolve().parents[2]


def _under_wine() -> bool:
    if not ON_WINDOWS:
        return False
    try:
        import ctypes
        return hasattr(ctypes.windll.ntdll, "wine_get_version")
    except (ImportError, OSError, AttributeError):
        return False


#: True when this Windows Python runs under Wine (the CI job), False on real Windows and POSIX.
UNDER_WINE = _under_wine()


def wine_gap(name: str) -> pytest.MarkDecorator:
    """Skip a test under Wine only, naming the gap (``"KERNEL32.dll.GetNumaNodeProcessorMaskEx"``).

    Use it when the job's summary printed ``WINE GAP: <name>`` for a code path that is
    correct on real Windows; the skip reason keeps the gap visible in every run.
    """
    return pytest.mark.skipif(UNDER_WINE, reason=f"Wine gap: {name} (works on real Windows)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(drop: Sequence[str] = (), **extra: str) -> Dict[str, str]:
    """This process's environment without ``drop`` and with ``extra``; the checkout importable.

    PYTHONPATH is ignored by the embeddable Windows Python (its ._pth file rules, and a .pth
    file makes the checkout importable there) but is what a Linux child needs.
    """
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env


def run_python(args: Sequence[str], env: Optional[Mapping[str, str]] = None, timeout: float = 180,
               cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Run ``python args...`` with pipes for its output (never a file: Wine cannot redirect there)."""
    return subprocess.run([sys.executable, *args], env=dict(env) if env is not None else child_env(),
                          cwd=str(cwd or REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, text=True, timeout=timeout)


def _bare_worker(rank: int, fn: Callable, world_size: int, port: int, out_dir: str,
                 args: tuple, env: Dict[str, str]) -> None:
    import torch
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), **env})
    torch.set_num_threads(1)
    result = fn(rank, world_size, *args)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def spawn_ranks(fn: Callable, world_size: int, *args: Any, drop_env: Sequence[str] = ("USE_LIBUV",),
                env: Optional[Dict[str, str]] = None) -> List[Any]:
    """Run module-level ``fn(rank, world_size, *args)`` in spawned processes that have the
    launcher's env:// variables but NO process group yet: the library must create it itself
    (choosing the backend, and on Windows a TCPStore without libuv).
    """
    import torch
    import torch.multiprocessing as mp
    saved = {name: os.environ.pop(name) for name in drop_env if name in os.environ}
    try:  # spawned children copy this process's environment when they start
        with tempfile.TemporaryDirectory() as out_dir:
            mp.start_processes(_bare_worker, args=(fn, world_size, free_port(), out_dir, args, env or {}),
                               nprocs=world_size, join=True, start_method="spawn")
            return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
                    for r in range(world_size)]
    finally:
        os.environ.update(saved)
