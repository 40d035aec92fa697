"""Run one child process under a host-memory cap: a cgroup v2 group where the kernel offers
one, else a watchdog.

- **cgroup v2** (``cap: cgroup``): when ``/sys/fs/cgroup`` is a cgroup v2 mount whose
  ``cgroup.controllers`` lists ``memory`` and this process may create a group there (root, as
  on the GPU machine's VM), each child gets its own group ``/sys/fs/cgroup/<name>`` with
  ``memory.max`` = the cap (and ``memory.swap.max`` = 0): the kernel reclaims and finally
  OOM-kills the child inside the group, exactly at the cap; ``memory.peak`` (or the sampled
  ``memory.current``) is its peak, page cache and page-locked memory included.
- **watchdog** (``cap: watchdog``): ``RLIMIT_AS`` cannot be used with CUDA (the driver maps
  huge virtual ranges), so the parent samples the child's resident set (its process tree;
  page-locked host memory is resident and counted) every 50 ms and kills it above the cap.
  Spikes shorter than a sample can slip through: the cgroup is the precise cap.
"""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_v2_memory(root: Path = CGROUP_ROOT) -> Optional[str]:
    """None when a memory-capped child group can be made under ``root``, else why not."""
    controllers = root / "cgroup.controllers"
    if not controllers.exists():
        return f"{root} is not a cgroup v2 mount (no cgroup.controllers)"
    if "memory" not in controllers.read_text().split():
        return f"the memory controller is not available in {controllers}"
    subtree = root / "cgroup.subtree_control"
    try:
        if "memory" not in subtree.read_text().split():
            subtree.write_text("+memory")
        probe = root / f"shardwise_memcap_probe_{os.getpid()}"
        probe.mkdir(exist_ok=True)
        ok = (probe / "memory.max").exists()
        probe.rmdir()
    except OSError as exc:
        return f"cannot create a memory-capped group under {root} ({exc.strerror or exc})"
    return None if ok else f"child groups under {root} have no memory.max"


@dataclass
class CappedRun:
    """How a capped child ended."""

    status: str
    """'ok', 'failed', 'oom' (killed at the cap) or 'timeout'."""
    wall_s: float
    peak_bytes: int
    """Peak host memory of the child as the cap measured it."""
    returncode: Optional[int]


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc] + proc.children(recursive=True):
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _kill_tree(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for p in parent.children(recursive=True) + [parent]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


class MemoryCap:
    """Runs children under ``limit_bytes``; ``kind`` is "cgroup" or "watchdog"."""

    def __init__(self, limit_bytes: int, prefer_cgroup: bool = True,
                 root: Path = CGROUP_ROOT) -> None:
        self.limit = int(limit_bytes)
        self.root = root
        self.why_not_cgroup = cgroup_v2_memory(root) if prefer_cgroup else "disabled (--no-cgroup)"
        self.kind = "cgroup" if self.why_not_cgroup is None else "watchdog"
        self._count = 0

    def _make_group(self) -> Path:
        self._count += 1
        group = self.root / f"shardwise_nvme_bench_{os.getpid()}_{self._count}"
        group.mkdir()
        (group / "memory.max").write_text(str(self.limit))
        swap = group / "memory.swap.max"
        if swap.exists():
            swap.write_text("0")
        return group

    @staticmethod
    def _read_int(path: Path, key: Optional[str] = None) -> int:
        try:
            text = path.read_text()
        except OSError:
            return 0
        if key is None:
            return int(text.split()[0]) if text.strip() else 0
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
        return 0

    def run(self, argv: List[str], log_path: Path, timeout_s: float,
            env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None) -> CappedRun:
        """Run ``argv`` (output to ``log_path``) under the cap and a timeout."""
        group = None
        if self.kind == "cgroup":
            try:
                group = self._make_group()
            except OSError as exc:  # the probe passed but this group cannot be made: watch instead
                self.kind, self.why_not_cgroup = "watchdog", f"cgroup setup failed ({exc})"
        start = time.perf_counter()
        peak, status = 0, None
        with log_path.open("w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
            try:
                if group is not None:  # before the child has imported anything large
                    try:
                        (group / "cgroup.procs").write_text(str(proc.pid))
                    except OSError as exc:
                        self.kind, self.why_not_cgroup = "watchdog", f"cgroup.procs: {exc}"
                        group.rmdir()
                        group = None
                ps = psutil.Process(proc.pid)
                while status is None:
                    try:
                        proc.wait(timeout=0.05)
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    used = (self._read_int(group / "memory.current") if group is not None
                            else tree_rss(ps))
                    peak = max(peak, used)
                    if group is None and used > self.limit:
                        status = "oom"
                    elif time.perf_counter() - start > timeout_s:
                        status = "timeout"
            except psutil.NoSuchProcess:
                pass
            finally:
                if status is not None or proc.poll() is None:
                    _kill_tree(proc.pid)
                proc.wait()
        if group is not None:
            peak = max(peak, self._read_int(group / "memory.peak"))
            if self._read_int(group / "memory.events", "oom_kill") > 0:
                status = "oom"
            try:
                group.rmdir()
            except OSError:
                pass
        if status is None:
            status = "ok" if proc.returncode == 0 else "failed"
        return CappedRun(status, time.perf_counter() - start, peak, proc.returncode)
