"""Autotuning on the 1.1B Llama: the exhaustive grid vs shardwise's tuner vs DeepSpeed's autotuner.

Each experiment is a real launch of ``benchmarks/autotune_train.py`` (the model of
``train_bench.py``). Three ways to find the best config over one space:

* grid: every (ZeRO stage, offload, activation checkpointing, compile, micro batch) of the
  space, run one after another (resumable: rerunning the script continues the grid);
* tuner: ``shardwise --autotuning tune`` with the same config (its defaults: fast, binary
  micro batch search, memory pruning) and ``--tuner`` as tuner_type;
* deepspeed: ``deepspeed --autotuning tune`` on the same script over the part of the space
  DeepSpeed's autotuner knows (stage x micro batch), or the exact error when it fails.

The table (last) gives trials, wall time (sum of trial times for the grid, end to end for
the autotuners), the pick and the pick's tokens/s as the grid measured it, with the ratios
to the grid. Targets (issue 25): tuner pick >= 0.95 x grid best, trials and wall <= 1/3.

    python benchmarks/autotune_bench.py --quick   # stages 0,1 x ckpt none/full x micro 4,8,16, seq 1024
    python benchmarks/autotune_bench.py           # stages 0-3 x ckpt none/selective/full x micro 2..32
    (the grid is resumable: rerun the same command to continue it; the tuner and DeepSpeed
    always start from scratch, --skip-tuner / --skip-deepspeed leave them out)
    python benchmarks/autotune_bench.py --device cpu --layers 2 --hidden 64 --intermediate 128 \
        --heads 4 --kv-heads 2 --vocab 256 --seq 32 --stages 0,1 --micro-batches 1,2 --skip-deepspeed
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO_ROOT))
from _common import add_shape_args, format_table  # noqa: E402

SCRIPT = BENCH_DIR / "autotune_train.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial_env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(BENCH_DIR)]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / "out" / "torch_extensions"))
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    try:
        import torch
        if torch.cuda.is_available():  # DeepSpeed's op builder cannot parse "9.0a"
            major, minor = torch.cuda.get_device_capability()
            env["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    except ImportError:
        pass
    return env


def shape_flags(args: argparse.Namespace) -> List[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
            ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "seq")]


def user_config(args: argparse.Namespace, ours: bool = True) -> Dict[str, Any]:
    """The ds_config with the space as "auto"/list values (``ours``: shardwise's whole space)."""
    zero: Dict[str, Any] = {"stage": args.stages}
    cfg: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batches if ours else "auto",
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero, "steps_per_print": 1_000_000,
        "autotuning": {"enabled": True, "start_profile_step": args.start_profile_step,
                       "end_profile_step": args.end_profile_step, "metric": "throughput",
                       "min_train_micro_batch_size_per_gpu": min(args.micro_batches),
                       "max_train_micro_batch_size_per_gpu": max(args.micro_batches)}}
    if args.device == "cuda":
        cfg["bf16"] = {"enabled": True}
    if not ours:  # torch's AdamW: no FusedAdam JIT build (minutes) inside DeepSpeed's trials
        cfg["optimizer"]["params"]["torch_adam"] = True
    if ours:
        cfg["autotuning"]["trial_timeout"] = args.trial_timeout
        cfg["autotuning"]["tuner_type"] = args.tuner
        if args.offload:
            zero["offload_optimizer"] = {"device": "auto"}
        if args.ac and len(args.ac_policies) > 1:
            cfg["activation_checkpointing"] = {"policy": args.ac_policies, "modules": ["LlamaDecoderLayer"]}
        if args.compile:
            cfg["compile"] = {"enabled": "auto"}
    return cfg


def script_args(args: argparse.Namespace, framework: str, config: str) -> List[str]:
    return ["--framework", framework, *shape_flags(args), "--deepspeed", "--deepspeed_config", config]


# --- the three methods ----------------------------------------------------------------------
def run_grid(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    from shardwise.autotuning.autotuner import Autotuner
    from shardwise.autotuning.cli import load_autotuning
    from shardwise.autotuning.runner import TrialCommand
    from shardwise.autotuning.space import build_space

    raw = user_config(args)
    raw["autotuning"].update(tuner_num_trials=100_000, tuner_early_stopping=100_000)
    at = load_autotuning(raw)
    space = build_space(raw, at, 1)
    os.environ.update(trial_env())
    command = TrialCommand(["--num_gpus", "1", "--master_port", str(free_port())], str(SCRIPT),
                           script_args(args, "shardwise", "ds.json"))
    tuner = Autotuner(space, at, command, base_dir=work / "grid")
    outcome = tuner.exhaustive()
    measured = {r.exp.name: r.result.value("throughput") for r in outcome.records}
    return {"method": "grid", "trials": len(outcome.records),
            "wall_s": sum(r.result.seconds for r in outcome.records),
            "pick": outcome.best.exp.name if outcome.best else None, "measured": measured}


def _records(exps: Path) -> List[Dict[str, Any]]:
    out = []
    for folder in sorted(exps.glob("*")) if exps.exists() else []:
        # the profiling run is a launch too (and, since it times its profile steps, a trial)
        if (folder / "result.json").exists():
            out.append(json.loads((folder / "result.json").read_text()))
    return out


def run_tuner(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    folder = work / "tuner"
    shutil.rmtree(folder, ignore_errors=True)  # timed from scratch every time
    folder.mkdir(parents=True)
    (folder / "ds.json").write_text(json.dumps(user_config(args), indent=2))
    cmd = [sys.executable, "-m", "shardwise", "--autotuning", "tune", "--num_gpus", "1",
           "--master_port", str(free_port()), str(SCRIPT), *script_args(args, "shardwise", "ds.json")]
    start = time.perf_counter()
    with open(folder / "tune.log", "w") as log:
        proc = subprocess.run(cmd, cwd=folder, env=trial_env(), stdout=log, stderr=subprocess.STDOUT,
                              timeout=args.tuner_timeout)
    wall = time.perf_counter() - start
    records = _records(folder / "autotuning_exps")
    summary = folder / "autotuning_results" / "summary.txt"
    best = [ln for ln in summary.read_text().splitlines() if ln.startswith("best: ")] \
        if summary.exists() else []
    pick = best[-1].split()[1] if best else None  # "best: z0_tmbspg16_gas1 (*)"
    error = None if proc.returncode == 0 else (folder / "tune.log").read_text()[-600:]
    return {"method": f"tuner ({args.tuner})", "trials": len(records), "wall_s": wall, "pick": pick,
            "error": error, "profiled": (folder / "autotuning_exps" / "profile_model_info").exists()}


#: DeepSpeed's autotuner ends every experiment with ``pdsh -f N -w HOSTS pkill -f NAME`` (its
#: scheduler's clean_up), even on one machine, and stops with FileNotFoundError where there is
#: no pdsh (the GPU image has none). On one host pdsh would run that command here over ssh;
#: this stand-in drops pdsh's options and runs it here directly (exec: pkill must not match
#: the stand-in's own command line).
PDSH_STANDIN = """#!/bin/sh
# pdsh stand-in (benchmarks/autotune_bench.py): one host, so run the command here
while [ $# -gt 0 ]; do
  case "$1" in -f|-w|-l|-R|-u|-t) shift 2 ;; -*) shift ;; *) break ;; esac
done
exec "$@"
"""


def pdsh_env(folder: Path, env: Dict[str, str]) -> Tuple[Dict[str, str], Optional[str]]:
    """``env`` with a pdsh stand-in first on PATH when the machine has no pdsh (and a note)."""
    if shutil.which("pdsh", path=env.get("PATH")):
        return env, None
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "pdsh").write_text(PDSH_STANDIN)
    (bin_dir / "pdsh").chmod(0o755)
    env = dict(env, PATH=os.pathsep.join([str(bin_dir), env.get("PATH", "")]))
    return env, "no pdsh here: a local stand-in ran DeepSpeed's per-experiment clean-up"


def run_deepspeed(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    folder = work / "deepspeed"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "ds.json").write_text(json.dumps(user_config(args, ours=False), indent=2))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--autotuning", "tune", "--num_gpus", "1",
           "--master_port", str(free_port()), str(SCRIPT), *script_args(args, "deepspeed", "ds.json")]
    env, note = pdsh_env(folder, trial_env())
    start = time.perf_counter()
    log_path = folder / "deepspeed.log"
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.ds_timeout)
        code: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    wall = time.perf_counter() - start
    results = folder / "autotuning_results"
    # every launch counts, its profiling run too (as the tuner row's does)
    trials = [p for p in results.glob("*") if p.is_dir()] if results.exists() else []
    optimal = results / "ds_config_optimal.json"
    pick, error = None, None
    if optimal.exists():
        cfg = json.loads(optimal.read_text())
        pick = (f"z{cfg.get('zero_optimization', {}).get('stage', 0)}_tmbspg"
                f"{cfg.get('train_micro_batch_size_per_gpu')}_gas{cfg.get('gradient_accumulation_steps', 1)}")
    else:
        tail = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()][-3:]
        error = ("timed out after %ds; " % args.ds_timeout if code is None else f"exit {code}; ") + " | ".join(tail)
    return {"method": "deepspeed", "trials": len(trials), "wall_s": wall, "pick": pick, "error": error,
            "note": note}


# --- the table ------------------------------------------------------------------------------
def add_ratios(rows: List[Dict[str, Any]], grid: Dict[str, Any], seq: int) -> None:
    measured = grid["measured"]
    best = measured.get(grid["pick"]) if grid["pick"] else None
    for row in rows:
        value = measured.get(row["pick"]) if row.get("pick") else None
        row["tokens_s"] = value * seq if value else None
        row["vs_best"] = value / best if value and best else None
        row["trials_ratio"] = row["trials"] / grid["trials"] if grid["trials"] else None
        row["wall_ratio"] = row["wall_s"] / grid["wall_s"] if grid["wall_s"] else None


COLUMNS = [("method", "method", ""), ("trials", "trials", "d"), ("wall_s", "wall s", ".0f"),
           ("pick", "pick", ""), ("tokens_s", "pick tok/s (grid)", ".0f"),
           ("vs_best", "vs grid best", ".3f"), ("trials_ratio", "trials/grid", ".2f"),
           ("wall_ratio", "wall/grid", ".2f")]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="stages 0,1,2 x micro 2,4,8 at seq 1024, no checkpointing/compile/offload, "
                        "profile steps 1..2 (fits ~6 device minutes)")
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--micro-batches", default="2,4,8,16,32")
    p.add_argument("--ac", action=argparse.BooleanOptionalAction, default=True,
                   help="activation checkpointing policies (--ac-policies) in the space")
    p.add_argument("--ac-policies", default="none,selective,full")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--tuner", choices=("gridsearch", "random", "model_based"), default="model_based")
    p.add_argument("--start-profile-step", type=int, default=2)
    p.add_argument("--end-profile-step", type=int, default=4)
    p.add_argument("--trial-timeout", type=float, default=300.0)
    p.add_argument("--tuner-timeout", type=float, default=3600.0)
    p.add_argument("--ds-timeout", type=float, default=None,
                   help="seconds for DeepSpeed's whole autotuner run (default 900; --quick: 150)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--skip-grid", action="store_true")
    p.add_argument("--skip-tuner", action="store_true")
    p.add_argument("--skip-deepspeed", action="store_true")
    p.add_argument("--work-dir", type=Path, default=REPO_ROOT / "out" / "autotune_bench")
    add_shape_args(p)
    args = p.parse_args(argv)
    if args.quick:
        args.stages, args.micro_batches, args.seq = "0,1", "4,8,16", 1024
        args.ac, args.ac_policies = True, "none,full"
        args.compile = args.offload = False
        args.start_profile_step, args.end_profile_step = 1, 2
    if args.ds_timeout is None:
        args.ds_timeout = 150.0 if args.quick else 900.0
    args.ac_policies = str(args.ac_policies).split(",")
    args.stages = [int(s) for s in str(args.stages).split(",")]
    args.micro_batches = [int(m) for m in str(args.micro_batches).split(",")]
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    work = args.work_dir / ("quick" if args.quick else "full")
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    grid = run_grid(args, work) if not args.skip_grid else {"trials": 0, "wall_s": 0, "pick": None,
                                                           "measured": {}, "method": "grid"}
    rows.append(grid)
    if not args.skip_tuner:
        rows.append(run_tuner(args, work))
    if not args.skip_deepspeed:
        rows.append(run_deepspeed(args, work))
    add_ratios(rows, grid, args.seq)
    (work / "autotune_bench.json").write_text(json.dumps(rows, indent=2, default=str))
    print(f"space: stages {args.stages} x micro {args.micro_batches}, ckpt {args.ac and args.ac_policies}, compile "
          f"{args.compile}, offload {args.offload}; seq {args.seq}; results in {work}")
    for row in rows:
        if row.get("note"):
            print(f"note ({row['method']}): {row['note']}")
    print(format_table(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
