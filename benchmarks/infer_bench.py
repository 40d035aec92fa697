"""Decode benchmark: Hugging Face eager / static+compile, DeepSpeed init_inference, shardwise.

Every (model, variant, batch) runs in a fresh Python process (the static-cache compile of
transformers must not see another batch size's graphs; a crash or OOM costs one row), on a
random-init Llama in bf16, prompt ``--prompt`` tokens, ``--new`` new tokens, greedy.

Per row: decode tokens/s (all sequences), ms per token, fraction of the HBM bound (measured
device-to-device copy bandwidth / weight bytes per step, the bf16 weights for every variant),
prefill time (a 1-token generate), peak memory, cold start (model build + engine + first
generate: load, compile and graph capture) and the first token's latency once warm. A ratio
table comes last.

    python benchmarks/infer_bench.py                       # everything the issue lists
    python benchmarks/infer_bench.py --sizes 1.1b --batches 1 --variants sw_inject,hf_static
    python benchmarks/infer_bench.py --sizes 7b --batches 8 --out rows.json   # split runs add up
    python benchmarks/infer_bench.py --merge rows_a.json rows_b.json             # one table
    python benchmarks/infer_bench.py --device cpu --sizes tiny --batches 1 --new 8 --prompt 16 \
        --variants hf_eager,sw_eager,sw_inject                       # CPU smoke run

DeepSpeed on the GPU machine: install the wheels of scripts/prepare_device_wheels.sh first.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child_run import LLAMA_SHAPES, run_child, tok_s_ratio  # noqa: E402

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    **{k: LLAMA_SHAPES[k] for k in ("1.1b", "7b")},
}
VARIANTS = ["hf_eager", "hf_static", "ds", "ds_inject", "sw_eager", "sw_inject", "sw_int8"]
LABELS = {"hf_eager": "HF eager", "hf_static": "HF static+compile", "ds": "DeepSpeed",
          "ds_inject": "DeepSpeed inject", "sw_eager": "shardwise eager",
          "sw_inject": "shardwise inject", "sw_int8": "shardwise int8 inject"}


# --- one measurement (child process) -------------------------------------------------------
def _copy_bandwidth(torch: Any, device: str) -> Optional[float]:
    if device != "cuda":
        return None
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / 20
    del x, y
    return 2 * (1 << 30) / seconds  # bytes read + written


def _build_model(torch: Any, size: str, device: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**SIZES[size], max_position_embeddings=4096, eos_token_id=None,
                      bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


def _engine(variant: str, model: Any, torch: Any, max_tokens: int, device: str) -> Any:
    dtype = "bf16" if device == "cuda" else "fp32"
    if variant.startswith("hf"):
        return model
    if variant.startswith("ds"):
        import deepspeed
        return deepspeed.init_inference(model, dtype=torch.bfloat16, max_out_tokens=max_tokens,
                                        replace_with_kernel_inject=variant == "ds_inject")
    import shardwise
    if variant == "sw_eager":
        return shardwise.init_inference(model, dtype=dtype)
    return shardwise.init_inference(model, dtype="int8" if variant == "sw_int8" else dtype,
                                    replace_with_kernel_inject=True, max_out_tokens=max_tokens)


def _fixed_text_ids(torch: Any, size: str, device: str) -> Any:
    """quant.FIXED_TEXT as byte ids (no tokenizer needed; the same tokens every run)."""
    from shardwise.inference.quant import FIXED_TEXT
    data = list(FIXED_TEXT.encode("utf-8"))
    return torch.tensor([data], device=device) % SIZES[size]["vocab_size"]


def _perplexity(model: Any, ids: Any) -> float:
    from shardwise.inference.quant import perplexity
    return perplexity(lambda x: model(x).logits, ids)


def _sync(torch: Any, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_generate(torch: Any, engine: Any, ids: Any, mask: Any, new: int, extra: Dict, device: str) -> float:
    _sync(torch, device)
    start = time.perf_counter()
    engine.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, **extra)
    _sync(torch, device)
    return time.perf_counter() - start


def measure(size: str, variant: str, batch: int, prompt: int, new: int, device: str,
            repeats: int) -> Dict[str, Any]:
    import torch
    row: Dict[str, Any] = {"size": size, "variant": variant, "batch": batch}
    bandwidth = _copy_bandwidth(torch, device)
    t0 = time.perf_counter()
    model = _build_model(torch, size, device)
    weight_bytes = sum(p.numel() * 2 for p in model.parameters())  # bf16 weights read per step
    ids = torch.randint(0, SIZES[size]["vocab_size"], (batch, prompt), device=device)
    mask = torch.ones_like(ids)
    extra = {"cache_implementation": "static"} if variant == "hf_static" else {}
    text_ids = _fixed_text_ids(torch, size, device)
    ppl_before = _perplexity(model, text_ids) if variant == "sw_int8" else None
    engine = _engine(variant, model, torch, prompt + new, device)
    if ppl_before is not None:  # int8's accuracy cost on a fixed text (random weights: relative)
        ppl_after = _perplexity(engine.module, text_ids)
        row.update(ppl_bf16=ppl_before, ppl_int8=ppl_after,
                   ppl_delta_rel=(ppl_after - ppl_before) / ppl_before)
    _timed_generate(torch, engine, ids, mask, new, extra, device)  # compile / capture / warm up
    row["cold_start_s"] = time.perf_counter() - t0
    if variant == "hf_static":  # transformers compiles after its first call
        _timed_generate(torch, engine, ids, mask, new, extra, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    prefill = min(_timed_generate(torch, engine, ids, mask, 1, extra, device) for _ in range(repeats))
    total = min(_timed_generate(torch, engine, ids, mask, new, extra, device) for _ in range(repeats))
    decode = total - prefill
    if decode <= 0:  # timer noise on a tiny CPU run: fall back to the whole call per token
        decode = total * (new - 1) / new
    steps = new - 1
    row.update(prefill_ms=prefill * 1000, first_token_ms=prefill * 1000,
               ms_per_token=decode / steps * 1000, tok_s=batch * steps / decode,
               seq_tok_s=steps / decode)
    if bandwidth:
        bound = bandwidth / weight_bytes
        row.update(copy_tb_s=bandwidth / 1e12, hbm_bound_tok_s=bound,
                   hbm_fraction=row["seq_tok_s"] / bound,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    return row


# --- the driver ----------------------------------------------------------------------------
def _child(args: argparse.Namespace, size: str, variant: str, batch: int) -> Dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--sizes", size, "--variants", variant,
           "--batches", str(batch), "--prompt", str(args.prompt), "--new", str(args.new),
           "--device", args.device, "--repeats", str(args.repeats)]
    return run_child(cmd, {"size": size, "variant": variant, "batch": batch}, args.timeout)


def print_tables(rows: List[Dict[str, Any]]) -> None:
    print(f"\n{'size':5} {'variant':22} {'B':>3} {'tok/s':>9} {'ms/tok':>8} {'HBM%':>6} "
          f"{'prefill ms':>10} {'peak GiB':>8} {'cold s':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['size']:5} {LABELS[r['variant']]:22} {r['batch']:>3} FAILED: {r['error']}")
            continue
        hbm = f"{100 * r['hbm_fraction']:.1f}" if "hbm_fraction" in r else "-"
        peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else "-"
        print(f"{r['size']:5} {LABELS[r['variant']]:22} {r['batch']:>3} {r['tok_s']:9.1f} "
              f"{r['ms_per_token']:8.2f} {hbm:>6} {r['prefill_ms']:10.1f} {peak:>8} {r['cold_start_s']:7.1f}")
    print(f"\nratios (tokens/s): {'size':5} {'variant':22} {'B':>3} {'vs HF static':>12} "
          f"{'vs HF eager':>11} {'vs DeepSpeed':>12} {'vs sw inject':>12}")
    for r in rows:
        if "error" in r:
            continue
        print(f"                   {r['size']:5} {LABELS[r['variant']]:22} {r['batch']:>3} "
              f"{tok_s_ratio(rows, r, 'hf_static'):>12} {tok_s_ratio(rows, r, 'hf_eager'):>11} "
              f"{tok_s_ratio(rows, r, 'ds'):>12} {tok_s_ratio(rows, r, 'sw_inject'):>12}")


def _sorted(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    order = {v: i for i, v in enumerate(VARIANTS)}
    return sorted(rows, key=lambda r: (r["size"], r["batch"], order.get(r["variant"], 99)))


def print_int8_accuracy(rows: List[Dict[str, Any]]) -> None:
    for r in rows:
        if "ppl_int8" in r:
            print(f"int8 accuracy {r['size']} B={r['batch']}: perplexity on quant.FIXED_TEXT "
                  f"{r['ppl_bf16']:.3f} (bf16) -> {r['ppl_int8']:.3f} (int8), "
                  f"{100 * r['ppl_delta_rel']:+.3f}%")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1.1b,7b")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout", type=int, default=600, help="seconds per child process")
    p.add_argument("--out", default=None, help="JSON file of rows: read first, rows of this run "
                                               "replace or join them, the table covers all")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="print the tables of rows saved by earlier runs (--out files); run nothing")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.merge:
        rows = [row for path in args.merge for row in json.loads(Path(path).read_text())]
        print_int8_accuracy(rows)
        print_tables(_sorted(rows))
        return 0
    sizes, variants = args.sizes.split(","), args.variants.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(measure(sizes[0], variants[0], batches[0], args.prompt, args.new,
                                 args.device, args.repeats)), flush=True)
        return 0
    out = Path(args.out) if args.out else None
    rows = json.loads(out.read_text()) if out is not None and out.is_file() else []
    for size in sizes:
        for batch in batches:
            for variant in variants:
                row = _child(args, size, variant, batch)
                rows = [r for r in rows if (r["size"], r["variant"], r["batch"]) != (size, variant, batch)]
                rows.append(row)
                if out is not None:  # saved after every row, so split or cut-off runs add up
                    out.write_text(json.dumps(rows, indent=1))
                print(json.dumps(row), flush=True)
    print_int8_accuracy(rows)
    print_tables(_sorted(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
