"""``shardwise generate MODEL_DIR --prompt "..."``: load a local Hugging Face directory and generate.

The model is built on the meta device (``OnDevice``) and its weights stream from the
directory straight to the device (``checkpoint=``); the tokenizer comes from the same
directory. Prints the text and the decode speed. With ``--tp N`` launch N ranks
(``shardwise --num_gpus N --module shardwise.inference.cli MODEL_DIR ...`` or torchrun); rank 0 prints.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import List, Optional

from shardwise.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="local Hugging Face model directory (config, weights, tokenizer)")
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for a batch; left-padded)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default=None, help="fp32 | fp16 | bf16 | int8 (default: bf16 on GPU, "
                                                 "the model's own on CPU)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (launch that many)")
    p.add_argument("--no-kernel-inject", action="store_true",
                   help="plain Hugging Face generate instead of the fast decode path")
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--max-out-tokens", type=int, default=2048)
    return p


def _load(args: argparse.Namespace):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import shardwise
    root = Path(args.model_dir)
    if not (root / "config.json").is_file():
        raise ConfigError(f"{root.resolve()} has no config.json: pass a local Hugging Face model "
                          f"directory (save_pretrained output or a `shardwise convert` export).")
    tokenizer = AutoTokenizer.from_pretrained(str(root))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    tokenizer.padding_side = "left"
    config = AutoConfig.from_pretrained(str(root))
    with shardwise.OnDevice(dtype=torch.float32, device="meta"):
        model = AutoModelForCausalLM.from_config(config)
    kwargs = {"checkpoint": str(root), "replace_with_kernel_inject": not args.no_kernel_inject,
              "tensor_parallel": {"tp_size": args.tp}, "max_out_tokens": args.max_out_tokens}
    if args.dtype:
        kwargs["dtype"] = args.dtype
    elif torch.cuda.is_available():
        kwargs["dtype"] = "bf16"
    return tokenizer, shardwise.init_inference(model, **kwargs)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tp > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import shardwise
        shardwise.init_distributed()
    tokenizer, engine = _load(args)
    batch = tokenizer(args.prompt, return_tensors="pt", padding=True)
    gen = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample,
           "pad_token_id": tokenizer.pad_token_id}
    for key in ("temperature", "top_k", "top_p"):
        if getattr(args, key) is not None:
            gen[key] = getattr(args, key)
    engine.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=1)
    start = time.perf_counter()
    out = engine.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **gen)
    if engine.device.type == "cuda":
        import torch
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    new = out.shape[1] - batch["input_ids"].shape[1]
    if int(os.environ.get("RANK", "0")) == 0:
        for row in out:
            print(tokenizer.decode(row, skip_special_tokens=True))
        print(f"[shardwise generate] {new} new tokens x {out.shape[0]} sequences in {seconds:.2f} s: "
              f"{new * out.shape[0] / max(seconds, 1e-9):.1f} tokens/s "
              f"(fast path: {engine.decoder is not None}, dtype {engine.dtype}, tp {args.tp})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
