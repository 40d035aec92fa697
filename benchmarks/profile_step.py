"""Where one shardwise training step spends its time: phase timings and a profiler table.

Runs one ``train_bench`` ZeRO section (same model, batch and ds_config as ``train_bench.py``)
and prints, per micro batch, the wall time of forward, backward and ``engine.step()`` with a
device synchronize after each (so the phases do not overlap: this is a diagnosis tool, not a
throughput benchmark), then ``torch.profiler``'s top operators by self CPU and by device time
over one more optimizer step.

    python benchmarks/profile_step.py --zero z3_offload --grad-accum 4
    python benchmarks/profile_step.py --device cpu --layers 2 --hidden 64 --intermediate 128 \
        --heads 4 --kv-heads 2 --vocab 256 --seq 64 --micro-batch 2 --zero z3
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import torch  # noqa: E402

from _common import BenchConfig, build_model, make_batches, synchronize  # noqa: E402
from train_bench import ZERO_SECTIONS, engine_config, set_single_process_env  # noqa: E402


def main() -> None:
    d = BenchConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zero", default="z3_offload", choices=sorted(ZERO_SECTIONS))
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "seq",
                 "micro_batch", "grad_accum"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--device", choices=["cuda", "cpu"], default=d.device)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps timed by phase")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--trace", type=Path, default=None, help="write a Chrome trace here")
    args = p.parse_args()
    cfg = BenchConfig(**{k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads",
                                                       "kv_heads", "vocab", "seq", "micro_batch",
                                                       "grad_accum")}, device=args.device)
    device = torch.device(args.device)
    set_single_process_env()
    import shardwise

    model = build_model(cfg, device)
    batches = make_batches(cfg, device)
    engine, *_ = shardwise.initialize(model=model, config=engine_config(cfg, ZERO_SECTIONS[args.zero]))

    def one_step(timed: bool) -> list:
        rows = []
        for x in batches:
            t0 = time.perf_counter()
            loss = engine(input_ids=x, labels=x).loss
            if timed:
                synchronize(device)
            t1 = time.perf_counter()
            engine.backward(loss)
            if timed:
                synchronize(device)
            t2 = time.perf_counter()
            engine.step()
            synchronize(device)
            t3 = time.perf_counter()
            rows.append((t1 - t0, t2 - t1, t3 - t2))
        return rows

    one_step(False)  # warm-up: lazy optimizer state, allocator, recorded module order
    for s in range(args.steps):
        t = time.perf_counter()
        one_step(False)
        synchronize(device)
        untimed = time.perf_counter() - t
        rows = one_step(True)
        total = sum(sum(r) for r in rows)
        print(f"step {s}: free-running {untimed:.3f} s; phases (synced) {total:.3f} s")
        for i, (f, b, st) in enumerate(rows):
            print(f"  micro {i}: forward {f:.3f}  backward {b:.3f}  step {st:.3f}")

    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        one_step(False)
        synchronize(device)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))
    if args.trace is not None:
        prof.export_chrome_trace(str(args.trace))


if __name__ == "__main__":
    main()
