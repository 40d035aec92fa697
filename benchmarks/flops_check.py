"""Check the flops profiler against the analytic FLOPs/token of train_bench's Llama.

The profiler counts one forward pass of the benchmark model (``get_model_profile``: a
micro batch of random token ids, no autograd); fwd + bwd FLOPs per token are 3 x the
forward's (DeepSpeed's rule with recompute_fwd_factor 0). The analytic figure is
train_bench's ``6 N + 12 L h s`` (``_common.flops_per_token``: N excludes the input
embedding table, attention over the full s x s matrix). The ratio should be 1 within 5%;
the script exits 1 when it is not.

With ``--engine`` it also trains a few steps through ``shardwise.initialize`` with the
``flops_profiler`` section on (bf16, ZeRO-2, profile_step 1) and prints the engine's
summary: achieved TFLOP/s per GPU and MFU against the accelerator's peak.

    python benchmarks/flops_check.py                      # 1.1B Llama on the GPU
    python benchmarks/flops_check.py --engine             # + the engine's profile
    python benchmarks/flops_check.py --device cpu --layers 2 --hidden 64 --intermediate 128 \\
        --heads 4 --kv-heads 2 --vocab 256 --seq 32 --micro-batch 2   # CPU smoke test
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import torch  # noqa: E402

from _common import (BenchConfig, add_shape_args, build_model, count_params,  # noqa: E402
                     embedding_params, flops_per_token, make_batches)

TOLERANCE = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p, micro_batch=2)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--engine", action="store_true",
                   help="also profile step 1 of a bf16 ZeRO-2 engine and print its summary")
    p.add_argument("--json", type=Path, default=None, help="write the numbers here as JSON")
    return p.parse_args(argv)


def profiler_flops_per_token(cfg: BenchConfig, device: torch.device) -> dict:
    """Forward FLOPs/MACs of one micro batch, counted by the profiler."""
    from shardwise.profiling.flops_profiler import get_model_profile
    model = build_model(cfg, device)
    n_params, n_emb = count_params(model), embedding_params(model)
    if device.type == "cuda":
        model = model.to(torch.bfloat16)  # the count does not depend on the dtype
    ids = make_batches(cfg, device)[0]
    flops, macs, params = get_model_profile(model, kwargs={"input_ids": ids}, print_profile=False,
                                            as_string=False, warm_up=0)
    tokens = ids.numel()
    del model
    return {"n_params": n_params, "embedding_params": n_emb, "profiled_params": params,
            "fwd_flops": flops, "fwd_macs": macs, "tokens": tokens,
            "profiler_flops_per_token": 3.0 * flops / tokens,
            "analytic_flops_per_token": flops_per_token(cfg, n_params, n_emb)}


def engine_profile(cfg: BenchConfig, device: torch.device) -> dict:
    """Train three steps with the flops_profiler section on; the engine's step-1 numbers."""
    import shardwise
    model = build_model(cfg, device)
    ds_config = {"train_micro_batch_size_per_gpu": cfg.micro_batch,
                 "gradient_accumulation_steps": 1, "steps_per_print": 0,
                 "bf16": {"enabled": device.type == "cuda"},
                 "zero_optimization": {"stage": 2},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                 "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False}}
    engine, *_ = shardwise.initialize(model=model, config=ds_config)
    ids = make_batches(cfg, device)[0]
    for _ in range(3):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    result = engine._profile.result
    times = result.times
    iter_s = times.fwd + times.bwd + times.step
    return {"engine_fwd_flops": result.flops, "engine_fwd_macs": result.macs,
            "engine_fwd_s": times.fwd, "engine_bwd_s": times.bwd,
            "engine_step_s": times.step,
            "engine_tflops_per_gpu": 3 * result.flops / iter_s / 1e12}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU; pass --device cpu (and a tiny "
                         "shape) to smoke-test")
    cfg = BenchConfig(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
                      heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab, seq=args.seq,
                      micro_batch=args.micro_batch, device=args.device)
    device = torch.device(args.device)
    out = profiler_flops_per_token(cfg, device)
    ratio = out["profiler_flops_per_token"] / out["analytic_flops_per_token"]
    out["ratio"] = ratio
    print(f"model: {out['n_params'] / 1e9:.3f} B params ({out['embedding_params'] / 1e6:.1f} M "
          f"input embedding), {cfg.layers} layers, hidden {cfg.hidden}, seq {cfg.seq}")
    print(f"profiler fwd MACs: {out['fwd_macs']:.4e}  fwd FLOPs: {out['fwd_flops']:.4e} "
          f"over {out['tokens']} tokens")
    print(f"profiler FLOPs/token (3 x fwd): {out['profiler_flops_per_token']:.6e}")
    print(f"analytic FLOPs/token (6N + 12Lhs): {out['analytic_flops_per_token']:.6e}")
    print(f"ratio profiler / analytic: {ratio:.4f}  (pass: within {TOLERANCE:.0%})")
    if args.engine:
        out.update(engine_profile(cfg, device))
        print(f"engine step 1: fwd {out['engine_fwd_s'] * 1e3:.1f} ms, bwd "
              f"{out['engine_bwd_s'] * 1e3:.1f} ms, step {out['engine_step_s'] * 1e3:.1f} ms, "
              f"{out['engine_tflops_per_gpu']:.1f} TFLOP/s per GPU (model flops)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0 if abs(ratio - 1.0) <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
