"""``shardwise estimate``: the memory a training setup needs, without loading any weights.

    shardwise estimate --model-config config.json --gpus 8 --micro-batch 4 --seq 2048
    shardwise estimate --model-config config.json --gpus 2 --activation-checkpointing full --json
    shardwise estimate --model-config config.json --gpus 8 --nodes 2 --deepspeed-tables

The model is built on the meta device from its config; nothing is downloaded.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..errors import ConfigError
from .memory_estimator import (GiB, estimate_memory, estimate_zero2_model_states_mem_needs_all_cold,
                               estimate_zero3_model_states_mem_needs_all_cold, model_shape)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise estimate", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", required=True,
                   help="a Hugging Face config.json (or the folder holding it)")
    p.add_argument("--gpus", type=int, default=1, help="devices per node (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--micro-batch", type=int, default=1, help="micro batch per device (default 1)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages (default 0,1,2,3)")
    p.add_argument("--offload", default="none,optimizer,optimizer+param",
                   help="comma-separated offload choices: none, optimizer, optimizer+param")
    p.add_argument("--activation-checkpointing", default="none",
                   choices=("none", "full", "selective", "offload", "cpu"),
                   help="activation policy (cpu = full with cpu_checkpointing)")
    p.add_argument("--no-flash", action="store_true",
                   help="attention without a fused kernel (keeps the s x s attention matrix)")
    p.add_argument("--device-memory", type=float, help="GiB per device (default: detected)")
    p.add_argument("--host-memory", type=float, help="GiB per host (default: detected)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--deepspeed-tables", action="store_true",
                   help="also print DeepSpeed's ZeRO-2/ZeRO-3 model-state tables")
    return p


def _ints(text: str, flag: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated integers such as 0,1,2,3") from None


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``shardwise estimate``; returns the exit code."""
    args = _parser().parse_args(argv)
    ac = {"none": False, "full": "full"}.get(args.activation_checkpointing, args.activation_checkpointing)
    try:
        shape = model_shape(args.model_config)
        result = estimate_memory(
            shape, num_gpus=args.gpus, num_nodes=args.nodes, stages=_ints(args.stages, "--stages"),
            offload=[x.strip() for x in args.offload.split(",") if x.strip()], precision=args.precision,
            micro_batch=args.micro_batch, seq_len=args.seq, activation_checkpointing=ac,
            device_memory=int(args.device_memory * GiB) if args.device_memory else None,
            host_memory=int(args.host_memory * GiB) if args.host_memory else None,
            flash_attention=not args.no_flash)
    except ConfigError as err:
        print(f"shardwise estimate: {err}", file=sys.stderr)
        return 2
    except ImportError as err:  # building from a config needs transformers
        print(f"shardwise estimate: {err}; install transformers (pip install transformers) to read "
              f"model configs", file=sys.stderr)
        return 2
    print(result.to_json() if args.json else result.table())
    if args.deepspeed_tables and not args.json:
        print()
        estimate_zero2_model_states_mem_needs_all_cold(shape.total_params, args.gpus, args.nodes)
        print()
        estimate_zero3_model_states_mem_needs_all_cold(shape.total_params, shape.largest_layer_params,
                                                       args.gpus, args.nodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
