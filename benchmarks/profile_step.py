"""Where one shardwise training step spends its time: phase timings and a profiler table.

Runs one ``train_bench`` ZeRO section (same model, batch and ds_config as ``train_bench.py``)
and prints, per micro batch, the wall time of forward, backward and ``engine.step()`` with a
device synchronize after each (so the phases do not overlap: this is a diagnosis tool, not a
throughput benchmark), then ``torch.profiler``'s top operators by self CPU and by device time
over one more optimizer step.

    python benchmarks/profile_step.py --zero z3_offload --grad-accum 4
    python benchmarks/profile_step.py --zero z2_offload --grad-accum 4 --memory-snapshot out/
    python benchmarks/profile_step.py --zero z3_offload_dpu --grad-accum 4 --gaps
    python benchmarks/profile_step.py --zero z3_offload_dpu --grad-accum 4 --sample --no-profiler
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

import memory_snapshot  # noqa: E402


def write_memory_snapshot(engine, batches: list, device: torch.device, out_dir: Path) -> None:
    """Two optimizer steps under allocation recording; prints allocated GiB after each phase
    (the first step is the warm-up) and the peak breakdown, and writes both to ``out_dir``."""
    import pickle

    gib = memory_snapshot.GIB
    torch.cuda.synchronize(device)
    lines = [f"after setup: allocated {torch.cuda.memory_allocated(device) / gib:.2f} GiB"]
    torch.cuda.reset_peak_memory_stats(device)
    for s in range(2):
        for i, x in enumerate(batches):
            loss = engine(input_ids=x, labels=x).loss
            fwd = torch.cuda.memory_allocated(device) / gib
            engine.backward(loss)
            bwd = torch.cuda.memory_allocated(device) / gib
            engine.step()
            torch.cuda.synchronize(device)
            lines.append(f"step {s} micro {i}: after forward {fwd:.2f}, after backward {bwd:.2f}, "
                         f"after step {torch.cuda.memory_allocated(device) / gib:.2f} GiB; "
                         f"peak so far {torch.cuda.max_memory_allocated(device) / gib:.2f}")
    snap = torch.cuda.memory._snapshot()
    memory_snapshot.stop_recording()
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "snapshot.pickle", "wb") as f:
        pickle.dump(snap, f)
    lines.append(memory_snapshot.summarize(snap["device_traces"][device.index or 0]))
    text = "\n".join(lines)
    (out_dir / "peak.txt").write_text(text + "\n")
    print(text)


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
    p.add_argument("--timeline", default="", metavar="PATTERNS",
                   help="comma-separated op-name fragments (e.g. _fused_adamw,EventSynchronize) "
                        "whose host-side spans are printed in time order with the phases")
    p.add_argument("--gaps", action="store_true",
                   help="after the profiled step, print each CUDA stream's busy time and the "
                        "compute stream's largest idle gaps (trace_gaps.py)")
    p.add_argument("--sample", action="store_true",
                   help="run --steps more free-running steps while sampling every thread's "
                        "Python stack (stack_sampler.py): which shardwise code each thread's "
                        "wall time is in, without the torch profiler's per-operator cost")
    p.add_argument("--no-profiler", action="store_true", help="skip the torch profiler step")
    p.add_argument("--memory-snapshot", type=Path, default=None, metavar="DIR",
                   help="instead of timing: record GPU allocations from before the model is "
                        "built through two optimizer steps, write snapshot.pickle and "
                        "peak.txt (what is live at peak memory, by allocating line) to DIR")
    args = p.parse_args()
    cfg = BenchConfig(**{k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads",
                                                       "kv_heads", "vocab", "seq", "micro_batch",
                                                       "grad_accum")}, device=args.device)
    device = torch.device(args.device)
    set_single_process_env()
    import shardwise

    if args.memory_snapshot is not None:
        memory_snapshot.start_recording()
    model = build_model(cfg, device)
    batches = make_batches(cfg, device)
    engine, *_ = shardwise.initialize(model=model, config=engine_config(cfg, ZERO_SECTIONS[args.zero]))
    if args.memory_snapshot is not None:
        write_memory_snapshot(engine, batches, device, args.memory_snapshot)
        return

    from torch.profiler import record_function

    def one_step(timed: bool) -> list:
        rows = []
        for i, x in enumerate(batches):
            t0 = time.perf_counter()
            with record_function(f"phase: micro {i} forward"):
                loss = engine(input_ids=x, labels=x).loss
            if timed:
                synchronize(device)
            t1 = time.perf_counter()
            with record_function(f"phase: micro {i} backward"):
                engine.backward(loss)
            if timed:
                synchronize(device)
            t2 = time.perf_counter()
            with record_function(f"phase: micro {i} step"):
                engine.step()
            if timed:  # free-running steps overlap the micro steps as training does
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

    if args.sample:
        from stack_sampler import StackSampler
        with StackSampler() as sampler:
            for _ in range(args.steps):
                one_step(False)
            synchronize(device)
        print(f"sampled: {args.steps} free-running steps, "
              f"{sampler.seconds / max(args.steps, 1):.3f} s each")
        print(sampler.summary())
    if args.no_profiler:
        return

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
    if args.gaps and device.type == "cuda":
        import json
        import tempfile

        import trace_gaps
        with tempfile.TemporaryDirectory() as tmp:
            path = args.trace or Path(tmp) / "trace.json"
            if args.trace is None:
                prof.export_chrome_trace(str(path))
            print(trace_gaps.summarize(json.loads(Path(path).read_text())))
    if args.timeline:
        print_timeline(prof, args.timeline.split(","))


def print_timeline(prof, patterns: list) -> None:
    """Start, duration and thread of the host-side events whose name contains one of
    ``patterns`` (plus the phase markers), in time order: shows what overlaps what, e.g.
    the offload worker's optimizer steps against the main thread's backward."""
    events = [e for e in prof.events()
              if e.name.startswith("phase: ") or any(pat in e.name for pat in patterns)]
    events = [e for e in events if e.device_type.name == "CPU"]
    if not events:
        return
    t0 = min(e.time_range.start for e in events)
    print(f"{'start ms':>9} {'dur ms':>8} {'thread':>8}  event")
    for e in sorted(events, key=lambda e: e.time_range.start):
        print(f"{(e.time_range.start - t0) / 1e3:9.1f} {(e.time_range.end - e.time_range.start) / 1e3:8.2f} "
              f"{e.thread % 100000:8d}  {e.name}")


if __name__ == "__main__":
    main()
