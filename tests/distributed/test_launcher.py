"""The launcher end to end: real workers through torch.distributed.run's elastic agent (gloo)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from shardwise.launcher.worker import cores_for_rank
from tests.dist_utils import free_port

# Tiny on purpose: every worker pays for `import torch` on a 2-core machine.
WORKER = r'''
import argparse, json, os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--mode", default="ok")
if os.environ.get("WORKER_USES_SHARDWISE_ARGS") == "1":
    from shardwise.launcher.script_args import add_config_arguments, apply_script_args
    add_config_arguments(parser)
else:
    parser.add_argument("--local_rank", type=int, default=None)
args = parser.parse_args()
out = Path(args.out)
rank = int(os.environ["RANK"])
(out / f"pid{rank}").write_text(str(os.getpid()))
dist.init_process_group("gloo")
if args.mode == "fail":
    if rank == 1:
        time.sleep(0.5)
        sys.exit(3)
    time.sleep(120)  # the agent must stop this one
if args.mode == "hang":
    (out / f"ready{rank}").write_text("1")
    time.sleep(120)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
          "argv": sys.argv[1:], "local_rank_arg": args.local_rank,
          "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                  "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "USE_LIBUV",
                  "SHARDWISE_PIN_MEMORY", "SHARDWISE_DATALOADER_NUM_WORKERS", "SW_FROM_ENV_FILE",
                  "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS")},
          "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
if os.environ.get("WORKER_USES_SHARDWISE_ARGS") == "1":
    e = apply_script_args(args)
    result["effects"] = {"config_path": e.config_path, "workers": e.dataloader_num_workers,
                         "pin": e.pin_memory, "numa": e.numa_binding, "allocator": e.allocator,
                         "windows": e.windows_optimization}
    result["env"]["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    result["env"]["USE_LIBUV"] = os.environ.get("USE_LIBUV")
print(f"hello from rank {rank}", flush=True)
(out / f"rank{rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
'''


@pytest.fixture
def job(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    return tmp_path, out


def _launch(cwd, argv, extra_env=None, timeout=180):
    env = dict(os.environ, **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "shardwise", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _results(out, world):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _survivors(out):
    alive = []
    for pid_file in out.glob("pid*"):
        pid = int(pid_file.read_text())
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_two_workers_seed_command_line(job):
    """The seed's line: seed flags after the script reach it and mean something there."""
    cwd, out = job
    port = free_port()
    proc = _launch(cwd, ["--num_procs", "2", "--master_port", str(port), "--dataloader_num_workers",
                         "3", "--pin_memory", "--bind_cores_to_rank", "worker.py", "--out", str(out),
                         "--deepspeed", "--deepspeed_config", "ds_config.json", "--local_rank", "0",
                         "--windows_optimization", "true", "--disable_numa_awareness",
                         "--windows_memory_allocator", "pytorch"],
                   {"WORKER_USES_SHARDWISE_ARGS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _results(out, 2)
    for r, res in enumerate(results):
        env = res["env"]
        assert (res["rank"], res["world"], res["sum"]) == (r, 2, 3.0)
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == \
            (str(r), str(r), "2", "2")
        assert env["MASTER_ADDR"] and env["MASTER_PORT"] == str(port)
        # The seed's '--local_rank 0' is overridden by the launcher's value, placed last.
        assert res["local_rank_arg"] == r and res["argv"][-1] == f"--local_rank={r}"
        assert res["effects"] == {"config_path": "ds_config.json", "workers": 3, "pin": True,
                                  "numa": False, "allocator": "pytorch", "windows": True}
        assert env["SHARDWISE_PIN_MEMORY"] == "1" and env["USE_LIBUV"] == "0"
        assert env["PYTORCH_CUDA_ALLOC_CONF"].startswith("backend:native")
        if res["affinity"] is not None:
            mine = cores_for_rank(sorted(os.sched_getaffinity(0)), r, 2)
            assert res["affinity"] == mine and env["OMP_NUM_THREADS"] == str(len(mine))


def test_four_workers_no_local_rank_and_rank_logs(job):
    cwd, out = job
    logs = cwd / "logs"
    # --windows_optimization: USE_LIBUV=0, so agent and workers run the Windows store path.
    proc = _launch(cwd, ["--num_gpus", "4", "--no_local_rank", "--master_port", str(free_port()),
                         "--windows_optimization", "--enable_each_rank_log", str(logs),
                         "worker.py", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _results(out, 4)
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    for res in results:
        assert res["world"] == 4 and res["sum"] == 10.0 and res["local_rank_arg"] is None
        assert not any(a.startswith("--local_rank") for a in res["argv"])
        assert res["env"]["LOCAL_WORLD_SIZE"] == "4" and res["env"]["USE_LIBUV"] == "0"
    texts = [p.read_text() for p in logs.rglob("stdout.log")]
    assert sorted(t.strip() for t in texts) == [f"hello from rank {r}" for r in range(4)]
    assert "hello from rank" not in proc.stdout  # redirected, not on the console


def test_dying_worker_stops_everyone(job):
    cwd, out = job
    start = time.monotonic()
    proc = _launch(cwd, ["--num_procs", "2", "--master_port", str(free_port()), "worker.py",
                         "--out", str(out), "--mode", "fail"])
    elapsed = time.monotonic() - start
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "rank 1" in proc.stderr and "exit code 3" in proc.stderr
    assert elapsed < 60  # rank 0 sleeps 120 s: it was stopped, not waited for
    assert len(list(out.glob("pid*"))) == 2 and _survivors(out) == []


@pytest.mark.skipif(sys.platform.startswith("win"), reason="SIGINT to a child is POSIX-only")
def test_ctrl_c_stops_everyone(job):
    cwd, out = job
    launcher = subprocess.Popen([sys.executable, "-m", "shardwise", "--num_procs", "2",
                                 "--master_port", str(free_port()), "worker.py", "--out", str(out),
                                 "--mode", "hang"], cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while len(list(out.glob("ready*"))) < 2:
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "workers never became ready"
            time.sleep(0.2)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, err[-3000:]
    assert _survivors(out) == []


def test_two_nodes_on_loopback(job):
    """Multi-node path: a hostfile, one agent per node (--launcher local), c10d rendezvous."""
    cwd, out = job
    (cwd / "hosts").write_text("node-a slots=2\nnode-b slots=2\n")
    (cwd / ".shardwise_env").write_text("SW_FROM_ENV_FILE=forwarded\n")
    proc = _launch(cwd, ["-H", "hosts", "--launcher", "local", "--master_port", str(free_port()),
                         "worker.py", "--out", str(out)], {"HOME": str(cwd)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _results(out, 4)
    assert all(r["world"] == 4 and r["sum"] == 10.0 for r in results)
    placement = sorted((r["env"]["GROUP_RANK"], r["env"]["LOCAL_RANK"]) for r in results)
    assert placement == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert all(r["env"]["SW_FROM_ENV_FILE"] == "forwarded" for r in results)
    assert all(r["local_rank_arg"] == int(r["env"]["LOCAL_RANK"]) for r in results)


def test_default_port_taken_launch_uses_the_free_port_it_prints(job):
    """No --master_port and the default taken (another job): the run goes on a free port it
    names, and the workers rendezvous there (the default is patched to a port this test holds,
    so no real job on 29500 is disturbed)."""
    cwd, out = job
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        code = ("import sys, shardwise.launcher.launch as launch; "
                f"launch.DEFAULT_MASTER_PORT = {taken}; "
                f"sys.exit(launch.main(['--num_procs', '1', 'worker.py', '--out', {str(out)!r}]))")
        proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                              text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    port = _results(out, 1)[0]["env"]["MASTER_PORT"]
    assert port != str(taken)
    assert f"master port {taken} is in use on this machine; using free port {port}" in proc.stderr
    assert "local rank 0: " in proc.stderr and "--local_rank=0" in proc.stderr
