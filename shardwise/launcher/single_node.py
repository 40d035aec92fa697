"""One node's workers, started by ``torch.distributed.run``'s elastic agent.

``run_node(plan)`` builds a ``LaunchConfig`` and runs ``elastic_launch`` in this process: the
agent starts ``plan.nproc`` workers with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set, watches them, stops all of them when one fails or when this
process gets SIGINT/SIGTERM, and reports the failure. A multi-node launch runs this module on
every node (``python -m shardwise.launcher.single_node --plan B64 --node_rank I``), like
DeepSpeed runs ``deepspeed.launcher.launch`` there.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import sys
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

from ..errors import LaunchError
from ..utils.logging import logger
from .env import platform_worker_env
from .torch_compat import make_worker_stop_portable, respect_use_libuv

# torch's macro that the agent replaces by each worker's local rank.
LOCAL_RANK_MACRO = "${local_rank}"


@dataclass
class NodePlan:
    """Everything one node's agent needs; JSON-serialisable so it can travel to remote nodes."""

    hosts: List[List]
    """``[[host, [slot, ...]], ...]``: every node of the job, in node-rank order."""
    command: List[str]
    """Worker argv after the interpreter: ``["-u", "train.py", "--local_rank=${local_rank}", ...]``."""
    rdzv_endpoint: str
    """``host:port`` of the rendezvous (static TCPStore single-node, c10d multi-node)."""
    run_id: str = "shardwise"
    """Rendezvous id: the same on every node of one job."""
    use_python: bool = True
    """Prefix ``command`` with this node's Python interpreter (False for --no_python)."""
    env: Dict[str, str] = field(default_factory=dict)
    """Variables set for the workers (on top of the agent's own environment)."""
    log_dir: Optional[str] = None
    """--enable_each_rank_log: each rank's stdout/stderr go to files under this folder."""
    bind_cores: bool = False
    """--bind_cores_to_rank: each local rank gets its own share of the cores."""
    max_restarts: int = 0
    """Elastic restarts of the worker group after a failure."""
    local_addr: Optional[str] = None
    """Address this node's workers advertise as MASTER_ADDR (None: the host name)."""
    set_visible_devices: bool = False
    """Export CUDA_VISIBLE_DEVICES from the node's slots (include/exclude picked a subset)."""

    @property
    def nnodes(self) -> int:
        return len(self.hosts)

    def encode(self) -> str:
        return base64.urlsafe_b64encode(json.dumps(asdict(self)).encode()).decode()

    @staticmethod
    def decode(text: str) -> "NodePlan":
        return NodePlan(**json.loads(base64.urlsafe_b64decode(text.encode())))


def port_bind_error(host: str, port: int) -> Optional[OSError]:
    """Why this machine cannot listen on ``host:port`` (None: it can; the agent will need it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if hasattr(socket, "SO_EXCLUSIVEADDRUSE"):
            # Windows lets two sockets share a port under SO_REUSEADDR; exclusive use tells truth.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_EXCLUSIVEADDRUSE, 1)
        else:
            # As TCPStore does: a port held only by TIME_WAIT connections counts as free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("" if host in ("", "0.0.0.0") else host, port))
        except OSError as err:
            return err
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("" if host in ("", "0.0.0.0") else host, 0))
        return s.getsockname()[1]


def worker_command_lines(plan: NodePlan, nproc: int) -> List[str]:
    """Each local rank's real command line, ``${local_rank}`` replaced by its value (what the
    agent runs; the launch log shows these rather than the macro)."""
    program = os.environ.get("PYTHON_EXEC", sys.executable) if plan.use_python else None
    lines = []
    for local_rank in range(nproc):
        argv = [a.replace(LOCAL_RANK_MACRO, str(local_rank)) for a in plan.command]
        shown = " ".join(([program] if program else []) + argv)
        lines.append(f"local rank {local_rank}: {shown}")
    return lines


def _worker_entrypoint(plan: NodePlan, nproc: int) -> tuple:
    """The entrypoint (program) and argv the agent starts; through the shim when needed."""
    if plan.bind_cores or os.environ.get("USE_LIBUV") == "0":
        # worker.py binds cores and/or fixes the libuv store, then runs the real command.
        args = ["-u", "-m", "shardwise.launcher.worker", *(["--bind"] if plan.bind_cores else []),
                "--python" if plan.use_python else "--exec", "--", *plan.command]
        return os.environ.get("PYTHON_EXEC", sys.executable), args
    if plan.use_python:
        return os.environ.get("PYTHON_EXEC", sys.executable), list(plan.command)
    return plan.command[0], list(plan.command[1:])


def _omp_threads(nproc: int) -> str:
    # torchrun would set 1; a CPU-only job wants the cores shared out instead.
    cores = os.cpu_count() or 1
    return str(max(1, cores // max(1, nproc)))


def _exit_code(failures: dict) -> int:
    """The first failed worker's exit code (signals and unknown codes become 1)."""
    first = min(failures.values(), key=lambda f: getattr(f, "timestamp", 0))
    code = getattr(first, "exitcode", 1)
    return code if isinstance(code, int) and 0 < code < 256 else 1


def run_node(plan: NodePlan, node_rank: int) -> int:
    """Run this node's agent until its workers finish; returns the job's exit code."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not 0 <= node_rank < plan.nnodes:
        raise LaunchError(f"node rank {node_rank} is outside 0..{plan.nnodes - 1} for this "
                          f"{plan.nnodes}-node job")
    host, slots = plan.hosts[node_rank]
    nproc = len(slots)
    os.environ.update(plan.env)
    os.environ.update(platform_worker_env())  # this node's platform, not the launcher's
    os.environ.setdefault("OMP_NUM_THREADS", _omp_threads(nproc))
    if plan.set_visible_devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in slots)

    respect_use_libuv()
    make_worker_stop_portable()
    multi = plan.nnodes > 1
    rdzv_configs: dict = {"timeout": 900}
    if multi:
        # The first node hosts the c10d store explicitly: on loopback every node would
        # otherwise think it is the host.
        rdzv_configs["is_host"] = node_rank == 0
    else:
        rdzv_configs["rank"] = 0
    logs = DefaultLogsSpecs(log_dir=plan.log_dir, redirects=Std.ALL if plan.log_dir else Std.NONE,
                            tee=Std.NONE)
    config = LaunchConfig(
        min_nodes=plan.nnodes, max_nodes=plan.nnodes, nproc_per_node=nproc,
        run_id=plan.run_id, role="shardwise", rdzv_endpoint=plan.rdzv_endpoint,
        rdzv_backend="c10d" if multi else "static", rdzv_configs=rdzv_configs,
        max_restarts=plan.max_restarts, monitor_interval=0.1, start_method="spawn",
        logs_specs=logs, local_addr=plan.local_addr)
    entrypoint, args = _worker_entrypoint(plan, nproc)
    where = f"node {node_rank} ({host})" if multi else "this node"
    logger.info(f"worker commands on {where}:\n  " + "\n  ".join(worker_command_lines(plan, nproc)))
    try:
        elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as failed:
        _kill_leftover_workers()
        rank, failure = failed.get_first_failure()
        code = _exit_code(failed.failures)
        print(f"shardwise: worker rank {rank} on {host} failed with exit code "
              f"{failure.exitcode}; all workers stopped", file=sys.stderr)
        return code
    except SignalException as sig:
        _kill_leftover_workers()
        print(f"shardwise: got signal {sig.sigval}; all workers stopped", file=sys.stderr)
        return 128 + int(sig.sigval)
    except KeyboardInterrupt:
        _kill_leftover_workers()
        return 130
    except Exception as err:  # the agent itself broke (rendezvous, a platform gap ...)
        _kill_leftover_workers()
        print(f"shardwise: the elastic agent on {host} failed: {type(err).__name__}: "
              f"{str(err).strip().splitlines()[-1] if str(err).strip() else ''}; all workers "
              f"stopped", file=sys.stderr)
        return 1
    return 0


def _kill_leftover_workers() -> None:
    """Kill whatever the agent left running (it normally stops its workers itself).

    A safety net against orphans when the agent's own shutdown failed part-way, e.g. a
    signal that cannot be delivered on this platform.
    """
    try:
        import psutil
        leftovers = psutil.Process().children(recursive=True)
    except Exception:
        return
    for child in leftovers:
        try:
            child.kill()
        except Exception:
            pass


def _node_rank_from_env(plan: NodePlan, variable: str) -> int:
    """A node's rank under srun/mpirun: by host name when it matches, else the task rank."""
    names = {socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn()}
    matches = [i for i, (host, _) in enumerate(plan.hosts) if host in names]
    if len(matches) == 1:
        return matches[0]
    value = os.environ.get(variable)
    if value is None:
        raise LaunchError(f"{variable} is not set on host {socket.gethostname()!r}, so its node "
                          f"rank is unknown; start it with --node_rank")
    return int(value)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardwise.launcher.single_node",
                                     description="one node's elastic agent (used by the launcher)")
    parser.add_argument("--plan", required=True, help="base64 NodePlan from the launcher")
    rank = parser.add_mutually_exclusive_group(required=True)
    rank.add_argument("--node_rank", type=int)
    rank.add_argument("--node_rank_env", help="variable holding the node rank (SLURM_PROCID, ...)")
    args = parser.parse_args(argv)
    plan = NodePlan.decode(args.plan)
    node_rank = args.node_rank if args.node_rank is not None else \
        _node_rank_from_env(plan, args.node_rank_env)
    try:
        return run_node(plan, node_rank)
    except LaunchError as err:
        print(f"shardwise: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
