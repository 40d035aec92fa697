"""The exit handler of ``init_distributed`` on NCCL (issue 18, bug 5): a script that never calls
``destroy_process_group()`` exits 0 promptly, without torch's "process group has NOT been
destroyed" warning, and with its last async collectives still in flight."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.dist_utils import free_port

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WORKER = textwrap.dedent('''
    import os
    import torch
    import torch.distributed as dist
    from shardwise.comm import init_distributed

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_distributed("nccl")
    t = torch.ones(1000, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    assert t[0].item() == dist.get_world_size()
    print("WORK DONE", flush=True)
    for t in [torch.ones(1 << 20, device="cuda") for _ in range(8)]:
        dist.all_reduce(t, async_op=True)
''')


def test_nccl_workers_without_destroy_exit_cleanly(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    nproc = min(2, torch.cuda.device_count())
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-m", "shardwise", "--num_gpus", str(nproc),
                               "--master_port", str(free_port()), str(script)], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.count("WORK DONE") == nproc
        assert "NOT been destroyed" not in proc.stderr and "terminate called" not in proc.stderr
