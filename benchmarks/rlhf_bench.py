"""RLHF actor benchmark (issue 23): generation, training step and switch time of one engine.

    python benchmarks/rlhf_bench.py --quick                  # 1.1B, ~5 device minutes
    python benchmarks/rlhf_bench.py --sizes 1.1b --out rows.json   # then --sizes 7b, same --out
    python benchmarks/rlhf_bench.py --device cpu --sizes tiny --batches 2 --prompt 16 --new 8

Each (size, variant, batch) runs in a fresh process. One PPO-style actor iteration is
``eval() -> generate(batch prompts, new tokens) -> train() -> forward/backward/step`` on a
random-init Llama (bf16, ZeRO-3, AdamW; the 7B offloads its optimizer to CPU on one GPU).
Variants:

* ``sw_hybrid``: shardwise with ``hybrid_engine`` (gather once, in-place refreshed fast path);
* ``sw_zero3``: shardwise ZeRO-3 without it: ``engine.generate`` is the module's Hugging Face
  ``generate``, whose ZeRO-3 hooks gather every layer for every token;
* ``ds_hybrid``: DeepSpeed's ``hybrid_engine`` (its inference kernels are JIT-built on first
  use; a failure is reported as the row's error).

``sw_hybrid@OPTIONS`` builds the hybrid engine's compiled decode step with ``DecodeOptions``
(``+``-joined, as ``decode_probe.py --jobs`` takes them), e.g.
``--variants sw_hybrid,sw_hybrid@attention=reduction,sw_zero3``.

Reported per row: generation tokens/s (batch x new tokens / generate time, prefill included),
train step time, switch time (train -> generate -> train: the gather + copy into the
inference layout + release; 0 for plain ZeRO-3, which never switches), one full all-gather of
the parameters for scale, peak memory of the iteration and the first iteration's time (build,
compile, graph capture). The ratio table comes last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's shardwise (children too)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child_run import LLAMA_SHAPES, run_child  # noqa: E402

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    **{k: LLAMA_SHAPES[k] for k in ("1.1b", "7b")},
}
VARIANTS = ["sw_hybrid", "sw_zero3", "ds_hybrid"]
LABELS = {"sw_hybrid": "shardwise hybrid", "sw_zero3": "ZeRO-3 module.generate",
          "ds_hybrid": "DeepSpeed hybrid"}


# --- the physical limit ---------------------------------------------------------------------
def decode_bytes(shape: Dict[str, int], batch: int, visible: float, dtype_bytes: int = 2) -> float:
    """Bytes one greedy decode step must read at least: every projection weight and the LM
    head once (one embedding row is negligible), and the K/V of ``visible`` positions for each
    of ``batch`` sequences in every layer."""
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i
    weights = layers * per_layer + shape["vocab_size"] * h
    cache = batch * layers * 2 * kv * visible
    return (weights + cache) * dtype_bytes


def generation_floor_s(shape: Dict[str, int], batch: int, prompt: int, new: int,
                       bandwidth: float) -> float:
    """The least time ``new`` decode steps can take at ``bandwidth`` bytes/s (prefill left
    out): each step reads ``decode_bytes`` with, on average, prompt + (new + 1) / 2 written
    positions. A ratio against plain ZeRO-3 above its generate time over this is impossible."""
    return new * decode_bytes(shape, batch, prompt + (new + 1) / 2) / bandwidth


# --- one measurement (child process) -------------------------------------------------------
def _config(size: str, variant: str, args: argparse.Namespace, max_tokens: int) -> Dict[str, Any]:
    cuda = args.device == "cuda"
    zero: Dict[str, Any] = {"stage": 3}
    if size == "7b" and cuda:
        zero["offload_optimizer"] = {"device": "cpu"}  # 84 GB of fp32 masters + Adam states
    cfg: Dict[str, Any] = {"train_micro_batch_size_per_gpu": args.train_batch,
                           "zero_optimization": zero, "bf16": {"enabled": cuda},
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-6}},
                           "steps_per_print": 10 ** 6}
    if variant != "sw_zero3":
        cfg["hybrid_engine"] = {"enabled": True, "max_out_tokens": max_tokens}
    return cfg


def _build(size: str, device: str) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**SIZES[size], max_position_embeddings=4096, eos_token_id=None,
                      bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.generation_config.eos_token_id = None
    return model


def base_variant(variant: str) -> str:
    """``sw_hybrid@attention=split`` -> ``sw_hybrid``."""
    return variant.partition("@")[0]


def label(variant: str) -> str:
    base, _, options = variant.partition("@")
    return LABELS[base] + (f" @{options}" if options else "")


def _engine(size: str, variant: str, args: argparse.Namespace, max_tokens: int):
    model = _build(size, args.device)
    variant, _, options = variant.partition("@")
    cfg = _config(size, variant, args, max_tokens)
    if variant.startswith("ds"):
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(k, v)
        import deepspeed
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        return engine, deepspeed.zero.GatheredParameters
    import shardwise
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    if options:
        from shardwise.inference.options import DecodeOptions
        engine.decode_options = DecodeOptions.parse(options)
    return engine, shardwise.zero.GatheredParameters


def _sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def _iteration(engine: Any, variant: str, ids: Any, new: int, train_batch: int, device: str):
    import torch
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine.eval()
    _sync(device)
    t0 = time.perf_counter()
    seq = engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False)
    _sync(device)
    gen_s = time.perf_counter() - t0
    switch_s = 0.0
    variant = base_variant(variant)
    if variant == "sw_hybrid":
        switch_s = engine.generate_stats["gather_s"]
    elif variant == "ds_hybrid":
        switch_s = float(engine._gather_latency)
    engine.train()
    t1 = time.perf_counter()
    micro = seq[:train_batch]
    loss = engine(micro, labels=micro).loss
    engine.backward(loss)
    engine.step()
    _sync(device)
    train_s = time.perf_counter() - t1
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    return dict(gen_s=gen_s, switch_s=switch_s, train_s=train_s, peak_gib=peak,
                iter_s=time.perf_counter() - t0)


def measure(size: str, variant: str, batch: int, args: argparse.Namespace) -> Dict[str, Any]:
    import torch
    row: Dict[str, Any] = {"size": size, "variant": variant, "batch": batch}
    t0 = time.perf_counter()
    engine, gathered = _engine(size, variant, args, args.prompt + args.new)
    ids = torch.randint(0, SIZES[size]["vocab_size"], (batch, args.prompt), device=args.device)
    params = list(engine.module.parameters())
    _sync(args.device)
    g0 = time.perf_counter()
    with gathered(params):
        _sync(args.device)
    _sync(args.device)
    row["allgather_s"] = time.perf_counter() - g0
    _iteration(engine, variant, ids, args.new, args.train_batch, args.device)  # build/compile/warm
    row["first_iter_s"] = time.perf_counter() - t0
    runs = [_iteration(engine, variant, ids, args.new, args.train_batch, args.device)
            for _ in range(args.repeats)]
    best = min(runs, key=lambda r: r["iter_s"])
    row.update(best, gen_tok_s=batch * args.new / best["gen_s"])
    from _infer_measure import copy_bandwidth
    bandwidth = copy_bandwidth(torch, args.device) if base_variant(variant) == "sw_hybrid" else None
    if bandwidth:
        row["copy_tb_s"] = bandwidth / 1e12
        row["floor_gen_s"] = generation_floor_s(SIZES[size], batch, args.prompt, args.new, bandwidth)
    return row


# --- the driver ----------------------------------------------------------------------------
def _child(args: argparse.Namespace, size: str, variant: str, batch: int) -> Dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--sizes", size, "--variants", variant,
           "--batches", str(batch), "--prompt", str(args.prompt), "--new", str(args.new),
           "--train-batch", str(args.train_batch), "--device", args.device,
           "--repeats", str(args.repeats)]
    return run_child(cmd, {"size": size, "variant": variant, "batch": batch}, args.timeout)


def _find(rows: List[Dict[str, Any]], row: Dict[str, Any], variant: str) -> Optional[Dict[str, Any]]:
    for other in rows:
        if (other["size"], other["batch"], other["variant"]) == (row["size"], row["batch"], variant) \
                and "error" not in other:
            return other
    return None


def _ratio(a: Optional[Dict[str, Any]], b: Optional[Dict[str, Any]], key: str) -> str:
    if a is None or b is None or not b.get(key):
        return "-"
    return f"{a[key] / b[key]:.2f}x"


def print_tables(rows: List[Dict[str, Any]]) -> None:
    print(f"\n{'size':5} {'variant':40} {'B':>3} {'gen tok/s':>10} {'gen s':>7} {'train s':>8} "
          f"{'switch s':>8} {'allgather s':>11} {'peak GiB':>8} {'1st iter s':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['size']:5} {label(r['variant']):40} {r['batch']:>3} FAILED: {r['error']}")
            continue
        print(f"{r['size']:5} {label(r['variant']):40} {r['batch']:>3} {r['gen_tok_s']:10.1f} "
              f"{r['gen_s']:7.2f} {r['train_s']:8.2f} {r['switch_s']:8.3f} {r['allgather_s']:11.3f} "
              f"{r['peak_gib']:8.1f} {r['first_iter_s']:10.1f}")
    floors = [r for r in rows if "floor_gen_s" in r and base_variant(r["variant"]) == "sw_hybrid"]
    if floors:  # the physical limit next to the ratios: the weights and KV read once a step
        print(f"\nHBM floor (weights + the written KV read once a step, at the copy bandwidth; "
              f"prefill left out):")
        for r in floors:
            plain = _find(rows, r, "sw_zero3")
            bound = f"{plain['gen_s'] / r['floor_gen_s']:.2f}x" if plain else "-"
            print(f"        {r['size']:5} {r['batch']:>3} {label(r['variant']):40} floor "
                  f"{r['floor_gen_s']:.2f} s at {r['copy_tb_s']:.2f} TB/s, measured at "
                  f"{r['floor_gen_s'] / r['gen_s']:.0%} of it; gen vs ZeRO-3 at most {bound}")
    print(f"\nratios: {'size':5} {'B':>3} {'variant':40} {'gen vs ZeRO-3 (>=10x)':>22} "
          f"{'gen vs DeepSpeed (>=1.2x)':>26} {'switch / allgather (<=2x)':>26}")
    for r in rows:
        if base_variant(r["variant"]) != "sw_hybrid" or "error" in r:
            continue
        switch = f"{r['switch_s'] / r['allgather_s']:.2f}x" if r["allgather_s"] > 0 else "-"
        print(f"        {r['size']:5} {r['batch']:>3} {label(r['variant']):40} "
              f"{_ratio(r, _find(rows, r, 'sw_zero3'), 'gen_tok_s'):>22} "
              f"{_ratio(r, _find(rows, r, 'ds_hybrid'), 'gen_tok_s'):>26} {switch:>26}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="RLHF actor: hybrid engine vs ZeRO-3 generate vs DeepSpeed")
    p.add_argument("--sizes", default="1.1b,7b")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batches", default="16,64")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--train-batch", type=int, default=8, help="sequences per training micro step")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout", type=int, default=900, help="seconds per child process")
    p.add_argument("--quick", action="store_true",
                   help="1.1B, batch 16, 128 new tokens, shardwise variants, one timed iteration")
    p.add_argument("--out", default=None, help="JSON file of rows: rows of earlier (split) runs "
                   "are read first, this run's are added, and the tables cover them all")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.batches, args.new, args.repeats = "1.1b", "16", 128, 1
        args.variants, args.timeout = "sw_hybrid,sw_zero3", min(args.timeout, 240)
    sizes, variants = args.sizes.split(","), args.variants.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(measure(sizes[0], variants[0], batches[0], args)), flush=True)
        return 0
    rows: List[Dict[str, Any]] = []
    if args.out and os.path.exists(args.out):
        with open(args.out) as f:
            rows = json.load(f)
    for size in sizes:
        for batch in batches:
            for variant in variants:
                row = _child(args, size, variant, batch)
                rows = [r for r in rows if (r["size"], r["variant"], r["batch"]) != (size, variant, batch)]
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(rows, f, indent=1)
    print_tables(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
