"""Multi-node: one elastic agent per node, started over ssh, pdsh, srun, mpirun or locally.

Every node runs ``python -m shardwise.launcher.single_node --plan B64 --node_rank I`` (the
same plan everywhere) and the agents meet in a c10d rendezvous on the master host. Remote
nodes do not inherit this process's environment, so the forwarded variables (``env.py``)
are exported in the remote shell command. ``local`` starts every "node" on this machine,
which is how the tests cover the multi-node path on loopback.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional

from ..errors import LaunchError
from .env import shell_exports
from .single_node import NodePlan


@dataclass
class NodeCommand:
    """One process this launcher starts (an ssh session, an srun, a local agent ...)."""

    argv: List[str]
    """The command line."""
    env: Optional[Dict[str, str]] = None
    """Its full environment (None: inherit this process's)."""
    label: str = ""
    """Which node(s) it covers, for messages."""


def agent_argv(plan: NodePlan, python: str, node_rank_arg: List[str]) -> List[str]:
    return [python, "-u", "-m", "shardwise.launcher.single_node", "--plan", plan.encode(),
            *node_rank_arg]


def remote_shell_command(plan: NodePlan, exports: Mapping[str, str], node_rank_arg: List[str],
                         cwd: str, python: str) -> str:
    """``cd CWD && export ...; python -u -m shardwise.launcher.single_node ...`` for sh."""
    argv = agent_argv(plan, python, node_rank_arg)
    return f"cd {shlex.quote(cwd)} && {shell_exports(exports)}" + " ".join(
        a if a == "%n" else shlex.quote(a) for a in argv)


class SSHRunner:
    """``ssh [-p PORT] [launcher_args] HOST 'cd CWD && export ...; python -m ...'`` per node."""

    def commands(self, plan: NodePlan, exports: Mapping[str, str], launcher_args: List[str],
                 ssh_port: Optional[int], cwd: str, python: str) -> List[NodeCommand]:
        port = ["-p", str(ssh_port)] if ssh_port else []
        return [NodeCommand(["ssh", *port, *launcher_args, host,
                             remote_shell_command(plan, exports, ["--node_rank", str(i)], cwd,
                                                  python)], label=host)
                for i, (host, _) in enumerate(plan.hosts)]


class PDSHRunner:
    """One ``pdsh -S -f 1024 -w h1,h2 'cmd --node_rank %n'`` for all nodes (%n: pdsh's rank)."""

    def commands(self, plan, exports, launcher_args, ssh_port, cwd, python) -> List[NodeCommand]:
        hosts = ",".join(h for h, _ in plan.hosts)
        env = dict(os.environ, PDSH_RCMD_TYPE="ssh")
        if ssh_port:
            env["PDSH_SSH_ARGS_APPEND"] = f"-p {ssh_port}"
        cmd = remote_shell_command(plan, exports, ["--node_rank", "%n"], cwd, python)
        return [NodeCommand(["pdsh", "-S", "-f", "1024", *launcher_args, "-w", hosts, cmd],
                            env=env, label=hosts)]


class SlurmRunner:
    """One ``srun -N n --ntasks-per-node 1 -w hosts`` task per node; rank from SLURM_PROCID."""

    def commands(self, plan, exports, launcher_args, ssh_port, cwd, python) -> List[NodeCommand]:
        hosts = ",".join(h for h, _ in plan.hosts)
        export = ",".join(["ALL", *(f"{k}={v}" for k, v in sorted(exports.items()))])
        argv = ["srun", "-N", str(plan.nnodes), "-n", str(plan.nnodes), "--ntasks-per-node", "1",
                "-w", hosts, f"--export={export}", f"--chdir={cwd}", *launcher_args,
                *agent_argv(plan, python, ["--node_rank_env", "SLURM_PROCID"])]
        return [NodeCommand(argv, label=hosts)]


class OpenMPIRunner:
    """One ``mpirun -n N -H h1:1,h2:1 -x VAR ...``: one agent per host, rank from OMPI."""

    def commands(self, plan, exports, launcher_args, ssh_port, cwd, python) -> List[NodeCommand]:
        hosts = ",".join(f"{h}:1" for h, _ in plan.hosts)
        xs: List[str] = []
        for key, value in sorted(exports.items()):
            xs += ["-x", f"{key}={value}"]
        argv = ["mpirun", "-n", str(plan.nnodes), "-H", hosts, "--wdir", cwd, *xs, *launcher_args,
                *agent_argv(plan, python, ["--node_rank_env", "OMPI_COMM_WORLD_RANK"])]
        return [NodeCommand(argv, label=hosts)]


class LocalRunner:
    """Every node's agent as a local subprocess (loopback multi-node; tests and debugging)."""

    def commands(self, plan, exports, launcher_args, ssh_port, cwd, python) -> List[NodeCommand]:
        env = dict(os.environ, **exports)
        return [NodeCommand(agent_argv(plan, python, ["--node_rank", str(i)]), env=env,
                            label=f"{host} (local)")
                for i, (host, _) in enumerate(plan.hosts)]


RUNNERS = {"ssh": SSHRunner, "pdsh": PDSHRunner, "slurm": SlurmRunner,
           "openmpi": OpenMPIRunner, "local": LocalRunner}
# The program each runner needs on PATH (local needs none).
RUNNER_PROGRAMS = {"ssh": "ssh", "pdsh": "pdsh", "slurm": "srun", "openmpi": "mpirun"}


def _descendants(proc: subprocess.Popen) -> list:
    try:
        import psutil
        return psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # already gone
        return []


def terminate_tree(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """Stop a node's agent and everything under it.

    POSIX: SIGTERM first, which the elastic agent turns into an orderly stop of its workers;
    whatever is left after ``timeout`` is killed. Windows has no SIGTERM to deliver, so the
    process tree is killed directly (children first, so no worker is orphaned).
    """
    children = _descendants(proc)
    if proc.poll() is None and not sys.platform.startswith("win"):
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    for child in children:
        try:
            child.kill()
        except Exception:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _normalise(code: int) -> int:
    return code if 0 < code < 256 else 1


def run_commands(commands: List[NodeCommand], poll_s: float = 0.2) -> int:
    """Start all commands, wait; the first failure (or Ctrl-C / SIGTERM) stops the rest."""
    procs: List[subprocess.Popen] = []

    def on_sigterm(signum, frame):  # turn SIGTERM into the same path as Ctrl-C
        raise KeyboardInterrupt

    previous = None
    if hasattr(signal, "SIGTERM") and not sys.platform.startswith("win"):
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        for command in commands:
            try:
                procs.append(subprocess.Popen(command.argv, env=command.env))
            except FileNotFoundError:
                raise LaunchError(f"cannot start {command.argv[0]!r} for {command.label}: not "
                                  f"found on PATH; install it or pick another --launcher") from None
        while True:
            codes = [p.poll() for p in procs]
            for command, code in zip(commands, codes):
                if code not in (None, 0):
                    print(f"shardwise: node {command.label} exited with code {code}; stopping "
                          f"the other nodes", file=sys.stderr)
                    for other in procs:
                        terminate_tree(other)
                    return _normalise(code)
            if all(code == 0 for code in codes):
                return 0
            time.sleep(poll_s)
    except KeyboardInterrupt:
        print("shardwise: interrupted; stopping all nodes", file=sys.stderr)
        for p in procs:
            terminate_tree(p)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def build_commands(launcher: str, plan: NodePlan, exports: Mapping[str, str],
                   launcher_args: str = "", ssh_port: Optional[int] = None,
                   cwd: Optional[str] = None, python: Optional[str] = None) -> List[NodeCommand]:
    """The commands that start every node's agent with the chosen runner."""
    runner = RUNNERS[launcher]()
    return runner.commands(plan, dict(exports), shlex.split(launcher_args), ssh_port,
                           cwd or str(Path.cwd()), python or sys.executable)
