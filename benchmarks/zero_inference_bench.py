"""ZeRO-Inference benchmark: generate with weights streamed from host memory / NVMe.

Every (size, variant, batch) runs in a fresh Python process (pinned host memory and swap files
are released between rows; an OOM costs one row). Random-init Llama in bf16, prompt
``--prompt`` tokens, ``--new`` new tokens, greedy.

Variants: shardwise ``init_inference`` with ``zero.offload_param`` (kernel injection on):
``sw_cpu_bf16``, ``sw_cpu_int8``, ``sw_cpu_int4`` (weight_quantization, groups of 64),
``sw_nvme_bf16``, ``sw_nvme_int4`` (swap files under ``--nvme-path``); ``hf_accel`` (Hugging
Face Accelerate ``cpu_offload``: every weight on the CPU, copied per module); ``ds_z3``
(DeepSpeed ZeRO-3 with ``offload_param`` cpu + pin_memory, ``engine.module.generate``).

Per row: decode tokens/s (all sequences; a 1-token generate's time is subtracted, so prefill
is out), the bytes streamed per decode step (``LayerStreamer.bytes_per_pass`` for shardwise;
the bf16 size of the decoder layers for the others), the measured pinned host-to-device GB/s
and the fraction of the PCIe bound (steps/s x bytes per step / GB/s), prefill time, peak device
memory, build time. A ratio table comes last.

    python benchmarks/zero_inference_bench.py --quick            # ~5 device minutes
    python benchmarks/zero_inference_bench.py                    # 7b and 13b, batch 1/16/64
    python benchmarks/zero_inference_bench.py --sizes 7b --batches auto --variants sw_cpu_bf16,sw_cpu_int4
    python benchmarks/zero_inference_bench.py --sizes 13b --mem-cap-gib 24   # a cap the model
                                                                  # does not fit next to its cache
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child_run import LLAMA_SHAPES, run_child, tok_s_ratio  # noqa: E402

SIZES = {
    "tiny": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    **{k: LLAMA_SHAPES[k] for k in ("1.1b", "7b", "13b")},
}
VARIANTS = ["sw_cpu_bf16", "sw_cpu_int8", "sw_cpu_int4", "sw_nvme_bf16", "sw_nvme_int4",
            "hf_accel", "ds_z3"]
QUICK = dict(sizes="7b", batches="1,16", new=16,
             variants="sw_cpu_bf16,sw_cpu_int4,sw_nvme_int4,hf_accel,ds_z3")


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
    return 5 * (1 << 30) / (time.perf_counter() - start) / 1e9


def build_model(torch: Any, size: str) -> Any:
    """Random-init bf16 Llama on the host, built without a float32 copy."""
    import shardwise
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(max_position_embeddings=4096, eos_token_id=None, bos_token_id=None,
                      pad_token_id=None, **SIZES[size])
    with shardwise.OnDevice(dtype=torch.bfloat16, device="meta"):
        model = LlamaForCausalLM(cfg)
    # one random block tiled over every matrix: memcpy speed (a serial normal_ over 7B values
    # takes minutes); the values only need to be realistic in scale
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
    model.generation_config.eos_token_id = None  # random weights: every row runs all tokens
    return model.eval()


def layer_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.model.layers.parameters())


def _sw_engine(torch: Any, model: Any, variant: str, max_tokens: int, nvme: str) -> Any:
    import shardwise
    _, where, fmt = variant.split("_")
    off = {"device": where, "pin_memory": True}
    if where == "nvme":
        off["nvme_path"] = nvme
    cfg: Dict[str, Any] = {"dtype": "bf16", "replace_with_kernel_inject": True,
                           "max_out_tokens": max_tokens,
                           "zero": {"stage": 3, "offload_param": off}}
    if fmt in ("int8", "int4"):
        cfg["weight_quantization"] = {"quantized_initialization": {"num_bits": int(fmt[3:]),
                                                                   "group_size": 64}}
    return shardwise.init_inference(model, config=cfg)


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


def make_engine(torch: Any, model: Any, variant: str, max_tokens: int, nvme: str) -> Any:
    if variant.startswith("sw_"):
        return _sw_engine(torch, model, variant, max_tokens, nvme)
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


def measure(args: argparse.Namespace, size: str, variant: str, batch: Any) -> Dict[str, Any]:
    import torch
    if args.mem_cap_gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.mem_cap_gib * 2**30 / total))
    cuda = torch.cuda.is_available()
    gbps = h2d_gbps(torch) if cuda else float("nan")  # CPU smoke runs: no PCIe numbers
    start = time.perf_counter()
    model = build_model(torch, size)
    bf16_layers = layer_bytes(model)
    engine = make_engine(torch, model, variant, args.prompt + args.new, args.nvme_path)
    build_s = time.perf_counter() - start
    streamer = getattr(engine, "streamer", None)
    label = batch
    if batch == "auto":  # shardwise's max_batch_size="auto": the largest batch that fits
        if streamer is None:
            raise SystemExit("batch 'auto' is for the shardwise variants")
        from shardwise.inference.zero_inference import auto_batch_size
        batch = min(args.auto_cap, auto_batch_size(engine, args.prompt, args.new))
    batch = int(batch)
    step_bytes = streamer.bytes_per_pass if streamer is not None else bf16_layers
    ids = torch.randint(3, SIZES[size]["vocab_size"], (batch, args.prompt),
                        generator=torch.Generator().manual_seed(1)).to("cuda" if cuda else "cpu")
    _timed(torch, engine, ids, 2)  # warm-up
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t1 = _timed(torch, engine, ids, 1)
    tn = _timed(torch, engine, ids, args.new)
    steps_s = (args.new - 1) / max(tn - t1, 1e-9)
    row = dict(size=size, variant=variant, batch=label, rows=batch, tok_s=batch * steps_s, steps_s=steps_s,
               prefill_s=t1, step_mb=step_bytes / 1e6, h2d_gbps=gbps,
               pcie_fraction=steps_s * step_bytes / (gbps * 1e9),
               peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0, build_s=build_s)
    if streamer is not None:
        row["window"] = streamer.window
        streamer.close()
    return row


# --- the driver ----------------------------------------------------------------------------
def _child(args: argparse.Namespace, size: str, variant: str, batch: int) -> Dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--sizes", size, "--variants", variant,
           "--batches", str(batch), "--prompt", str(args.prompt), "--new", str(args.new),
           "--nvme-path", args.nvme_path, "--mem-cap-gib", str(args.mem_cap_gib),
           "--auto-cap", str(args.auto_cap)]
    return run_child(cmd, {"size": size, "variant": variant, "batch": batch}, args.timeout)


def _b(row: Dict[str, Any]) -> str:
    return f"auto={row['rows']}" if row["batch"] == "auto" and "rows" in row else str(row["batch"])


def print_tables(rows: List[Dict[str, Any]]) -> None:
    print(f"\n{'size':5} {'variant':13} {'B':>3} {'tok/s':>8} {'MB/step':>8} {'H2D GB/s':>8} "
          f"{'PCIe%':>6} {'prefill s':>9} {'peak GiB':>8} {'build s':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['size']:5} {r['variant']:13} {r['batch']:>3} FAILED: {r['error']}")
            continue
        print(f"{r['size']:5} {r['variant']:13} {_b(r):>3} {r['tok_s']:8.2f} {r['step_mb']:8.0f} "
              f"{r['h2d_gbps']:8.1f} {100 * r['pcie_fraction']:6.1f} {r['prefill_s']:9.2f} "
              f"{r['peak_gib']:8.1f} {r['build_s']:7.1f}")
    print(f"\nratios (tokens/s): {'size':5} {'variant':13} {'B':>3} {'vs DeepSpeed':>12} "
          f"{'vs Accelerate':>13} {'vs sw bf16':>10}")
    for r in rows:
        if "error" not in r:
            print(f"                   {r['size']:5} {r['variant']:13} {_b(r):>3} "
                  f"{tok_s_ratio(rows, r, 'ds_z3'):>12} {tok_s_ratio(rows, r, 'hf_accel'):>13} "
                  f"{tok_s_ratio(rows, r, 'sw_cpu_bf16'):>10}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--quick", action="store_true", help="7b, batch 1 and 16, 16 new tokens, 5 variants")
    p.add_argument("--timeout", type=int, default=900, help="seconds per child process")
    p.add_argument("--out", default=None, help="JSON file of rows (read first; rows add up)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    sizes, variants = args.sizes.split(","), args.variants.split(",")
    batches = [b if b == "auto" else int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(measure(args, sizes[0], variants[0], batches[0])), flush=True)
        return 0
    out = Path(args.out) if args.out else None
    rows = json.loads(out.read_text()) if out is not None and out.is_file() else []
    for size in sizes:
        for batch in batches:
            for variant in variants:
                if variant in ("hf_accel", "ds_z3") and (batch == "auto" or (args.quick and batch > 1)):
                    continue  # the slow baselines: batch 1 only in the quick run, no 'auto'

                row = _child(args, size, variant, batch)
                rows = [r for r in rows if (r["size"], r["variant"], r["batch"]) != (size, variant, batch)]
                rows.append(row)
                if out is not None:
                    out.write_text(json.dumps(rows, indent=1))
                print(json.dumps(row), flush=True)
    order = {v: i for i, v in enumerate(VARIANTS)}
    rows.sort(key=lambda r: (r["size"], str(r["batch"]).zfill(6), order.get(r["variant"], 99)))
    print_tables(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
