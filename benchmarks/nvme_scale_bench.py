"""The largest Llama-shaped model that trains with 32 GiB of host RAM: CPU offload vs NVMe
offload (issue 21's scale test).

Models grow as in ``scale_bench.py``: Llama-2-7B's width (hidden 4096, MLP 11008, 32 heads)
and more decoder layers per rung of ``--ladder``. Each trial is one child process that builds
the model under ``zero.Init``, wraps it with ZeRO stage 3 (bf16, AdamW) and trains
``--steps`` timed steps after one warm-up step, under a host-memory cap (``_memcap.py``: a
cgroup v2 group with ``memory.max``, else an RSS watchdog; the table says which). Modes:

- ``cpu``: ``offload_param`` and ``offload_optimizer`` on pinned host memory;
- ``nvme``: ``offload_param`` on NVMe (swap files under ``--nvme-path``) and
  ``offload_optimizer`` on NVMe too when this shardwise has NVMe optimizer offload, else on
  the host (the row then reads "nvme (params)": the optimizer's 12 bytes/parameter stay in
  RAM and bound the model).

Per mode a binary search over the ladder starts at the rung its bytes/parameter predict;
``--max-seconds`` bounds the whole run (each mode gets an equal share of what is left), so it
fits one 10-minute GPU call::

    python benchmarks/nvme_scale_bench.py --nvme-path /local_nvme --max-seconds 540

It prints a table (mode, largest parameters trained, peak host memory, tokens/s) and the
NVMe/CPU ratio of the largest models last; ``--out`` keeps every trial as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

from _common import GIB, BenchConfig, add_shape_args, format_table  # noqa: E402
from _memcap import MemoryCap  # noqa: E402

RESULT_MARKER = "@@NVME_SCALE_RESULT@@ "
MODES = ("cpu", "nvme")
LADDER = "1,2,3,4,5,6,7,8,10,12,14,16,20,24,28,32,40,48"
#: host bytes per parameter each mode needs (bf16 weights and gradients on the host where
#: offloaded, fp32 gradient partitions, master + Adam moments where on the host), for the
#: first rung of the search; FIXED_GIB (CUDA context, libraries; with NVMe the pinned rings
#: of optimizer sub-groups and parameter buffers) comes on top
HOST_BYTES = {"cpu": 18.0, "nvme (params)": 16.0, "nvme": 4.5}
FIXED_GIB = {"cpu": 4.0, "nvme (params)": 6.0, "nvme": 11.0}
#: bytes per parameter in the swap files (the disk must hold them)
DISK_BYTES = {"cpu": 0.0, "nvme (params)": 2.0, "nvme": 14.0}


def n_params(cfg: BenchConfig) -> int:
    """Parameters of the Llama of ``cfg`` (untied embedding and head, RMSNorm weights)."""
    head_dim = cfg.hidden // cfg.heads
    attn = cfg.hidden * cfg.hidden * 2 + 2 * cfg.hidden * cfg.kv_heads * head_dim
    layer = attn + 3 * cfg.hidden * cfg.intermediate + 2 * cfg.hidden
    return cfg.layers * layer + 2 * cfg.vocab * cfg.hidden + cfg.hidden


def trial_config(args: argparse.Namespace, layers: int) -> BenchConfig:
    return BenchConfig(layers=layers, hidden=args.hidden, intermediate=args.intermediate,
                       heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab, seq=args.seq,
                       micro_batch=args.micro_batch, grad_accum=1, warmup=1, steps=args.steps,
                       device=args.device)


def zero_section(mode: str, cfg: BenchConfig, nvme_path: str, opt_nvme: bool) -> Dict[str, Any]:
    """ZeRO-3 with both offloads on the host (``cpu``) or on NVMe (``nvme``)."""
    host = {"device": "cpu", "pin_memory": True}
    if mode == "cpu":
        return {"stage": 3, "offload_param": dict(host), "offload_optimizer": dict(host)}
    param = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True, "max_in_cpu": 0,
             "buffer_count": 5, "buffer_size": max(100_000_000, cfg.vocab * cfg.hidden)}
    opt = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True} if opt_nvme else host
    return {"stage": 3, "offload_param": param, "offload_optimizer": opt}


# ---------------------------------------------------------------------------------------------
# Children: the NVMe-optimizer probe and one trial.
# ---------------------------------------------------------------------------------------------
def probe_nvme_optimizer(nvme_path: str) -> bool:
    """Does this shardwise take ``offload_optimizer: {device: nvme}`` at stage 3? (on the CPU:
    a tiny engine, initialize's ConfigError means no)."""
    import torch

    import shardwise
    from shardwise.errors import ConfigError
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                                   "nvme_path": nvme_path}}}
    try:
        engine = shardwise.initialize(model=torch.nn.Linear(8, 8), config=cfg)[0]
    except ConfigError as exc:
        if "nvme" in str(exc).lower():
            return False
        raise
    engine.destroy()
    return True


def run_trial(mode: str, cfg: BenchConfig, nvme_path: str, opt_nvme: bool) -> Dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM

    import shardwise
    import train_bench as tb
    from _common import HostRssSampler, llama_config
    from scale_bench import timed_steps
    from shardwise.zero.stage3.partition import full_numel

    device = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = tb.engine_config(cfg, zero_section(mode, cfg, nvme_path, opt_nvme))
    tb.set_single_process_env()
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    with HostRssSampler() as rss:
        with shardwise.zero.Init(config_dict_or_path=config):
            model = LlamaForCausalLM(llama_config(cfg))
        count = sum(full_numel(p) for p in {id(p): p for p in model.parameters()}.values())
        engine = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)[0]
        build_s = time.perf_counter() - start
        times, losses = timed_steps(engine, cfg, device)
        swapper = getattr(getattr(engine.strategy, "params", None), "swapper", None)
        swap_gib = swapper.nvme_bytes / GIB if swapper is not None else 0.0
        engine.destroy()
    step_s = sum(times) / len(times)
    return {"n_params": count, "build_s": build_s, "step_s": step_s, "losses": losses,
            "tok_s": cfg.micro_batch * cfg.seq / step_s, "rss_peak_gib": rss.peak_bytes / GIB,
            "param_swap_gib": swap_gib}


def child_main(args: argparse.Namespace) -> int:
    if args.probe:
        print(RESULT_MARKER + json.dumps({"nvme_optimizer": probe_nvme_optimizer(args.nvme_path)}))
        return 0
    try:
        result = run_trial(args.worker, BenchConfig.from_json(args.config_json), args.nvme_path,
                           args.opt_nvme)
        code = 0
    except BaseException as exc:  # every failure becomes a row, with its reason
        traceback.print_exc()
        result, code = {"error": f"{type(exc).__name__}: {exc}"}, 1
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return code


# ---------------------------------------------------------------------------------------------
# Parent: the probe, then a binary search per mode under the cap and the time budget.
# ---------------------------------------------------------------------------------------------
def _result_of(log: Path) -> Optional[Dict[str, Any]]:
    found = None
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(RESULT_MARKER):
            found = json.loads(line[len(RESULT_MARKER):])
    return found


def _child_env(cpu_only: bool = False, exact_pin: bool = False) -> Dict[str, str]:
    env = dict(os.environ)
    if exact_pin:  # both modes alike: large pinned buffers page-locked at their exact size
        env["SHARDWISE_EXACT_PIN"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR.parent), str(BENCH_DIR)]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def has_nvme_optimizer(nvme_path: str, log_dir: Path) -> bool:
    import subprocess
    log = log_dir / "probe.log"
    with log.open("w") as out:
        try:
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--probe",
                            "--nvme-path", nvme_path], stdout=out, stderr=subprocess.STDOUT,
                           env=_child_env(cpu_only=True), timeout=180, cwd=str(BENCH_DIR.parent))
        except subprocess.TimeoutExpired:
            return False
    found = _result_of(log)
    return bool(found and found.get("nvme_optimizer"))


def start_rung(ladder: List[int], sizes: List[int], label: str, cap_gib: float,
               disk_gib: float) -> int:
    """The largest rung the mode's bytes/parameter predict to fit (host and disk)."""
    fits = [i for i, n in enumerate(sizes) if n * HOST_BYTES[label] / GIB + FIXED_GIB[label] <= cap_gib
            and n * DISK_BYTES[label] / GIB <= disk_gib]
    return fits[-1] if fits else 0


def search(ladder: List[int], first: int, deadline: float,
           trial: Callable[[int, float], Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Binary search for the largest rung that trains; ``trial(layers, seconds_left)``."""
    lo, hi, probe = -1, len(ladder), first
    rows = []
    while hi - lo > 1 and time.perf_counter() < deadline - 20:
        row = trial(ladder[probe], deadline - time.perf_counter())
        rows.append(row)
        if row.get("error"):
            hi = probe
        else:
            lo = probe
        # the first rung is a prediction: walk away from it one rung at a time until the
        # edge is bracketed, then bisect
        if lo < 0:
            probe = hi - 1
        elif hi >= len(ladder):
            probe = lo + 1
        else:
            probe = (lo + hi) // 2
    return rows


def run_mode(mode: str, args: argparse.Namespace, cap: MemoryCap, opt_nvme: bool,
             deadline: float, log_dir: Path) -> List[Dict[str, Any]]:
    label = mode if mode == "cpu" else ("nvme" if opt_nvme else "nvme (params)")
    ladder = [int(x) for x in args.ladder.split(",") if x.strip()]
    sizes = [n_params(trial_config(args, layers)) for layers in ladder]
    disk_gib = shutil.disk_usage(args.nvme_path).free / GIB * 0.9

    def trial(layers: int, left: float) -> Dict[str, Any]:
        cfg = trial_config(args, layers)
        row = {"mode": label, "layers": layers, "n_params": n_params(cfg)}
        if row["n_params"] * DISK_BYTES[label] / GIB > disk_gib:
            row["error"] = f"the swap files need more than the {disk_gib:.0f} GiB free on the disk"
            return row
        log = log_dir / f"{mode}_{layers}.log"
        # a folder per trial, removed after it: a trial killed at the cap cannot clean up
        swap = Path(args.nvme_path) / f"nvme_scale_{mode}_{layers}_{os.getpid()}"
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--config-json",
                cfg.to_json(), "--nvme-path", str(swap)] + (["--opt-nvme"] if opt_nvme else [])
        try:
            ran = cap.run(argv, log, min(args.trial_timeout, max(10.0, left)),
                          env=_child_env(exact_pin=args.exact_pin),
                          cwd=str(BENCH_DIR.parent))
        finally:
            shutil.rmtree(swap, ignore_errors=True)
        row.update(_result_of(log) or {}, peak_gib=ran.peak_bytes / GIB, wall_s=ran.wall_s)
        if ran.status == "oom":
            row["error"] = f"over the {args.cap_gib:g} GiB cap ({cap.kind})"
        elif ran.status == "timeout":
            row["error"] = "timed out (trial limit or --max-seconds)"
        elif ran.status != "ok" and not row.get("error"):
            row["error"] = f"exit code {ran.returncode}"
        done = row.get("error") or (f"trained, peak {row['peak_gib']:.1f} GiB, "
                                    f"{row['tok_s']:.0f} tok/s")
        print(f"[nvme_scale] {label} {layers} layers ({row['n_params'] / 1e9:.2f}B): {done}",
              flush=True)
        return row

    first = start_rung(ladder, sizes, label, args.cap_gib, disk_gib)
    return search(ladder, first, deadline, trial)


COLUMNS = [("mode", "mode", ""), ("layers", "layers", "d"), ("params_b", "params B", ".2f"),
           ("peak_gib", "peak host GiB", ".1f"), ("rss_peak_gib", "peak RSS GiB", ".1f"),
           ("param_swap_gib", "params on disk GiB", ".2f"),
           ("tok_s", "tokens/s", ".0f"), ("step_s", "step s", ".2f"), ("wall_s", "trial s", ".0f")]


def report(rows: List[Dict[str, Any]], modes: List[str], cap: MemoryCap, args) -> Dict[str, Any]:
    for row in rows:
        row["params_b"] = row["n_params"] / 1e9
    print(f"\ncap: {cap.kind} ({args.cap_gib:g} GiB"
          f"{'' if cap.kind == 'cgroup' else '; no cgroup: ' + str(cap.why_not_cgroup)}), "
          f"width {args.hidden}/{args.intermediate}, micro batch {args.micro_batch} x "
          f"{args.seq}, bf16, pinned buffers "
          f"{'exact-size (SHARDWISE_EXACT_PIN=1)' if args.exact_pin else 'from torch (rounded)'}")
    print(format_table(rows, COLUMNS))
    best: Dict[str, Dict[str, Any]] = {}
    for row in rows:
        if not row.get("error") and row["n_params"] > best.get(row["mode"], {}).get("n_params", 0):
            best[row["mode"]] = row
    print("\nlargest trained per mode:")
    print(format_table(list(best.values()), [c for c in COLUMNS if c[0] != "wall_s"]))
    cpu = best.get("cpu")
    nvme = next((best[k] for k in ("nvme", "nvme (params)") if k in best), None)
    ratio = nvme["n_params"] / cpu["n_params"] if cpu and nvme else None
    note = (" (optimizer on the host: no NVMe optimizer offload in this build)"
            if nvme is not None and nvme["mode"] == "nvme (params)" else "")
    print(f"NVMe/CPU largest parameters: {f'{ratio:.2f}x' if ratio else '-'}{note}")
    return {"cap": cap.kind, "cap_gib": args.cap_gib, "rows": rows, "ratio": ratio}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--modes", default="cpu,nvme", help="comma-separated: cpu, nvme")
    p.add_argument("--ladder", default=LADDER, help="decoder layers of the rungs, ascending")
    add_shape_args(p, layers=False, hidden=4096, intermediate=11008, kv_heads=32,
                   micro_batch=1, seq=1024)
    p.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up step")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--cap-gib", type=float, default=32.0, help="host memory cap per trial")
    p.add_argument("--no-cgroup", action="store_true", help="use the RSS watchdog even where a "
                                                            "cgroup v2 memory group is possible")
    swap_default = str(BENCH_DIR.parent / "out" / "nvme_swap")
    p.add_argument("--nvme-path", default=os.environ.get("NVME_PATH", swap_default),
                   help="folder for the swap files (a local NVMe disk; not tmpfs)")
    p.add_argument("--max-seconds", type=float, default=540.0, help="budget of the whole run")
    p.add_argument("--trial-timeout", type=float, default=300.0, help="seconds per trial")
    p.add_argument("--exact-pin", action=argparse.BooleanOptionalAction, default=True,
                   help="SHARDWISE_EXACT_PIN=1 in every trial (both modes): torch 2.11's pinned "
                        "allocator rounds each block up to a power of two, which decides the "
                        "largest model under a cap more than the offload mode does")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", BENCH_DIR.parent / "out"))
                   / "nvme_scale_bench.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--config-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--opt-nvme", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def filesystem_of(path: str) -> str:
    """The filesystem type of the mount holding ``path`` ("" when unknown)."""
    import psutil
    real, best = os.path.realpath(path), None
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        if (real == mount or real.startswith(mount.rstrip(os.sep) + os.sep)) and \
                (best is None or len(mount) > len(best.mountpoint)):
            best = part
    return best.fstype if best is not None else ""


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker or args.probe:
        return child_main(args)
    start = time.perf_counter()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown {bad}; choose from {list(MODES)}")
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    fstype = filesystem_of(args.nvme_path)
    if fstype in ("tmpfs", "ramfs"):
        print(f"[nvme_scale] WARNING: --nvme-path {args.nvme_path} is on {fstype}: the swap "
              "files live in RAM (and count against the cap). Pass a folder on a disk.", flush=True)
    cap = MemoryCap(int(args.cap_gib * GIB), prefer_cgroup=not args.no_cgroup)
    print(f"[nvme_scale] cap: {cap.kind}"
          f"{'' if cap.kind == 'cgroup' else ' (' + str(cap.why_not_cgroup) + ')'}", flush=True)
    rows: List[Dict[str, Any]] = []
    # every trial's log next to --out (a device call brings that folder back)
    log_dir = args.out.parent / f"{args.out.stem}_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    opt_nvme = "nvme" in modes and has_nvme_optimizer(args.nvme_path, log_dir)
    print(f"[nvme_scale] NVMe optimizer offload: {'yes' if opt_nvme else 'no (params only)'}",
          flush=True)
    deadline = start + args.max_seconds
    for i, mode in enumerate(modes):
        share = (deadline - time.perf_counter()) / (len(modes) - i)
        rows += run_mode(mode, args, cap, opt_nvme, time.perf_counter() + share, log_dir)
    summary = report(rows, modes, cap, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
