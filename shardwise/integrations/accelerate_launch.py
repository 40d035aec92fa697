"""``python -m shardwise.integrations.accelerate_launch [accelerate launch arguments]``.

``accelerate launch --use_deepspeed`` (or an accelerate config with a DeepSpeed section)
checks in the launcher process that DeepSpeed is installed. This entry point turns the
alias on first and then runs accelerate's own ``launch`` command unchanged; the training
script calls ``shardwise.integrations.use_as_deepspeed()`` itself, before it imports
accelerate or transformers.
"""
from __future__ import annotations

from typing import List, Optional

from . import use_as_deepspeed


def main(argv: Optional[List[str]] = None) -> None:
    use_as_deepspeed()
    try:
        from accelerate.commands.launch import launch_command, launch_command_parser
    except ImportError as exc:
        raise SystemExit(f"shardwise.integrations.accelerate_launch needs accelerate: "
                         f"pip install accelerate ({exc})") from None
    args = launch_command_parser().parse_args(argv)
    launch_command(args)


if __name__ == "__main__":
    main()
