"""ZeRO-Inference benchmark: generate with weights streamed from host memory / NVMe.

Every (size, variant, batch) row runs in a fresh Python process with its own timeout (pinned
host memory and swap files are released between rows; an OOM or a hang costs one row); the
rows are written to ``--out`` (JSON) after each child. Random-init Llama in bf16, prompt
``--prompt`` tokens, greedy, every row runs all its new tokens (no EOS).

Variants: shardwise ``init_inference`` with ``zero.offload_param`` (kernel injection on):
``sw_cpu_bf16``, ``sw_cpu_int8``, ``sw_cpu_int4`` (weight_quantization, groups of 64),
``sw_nvme_bf16``, ``sw_nvme_int4`` (swap files under ``--nvme-path``), ``sw_cpu_bf16_kv``
(``kv_offload: true``: the KV cache in pinned host memory too); ``hf_accel`` (Hugging Face
Accelerate ``cpu_offload``: every weight on the CPU, copied per module); ``ds_z3`` (DeepSpeed
ZeRO-3 with ``offload_param`` cpu + pin_memory, ``engine.module.generate``). DeepSpeed's NVMe
offload is not run: its aio op builds against libaio, which the GPU machine lacks (a note in
the table).

Model build: the shardwise rows build the model on the meta device and make each layer's
random weights on the GPU (``weight_store.RandomWeights``), quantized there when asked, then
copied into the layer's pinned host buffer (or swap file): a 70B model in int4 never exists
whole, and the build takes seconds. The baselines need a whole host model: one random block
tiled over every matrix (memcpy speed; a serial ``normal_`` over 7B values takes minutes).

Per row: decode tokens/s (all sequences; a 1-token generate's time is subtracted, so prefill
is out), the bytes streamed per decode step (``LayerStreamer.bytes_per_pass`` for shardwise,
plus the K/V bytes with kv_offload; the bf16 size of the decoder layers for the others), the
pinned host-to-device GB/s measured in the same process, the fraction of that PCIe bound
(steps/s x bytes per step / GB/s; NVMe rows: also of the swap files' measured read speed),
prefill time, peak device memory, build time. A ratio table comes last.

    python benchmarks/zero_inference_bench.py --plan issue22 --out zi.json   # <= 9 minutes
    python benchmarks/zero_inference_bench.py --plan issue22 --dry-run       # rows + estimates
    python benchmarks/zero_inference_bench.py --sizes 70b --variants sw_cpu_int4 --batches 1
    python benchmarks/zero_inference_bench.py --sizes 7b --batches auto --variants sw_cpu_bf16
    python benchmarks/zero_inference_bench.py --merge a.json,b.json --out all.json
DeepSpeed rows need the wheels of scripts/prepare_device_wheels.sh; ``--nvme-path`` should be on
a local NVMe disk (default: $TMPDIR).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's shardwise (children too)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child_run import LLAMA_SHAPES, run_child, tok_s_ratio  # noqa: E402
from _zi_plan import PLANS, Row, estimate_s  # noqa: E402

SIZES = {
    "tiny": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    **{k: LLAMA_SHAPES[k] for k in ("1.1b", "7b", "13b")},
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=32000),
}
VARIANTS = ["sw_cpu_bf16", "sw_cpu_int8", "sw_cpu_int4", "sw_nvme_bf16", "sw_nvme_int4",
            "sw_cpu_bf16_kv", "hf_accel", "ds_z3"]
NOTES = {"ds_z3": "DeepSpeed rows stream from offload_param device cpu (pinned), its ZeRO-Inference default"}


# --- one measurement (child process) -------------------------------------------------------
def h2d_gbps(torch: Any) -> float:
    """Pinned host -> device copy bandwidth, GB/s (10^9 B/s), 1 GiB copies."""
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del src, dst
    return 5 * (1 << 30) / seconds / 1e9


def _config(torch: Any, size: str) -> Any:
    from transformers import LlamaConfig
    return LlamaConfig(max_position_embeddings=4096, eos_token_id=None, bos_token_id=None,
                       pad_token_id=None, **SIZES[size])


def meta_model(torch: Any, size: str) -> Any:
    """The Llama on the meta device (no memory anywhere)."""
    import shardwise
    from transformers import LlamaForCausalLM
    with shardwise.OnDevice(dtype=torch.bfloat16, device="meta"):
        model = LlamaForCausalLM(_config(torch, size))
    model.generation_config.eos_token_id = None  # random weights: every row runs all tokens
    return model.eval()


def host_model(torch: Any, size: str) -> Any:
    """The whole random-init bf16 Llama on the host (for the baselines)."""
    model = meta_model(torch, size)
    block = torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)).mul_(0.02).bfloat16()
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            value = torch.empty(p.numel(), dtype=torch.bfloat16)
            if p.dim() == 1:
                value.fill_(1.0)
            else:
                for start in range(0, p.numel(), block.numel()):
                    n = min(block.numel(), p.numel() - start)
                    value[start:start + n].copy_(block[:n])
            module._parameters[name] = torch.nn.Parameter(value.view(p.shape), requires_grad=False)
    return model


def layer_bytes(size: str) -> int:
    """bf16 bytes of the decoder layers."""
    s = SIZES[size]
    h, f, heads, kv = (s["hidden_size"], s["intermediate_size"], s["num_attention_heads"],
                       s["num_key_value_heads"])
    per = 2 * h * h + 2 * h * (h // heads) * kv + 3 * h * f + 2 * h
    return 2 * per * s["num_hidden_layers"]


def _sw_engine(torch: Any, size: str, variant: str, max_tokens: int, nvme: str) -> Any:
    from shardwise.inference.config import load_inference_config
    from shardwise.inference.engine import InferenceEngine
    from shardwise.inference.weight_store import RandomWeights
    parts = variant.split("_")
    where, fmt = parts[1], parts[2]
    off: Dict[str, Any] = {"device": where, "pin_memory": True}
    if where == "nvme":
        off["nvme_path"] = nvme
    cfg: Dict[str, Any] = {"dtype": "bf16", "replace_with_kernel_inject": True,
                           "max_out_tokens": max_tokens, "kv_offload": variant.endswith("_kv"),
                           "zero": {"stage": 3, "offload_param": off}}
    if fmt in ("int8", "int4"):
        cfg["weight_quantization"] = {"quantized_initialization": {"num_bits": int(fmt[3:]),
                                                                   "group_size": 64}}
    return InferenceEngine(meta_model(torch, size), load_inference_config(cfg),
                           layer_weights=RandomWeights(std=0.02, seed=0))


def _ds_engine(torch: Any, model: Any) -> Any:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import deepspeed
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    engine.module.eval()
    return engine.module


def make_engine(torch: Any, size: str, variant: str, max_tokens: int, nvme: str) -> Any:
    if variant.startswith("sw_"):
        return _sw_engine(torch, size, variant, max_tokens, nvme)
    model = host_model(torch, size)
    if variant == "hf_accel":
        from accelerate import cpu_offload
        cpu_offload(model, execution_device=torch.device("cuda:0"))
        return model
    if variant == "ds_z3":
        return _ds_engine(torch, model)
    raise SystemExit(f"unknown variant {variant}")


def _sync(torch: Any) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(torch: Any, engine: Any, ids: Any, new: int) -> float:
    _sync(torch)
    start = time.perf_counter()
    engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                    min_new_tokens=new, do_sample=False, pad_token_id=0)
    _sync(torch)
    return time.perf_counter() - start


def disk_gbps(streamer: Any) -> float:
    """Read speed of the swap files through the streamer's own IO handle, GB/s."""
    start = time.perf_counter()
    total = streamer.read_swap_files()
    return total / (time.perf_counter() - start) / 1e9 if total else float("nan")


def kv_step_bytes(size: str, batch: int, prompt: int, new: int) -> float:
    """Mean K/V bytes one decode step moves up with kv_offload (bf16, the filled prefix)."""
    s = SIZES[size]
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    per_pos = 2 * s["num_key_value_heads"] * head_dim * 2 * batch * s["num_hidden_layers"]
    return per_pos * (prompt + new / 2)


def measure(args: argparse.Namespace, size: str, variant: str, batch: Any) -> Dict[str, Any]:
    import torch
    cuda = torch.cuda.is_available()
    if args.mem_cap_gib and cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.mem_cap_gib * 2**30 / total))
    gbps = h2d_gbps(torch) if cuda else float("nan")  # CPU smoke runs: no PCIe numbers
    start = time.perf_counter()
    engine = make_engine(torch, size, variant, args.prompt + args.new, args.nvme_path)
    _sync(torch)
    build_s = time.perf_counter() - start
    streamer = getattr(engine, "streamer", None)
    label = batch
    if batch == "auto":  # shardwise's max_batch_size="auto": the largest batch that fits
        if streamer is None:
            raise SystemExit("batch 'auto' is for the shardwise variants")
        from shardwise.inference.zero_inference import auto_batch_size
        batch = min(args.auto_cap, auto_batch_size(engine, args.prompt, args.new))
    batch = int(batch)
    step_bytes = float(streamer.bytes_per_pass if streamer is not None else layer_bytes(size))
    if variant.endswith("_kv"):
        step_bytes += kv_step_bytes(size, batch, args.prompt, args.new)
    ids = torch.randint(3, SIZES[size]["vocab_size"], (batch, args.prompt),
                        generator=torch.Generator().manual_seed(1)).to("cuda" if cuda else "cpu")
    _timed(torch, engine, ids, 2)  # warm-up
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t1 = _timed(torch, engine, ids, 1)
    tn = _timed(torch, engine, ids, args.new)
    steps_s = (args.new - 1) / max(tn - t1, 1e-9)
    row = dict(size=size, variant=variant, batch=label, rows=batch, new=args.new,
               tok_s=batch * steps_s, steps_s=steps_s, prefill_s=t1, step_mb=step_bytes / 1e6,
               h2d_gbps=gbps, pcie_fraction=steps_s * step_bytes / (gbps * 1e9),
               peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
               build_s=build_s)
    if streamer is not None:
        row["window"] = streamer.window
        if "_nvme_" in variant:
            row["disk_gbps"] = disk_gbps(streamer)
            row["disk_fraction"] = steps_s * step_bytes / (row["disk_gbps"] * 1e9)
        streamer.close()
    if variant in NOTES:
        row["note"] = NOTES[variant]
    return row


# --- the driver ----------------------------------------------------------------------------
def _child(args: argparse.Namespace, row: Row, timeout: float) -> Dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--sizes", row.size, "--variants", row.variant,
           "--batches", str(row.batch), "--prompt", str(args.prompt), "--new", str(row.new),
           "--nvme-path", args.nvme_path, "--auto-cap", str(args.auto_cap),
           "--mem-cap-gib", str(args.mem_cap_gib)]
    return run_child(cmd, {"size": row.size, "variant": row.variant, "batch": row.batch},
                     timeout)


def _b(row: Dict[str, Any]) -> str:
    return f"auto={row['rows']}" if row["batch"] == "auto" and "rows" in row else str(row["batch"])


def print_tables(rows: List[Dict[str, Any]]) -> None:
    print(f"\n{'size':5} {'variant':14} {'B':>3} {'tok/s':>8} {'MB/step':>8} {'H2D GB/s':>8} "
          f"{'PCIe%':>6} {'disk%':>6} {'prefill s':>9} {'peak GiB':>8} {'build s':>7}")
    for r in rows:
        if "error" in r or "skipped" in r:
            print(f"{r['size']:5} {r['variant']:14} {r['batch']:>3} "
                  f"{'FAILED: ' + r['error'] if 'error' in r else 'skipped: ' + r['skipped']}")
            continue
        disk = f"{100 * r['disk_fraction']:6.1f}" if "disk_fraction" in r else f"{'-':>6}"
        print(f"{r['size']:5} {r['variant']:14} {_b(r):>3} {r['tok_s']:8.2f} {r['step_mb']:8.0f} "
              f"{r['h2d_gbps']:8.1f} {100 * r['pcie_fraction']:6.1f} {disk} {r['prefill_s']:9.2f} "
              f"{r['peak_gib']:8.1f} {r['build_s']:7.1f}")
    print(f"\nratios (tokens/s): {'size':5} {'variant':14} {'B':>3} {'vs DeepSpeed':>12} "
          f"{'vs Accelerate':>13} {'vs sw bf16':>10}")
    for r in rows:
        if "tok_s" in r:
            print(f"                   {r['size']:5} {r['variant']:14} {_b(r):>3} "
                  f"{tok_s_ratio(rows, r, 'ds_z3'):>12} {tok_s_ratio(rows, r, 'hf_accel'):>13} "
                  f"{tok_s_ratio(rows, r, 'sw_cpu_bf16'):>10}")
    for note in sorted({r["note"] for r in rows if "note" in r}):
        print(f"note: {note}")


def _plan(args: argparse.Namespace) -> List[Row]:
    if args.plan:
        return PLANS[args.plan]
    batches = [b if b == "auto" else int(b) for b in args.batches.split(",")]
    return [Row(size, variant, batch, args.new) for size in args.sizes.split(",")
            for batch in batches for variant in args.variants.split(",")
            if not (variant in ("hf_accel", "ds_z3") and batch == "auto")]


def _key(r: Dict[str, Any]) -> tuple:
    return (r["size"], r["variant"], r["batch"])


def _save(out: Optional[Path], rows: List[Dict[str, Any]], row: Dict[str, Any]) -> List[Dict[str, Any]]:
    rows = [r for r in rows if _key(r) != _key(row)] + [row]
    if out is not None:
        out.write_text(json.dumps(rows, indent=1))
    return rows


def run_plan(args: argparse.Namespace, rows: List[Dict[str, Any]], out: Optional[Path]) -> List[Dict[str, Any]]:
    """Rows in priority order; a row whose estimate no longer fits ``--budget-s`` is skipped
    (recorded as such), and every child's timeout is what is left of the budget."""
    start = time.perf_counter()
    for row in _plan(args):
        est = estimate_s(row, SIZES, args.prompt)
        left = args.budget_s - (time.perf_counter() - start)
        key = {"size": row.size, "variant": row.variant, "batch": row.batch}
        if est > left:
            result = {**key, "skipped": f"estimate {est:.0f}s > {left:.0f}s left of --budget-s"}
        else:
            result = _child(args, row, min(args.timeout, max(30.0, left)))
            result["wall_s"] = round(time.perf_counter() - start, 1)
            result["estimate_s"] = round(est)
        rows = _save(out, rows, result)
        print(json.dumps(result), flush=True)
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", choices=sorted(PLANS), help="a fixed list of rows in priority order "
                   "(see benchmarks/_zi_plan.py); replaces --sizes/--variants/--batches/--new")
    p.add_argument("--sizes", default="7b,13b")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batches", default="1,16,64",
                   help="comma list; 'auto' = the largest batch that fits (shardwise variants)")
    p.add_argument("--auto-cap", type=int, default=256, help="upper bound for batch 'auto'")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--nvme-path", default=os.environ.get("TMPDIR", tempfile.gettempdir()))
    p.add_argument("--mem-cap-gib", type=float, default=0.0,
                   help="cap device memory per process (torch.cuda.set_per_process_memory_fraction)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per child process at most")
    p.add_argument("--budget-s", type=float, default=1e9,
                   help="wall-clock budget of the whole run: rows that no longer fit are skipped")
    p.add_argument("--dry-run", action="store_true", help="print the rows and their estimates")
    p.add_argument("--out", default=None, help="JSON file of rows (read first; rows add up)")
    p.add_argument("--merge", default=None, help="comma list of JSON row files: print them together "
                   "(and write them to --out)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        batch = args.batches if args.batches == "auto" else int(args.batches)
        print(json.dumps(measure(args, args.sizes, args.variants, batch)), flush=True)
        return 0
    if args.dry_run:
        total = 0.0
        for row in _plan(args):
            est = estimate_s(row, SIZES, args.prompt)
            total += est
            print(f"{row.size:5} {row.variant:14} B={row.batch!s:4} new={row.new:3} ~{est:4.0f}s "
                  f"(cumulative {total:4.0f}s)")
        return 0
    out = Path(args.out) if args.out else None
    rows = json.loads(out.read_text()) if out is not None and out.is_file() else []
    if args.merge:
        for name in args.merge.split(","):
            for row in json.loads(Path(name).read_text()):
                rows = _save(out, rows, row)
    else:
        rows = run_plan(args, rows, out)
    order = {v: i for i, v in enumerate(VARIANTS)}
    rows.sort(key=lambda r: (r["size"], str(r["batch"]).zfill(6), order.get(r["variant"], 99)))
    print_tables(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
