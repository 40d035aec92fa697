"""Checkpoint save/load throughput: shardwise vs a dd-style raw write (and DeepSpeed if present).

One run measures, on the same disk and with the same byte count:

- ``raw``: what the disk can do. The checkpoint's byte count written with 32 MiB ``write``
  calls from one in-memory buffer, then ``fsync`` (``dd bs=32M conv=fsync``), and read back.
- ``shardwise``: ``engine.save_checkpoint`` (streaming safetensors writer, crc32 on a second
  thread, fsync, atomic renames) and ``engine.load_checkpoint`` (verified reads).
- ``shardwise-convert``: ``shardwise convert`` into Hugging Face safetensors shards.
- ``deepspeed``: ``engine.save_checkpoint`` / ``load_checkpoint`` of DeepSpeed on the same
  model and config, when ``import deepspeed`` works (it is skipped with the reason otherwise).

Sizes come from flags so it smoke-tests on a CPU in seconds::

    python benchmarks/checkpoint_bench.py --params-m 2 --repeats 1          # smoke test
    python benchmarks/checkpoint_bench.py --params-m 500 --dir /nvme/tmp    # a real disk

The table printed last gives GB/s and the ratio to the raw write/read. Reads after a write
usually come from the page cache (dropping it needs root), so read ratios compare cached
reads with cached reads.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _model(params_m: float, hidden: int) -> torch.nn.Module:
    layers = max(1, round(params_m * 1e6 / (hidden * hidden + hidden)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])


def _config(stage: int, bf16: bool) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           # torch_adam: DeepSpeed uses torch's AdamW instead of JIT-building FusedAdam (the
           # checkpoint's contents are the same; shardwise always uses torch's kernels)
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _one_step(engine, hidden: int) -> None:
    x = torch.randn(1, hidden, device=engine.device)
    if getattr(engine, "_compute_dtype", torch.float32) != torch.float32:
        x = x.to(engine._compute_dtype)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _time(fn: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def raw_write_read(folder: Path, nbytes: int, repeats: int) -> Dict[str, float]:
    buf = torch.empty(nbytes, dtype=torch.uint8).random_().numpy()
    path = folder / "raw.bin"
    chunk = 32 * 1024 * 1024

    def write() -> None:
        with open(path, "wb") as f:
            for i in range(0, nbytes, chunk):
                f.write(buf[i:i + chunk])
            f.flush()
            os.fsync(f.fileno())

    def read() -> None:
        out = torch.empty(nbytes, dtype=torch.uint8).numpy()
        with open(path, "rb") as f:
            f.readinto(out)

    result = {"save_s": _time(write, repeats), "load_s": _time(read, repeats), "bytes": nbytes}
    path.unlink()
    return result


def shardwise_case(folder: Path, args: argparse.Namespace) -> Dict[str, float]:
    import shardwise
    from shardwise.checkpoint.convert import main as convert_main

    engine, *_ = shardwise.initialize(model=_model(args.params_m, args.hidden),
                                      config=_config(args.stage, args.bf16))
    _one_step(engine, args.hidden)  # optimizer states exist, as in a real checkpoint
    save_dir = folder / "sw"
    counter = iter(range(10**6))

    def save() -> None:
        engine.save_checkpoint(save_dir, tag=f"t{next(counter)}")

    save_s = _time(save, args.repeats)
    latest = (save_dir / "latest").read_text()
    nbytes = _dir_bytes(save_dir / latest)
    load_s = _time(lambda: engine.load_checkpoint(save_dir), args.repeats)
    out = folder / "hf"
    convert_s = _time(lambda: convert_main([str(save_dir), str(out)]) and None, 1)
    return {"save_s": save_s, "load_s": load_s, "bytes": nbytes, "convert_s": convert_s,
            "convert_bytes": _dir_bytes(out)}


def deepspeed_case(folder: Path, args: argparse.Namespace) -> Optional[Dict[str, float]]:
    try:
        import deepspeed
    except Exception as exc:  # not installed, or its import fails on this machine
        print(f"deepspeed: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    for key, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):
        os.environ.setdefault(key, value)  # DeepSpeed insists on launcher variables
    try:
        model = _model(args.params_m, args.hidden)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=_config(args.stage, args.bf16))
        _one_step(engine, args.hidden)
        save_dir = folder / "ds"
        counter = iter(range(10**6))
        save_s = _time(lambda: engine.save_checkpoint(str(save_dir), tag=f"t{next(counter)}"),
                       args.repeats)
        nbytes = _dir_bytes(save_dir / (save_dir / "latest").read_text().strip())
        load_s = _time(lambda: engine.load_checkpoint(str(save_dir)), args.repeats)
        return {"save_s": save_s, "load_s": load_s, "bytes": nbytes}
    except Exception as exc:
        print(f"deepspeed: failed ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def _table(rows: Dict[str, Dict[str, float]]) -> str:
    raw = rows["raw"]
    raw_w, raw_r = raw["bytes"] / raw["save_s"], raw["bytes"] / raw["load_s"]
    lines = [f"{'case':<20}{'MB':>10}{'save GB/s':>12}{'x raw':>8}{'load GB/s':>12}{'x raw':>8}"]
    for name, r in rows.items():
        w, rd = r["bytes"] / r["save_s"], r["bytes"] / r["load_s"]
        lines.append(f"{name:<20}{r['bytes'] / 1e6:>10.1f}{w / 1e9:>12.3f}{w / raw_w:>8.2f}"
                     f"{rd / 1e9:>12.3f}{rd / raw_r:>8.2f}")
        if "convert_s" in r:
            c = r["convert_bytes"] / r["convert_s"]
            lines.append(f"{name + '-convert':<20}{r['convert_bytes'] / 1e6:>10.1f}{c / 1e9:>12.3f}"
                         f"{c / raw_w:>8.2f}{'':>12}{'':>8}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params-m", type=float, default=50.0,
                        help="model size in millions of parameters (default 50)")
    parser.add_argument("--hidden", type=int, default=1024, help="width of each Linear layer")
    parser.add_argument("--stage", type=int, default=1, help="ZeRO stage (default 1)")
    parser.add_argument("--bf16", action="store_true", help="bf16 weights (+ fp32 masters)")
    parser.add_argument("--repeats", type=int, default=2, help="best of N timings (default 2)")
    parser.add_argument("--dir", default=None, help="folder on the disk to measure (default: tmp)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed case")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    args = parser.parse_args(argv)

    os.environ.setdefault("SHARDWISE_LOG_LEVEL", "warning")
    folder = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        rows: Dict[str, Dict[str, float]] = {}
        sw = shardwise_case(folder, args)
        rows["raw"] = raw_write_read(folder, sw["bytes"], args.repeats)
        rows["shardwise"] = sw
        if not args.no_deepspeed:
            ds = deepspeed_case(folder, args)
            if ds is not None:
                rows["deepspeed"] = ds
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
