"""A world of one starts without ``torch.distributed.HashStore`` (the Windows wheels lack it)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    del dist.HashStore  # as on Windows torch
    from shardwise import comm
    comm.init_distributed()
    t = torch.ones(3)
    dist.all_reduce(t)
    print("world", dist.get_world_size(), "sum", float(t.sum()))
""")


def test_world_of_one_starts_without_hash_store() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "world 1 sum 3.0" in proc.stdout
