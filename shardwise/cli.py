"""The ``shardwise`` command: ``run`` (the default), ``report``, ``convert``, ``estimate``,
``plot``, ``generate``.

``shardwise train.py ...`` and ``shardwise run train.py ...`` launch; the other words are
subcommands. Each subcommand's module is imported only when it is used, so a missing
optional part gives a one-line error instead of breaking the whole command.
"""
from __future__ import annotations

import importlib
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .errors import ShardwiseError

# subcommand -> (module, function taking argv and returning an exit code)
SUBCOMMANDS: Dict[str, Tuple[str, str]] = {
    "run": ("shardwise.launcher.launch", "launch"),
    "report": ("shardwise.report", "main"),
    "convert": ("shardwise.checkpoint.convert", "main"),
    "estimate": ("shardwise.profiling.estimate_cli", "main"),
    "generate": ("shardwise.inference.cli", "main"),
    "io-bench": ("shardwise.io.bench_cli", "io_bench_main"),
    "nvme-tune": ("shardwise.io.bench_cli", "nvme_tune_main"),
    "plot": ("shardwise.monitor.plot", "main"),
}


def _load(name: str) -> Callable[[List[str]], Optional[int]]:
    module_name, attr = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # Only "this part is not installed" is turned into a message; an import error
        # inside an existing module is a bug and keeps its traceback.
        if err.name and module_name.startswith(err.name):
            raise ShardwiseError(f"'shardwise {name}' is not available in this installation "
                                 f"({module_name} is missing); update shardwise") from None
        raise
    return getattr(module, attr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch; returns the subcommand's exit code (2 for bad input, with a one-line error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("--version", "-V"):
        from .version import __version__
        print(f"shardwise {__version__}")
        return 0
    name = argv[0] if argv and argv[0] in SUBCOMMANDS else "run"
    rest = argv[1:] if argv and argv[0] in SUBCOMMANDS else argv
    try:
        code = _load(name)(rest)
    except ShardwiseError as err:
        print(f"shardwise: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
