"""``shardwise convert CHECKPOINT_DIR OUTPUT_DIR``: DeepSpeed's ``zero_to_fp32.py`` as a command.

Reads a shardwise checkpoint written at any world size and ZeRO stage and writes one
consolidated model as Hugging Face safetensors shards (+ index), ready for
``AutoModel.from_pretrained(OUTPUT_DIR)``. Streams tensor by tensor: peak memory is about
one tensor, not the model.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

import torch

from ..errors import CheckpointError
from .consolidate import describe, export_safetensors, parse_size

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise convert",
        description="Consolidate a sharded shardwise checkpoint into a Hugging Face safetensors "
                    "model (the equivalent of DeepSpeed's zero_to_fp32.py).")
    parser.add_argument("checkpoint_dir", help="folder holding 'latest' and the tag folders "
                                               "(the save_dir given to engine.save_checkpoint)")
    parser.add_argument("output_dir", help="folder to write model*.safetensors (+ index) into; "
                                           "written as a new folder and swapped in when complete")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier export in OUTPUT_DIR (its weights, index and "
                             "config.json; other files such as the tokenizer are kept). Without "
                             "it a folder that holds an export is refused")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="accepted for zero_to_fp32 compatibility; output is always "
                             "safetensors (shardwise never writes pickles)")
    parser.add_argument("--max_shard_size", default="5GB",
                        help="largest shard file, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    parser.add_argument("--tag", default=None,
                        help="checkpoint tag to convert (default: the one named in 'latest')")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32",
                        help="dtype of the floating tensors written (default fp32)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out parameters that were frozen (requires_grad=False)")
    parser.add_argument("--no_config", action="store_true",
                        help="do not write config.json even if the checkpoint recorded one")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns the process exit code (0 ok, 1 checkpoint error, 2 bad flags)."""
    args = build_parser().parse_args(argv)
    try:
        parse_size(args.max_shard_size)
        info = describe(args.checkpoint_dir, args.tag)
        print(f"converting {args.checkpoint_dir} tag {info['tag']}: {info['parameters']} tensors, "
              f"{info['numel']:,} parameters, written by {info['world_size']} ranks at ZeRO stage "
              f"{info['zero_stage']}")
        t0 = time.perf_counter()
        files = export_safetensors(args.checkpoint_dir, args.output_dir, tag=args.tag,
                                   max_shard_size=args.max_shard_size, dtype=_DTYPES[args.dtype],
                                   exclude_frozen_parameters=args.exclude_frozen_parameters,
                                   write_config=not args.no_config,
                                   overwrite=args.overwrite)
    except CheckpointError as exc:
        print(f"shardwise convert: error: {exc}", file=sys.stderr)
        return 1
    for path in files:
        print(f"  wrote {path}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
