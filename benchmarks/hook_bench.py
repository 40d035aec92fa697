"""Host overhead of each ZeRO variant, on a model too small for its compute to matter.

With 64-wide layers every kernel is tiny, so a forward or backward takes as long as the
host needs to issue it: the model's own Python and torch's dispatch (the same in every
variant) plus what the variant adds per module and per parameter (stage 3's gather and
release hooks, offload's side-stream copies and events). On a GPU this measures exactly
the host work that decides when kernels start once a sync has drained the queue (run on
the GPU host it runs on, since the host is what is measured).

    python benchmarks/hook_bench.py --device cpu
    python benchmarks/hook_bench.py --device cuda --variants z2,z3,z3_offload,z3_offload_dpu

Prints the median forward, backward and step time of each variant, then the ratios to the
first variant.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import torch  # noqa: E402

from _common import BenchConfig, build_model, make_batches, synchronize  # noqa: E402
from train_bench import ZERO_SECTIONS, engine_config, set_single_process_env  # noqa: E402


def measure(cfg: BenchConfig, zero_key: str, steps: int, device: torch.device) -> dict:
    """Median wall time (ms) of forward, backward and step over ``steps`` optimizer steps
    (after two untimed ones), with a device sync after each phase."""
    import shardwise
    model = build_model(cfg, device)
    batches = make_batches(cfg, device)
    zero = dict(ZERO_SECTIONS[zero_key])
    if zero["stage"] == 3:
        # 64-wide weights are below the default persistence threshold: partition them all,
        # as the 1.1B model's matrices are
        zero["stage3_param_persistence_threshold"] = 0
    engine, *_ = shardwise.initialize(model=model, config=engine_config(cfg, zero))
    times: dict = {"forward": [], "backward": [], "step": []}
    for s in range(steps + 2):
        for x in batches:
            t0 = time.perf_counter()
            loss = engine(input_ids=x, labels=x).loss
            synchronize(device)
            t1 = time.perf_counter()
            engine.backward(loss)
            synchronize(device)
            t2 = time.perf_counter()
            engine.step()
            synchronize(device)
            t3 = time.perf_counter()
            if s >= 2:
                times["forward"].append(t1 - t0)
                times["backward"].append(t2 - t1)
                times["step"].append(t3 - t2)
    engine.destroy()
    return {phase: 1e3 * statistics.median(v) for phase, v in times.items()}


def table(rows: dict) -> str:
    """The times, then each variant's ratio to the first one."""
    phases = ("forward", "backward", "step")
    lines = [f"{'variant':<18}" + "".join(f"{p + ' ms':>13}" for p in phases)]
    for name, row in rows.items():
        lines.append(f"{name:<18}" + "".join(f"{row[p]:13.2f}" for p in phases))
    base_name, base = next(iter(rows.items()))
    lines.append(f"\n{'x ' + base_name:<18}" + "".join(f"{p:>13}" for p in phases))
    for name, row in rows.items():
        lines.append(f"{name:<18}" + "".join(f"{row[p] / base[p]:13.2f}" for p in phases))
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="z2,z3", help="comma-separated train_bench ZeRO sections")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per variant")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in ZERO_SECTIONS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {sorted(ZERO_SECTIONS)}")
    cfg = BenchConfig(layers=args.layers, hidden=64, intermediate=128, heads=4, kv_heads=2,
                      vocab=256, seq=16, micro_batch=1, grad_accum=args.grad_accum,
                      device=args.device)
    set_single_process_env()
    device = torch.device(args.device)
    rows = {v: measure(cfg, v, args.steps, device) for v in variants}
    print(table(rows))


if __name__ == "__main__":
    main()
