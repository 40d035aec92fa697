"""``shardwise estimate``: the memory a training setup needs, without loading any weights.

    shardwise estimate --model-config config.json --gpus 8 --micro-batch 4 --seq 2048
    shardwise estimate --model-config config.json --gpus 2 --activation-checkpointing full --json
    shardwise estimate --model-config config.json --gpus 8 --nodes 2 --deepspeed-tables

The model is built on the meta device from its config; nothing is downloaded.
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
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


def _config_file(model_config: str) -> Path:
    path = Path(model_config)
    return path / "config.json" if path.is_dir() else path


def _model_error(model_config: str, err: Exception) -> str:
    """One line for a config transformers cannot build: an unknown ``model_type`` (with the
    closest known names) or another reason (its first line), instead of a traceback."""
    file = _config_file(model_config)
    try:
        model_type = json.loads(file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return f"{str(file)!r} is not a readable JSON config: {str(err).strip().splitlines()[0]}"
    try:
        import transformers
        from transformers import CONFIG_MAPPING
        known, version = list(CONFIG_MAPPING.keys()), transformers.__version__
    except ImportError:
        known, version = [], "?"
    if known and model_type not in known:
        close = difflib.get_close_matches(str(model_type), known, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        return (f"model_type {model_type!r} in {str(file)!r} is not a model transformers {version} "
                f"knows; {hint}Check the spelling, or upgrade transformers (pip install -U "
                f"transformers) for a newer architecture")
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (f"cannot build a causal language model from {str(file)!r} (model_type "
            f"{model_type!r}): {first[:300]}")


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``shardwise estimate``; returns the exit code."""
    args = _parser().parse_args(argv)
    ac = {"none": False, "full": "full"}.get(args.activation_checkpointing, args.activation_checkpointing)
    try:
        try:
            shape = model_shape(args.model_config)
        except (ValueError, KeyError, TypeError) as err:  # transformers: unknown/unbuildable model
            raise ConfigError(_model_error(args.model_config, err)) from None
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
