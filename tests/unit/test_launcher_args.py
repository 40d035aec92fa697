"""Launcher flags, worker commands, env forwarding, runners and the script-side flags."""
import argparse
import os
import socket

import pytest

from shardwise import cli
from shardwise.errors import ConfigError, LaunchError
from shardwise.launcher import env, launch, multi_node, worker
from shardwise.launcher.cli_args import parse_launch_args, split_argv
from shardwise.launcher.script_args import add_config_arguments, apply_script_args
from shardwise.launcher.single_node import NodePlan

SEED_SCRIPT_ARGS = ["--deepspeed", "--deepspeed_config", "ds_config.json", "--local_rank", "0",
                    "--num_gpus", "1", "--windows_optimization", "true",
                    "--disable_numa_awareness", "--windows_memory_allocator", "pytorch",
                    "--dataloader_num_workers", "2", "--pin_memory"]


@pytest.mark.parametrize("argv, launcher, script, rest", [
    (["--num_gpus", "2", "train.py", "--deepspeed"], ["--num_gpus", "2"], "train.py",
     ["--deepspeed"]),
    (["train.py", *SEED_SCRIPT_ARGS], [], "train.py", SEED_SCRIPT_ARGS),
    # An optional-value flag must not swallow the script name ...
    (["--windows_optimization", "train.py", "-x"], ["--windows_optimization"], "train.py", ["-x"]),
    # ... but takes a boolean right after it.
    (["--windows_optimization", "false", "t.py"], ["--windows_optimization", "false"], "t.py", []),
    (["-H", "hosts", "-i", "a@b:0", "--pin_memory", "t.py", "--num_gpus", "9"],
     ["-H", "hosts", "-i", "a@b:0", "--pin_memory"], "t.py", ["--num_gpus", "9"]),
    (["--master_port=1234", "--", "t.py", "--x"], ["--master_port=1234"], "t.py", ["--x"]),
])
def test_split_argv(argv, launcher, script, rest):
    assert split_argv(argv) == (launcher, script, rest)


def test_parse_launch_args_values():
    args = parse_launch_args(["--num_procs", "3", "--windows_optimization", "--dataloader_num_workers",
                              "4", "--launcher", "local", "m", "--a"])
    o = args.options
    assert (o.num_gpus, o.windows_optimization, o.dataloader_num_workers, o.launcher) == \
        (3, True, 4, "local")
    assert parse_launch_args(["--num_accelerators", "2", "t.py"]).options.num_gpus == 2
    assert parse_launch_args(["--windows_optimization", "off", "t.py"]).options \
        .windows_optimization is False


@pytest.mark.parametrize("argv, fragment", [
    (["--bogus", "t.py"], "unknown launcher flag"),
    (["--num_gpus", "2"], "no training script"),
    ([], "no training script"),
    (["--module", "--no_python", "t.py"], "contradict"),
    (["--launcher", "telnet", "t.py"], "invalid choice"),
    (["--num_gpus", "two", "t.py"], "invalid int"),
])
def test_parse_errors_are_one_line(argv, fragment):
    with pytest.raises(LaunchError, match=fragment) as info:
        parse_launch_args(argv)
    assert "\n" not in str(info.value)


def test_worker_command_local_rank_placement():
    cmd = launch.worker_command(parse_launch_args(["t.py", "--x", "1"]))
    assert cmd == ["-u", "t.py", "--local_rank=${local_rank}", "--x", "1"]
    # The seed's own '--local_rank 0' comes first, ours last (argparse keeps the last).
    cmd = launch.worker_command(parse_launch_args(["t.py", "--local_rank", "0"]))
    assert cmd[-1] == "--local_rank=${local_rank}" and cmd[2:4] == ["--local_rank", "0"]
    assert launch.worker_command(parse_launch_args(["--no_local_rank", "t.py", "-a"])) == \
        ["-u", "t.py", "-a"]
    assert launch.worker_command(parse_launch_args(["--module", "pkg.train"]))[:3] == \
        ["-u", "-m", "pkg.train"]
    assert launch.worker_command(parse_launch_args(["--no_python", "--no_local_rank", "./run.sh"])) \
        == ["./run.sh"]


def test_local_resources(monkeypatch):
    monkeypatch.setattr(launch, "local_device_count", lambda: 0)
    assert launch.local_resources(-1, []) == {"localhost": [0]}
    assert launch.local_resources(3, []) == {"localhost": [0, 1, 2]}
    # The seed's line: '--num_gpus 2' after the script counts when none came before it.
    assert launch.local_resources(-1, ["--num_gpus", "2"]) == {"localhost": [0, 1]}
    monkeypatch.setattr(launch, "local_device_count", lambda: 2)
    assert launch.local_resources(-1, []) == {"localhost": [0, 1]}
    with pytest.raises(LaunchError, match="more than the 2 accelerator"):
        launch.local_resources(4, [])


def test_resources_from_hostfile_and_filters(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "local_device_count", lambda: 0)
    (tmp_path / "hosts").write_text("worker-0 slots=4\nworker-1 slots=4\nworker-2 slots=2\n")
    resolve = lambda *a: launch.resolve_resources(parse_launch_args([*a, "t.py"]))[0]
    hosts = str(tmp_path / "hosts")
    assert resolve("-H", hosts, "--num_nodes", "2", "--num_gpus", "1") == \
        {"worker-0": [0], "worker-1": [0]}
    assert resolve("-H", hosts, "-e", "worker-0@worker-1:1,3") == \
        {"worker-1": [0, 2], "worker-2": [0, 1]}
    assert resolve("--num_procs", "2", "-i", "localhost:1") == {"localhost": [1]}
    plan = launch.build_plan(parse_launch_args(["--num_procs", "2", "-i", "localhost:1", "t.py"]),
                             {"localhost": [1]}, "127.0.0.1", multi=False)
    assert plan.set_visible_devices and plan.rdzv_endpoint == "127.0.0.1:29500"


def _cli_error(capsys, argv):
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def test_bad_input_gives_one_line_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("print('never runs')\n")
    (tmp_path / "bad_hosts").write_text("worker-0 slots=2\nworker-1 two\n")
    (tmp_path / "hosts").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    cases = [
        (["missing.py"], "not found"),
        (["--frobnicate", "t.py"], "unknown launcher flag"),
        (["-H", "bad_hosts", "t.py"], "line 2"),
        (["-H", "nowhere", "t.py"], "does not exist"),
        (["-H", "hosts", "-i", "worker-7", "t.py"], "not in the hostfile"),
        (["-H", "hosts", "-e", "worker-0:5", "t.py"], "slot(s) [5]"),
        (["--master_port", "70000", "t.py"], "not a TCP port"),
        (["--master_addr", "203.0.113.9", "t.py"], "must be an address of this machine"),
        (["--num_nodes", "2", "t.py"], "needs a hostfile"),
    ]
    for argv, fragment in cases:
        code, err = _cli_error(capsys, argv)
        assert code == 2, argv
        assert fragment in err and err.count("\n") == 0 and err.startswith("shardwise: error:"), err
    monkeypatch.setattr(launch, "local_device_count", lambda: 1)
    code, err = _cli_error(capsys, ["--num_gpus", "2", "t.py"])
    assert code == 2 and "more than the 1 accelerator" in err


def test_busy_master_port(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("raise SystemExit(5)\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, err = _cli_error(capsys, ["--master_port", str(port), "t.py"])
    assert code == 2 and f"master port {port}" in err and "--master_port" in err


def test_cli_dispatch(monkeypatch, capsys):
    assert cli.main(["--version"]) == 0
    assert "shardwise" in capsys.readouterr().out
    assert cli.main(["run", "missing.py"]) == 2  # 'run' is the launcher too
    assert "'missing.py' not found" in capsys.readouterr().err
    monkeypatch.setitem(cli.SUBCOMMANDS, "convert", ("shardwise.checkpoint.no_such_module", "main"))
    assert cli.main(["convert", "x"]) == 2
    err = capsys.readouterr().err
    assert "'shardwise convert' is not available" in err and err.count("\n") == 1


def test_env_file_parsing_and_priority(tmp_path, monkeypatch):
    monkeypatch.delenv("SHARDWISE_ENV_FILE", raising=False)
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (work / ".deepspeed_env").write_text("# c\nexport B=\"work ds\"\nC=ds\n")
    (work / ".shardwise_env").write_text("C=sw\n")
    paths = env.env_file_paths(cwd=work, home=home)
    assert env.load_env_files(paths) == {"A": "home", "B": "work ds", "C": "sw"}
    with pytest.raises(LaunchError, match="line 2"):
        env.parse_env_file("OK=1\nnot a pair\n", "f")
    with pytest.raises(LaunchError, match="NAME=VALUE"):
        env.parse_env_file("1BAD=x\n", "f")
    monkeypatch.setenv("SHARDWISE_ENV_FILE", str(tmp_path / "absent"))
    with pytest.raises(LaunchError, match="does not exist"):
        env.env_file_paths(cwd=work, home=home)


def test_forwarded_env_and_seed_flags():
    fwd = env.forwarded_env({"PYTHONPATH": "/x", "NCCL_DEBUG": "INFO", "UCX_TLS": "tcp",
                             "HOME": "/root", "SECRET": "no", "PATH": "/bin"})
    assert fwd == {"PYTHONPATH": "/x", "NCCL_DEBUG": "INFO", "UCX_TLS": "tcp"}
    o = parse_launch_args(["--windows_optimization", "--dataloader_num_workers", "3",
                           "--pin_memory", "--windows_memory_allocator", "pytorch", "t.py"]).options
    assert env.seed_flags_env(o) == {
        "SHARDWISE_DATALOADER_NUM_WORKERS": "3", "SHARDWISE_PIN_MEMORY": "1",
        "SHARDWISE_NUMA_BINDING": "0", "SHARDWISE_MEMORY_ALLOCATOR": "pytorch",
        "SHARDWISE_WINDOWS_OPTIMIZATION": "1", "USE_LIBUV": "0"}
    assert env.seed_flags_env(parse_launch_args(["t.py"]).options) == {}
    assert env.platform_worker_env("win32") == {"USE_LIBUV": "0"}
    assert env.platform_worker_env("linux") == {}
    assert env.shell_exports({"B": "x y", "A": "1"}) == "export A=1; export B='x y'; "


def _plan(hosts):
    return NodePlan(hosts=hosts, command=["-u", "t.py", "--local_rank=${local_rank}"],
                    rdzv_endpoint="worker-0:29500", run_id="job1", env={"SHARDWISE_PIN_MEMORY": "1"})


def test_runner_commands():
    plan = _plan([["worker-0", [0, 1]], ["worker-1", [0]]])
    exports = {"PYTHONPATH": "/src", "NCCL_DEBUG": "INFO"}
    ssh = multi_node.build_commands("ssh", plan, exports, "-o StrictHostKeyChecking=no", 2222,
                                    cwd="/job dir", python="/py/bin/python")
    assert len(ssh) == 2
    argv = ssh[1].argv
    assert argv[:6] == ["ssh", "-p", "2222", "-o", "StrictHostKeyChecking=no", "worker-1"]
    remote = argv[6]
    assert remote.startswith("cd '/job dir' && export NCCL_DEBUG=INFO; export PYTHONPATH=/src; ")
    assert remote.endswith("--node_rank 1") and "/py/bin/python -u -m shardwise.launcher.single_node" in remote
    encoded = remote.split("--plan ")[1].split()[0]
    assert NodePlan.decode(encoded) == plan

    (pdsh,) = multi_node.build_commands("pdsh", plan, exports, cwd="/w", python="python")
    assert pdsh.argv[:6] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1"]
    assert pdsh.argv[-1].endswith("--node_rank %n") and pdsh.env["PDSH_RCMD_TYPE"] == "ssh"

    (srun,) = multi_node.build_commands("slurm", plan, exports, cwd="/w", python="python")
    assert srun.argv[:9] == ["srun", "-N", "2", "-n", "2", "--ntasks-per-node", "1", "-w",
                             "worker-0,worker-1"]
    assert "--export=ALL,NCCL_DEBUG=INFO,PYTHONPATH=/src" in srun.argv
    assert srun.argv[-2:] == ["--node_rank_env", "SLURM_PROCID"]

    (mpi,) = multi_node.build_commands("openmpi", plan, exports, cwd="/w", python="python")
    assert mpi.argv[:5] == ["mpirun", "-n", "2", "-H", "worker-0:1,worker-1:1"]
    assert ["-x", "PYTHONPATH=/src"] == mpi.argv[mpi.argv.index("PYTHONPATH=/src") - 1:][:2]
    assert mpi.argv[-1] == "OMPI_COMM_WORLD_RANK"

    local = multi_node.build_commands("local", plan, exports, cwd="/w", python="python")
    assert [c.argv[-1] for c in local] == ["0", "1"] and local[0].env["NCCL_DEBUG"] == "INFO"


def test_missing_runner_program(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no pdsh anywhere
    (tmp_path / "t.py").write_text("")
    (tmp_path / "hosts").write_text("a slots=1\nb slots=1\n")
    code, err = _cli_error(capsys, ["-H", "hosts", "--launcher", "pdsh", "t.py"])
    assert code == 2 and "needs 'pdsh' on PATH" in err


def test_agent_store_obeys_use_libuv(monkeypatch):
    """torch's rendezvous stores ignore USE_LIBUV; Windows torch has no libuv at all."""
    import torch.distributed
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous
    from shardwise.launcher.torch_compat import respect_use_libuv
    from shardwise.report_checks import libuv_store_available
    respect_use_libuv()
    respect_use_libuv()  # idempotent: wrapped once
    assert not hasattr(static_tcp_rendezvous.TCPStore.__wrapped__, "__wrapped__")
    monkeypatch.setenv("USE_LIBUV", "0")
    store = static_tcp_rendezvous.TCPStore("127.0.0.1", 0, 1, True)
    assert store.libuvBackend is False
    import importlib
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    worker.patch_worker_store()
    client_side = rendezvous.TCPStore("127.0.0.1", 0, 1, True)  # what env:// workers create
    assert client_side.libuvBackend is False
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    shared = DynamicRendezvousHandler._create_tcp_store_server(None, "127.0.0.1", 0)  # c10d agent
    assert shared.libuvBackend is False
    assert not hasattr(torch.distributed.TCPStore, "__wrapped__")  # the global name is untouched
    monkeypatch.delenv("USE_LIBUV")
    if libuv_store_available():
        assert static_tcp_rendezvous.TCPStore("127.0.0.1", 0, 1, True).libuvBackend is True


@pytest.mark.parametrize("cores, world, expected", [
    (list(range(8)), 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (list(range(5)), 2, [[0, 1, 2], [3, 4]]),
    ([0, 1], 4, [[0], [1], [0], [1]]),
])
def test_cores_for_rank(cores, world, expected):
    assert [worker.cores_for_rank(cores, r, world) for r in range(world)] == expected


# --- the script side -----------------------------------------------------------------------

def test_add_config_arguments_parses_the_seed_line(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-7)  # the script's own: kept
    parser.add_argument("--epochs", type=int, default=1)
    add_config_arguments(parser)
    args = parser.parse_args(SEED_SCRIPT_ARGS + ["--epochs", "2"])
    assert (args.deepspeed, args.deepspeed_config, args.local_rank, args.num_gpus) == \
        (True, "ds_config.json", 0, 1)
    assert (args.windows_optimization, args.disable_numa_awareness, args.windows_memory_allocator,
            args.dataloader_num_workers, args.pin_memory, args.epochs) == \
        (True, True, "pytorch", 2, True, 2)
    assert parser.parse_args([]).local_rank == -7
    fresh = add_config_arguments(argparse.ArgumentParser())
    assert fresh.parse_args([]).local_rank == 3  # default from LOCAL_RANK
    assert fresh.parse_args(["--windows_optimization"]).windows_optimization is True
    with pytest.raises(SystemExit):
        fresh.parse_args(["--windows_optimization", "maybe"])


def test_apply_script_args(monkeypatch):
    for name in ("SHARDWISE_DATALOADER_NUM_WORKERS", "SHARDWISE_PIN_MEMORY", "SHARDWISE_NUMA_BINDING",
                 "SHARDWISE_MEMORY_ALLOCATOR", "SHARDWISE_WINDOWS_OPTIMIZATION",
                 "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "USE_LIBUV"):
        monkeypatch.delenv(name, raising=False)
    parser = add_config_arguments(argparse.ArgumentParser())
    plain = apply_script_args(parser.parse_args([]))
    assert (plain.config_path, plain.dataloader_num_workers, plain.pin_memory, plain.numa_binding,
            plain.allocator) == (None, None, None, True, None)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ

    effects = apply_script_args(parser.parse_args(SEED_SCRIPT_ARGS + ["--shardwise_config", "s.json"]))
    assert effects.config_path == "s.json"
    assert (effects.dataloader_num_workers, effects.pin_memory, effects.numa_binding,
            effects.allocator, effects.windows_optimization) == (2, True, False, "pytorch", True)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"].startswith("backend:native")
    assert os.environ["USE_LIBUV"] == "0"
    assert any("num_workers=2" in n for n in effects.notes) and all("\n" not in n for n in effects.notes)

    # Launcher-provided env is the default; explicit flags win over it.
    monkeypatch.setenv("SHARDWISE_DATALOADER_NUM_WORKERS", "5")
    monkeypatch.setenv("SHARDWISE_PIN_MEMORY", "1")
    monkeypatch.setenv("SHARDWISE_NUMA_BINDING", "0")
    from_env = apply_script_args(parser.parse_args(["--deepspeed_config", "d.json"]))
    assert (from_env.config_path, from_env.dataloader_num_workers, from_env.pin_memory,
            from_env.numa_binding) == ("d.json", 5, True, False)
    assert apply_script_args(parser.parse_args(["--dataloader_num_workers", "1"])) \
        .dataloader_num_workers == 1
    # Attributes may be missing entirely (a script without add_config_arguments).
    assert apply_script_args(argparse.Namespace()).dataloader_num_workers == 5
    monkeypatch.setenv("SHARDWISE_PIN_MEMORY", "perhaps")
    with pytest.raises(ConfigError, match="SHARDWISE_PIN_MEMORY"):
        apply_script_args(argparse.Namespace())
    with pytest.raises(ConfigError, match="must be >= 0"):
        apply_script_args(argparse.Namespace(dataloader_num_workers=-1, pin_memory=True))


def test_user_alloc_conf_is_kept(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    effects = apply_script_args(argparse.Namespace(windows_memory_allocator="pytorch"))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
    assert any("already set" in n for n in effects.notes)


def test_help_mentions_seed_flags(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--windows_optimization", "--disable_numa_awareness", "--windows_memory_allocator",
                 "--dataloader_num_workers", "--pin_memory", "SHARDWISE_PIN_MEMORY", "shardwise report"):
        assert flag in out


# --- issue 18: launcher usability --------------------------------------------------------------

@pytest.mark.windows
def test_mistyped_flag_gets_did_you_mean(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("print('never runs')\n")
    cases = [
        (["--num_gpu", "2", "t.py"], "unknown launcher flag(s) --num_gpu: did you mean --num_gpus?"),
        (["--num_gpu=2", "t.py"], "did you mean --num_gpus?"),
        (["--master-port", "1234", "t.py"], "did you mean --master_port?"),
        (["--num_node=2", "--pin-memory", "t.py"],
         "did you mean --num_nodes for --num_node, --pin_memory for --pin-memory?"),
        (["--local_rank", "0", "t.py"], "--local_rank belong(s) to the training script"),
        (["--frobnicate", "t.py"], "launcher flags go before the script"),
    ]
    for argv, fragment in cases:
        code, err = _cli_error(capsys, argv)
        assert code == 2 and fragment in err and err.count("\n") == 0, (argv, err)
    assert "did you mean" not in _cli_error(capsys, ["--frobnicate", "t.py"])[1]


@pytest.mark.windows
def test_default_master_port_taken_picks_a_free_one(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        monkeypatch.setattr(launch, "DEFAULT_MASTER_PORT", taken)
        messages = []
        monkeypatch.setattr(launch.logger, "warning", messages.append)
        port = launch.choose_master_port(None, "127.0.0.1")
        assert port != taken and 1 <= port <= 65535
        assert launch.port_bind_error("127.0.0.1", port) is None
        assert messages and f"using free port {port}" in messages[0] and str(taken) in messages[0]
        # An explicit --master_port is never changed (a busy one is an error later).
        assert launch.choose_master_port(taken, "127.0.0.1") == taken
    monkeypatch.setattr(launch, "DEFAULT_MASTER_PORT", port)
    assert launch.choose_master_port(None, "127.0.0.1") == port  # free: the default is kept


@pytest.mark.windows
def test_launch_log_shows_each_workers_real_local_rank():
    from shardwise.launcher.single_node import worker_command_lines
    args = parse_launch_args(["--num_procs", "2", "t.py", "--local_rank", "0", "--x"])
    plan = launch.build_plan(args, {"localhost": [0, 1]}, "127.0.0.1", multi=False)
    lines = worker_command_lines(plan, 2)
    assert len(lines) == 2
    for r, line in enumerate(lines):
        assert line.startswith(f"local rank {r}: ") and line.endswith(f"--local_rank={r}")
        assert "${local_rank}" not in line
