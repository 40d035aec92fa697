"""The launcher's flags, named as DeepSpeed's ``deepspeed`` command names them.

``shardwise [LAUNCHER FLAGS] script.py [SCRIPT ARGS]``: flags before the script belong to the
launcher, everything after the script is handed to the script untouched.
"""
from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from ..errors import LaunchError

DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's default location
DEFAULT_MASTER_PORT = 29500
LAUNCHERS = ("ssh", "pdsh", "slurm", "openmpi", "local")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}

USAGE = "shardwise [run] [launcher flags] SCRIPT [script args]"
EPILOG = """\
other commands:
  shardwise report [--json]      environment report (DeepSpeed's ds_report)
  shardwise convert ...          checkpoint conversion
  shardwise estimate ...         memory estimates

Flags after SCRIPT go to the script. A script that calls shardwise.add_config_arguments(parser)
accepts the seed flags there too (--deepspeed_config, --local_rank, --windows_optimization ...).
"""


class _Parser(argparse.ArgumentParser):
    """argparse that raises ``LaunchError`` (one line) instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if "unrecognized arguments" in message:
            flags = message.split(":", 1)[1].strip()
            hint = unknown_flag_hint(flags.split(), list(self._option_string_actions))
            raise LaunchError(f"unknown launcher flag(s) {flags}: {hint} (see 'shardwise --help')")
        raise LaunchError(f"{message}; see 'shardwise --help'")


#: Flags of the training script (``add_config_arguments``) that users write before it.
SCRIPT_FLAGS = ("--local_rank", "--deepspeed", "--deepspeed_config", "--shardwise",
                "--shardwise_config")


def unknown_flag_hint(tokens: Sequence[str], known: Sequence[str]) -> str:
    """What to do about unknown launcher flags: the closest known flag for a typo
    (``--num_gpu`` → ``--num_gpus``; ``--x=1`` is matched on ``--x``), or where a script flag
    belongs."""
    names = [t.split("=", 1)[0] for t in tokens if t.startswith("-")]
    script_flags = [n for n in names if n in SCRIPT_FLAGS]
    fixes = []
    for name in names:
        close = difflib.get_close_matches(name, [k for k in known if k.startswith("--")], n=1,
                                          cutoff=0.75)
        if close and name not in SCRIPT_FLAGS:
            fixes.append((name, close[0]))
    hints = []
    if len(fixes) == 1 and len(names) == 1:
        hints.append(f"did you mean {fixes[0][1]}?")
    elif fixes:
        hints.append("did you mean " + ", ".join(f"{fix} for {name}" for name, fix in fixes) + "?")
    if script_flags:
        hints.append(f"{' '.join(script_flags)} belong(s) to the training script: write it after "
                     "the script")
    return " ".join(hints) or "launcher flags go before the script, script flags after it"


def _bool_value(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="shardwise", usage=USAGE, epilog=EPILOG, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Start a training script on one or more nodes through "
                            "torch.distributed.run's elastic agent (DeepSpeed's 'deepspeed').")
    res = p.add_argument_group("resources")
    res.add_argument("--num_gpus", "--num_accelerators", "--num_procs", dest="num_gpus", type=int,
                     default=-1, help="worker processes per node: accelerators to use (all by "
                     "default), or on a CPU-only machine the number of processes (1 by default)")
    res.add_argument("--num_nodes", type=int, default=-1,
                     help="use the first N hosts of the hostfile (all by default)")
    res.add_argument("-H", "--hostfile", default=None,
                     help=f"'HOST slots=N' lines; default {DEFAULT_HOSTFILE} if it exists, else "
                     "this machine only")
    res.add_argument("-i", "--include", default="",
                     help="only these hosts/slots, e.g. 'worker-0@worker-1:0,2'")
    res.add_argument("-e", "--exclude", default="",
                     help="all hosts/slots except these, e.g. 'worker-1:0'")
    net = p.add_argument_group("rendezvous")
    net.add_argument("--master_addr", default="",
                     help="rendezvous host (default 127.0.0.1 single-node, the first host otherwise)")
    net.add_argument("--master_port", type=int, default=None,
                     help=f"rendezvous port (default {DEFAULT_MASTER_PORT}; when it is taken on "
                     "a single node, a free port is picked and printed)")
    net.add_argument("--node_rank", type=int, default=-1,
                     help="multi-node without a remote launcher: start only this node's agent "
                     "(run the same command on every host with its own --node_rank)")
    cmd = p.add_argument_group("worker command")
    cmd.add_argument("--module", action="store_true", help="SCRIPT is a module (python -m SCRIPT)")
    cmd.add_argument("--no_python", action="store_true", help="SCRIPT is an executable, not Python")
    cmd.add_argument("--no_local_rank", action="store_true",
                     help="do not pass --local_rank=N to the script (LOCAL_RANK is always set)")
    cmd.add_argument("--enable_each_rank_log", default=None, metavar="DIR",
                     help="write each rank's stdout/stderr to files under DIR instead of the console")
    cmd.add_argument("--bind_cores_to_rank", action="store_true",
                     help="give each local rank its own share of the CPU cores (affinity and "
                     "OMP_NUM_THREADS); Linux and Windows")
    cmd.add_argument("--max_restarts", type=int, default=0,
                     help="elastic agent restarts of the worker group after a failure (default 0)")
    multi = p.add_argument_group("multi-node")
    multi.add_argument("--launcher", choices=LAUNCHERS, default="ssh",
                       help="how to start one agent per node: ssh (default), pdsh, slurm (srun), "
                       "openmpi (mpirun), or local (every 'node' on this machine, for tests)")
    multi.add_argument("--launcher_args", default="",
                       help="extra arguments for the remote launcher command (quoted string)")
    multi.add_argument("--ssh_port", type=int, default=None, help="ssh port of the remote hosts")
    multi.add_argument("--force_multi", action="store_true",
                       help="use the multi-node path even for a single host")
    cmd.add_argument("--autotuning", choices=("tune", "run"), default=None,
                     help="DeepSpeed's autotuner: 'tune' runs short experiments over the config's "
                     "\"auto\" values and writes the best config; 'run' also trains with it "
                     "(docs/autotuning.md)")
    seed = p.add_argument_group("platform tuning (the seed article's flags)")
    seed.add_argument("--windows_optimization", type=_bool_value, nargs="?", const=True,
                      default=None, metavar="{true,false}",
                      help="Windows-safe worker settings on any OS: USE_LIBUV=0 (the TCPStore "
                      "without libuv) and no core binding")
    seed.add_argument("--disable_numa_awareness", action="store_true",
                      help="no NUMA/core binding (overrides --bind_cores_to_rank); workers see "
                      "SHARDWISE_NUMA_BINDING=0")
    seed.add_argument("--windows_memory_allocator", choices=("pytorch", "default"), default=None,
                      help="pytorch: workers set PYTORCH_CUDA_ALLOC_CONF to PyTorch's native "
                      "caching allocator (plus expandable segments on Linux) unless already set; "
                      "default: leave allocator settings alone")
    seed.add_argument("--dataloader_num_workers", type=int, default=None, metavar="N",
                      help="DataLoader worker processes; passed to workers as "
                      "SHARDWISE_DATALOADER_NUM_WORKERS (the engine's deepspeed_io uses it)")
    seed.add_argument("--pin_memory", action="store_true",
                      help="pinned DataLoader memory; passed to workers as SHARDWISE_PIN_MEMORY=1")
    return p


@dataclass
class LaunchArgs:
    """Parsed launcher flags plus the worker command."""

    options: argparse.Namespace
    """The launcher flags (names as in ``build_parser``)."""
    script: str
    """The training script, module (``--module``) or executable (``--no_python``)."""
    script_args: List[str] = field(default_factory=list)
    """Everything after the script, untouched."""


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0 and action.nargs != "?"


def split_argv(argv: Sequence[str], parser: Optional[argparse.ArgumentParser] = None
               ) -> tuple:
    """Split ``argv`` into (launcher tokens, script, script tokens).

    argparse alone cannot do this: ``--windows_optimization`` takes an *optional* value and
    would swallow the script name. Options that take a value skip their value; the first
    bare token is the script.
    """
    parser = parser or build_parser()
    actions = parser._option_string_actions
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            return tokens[:i], (tokens[i + 1] if i + 1 < len(tokens) else None), tokens[i + 2:]
        if not token.startswith("-") or token == "-":
            return tokens[:i], token, tokens[i + 1:]
        name = token.split("=", 1)[0]
        action = actions.get(name)
        if action is not None and "=" not in token:
            if _takes_value(action):
                i += 1
            elif action.nargs == "?" and i + 1 < len(tokens) and \
                    tokens[i + 1].strip().lower() in _TRUE | _FALSE:
                i += 1
        i += 1
    return tokens, None, []


def parse_launch_args(argv: Sequence[str]) -> LaunchArgs:
    """Parse a launcher command line; ``LaunchError`` (one line) on bad input."""
    parser = build_parser()
    launcher_tokens, script, script_args = split_argv(argv, parser)
    options = parser.parse_args(launcher_tokens)
    if script is None:
        raise LaunchError("no training script given: usage is 'shardwise [launcher flags] "
                          "train.py [script args]'")
    if options.module and options.no_python:
        raise LaunchError("--module and --no_python contradict each other (a module needs "
                          "Python); drop one of them")
    return LaunchArgs(options=options, script=script, script_args=list(script_args))


def peek_script_num_gpus(script_args: Sequence[str]) -> Optional[int]:
    """``--num_gpus N`` written after the script (the seed's command line), if any."""
    for i, token in enumerate(script_args):
        name, sep, value = token.partition("=")
        if name in ("--num_gpus", "--num_accelerators", "--num_procs"):
            text = value if sep else (script_args[i + 1] if i + 1 < len(script_args) else "")
            try:
                return int(text)
            except ValueError:
                return None
    return None
