"""The largest Llama-shaped model that trains on one GPU under ZeRO-3 + full CPU offload.

Each trial builds a Llama-2-7B-wide model (hidden 4096, MLP 11008, 32 heads) with a given
number of decoder layers under ``zero.Init`` (shardwise's or DeepSpeed's, so the full model
never exists in one piece), wraps it with ZeRO stage 3, ``offload_param`` and
``offload_optimizer`` on pinned CPU memory, bf16, and runs a few optimizer steps. Trials run
one per subprocess, smallest first, and a framework stops at its first failure:

    python benchmarks/scale_bench.py --sw-layers 24,32,36 --ds-layers 20,24,28 --ds-prebuild

``--optimizer-device nvme`` keeps the optimizer states in swap files under ``--nvme-path``
instead (ZeRO-Infinity; train_bench's ``z3_nvme`` section), and ``--host-cap-gib 32`` stops a
trial whose processes hold more than 32 GiB resident (pinned memory included; page cache is
not counted): the host-memory budget of issue 21, without needing a cgroup.

Host RAM is what bounds the model here (the GPU only ever holds a few layers), so the parent
watches the machine's available memory and kills a trial before the kernel's OOM killer has
to choose a victim (which could be this parent or the machine's agent): such a trial reads
"host memory exhausted". The table puts the measured host peak next to the ZeRO paper's
16 bytes/parameter of model states (2 bf16 weights + 2 bf16 gradients + 12 fp32 master,
momentum and variance); both frameworks keep fp32 gradients on the host, 18 bytes/param.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import psutil  # noqa: E402
import torch  # noqa: E402

import train_bench as tb  # noqa: E402
from _memcap import tree_rss  # noqa: E402
from _common import (GIB, BenchConfig, HostRssSampler, add_shape_args, format_table,  # noqa: E402
                     llama_config)

RESULT_MARKER = "@@SCALE_BENCH_RESULT@@ "
FRAMEWORKS = ("sw", "ds")
#: Environment variable: the trial's ZeRO section in train_bench's ZERO_SECTIONS.
ZERO_KEY_ENV = "SCALE_BENCH_ZERO"


def trial_config(args: argparse.Namespace, layers: int) -> BenchConfig:
    return BenchConfig(layers=layers, hidden=args.hidden, intermediate=args.intermediate,
                       heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab, seq=args.seq,
                       micro_batch=args.micro_batch, grad_accum=1, warmup=1, steps=args.steps,
                       device=args.device)


# ---------------------------------------------------------------------------------------------
# Worker: one trial in its own process.
# ---------------------------------------------------------------------------------------------
def build_engine(framework: str, cfg: BenchConfig) -> tuple[Any, int]:
    """The model built under zero.Init and wrapped by the framework's initialize()."""
    from transformers import LlamaForCausalLM

    zero = tb.ZERO_SECTIONS[os.environ.get(ZERO_KEY_ENV) or "z3_offload"]
    config = tb.engine_config(cfg, tb.nvme_zero(zero))
    tb.set_single_process_env()
    torch.manual_seed(cfg.seed)
    if framework == "sw":
        import shardwise as lib
    else:
        import deepspeed as lib
        lib.init_distributed(dist_backend=tb.backend_for(torch.device(cfg.device)))
    with lib.zero.Init(config_dict_or_path=config):
        model = LlamaForCausalLM(llama_config(cfg))
    model.train()
    # partitioned parameters report an empty local shape; count the global shapes
    if framework == "sw":
        from shardwise.zero.stage3.partition import full_numel as numel_of
    else:
        def numel_of(p):
            return int(getattr(p, "ds_numel", 0) or p.numel())
    n_params = sum(numel_of(p) for p in {id(p): p for p in model.parameters()}.values())
    engine, _, _, _ = lib.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, n_params


def timed_steps(engine: Any, cfg: BenchConfig, device: torch.device) -> tuple[list[float], list[float]]:
    """``cfg.warmup + cfg.steps`` steps on one fixed random batch: the timed steps' seconds and
    every loss. A loss that is NaN or blown up means the model does not train: an error."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    x = torch.randint(0, cfg.vocab, (cfg.micro_batch, cfg.seq), generator=gen).to(device)
    step = tb.engine_step(engine, [x])
    times, losses = [], []
    for i in range(cfg.warmup + cfg.steps):
        t0 = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= cfg.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach().float().item()))
    if not all(l == l and abs(l) < 1e4 for l in losses):
        raise RuntimeError(f"losses are not finite: {losses}")
    return times, losses


def run_trial(framework: str, cfg: BenchConfig) -> dict[str, Any]:
    device = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    start = time.perf_counter()
    with HostRssSampler() as rss:
        engine, n_params = build_engine(framework, cfg)
        build_s = time.perf_counter() - start
        times, losses = timed_steps(engine, cfg, device)
    return {"framework": framework, "layers": cfg.layers, "n_params": n_params,
            "build_s": build_s, "step_s": sum(times) / len(times), "losses": losses,
            "host_rss_peak_gib": rss.peak_bytes / GIB,
            "gpu_peak_gib": (torch.cuda.max_memory_allocated(device) / GIB
                             if device.type == "cuda" else None)}


def worker_main(framework: str, cfg: BenchConfig) -> int:
    try:
        result, code = run_trial(framework, cfg), 0
    except BaseException as exc:  # every failure becomes a row, with its reason
        traceback.print_exc()
        result = {"framework": framework, "layers": cfg.layers,
                  "error": f"{type(exc).__name__}: {exc}"}
        code = 1
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return code


# ---------------------------------------------------------------------------------------------
# Parent: trials one after another, under a timeout and a host-memory watchdog.
# ---------------------------------------------------------------------------------------------
def run_guarded(argv: list[str], log_path: Path, timeout_s: float,
                min_free_gib: float, extra_env: dict[str, str] | None = None,
                cap_gib: float = 0.0) -> tuple[str, float, float]:
    """Run ``argv``; ('ok'|'failed'|'timeout'|'host-oom'|'host-cap', wall seconds, min
    available GiB). ``cap_gib`` > 0: stop it when its process tree's RSS passes that."""
    start = time.perf_counter()
    low = psutil.virtual_memory().available
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env={**tb._worker_env(1), **(extra_env or {})},
                                cwd=str(BENCH_DIR.parent))
        status = None
        while status is None:
            try:
                code = proc.wait(timeout=0.25)
                status = "ok" if code == 0 else "failed"
                break
            except subprocess.TimeoutExpired:
                pass
            avail = psutil.virtual_memory().available
            low = min(low, avail)
            if avail < min_free_gib * GIB:
                status = "host-oom"
            elif cap_gib > 0 and tree_rss(psutil.Process(proc.pid)) > cap_gib * GIB:
                status = "host-cap"
            elif time.perf_counter() - start > timeout_s:
                status = "timeout"
        if status in ("host-oom", "host-cap", "timeout"):
            tb._kill_tree(proc.pid)
            proc.wait()
    return status, time.perf_counter() - start, low / GIB


def run_trial_subprocess(framework: str, cfg: BenchConfig, args: argparse.Namespace,
                         log_dir: Path) -> dict[str, Any]:
    log_path = log_dir / f"{framework}_{cfg.layers}.log"
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", framework,
            "--config-json", cfg.to_json()]
    # --exact-pin: shardwise's pinned host buffers (offload, stage 3) page-lock exactly their
    # size (accelerator/pinned.py) instead of going through torch's rounding allocator
    extra = {"SHARDWISE_EXACT_PIN": "1"} if framework == "sw" and args.exact_pin else {}
    extra[ZERO_KEY_ENV] = "z3_nvme" if args.optimizer_device == "nvme" else "z3_offload"
    status, wall, low = run_guarded(argv, log_path, args.timeout, args.min_free_gib, extra,
                                    args.host_cap_gib)
    result: dict[str, Any] | None = None
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER):])
    if status == "host-oom":
        result = {"error": f"host memory exhausted (available fell below {args.min_free_gib} GiB)"}
    elif status == "host-cap":
        result = {"error": f"host cap exceeded (resident memory above {args.host_cap_gib} GiB)"}
    elif status == "timeout":
        result = {"error": f"timed out after {args.timeout:.0f} s"}
    elif result is None:
        result = {"error": "worker died without a result (killed?)"}
    if result.get("error"):
        result["log_tail"] = tb._tail(log_path)
    result.update(framework=framework, layers=cfg.layers, wall_s=wall, min_available_gib=low)
    return result


def add_arithmetic(row: dict[str, Any], host_total_gib: float) -> None:
    """ZeRO model-state bytes beside the measurement (Psi = parameters)."""
    n = row.get("n_params")
    if not n:
        return
    row["params_b"] = n / 1e9
    row["states16_gib"] = 16 * n / GIB
    row["states18_gib"] = 18 * n / GIB
    row["host_bytes_per_param"] = row["host_rss_peak_gib"] * GIB / n
    row["host_total_gib"] = host_total_gib


TABLE_COLUMNS = [
    ("name", "trial", ""),
    ("params_b", "params B", ".2f"),
    ("states16_gib", "16*Psi GiB", ".1f"),
    ("states18_gib", "18*Psi GiB", ".1f"),
    ("host_rss_peak_gib", "host peak GiB", ".1f"),
    ("host_bytes_per_param", "host B/param", ".1f"),
    ("gpu_peak_gib", "GPU peak GiB", ".1f"),
    ("build_s", "build s", ".0f"),
    ("step_s", "step s", ".2f"),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sw-layers", default="24,32", help="shardwise trials: decoder layers, ascending")
    p.add_argument("--ds-layers", default="", help="DeepSpeed trials: decoder layers, ascending")
    # Llama-2-7B's width; the layer count is what each trial varies
    add_shape_args(p, layers=False, hidden=4096, intermediate=11008, kv_heads=32, micro_batch=4)
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per trial")
    p.add_argument("--min-free-gib", type=float, default=2.0,
                   help="kill a trial when the machine's available memory falls below this")
    p.add_argument("--ds-prebuild", action="store_true", help="JIT-build DeepSpeed's CPU Adam first")
    p.add_argument("--optimizer-device", choices=["cpu", "nvme"], default="cpu",
                   help="where offload_optimizer keeps the optimizer states")
    p.add_argument("--nvme-path", default=None,
                   help="swap folder for --optimizer-device nvme (default: a temporary folder)")
    p.add_argument("--host-cap-gib", type=float, default=0.0,
                   help="stop a trial whose processes hold more resident memory than this (0: off)")
    p.add_argument("--exact-pin", action="store_true",
                   help="shardwise trials pin host buffers at their exact size (cudaHostRegister; "
                        "sets SHARDWISE_EXACT_PIN=1 for them)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", BENCH_DIR.parent / "out"))
                   / "scale_bench.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--config-json", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker, BenchConfig.from_json(args.config_json))
    plan = {fw: [int(x) for x in getattr(args, f"{fw}_layers").split(",") if x.strip()]
            for fw in FRAMEWORKS}
    host_total = psutil.virtual_memory().total / GIB
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="scale_bench_") as tmp:
        log_dir = Path(tmp)
        if args.optimizer_device == "nvme":  # the trials inherit it (train_bench.nvme_zero)
            os.environ[tb.NVME_PATH_ENV] = args.nvme_path or str(log_dir)
        if plan["ds"] and args.ds_prebuild:
            print(f"[scale_bench] deepspeed prebuild: {tb.prebuild_deepspeed_ops(600, log_dir)}",
                  flush=True)
        for fw in FRAMEWORKS:
            for layers in plan[fw]:
                row = run_trial_subprocess(fw, trial_config(args, layers), args, log_dir)
                row["name"] = f"{fw} {layers} layers"
                add_arithmetic(row, host_total)
                results.append(row)
                print(f"[scale_bench] {row['name']}: "
                      f"{row.get('error') or 'trained, host peak %.1f GiB' % row['host_rss_peak_gib']}",
                      flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"host_total_gib": host_total, "results": results},
                                               indent=2))
                if row.get("error"):
                    break  # larger models of this framework will not fit either
    cap = f", host cap {args.host_cap_gib:g} GiB RSS" if args.host_cap_gib > 0 else ""
    print(f"\nhost RAM {host_total:.1f} GiB{cap}; ZeRO-3 + offload_param + offload_optimizer "
          f"({args.optimizer_device}, pinned{', shardwise exact-size' if args.exact_pin else ''}), "
          f"bf16, micro batch {args.micro_batch} x {args.seq}")
    print(format_table(results, TABLE_COLUMNS))
    for fw in FRAMEWORKS:
        ok = [r for r in results if r["framework"] == fw and not r.get("error")]
        if plan[fw]:
            best = max(ok, key=lambda r: r["n_params"]) if ok else None
            print(f"largest that trained, {fw}: "
                  f"{'%.2fB parameters (%d layers)' % (best['params_b'], best['layers']) if best else 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
