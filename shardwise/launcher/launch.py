"""``shardwise [launcher flags] script.py [script args]``: from a command line to running workers.

1. Parse the flags (``cli_args``) and check the script exists.
2. Work out the resources: the hostfile (``hostfile``) or this machine's accelerators (or,
   CPU-only, ``--num_gpus``/``--num_procs`` processes), then include/exclude/num_nodes/num_gpus.
3. Build one ``NodePlan`` (worker command, rendezvous, env) shared by every node.
4. One node: run the elastic agent in this process (``single_node``). Several: start one
   agent per node with the chosen runner (``multi_node``).
"""
from __future__ import annotations

import errno
import os
import sys
import uuid
from pathlib import Path
from typing import List, Optional, Sequence

from ..errors import LaunchError
from ..utils.logging import logger
from .cli_args import (DEFAULT_HOSTFILE, DEFAULT_MASTER_PORT, LaunchArgs, parse_launch_args,
                       peek_script_num_gpus)
from .env import env_file_paths, forwarded_env, load_env_files, seed_flags_env
from .hostfile import Resources, expand_slots, filter_resources, limit_resources, read_hostfile
from .multi_node import RUNNER_PROGRAMS, build_commands, run_commands
from .single_node import LOCAL_RANK_MACRO, NodePlan, free_port, port_bind_error, run_node

LOCAL_HOST = "localhost"


def local_device_count() -> int:
    """Accelerators on this machine that the workers can each take one of (0: CPU-only)."""
    import torch
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.xpu.device_count()
    return 0


def local_resources(num_gpus: int, script_args: Sequence[str]) -> Resources:
    """``{"localhost": slots}`` for a run without a hostfile."""
    if num_gpus == -1:
        seed_value = peek_script_num_gpus(script_args)
        if seed_value is not None:
            # The seed's command line puts --num_gpus after the script; honour it rather
            # than silently starting one worker per device.
            logger.info(f"using --num_gpus {seed_value} found after the script")
            num_gpus = seed_value
    if num_gpus == 0 or num_gpus < -1:
        raise LaunchError(f"--num_gpus {num_gpus} is invalid; give a positive count or omit it")
    devices = local_device_count()
    if devices > 0:
        if num_gpus > devices:
            raise LaunchError(f"--num_gpus {num_gpus} is more than the {devices} accelerator(s) "
                              f"on this machine; lower it to at most {devices}")
        return {LOCAL_HOST: list(range(num_gpus if num_gpus > 0 else devices))}
    count = num_gpus if num_gpus > 0 else 1
    cores = os.cpu_count() or 1
    if count > cores:
        logger.warning(f"{count} CPU worker processes on {cores} core(s): they will share cores")
    return {LOCAL_HOST: list(range(count))}


def resolve_resources(args: LaunchArgs) -> tuple:
    """(resources, from_hostfile) after every filter."""
    o = args.options
    hosts = read_hostfile(o.hostfile or DEFAULT_HOSTFILE, required=o.hostfile is not None)
    if hosts is None:
        resources = local_resources(o.num_gpus, args.script_args)
        if o.num_nodes > 1:
            raise LaunchError(f"--num_nodes {o.num_nodes} needs a hostfile (-H/--hostfile) that "
                              f"lists the nodes; none was found at {DEFAULT_HOSTFILE}")
        return filter_resources(resources, o.include, o.exclude), False
    resources = filter_resources(expand_slots(hosts), o.include, o.exclude)
    return limit_resources(resources, o.num_nodes, o.num_gpus), True


def worker_command(args: LaunchArgs) -> List[str]:
    """Worker argv after the interpreter, with ``--local_rank=${local_rank}`` (DeepSpeed style)."""
    o = args.options
    if o.no_python:
        head = [args.script]
    else:
        head = ["-u", *(["-m"] if o.module else []), args.script]
    if o.no_local_rank:
        return head + args.script_args
    ours = [f"--local_rank={LOCAL_RANK_MACRO}"]
    if any(a == "--local_rank" or a.startswith("--local_rank=") for a in args.script_args):
        # The seed's line carries its own '--local_rank 0'; argparse keeps the last value,
        # so ours goes last and every worker still learns its real local rank.
        logger.info("script arguments contain --local_rank; the launcher's value is appended "
                    "after them so that each worker gets its own")
        return head + args.script_args + ours
    return head + ours + args.script_args


def _check_script(args: LaunchArgs) -> None:
    o = args.options
    if o.module or o.no_python:
        return
    if not Path(args.script).is_file():
        raise LaunchError(f"training script {args.script!r} not found (cwd {str(Path.cwd())!r}); "
                          f"check the path, or pass --module for a module name")


def build_plan(args: LaunchArgs, resources: Resources, master_addr: str, multi: bool) -> NodePlan:
    o = args.options
    env = load_env_files(env_file_paths())
    env.update(seed_flags_env(o))
    bind = bool(o.bind_cores_to_rank)
    if bind and (o.disable_numa_awareness or o.windows_optimization):
        logger.warning("--bind_cores_to_rank is overridden by --disable_numa_awareness / "
                       "--windows_optimization: no core binding")
        bind = False
    log_dir = None
    if o.enable_each_rank_log:
        folder = Path(o.enable_each_rank_log).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        log_dir = str(folder)
    return NodePlan(
        hosts=[[host, slots] for host, slots in resources.items()],
        command=worker_command(args),
        rdzv_endpoint=f"{master_addr}:{o.master_port or DEFAULT_MASTER_PORT}",
        run_id=uuid.uuid4().hex if multi else "shardwise", use_python=not o.no_python,
        env=env, log_dir=log_dir, bind_cores=bind, max_restarts=o.max_restarts,
        local_addr="127.0.0.1" if o.launcher == "local" or not multi else None,
        set_visible_devices=any(slots != list(range(len(slots))) for slots in resources.values()))


_ADDR_IN_USE = {errno.EADDRINUSE, 10048}  # 10048: WSAEADDRINUSE on Windows


def _require_free_port(host: str, port: int) -> None:
    err = port_bind_error(host, port)
    if err is None:
        return
    if err.errno in _ADDR_IN_USE:
        raise LaunchError(f"master port {port} on {host or 'this machine'} is already in use "
                          f"(another job?); pass --master_port with a free port")
    raise LaunchError(f"cannot listen on {host}:{port} ({err.strerror or err}); --master_addr must "
                      f"be an address of this machine (e.g. 127.0.0.1) for the rendezvous host")


def choose_master_port(requested: Optional[int], host: str) -> int:
    """``--master_port`` as given, else 29500, else (29500 taken on this machine) a free port.

    Only for a rendezvous hosted on this machine: a port given explicitly is kept (and
    checked later), and DeepSpeed's default moves aside for another job holding it.
    """
    if requested is not None:
        return requested
    err = port_bind_error(host, DEFAULT_MASTER_PORT)
    if err is None or err.errno not in _ADDR_IN_USE:
        return DEFAULT_MASTER_PORT
    port = free_port(host)
    logger.warning(f"master port {DEFAULT_MASTER_PORT} is in use on this machine; using free "
                   f"port {port} (pass --master_port to choose one)")
    return port


def launch(argv: Optional[Sequence[str]] = None) -> int:
    """Run the launcher; returns the exit code (the first failed worker's, 130 on Ctrl-C)."""
    args = parse_launch_args(sys.argv[1:] if argv is None else argv)
    o = args.options
    _check_script(args)
    if o.autotuning:
        from ..autotuning.cli import autotune
        return autotune(args, sys.argv[1:] if argv is None else argv)
    if o.master_port is not None and not 1 <= o.master_port <= 65535:
        raise LaunchError(f"--master_port {o.master_port} is not a TCP port (1..65535)")
    resources, _ = resolve_resources(args)
    multi = len(resources) > 1 or o.force_multi
    if not multi:
        master = o.master_addr or "127.0.0.1"
        o.master_port = choose_master_port(o.master_port, master)
        plan = build_plan(args, resources, master, multi=False)
        _require_free_port(master, o.master_port)
        nproc = len(next(iter(resources.values())))
        logger.info(f"starting {nproc} worker(s) on this node, rendezvous {plan.rdzv_endpoint}")
        return run_node(plan, 0)

    first_host = next(iter(resources))
    master = o.master_addr or ("127.0.0.1" if o.launcher == "local" else first_host)
    if o.launcher == "local" and o.node_rank < 0:  # every agent on this machine: it can choose
        o.master_port = choose_master_port(o.master_port, master)
    o.master_port = o.master_port or DEFAULT_MASTER_PORT
    plan = build_plan(args, resources, master, multi=True)
    if o.node_rank >= 0:
        # No remote launcher: the user runs this same command on every host.
        if o.node_rank == 0:
            _require_free_port("", o.master_port)
        return run_node(plan, o.node_rank)
    if o.launcher == "local":
        _require_free_port(master, o.master_port)
    program = RUNNER_PROGRAMS.get(o.launcher)
    if program is not None:
        import shutil
        if shutil.which(program) is None:
            raise LaunchError(f"--launcher {o.launcher} needs {program!r} on PATH and it is not "
                              f"installed; install it, pick another --launcher, or run each node "
                              f"yourself with --node_rank")
    exports = forwarded_env()
    exports.update(plan.env)
    commands = build_commands(o.launcher, plan, exports, o.launcher_args, o.ssh_port)
    total = sum(len(s) for s in resources.values())
    logger.info(f"starting {len(resources)} node(s), {total} worker(s) with --launcher "
                f"{o.launcher}; rendezvous {plan.rdzv_endpoint}")
    return run_commands(commands)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point for ``shardwise run``: one-line errors, exit code 2 for bad input."""
    try:
        return launch(argv)
    except LaunchError as err:
        print(f"shardwise: error: {err}", file=sys.stderr)
        return 2
