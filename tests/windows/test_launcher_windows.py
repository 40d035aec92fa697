"""The launcher with 2 workers on Windows: gloo, env://, and no libuv.

``python -m shardwise --num_gpus 2 worker.py ...`` starts two workers through torch's
elastic agent. Windows builds of torch have no libuv, and torch's env:// rendezvous asks for
it unless USE_LIBUV=0, so the launcher must set it for its workers: the test starts the
launcher with USE_LIBUV removed from the environment and checks what the workers got. The
seed article's flags are written after the script, as in its command line, and the worker
checks what ``apply_script_args`` made of them. One launch covers all of it (every worker
pays 6-10 s for ``import torch`` under Wine).
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.windows._helpers import ON_WINDOWS, child_env, free_port, run_python

pytestmark = pytest.mark.windows

WORKER = textwrap.dedent('''
    import argparse, json, os, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from shardwise.launcher.script_args import add_config_arguments, apply_script_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    add_config_arguments(parser)
    args = parser.parse_args()
    libuv_at_start = os.environ.get("USE_LIBUV")
    effects = apply_script_args(args)
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(rank * 10)]))
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                          "MASTER_ADDR", "MASTER_PORT")}
    Path(args.out, "rank%d.json" % rank).write_text(json.dumps({
        "rank": rank, "world": world, "backend": dist.get_backend(), "env": env,
        "local_rank_arg": args.local_rank, "use_libuv": libuv_at_start,
        "platform": sys.platform, "all_reduce": total.item(),
        "all_gather": [t.item() for t in gathered],
        "effects": {"dataloader_num_workers": effects.dataloader_num_workers,
                    "pin_memory": effects.pin_memory, "numa_binding": effects.numa_binding,
                    "allocator": effects.allocator,
                    "windows_optimization": effects.windows_optimization},
    }))
    dist.barrier()
    dist.destroy_process_group()
''')


def test_two_workers_gloo_env_rendezvous_without_libuv(tmp_path: Path) -> None:
    from shardwise.cli import main  # noqa: F401 - a rename must fail, not skip
    from shardwise.launcher.script_args import (  # noqa: F401 - a rename must fail
        add_config_arguments, apply_script_args)
    script = tmp_path / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    seed_flags = ["--windows_optimization", "true", "--disable_numa_awareness",
                  "--windows_memory_allocator", "pytorch", "--dataloader_num_workers", "2",
                  "--pin_memory"]
    proc = run_python(["-m", "shardwise", "--num_gpus", "2", "--master_port", str(port),
                       str(script), "--out", str(out), *seed_flags],
                      env=child_env(drop=("USE_LIBUV", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                          "MASTER_ADDR", "MASTER_PORT")),
                      timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], proc.stdout[-4000:]
    for r in results:
        assert r["world"] == 2 and r["backend"] == "gloo"
        assert r["all_reduce"] == 3.0  # 1 + 2
        assert r["all_gather"] == [0.0, 10.0]
        env = r["env"]
        assert env["RANK"] == str(r["rank"]) and env["WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] == str(r["rank"]) and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_PORT"] == str(port)
        assert r["local_rank_arg"] == r["rank"]  # --local_rank=N handed to the script
        if ON_WINDOWS:
            assert r["platform"] == "win32"
            # Set by the launcher: this test started it with USE_LIBUV unset.
            assert r["use_libuv"] == "0"
        effects = r["effects"]
        assert effects == {"dataloader_num_workers": 2, "pin_memory": True, "numa_binding": False,
                           "allocator": "pytorch", "windows_optimization": True}


def test_a_failing_worker_fails_the_launch(tmp_path: Path) -> None:
    from shardwise.cli import main  # noqa: F401 - a rename must fail, not skip
    script = tmp_path / "dies.py"
    # No torch import: this checks exit-code propagation on Windows, cheaply. Rank 0 leaves
    # a mark, so the test knows the workers really started (not a launcher error).
    script.write_text(
        "import os, sys\n"
        "from pathlib import Path\n"
        "rank = os.environ['RANK']\n"
        "Path(sys.argv[1], 'started' + rank).write_text(rank)\n"
        "sys.exit(3 if rank == '1' else 0)\n", encoding="utf-8")
    proc = run_python(["-m", "shardwise", "--num_gpus", "2", "--master_port", str(free_port()),
                       "--no_local_rank", str(script), str(tmp_path)],
                      env=child_env(drop=("USE_LIBUV",)), timeout=240, cwd=tmp_path)
    assert (tmp_path / "started1").exists(), proc.stdout[-3000:]
    assert proc.returncode == 3, proc.stdout[-3000:]  # the failing worker's own exit code
