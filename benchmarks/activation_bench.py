"""Step time and peak memory of a Llama under each activation policy.

Default: the 1.1B Llama (hidden 2048, 22 layers, GQA 32/4 heads, vocab 32000) in bf16, micro
batch 8 x 2048 tokens, AdamW, on CUDA. Settings: ``none`` (no checkpointing), ``full``,
``selective`` (norms and the MLP's elementwise ops recomputed), ``selective_ops`` (torch's
op-level selective checkpoint over each whole layer: the previous ``selective``), ``offload``
(activations to pinned host memory, no recompute) and, on request, ``full_cpu`` (full with
``cpu_checkpointing``). Sizes are flags, so a tiny model smoke-tests
the script on CPU::

    python benchmarks/activation_bench.py                      # the GPU benchmark
    python benchmarks/activation_bench.py --device cpu --hidden 64 --layers 2 --intermediate 128 \\
        --heads 4 --kv-heads 2 --vocab 256 --micro-batch 2 --seq 64 --steps 2 --warmup 1

Columns: step time, ratio to ``none``, the estimator's activation bytes for that policy, the
activation bytes measured after the forward (allocated minus what was allocated before it),
and the peak allocated memory of the step (last).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import shardwise  # noqa: E402
from _common import add_shape_args  # noqa: E402
from shardwise.profiling.memory_estimator import GiB, estimate_activations, model_shape  # noqa: E402

ck = shardwise.checkpointing
SETTINGS = ("none", "full", "selective", "selective_ops", "offload", "full_cpu")
# Both selective policies keep the same number of bytes (different tensors): one estimate.
_ESTIMATE_MODE = {"none": False, "full": "full", "selective": "selective", "selective_ops": "selective",
                  "offload": "offload", "full_cpu": "cpu"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(p)
    p.add_argument("--steps", type=int, default=5, help="timed steps per setting")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per setting")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--settings", default="none,full,selective,selective_ops,offload",
                   help=f"comma-separated, from {', '.join(SETTINGS)}")
    return p


def _build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                         intermediate_size=args.intermediate, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, vocab_size=args.vocab, use_cache=False,
                         max_position_embeddings=max(2048, args.seq), attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16 if args.dtype == "bf16" else torch.float32).train()


def _prepare(model: torch.nn.Module, setting: str) -> None:
    ck.configure(checkpoint_in_cpu=setting == "full_cpu")
    if setting != "none":
        ck.apply(model, "full" if setting == "full_cpu" else setting)


def _run(args: argparse.Namespace, setting: str, device: torch.device) -> Dict[str, Optional[float]]:
    cuda = device.type == "cuda"
    model = _build(args, device)
    _prepare(model, setting)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq), device=device)
    times: List[float] = []
    act = peak = base = None
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            base = before  # weights + optimizer states (gradients are set to None)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        if cuda:
            act = torch.cuda.memory_allocated() - before
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    e = 2 if args.dtype == "bf16" else 4
    est = estimate_activations(model_shape(model), args.micro_batch, args.seq, "bf16" if e == 2 else "fp32",
                               _ESTIMATE_MODE[setting]).device
    grads = sum(p.numel() for p in model.parameters()) * e
    # the estimate of the peak: what lives before forward + activations + the gradients
    est_peak = None if base is None else base + est + grads
    del model, opt, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"step": sum(times) / len(times), "est": est, "act": act, "peak": peak,
            "est_peak": est_peak}


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        print(f"unknown setting(s) {bad}; choose from {', '.join(SETTINGS)}", file=sys.stderr)
        return 2
    print(f"Llama h={args.hidden} L={args.layers} i={args.intermediate} heads={args.heads}/{args.kv_heads} "
          f"V={args.vocab}, {args.dtype}, micro batch {args.micro_batch} x {args.seq}, {device}, "
          f"torch {torch.__version__}")
    results = {s: _run(args, s, device) for s in settings}
    base = results.get("none", next(iter(results.values())))["step"]
    gib = lambda v: "n/a" if v is None else f"{v / GiB:.2f}"  # noqa: E731
    print(f"{'setting':<14}{'step s':>9}{'ratio':>8}{'est act GiB':>13}{'act GiB':>10}{'est/act':>9}"
          f"{'peak GiB':>10}{'est peak':>10}{'est/peak':>10}")
    for name, r in results.items():
        ratio = r["est"] / r["act"] if r["act"] else None
        pk = r["est_peak"] / r["peak"] if r["peak"] and r["est_peak"] else None
        print(f"{name:<14}{r['step']:>9.3f}{r['step'] / base:>8.2f}{gib(r['est']):>13}{gib(r['act']):>10}"
              f"{'n/a' if ratio is None else f'{ratio:.2f}':>9}{gib(r['peak']):>10}"
              f"{gib(r['est_peak']):>10}{'n/a' if pk is None else f'{pk:.2f}':>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
