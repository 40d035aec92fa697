"""Where the batch-1 decode step's time goes: one process, random-init Llama, bf16, one GPU.

For each job (``SIZE:OPTIONS``, OPTIONS a ``+``-joined list of ``DecodeOptions`` settings
or ``base``; SIZE ``7b-int8`` for weight-only int8, whose "bound" stays the bf16 one) it
compiles shardwise's kernel-injected decode step and reports:

  (a) the step alone: CUDA events over ``--steps`` back-to-back calls with fixed inputs (the
      CUDA-graph replay plus its few input copies; the host time per call next to it shows
      whether the host keeps ahead of the GPU),
  (b) the full generate loop (prompt ``--prompt``, ``--new`` new tokens, greedy) in ms per
      token (whole call minus a 1-token call, as infer_bench measures it),
  (c) the same for the other jobs (the alternatives to compare),
  (d) for the first job: the torch.profiler top-15 CUDA kernels over 20 steps, the share of
      GEMV / attention / other, kernels per step; and each projection shape's cuBLAS GEMV
      alone in GB/s against the measured copy bandwidth (cuBLAS bf16, and
      ``torch._weight_int8pack_mm`` on CUDA where this torch has it).

A compact table comes last. Jobs past ``--budget`` seconds are skipped (and listed), so
one call stays inside its time limit.

    python benchmarks/decode_probe.py                                   # the default jobs
    python benchmarks/decode_probe.py --jobs 7b:base,7b:gemv=reduction --budget 150
    python benchmarks/decode_probe.py --jobs 7b:base,7b:attention=reduction --batch 16 --prompt 256 --new 256
    python benchmarks/decode_probe.py --device cpu --jobs tiny:base --prompt 16 --new 8   # smoke

``--batch N`` measures the step at batch N (the Hybrid Engine's RLHF shape is 16 x 256 + 256);
there the bound adds the static KV cache, which the masked attention reads whole every step
(N x (prompt + new) positions x layers x 2 x KV heads x head dim x 2 bytes).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's shardwise
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _infer_measure import SIZES, build_model, copy_bandwidth  # noqa: E402

DEFAULT_JOBS = ("7b:base,7b:attention=split,7b:gemv=reduction,1.1b:base,1.1b:attention=split,"
                "7b:gemv=reduction+attention=split,7b:max_autotune=true,7b:attention=reduction")
#: a rough cost of one job (build + compile + measure), to decide whether it fits the budget
JOB_ESTIMATE_S = {"tiny": 5, "1.1b": 40, "7b": 55}


def parse_options(text: str) -> Any:
    """``gemv=reduction+attention=split`` -> DecodeOptions (``base``: the defaults)."""
    from shardwise.inference.options import DecodeOptions
    return DecodeOptions.parse(text)


class Timer:
    """CUDA events around a block (wall clock on CPU); ``ms`` after the block."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __enter__(self) -> "Timer":
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        self.host0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.host_ms = (time.perf_counter() - self.host0) * 1000  # before the sync: host time
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = self.host_ms


def step_inputs(dec: Any, batch: int, prompt: int, device: str) -> tuple:
    """Fixed step inputs at cache index ``prompt`` (the cache must hold a prefilled prompt)."""
    tok = torch.ones(batch, 1, dtype=torch.long, device=device)
    pos = torch.tensor([prompt], device=device)
    positions = torch.full((batch, 1), prompt, dtype=torch.long, device=device)
    key_mask = torch.ones(batch, dec.cache.length, dtype=torch.bool, device=device)
    return tok, pos, positions, key_mask


@torch.no_grad()
def time_steps(dec: Any, inputs: tuple, steps: int, device: str) -> Dict[str, float]:
    """(a): ``steps`` back-to-back compiled steps (no generate logic between them)."""
    for _ in range(3):
        dec.run_step(*inputs)
    with Timer(device) as t:
        for _ in range(steps):
            dec.run_step(*inputs)
    return {"step_ms": t.ms / steps, "host_ms_per_call": t.host_ms / steps}


def time_generate(engine: Any, ids: Any, new: int, device: str) -> Dict[str, float]:
    """(b): ms per decoded token of the whole generate call (minus a 1-token call)."""
    def run(n: int) -> float:
        with Timer(device) as t:
            engine.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None)
        return t.ms
    run(new)
    one = min(run(1) for _ in range(2))
    full = min(run(new) for _ in range(2))
    return {"loop_ms_per_token": (full - one) / (new - 1), "prefill_ms": one}


def kv_cache_bytes(size: str, batch: int, length: int) -> int:
    """bf16 bytes of the static KV cache of ``batch`` x ``length`` positions (read whole by a
    masked decode step)."""
    s = SIZES[size]
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    return batch * length * s["num_hidden_layers"] * 2 * s["num_key_value_heads"] * head_dim * 2


def _kind(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("fmha", "flash", "attention", "attn", "softmax", "amax", "_exp")):
        return "attention"
    if any(k in low for k in ("gemv", "gemm", "nvjet", "xmma", "cutlass", "splitk", "cublas",
                              "_mm_", "mm_kernel", "_sum_", "int8")):
        return "gemv"
    return "other"


@torch.no_grad()
def profile_steps(dec: Any, inputs: tuple, steps: int = 20) -> Dict[str, Any]:
    """(d): the top-15 CUDA kernels of ``steps`` decode steps and the GEMV/attention/other shares."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            dec.run_step(*inputs)
        torch.cuda.synchronize()
    kernels: Dict[str, List[float]] = {}
    for evt in prof.events():
        if evt.device_type.name == "CUDA" and evt.device_time_total > 0:
            kernels.setdefault(evt.name, []).append(evt.device_time_total)
    total = sum(sum(v) for v in kernels.values()) or 1.0
    shares: Dict[str, float] = {"gemv": 0.0, "attention": 0.0, "other": 0.0}
    for name, times in kernels.items():
        shares[_kind(name)] += sum(times) / total
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:15]
    print(f"\n(d) top-15 CUDA kernels over {steps} steps (total {total / 1000 / steps:.3f} ms "
          f"kernel time per step, {sum(len(v) for v in kernels.values()) / steps:.0f} kernels per step)")
    print(f"{'kind':9} {'total ms':>9} {'share':>6} {'calls/step':>10} {'avg us':>8}  name")
    for name, times in top:
        print(f"{_kind(name):9} {sum(times) / 1000:9.2f} {100 * sum(times) / total:5.1f}% "
              f"{len(times) / steps:10.1f} {sum(times) / len(times):8.1f}  {name[:90]}")
    print("shares: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items()))
    if sum(len(v) for v in kernels.values()) < 10 * steps:
        print("note: few kernels seen; this profiler may not report the kernels inside CUDA "
              "graphs (run a job with --no-graph to see them)")
    return {f"share_{k}": v for k, v in shares.items()}


def _graph_time_us(fn: Any, reps: int) -> float:
    """Kernel time of one ``fn()``: ``reps`` calls captured in one CUDA graph, then replayed.
    (Timed call by call, a compiled function's host overhead, 30-40 us, hides its kernel:
    on one H100 every compiled int8 form timed 35-45 us whatever the shape.)"""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    with Timer("cuda") as t:
        graph.replay()
    return t.ms * 1000 / reps


def _int8_forms() -> Dict[str, Any]:
    """The int8 GEMV forms a compiled decode step can use (each compiled on its own)."""
    from shardwise.inference.quant import int8_gemv
    opts = {"coordinate_descent_tuning": True, "epilogue_fusion": True}
    return {
        "reduction": torch.compile(int8_gemv, dynamic=False, options=opts),
        "cast+mm": torch.compile(lambda x, q, s: torch.nn.functional.linear(x, q.to(x.dtype)) * s,
                                 dynamic=False, options=opts),  # gpt-fast's form
        "int8pack": torch._weight_int8pack_mm,
    }


@torch.no_grad()
def gemv_bandwidth(size: str, bandwidth: float, reps: int = 50) -> Dict[str, Any]:
    """Each projection shape of ``size`` at batch 1, GB/s of weight bytes against the copy
    bandwidth: cuBLAS bf16 GEMV, and each int8 form of ``_int8_forms`` (the compiled reduction,
    gpt-fast's cast + matmul, PyTorch's ``_weight_int8pack_mm``), kernel time only (CUDA
    graphs). The total row is the step's projections at each form's speed."""
    s = SIZES[size]
    h, i, v = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    d = h // s["num_attention_heads"]
    shapes = {"qkv": ((s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * d, h),
              "o": (h, h), "gate_up": (2 * i, h), "down": (h, i)}
    forms = _int8_forms()
    print(f"\n(d) one GEMV alone, {size}, batch 1 (copy bandwidth {bandwidth / 1e12:.2f} TB/s): "
          f"us and share of copy bandwidth")
    print(f"{'proj':8} {'out x in':>13} {'bf16':>14} " + " ".join(f"{f:>14}" for f in forms))
    totals: Dict[str, float] = {"bf16": 0.0, **{f: 0.0 for f in forms}}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        us = _graph_time_us(lambda: torch.nn.functional.linear(x, w), reps)
        totals["bf16"] += us
        line = f"{name:8} {n:>6}x{k:<6} {us:7.1f} {100 * w.numel() * 2 / (us * 1e-6) / bandwidth:5.1f}%"
        q = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
        scale = torch.rand(n, device="cuda", dtype=torch.bfloat16)
        for form, fn in forms.items():
            try:
                us8 = _graph_time_us(lambda: fn(x, q, scale), reps)
                totals[form] += us8
                line += f" {us8:7.1f} {100 * q.numel() / (us8 * 1e-6) / bandwidth:5.1f}%"
            except Exception as exc:  # a form this torch lacks
                totals[form] = float("nan")
                line += f" {type(exc).__name__[:14]:>14}"
        print(line, flush=True)
    layers = s["num_hidden_layers"]
    print(f"{'x layers':8} {layers:>13} " + " ".join(
        f"{t * layers / 1000:11.2f} ms" for t in totals.values()))
    return {f"gemv_ms_{k}": t * layers / 1000 for k, t in totals.items()}


def _graph_skips() -> int:
    from torch._dynamo.utils import counters
    return int(sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",)))


def run_job(size: str, options: Any, args: argparse.Namespace, state: Dict[str, Any],
            first: bool, bandwidth: Optional[float]) -> Dict[str, Any]:
    """Build (or reuse) the engine of ``size``, compile with ``options``, measure (a) and (b)."""
    import shardwise
    model_key, size = size, size.removesuffix("-int8")  # "7b-int8": weight-only int8
    if state.get("size") != model_key:
        state.clear()
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        model = build_model(torch, size, args.device)
        state["weight_bytes"] = sum(p.numel() * 2 for p in model.parameters())  # bf16 bytes
        dtype = "bf16" if args.device == "cuda" else "fp32"
        dtype = "int8" if model_key.endswith("-int8") else dtype
        state.update(size=model_key, engine=shardwise.init_inference(
            model, dtype=dtype, replace_with_kernel_inject=True, max_out_tokens=args.prompt + args.new))
    engine = state["engine"]
    dec = engine.decoder
    torch._dynamo.reset()
    skips = _graph_skips()
    dec.set_options(options)
    if args.device == "cuda":
        dec.compile_step(cuda_graph=not args.no_graph)
    ids = torch.randint(0, SIZES[size]["vocab_size"], (args.batch, args.prompt), device=args.device)
    t0 = time.perf_counter()
    engine.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)  # compile + capture
    row: Dict[str, Any] = {"compile_s": time.perf_counter() - t0}
    row.update(time_generate(engine, ids, args.new, args.device))
    inputs = step_inputs(dec, args.batch, args.prompt, args.device)
    row.update(time_steps(dec, inputs, args.steps, args.device))
    row["graph_skips"] = _graph_skips() - skips if args.device == "cuda" else "-"
    if bandwidth:
        step_bytes = state["weight_bytes"]  # batch 1: the bound, weights only
        if args.batch > 1:
            step_bytes += kv_cache_bytes(size, args.batch, args.prompt + args.new)
        bound_ms = step_bytes / bandwidth * 1000
        row.update(bound_ms=bound_ms, step_of_bound=bound_ms / row["step_ms"],
                   loop_of_bound=bound_ms / row["loop_ms_per_token"])
    if first and args.device == "cuda":
        for what in (lambda: row.update(profile_steps(dec, inputs)),
                     lambda: row.update(gemv_bandwidth(size, bandwidth))):
            try:
                what()
            except Exception as exc:  # a diagnostic that fails must not cost the timings
                print(f"(d) failed: {type(exc).__name__}: {exc}", flush=True)
    return row


def print_table(rows: List[Dict[str, Any]]) -> None:
    print(f"\n{'job':44} {'(a) step ms':>11} {'host ms':>8} {'(b) loop ms':>11} {'tok/s':>7} "
          f"{'bound ms':>8} {'a/bound':>7} {'b/bound':>7} {'compile s':>9} {'skips':>5}")
    for r in rows:
        if "error" in r:
            print(f"{r['job']:44} {r['error']}")
            continue
        bound = f"{r['bound_ms']:8.3f}" if "bound_ms" in r else f"{'-':>8}"
        fa = f"{100 * r['step_of_bound']:6.1f}%" if "bound_ms" in r else f"{'-':>7}"
        fb = f"{100 * r['loop_of_bound']:6.1f}%" if "bound_ms" in r else f"{'-':>7}"
        print(f"{r['job']:44} {r['step_ms']:11.3f} {r['host_ms_per_call']:8.3f} "
              f"{r['loop_ms_per_token']:11.3f} {1000 / r['loop_ms_per_token']:7.1f} {bound} {fa} {fb} "
              f"{r['compile_s']:9.1f} {r['graph_skips']:>5}")
    print("(a) compiled step alone (CUDA events over back-to-back calls); (b) the generate loop per "
          "token; bound: weight bytes (+ the KV cache at batch > 1) / measured copy bandwidth; skips: inductor cudagraph skips "
          "(0 = every step is one CUDA graph)")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default=DEFAULT_JOBS, help="comma-separated SIZE:OPTIONS (see above)")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="sequences per decode step")
    p.add_argument("--steps", type=int, default=100, help="steps timed in (a)")
    p.add_argument("--budget", type=float, default=225.0, help="seconds; later jobs are skipped")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-graph", action="store_true", help="compile the step without CUDA graphs")
    p.add_argument("--gemv-only", default="", metavar="SIZE",
                   help="only (d)'s GEMV table for SIZE (e.g. 7b), no jobs")
    args = p.parse_args(argv)
    start = time.perf_counter()
    bandwidth = copy_bandwidth(torch, args.device)
    if bandwidth:
        import shardwise
        print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, torch {torch.__version__}, "
              f"{torch.cuda.get_device_name()}, shardwise from {Path(shardwise.__file__).parent}",
              flush=True)
    if args.gemv_only:
        gemv_bandwidth(args.gemv_only, bandwidth)
        return 0
    rows: List[Dict[str, Any]] = []
    state: Dict[str, Any] = {}
    for n, job in enumerate(args.jobs.split(",")):
        size, _, opts = job.partition(":")
        left = args.budget - (time.perf_counter() - start)
        guess = JOB_ESTIMATE_S.get(size.removesuffix("-int8"), 60)
        if left < guess * (1.5 if state.get("size") != size else 1.0):
            rows.append({"job": job, "error": f"skipped: {left:.0f} s of the budget left"})
            continue
        try:
            row = run_job(size, parse_options(opts or "base"), args, state, n == 0, bandwidth)
        except Exception as exc:  # one job's failure is its row, the rest still run
            row = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        rows.append({"job": job, **row})
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()},
              f"[{time.perf_counter() - start:.0f} s]", flush=True)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
