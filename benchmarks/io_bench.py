"""Disk throughput through shardwise's IO layer vs ``dd`` with O_DIRECT vs DeepSpeed's aio, one run.

Rows (each writes then reads ``--size`` bytes in a test file under ``--dir``, removed after):

- ``dd``: ``dd if=/dev/zero of=F bs=1M oflag=direct`` then ``dd if=F of=/dev/null bs=1M
  iflag=direct`` (the issue's yardstick: shardwise should reach >= 0.9x of it).
- ``shardwise (aio defaults)``: ``AsyncIOHandle`` with the config's defaults (block 1 MiB,
  queue depth 8, intra_op_parallelism 1), O_DIRECT.
- ``shardwise (io-bench defaults)``: the same with 4 threads units (32 IO threads).
- ``shardwise buffered``: the same through the page cache (writes fsync'd, cache dropped
  before reads).
- ``shardwise -> GPU``: reads/writes of a CUDA tensor through pinned host memory (what NVMe
  offload does), when a GPU is present.
- ``shardwise gds``: kvikio (GPUDirect Storage), when kvikio imports.
- ``deepspeed aio``: DeepSpeed's own ``aio_handle`` (ds_io's engine) timed the same way, when
  its async_io op builds; it needs libaio, which the GPU machine's image lacks:
  ``scripts/device_plan.sh`` carries Debian's libaio1/libaio-dev (``.aio/``) and points the
  compiler and loader at them (CPATH, LIBRARY_PATH, LD_LIBRARY_PATH); without them the row
  says why it was skipped.

::

    python benchmarks/io_bench.py --dir /tmp/io --size 64M          # CPU smoke test
    python benchmarks/io_bench.py --dir $PWD/.io_bench --size 4G --out io_bench.json
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from shardwise.io.bench import BenchConfig, drop_cache, measure, parse_size  # noqa: E402
from shardwise.io.gds import kvikio_module  # noqa: E402


def _row(name: str, write: Optional[float], read: Optional[float], note: str = "") -> Dict[str, Any]:
    return {"name": name, "write_gbps": write, "read_gbps": read, "note": note}


def dd_row(folder: Path, size: int) -> Dict[str, Any]:
    if shutil.which("dd") is None:
        return _row("dd (O_DIRECT)", None, None, "dd not found")
    path = folder / "dd_test.bin"
    count = max(1, size >> 20)
    try:
        speeds = []
        for args in ([f"if=/dev/zero", f"of={path}", "oflag=direct"],
                     [f"if={path}", "of=/dev/null", "iflag=direct"]):
            if "iflag=direct" in args:
                drop_cache(path)
            start = time.perf_counter()
            proc = subprocess.run(["dd", "bs=1M", f"count={count}", *args], capture_output=True,
                                  text=True)
            seconds = time.perf_counter() - start
            if proc.returncode != 0:
                return _row("dd (O_DIRECT)", None, None, proc.stderr.strip().splitlines()[-1])
            match = re.search(r"copied, ([\d.]+) s", proc.stderr)
            seconds = float(match.group(1)) if match else seconds
            speeds.append(count * (1 << 20) / seconds / 1e9)
        return _row("dd (O_DIRECT)", round(speeds[0], 3), round(speeds[1], 3), "bs=1M")
    finally:
        path.unlink(missing_ok=True)


def shardwise_row(name: str, cfg: BenchConfig) -> Dict[str, Any]:
    try:
        res = measure(cfg)
    except Exception as exc:  # a row that cannot run says why; the others still run
        return _row(name, None, None, f"{type(exc).__name__}: {exc}")
    note = (f"block {cfg.block_size >> 10}K qd {cfg.queue_depth} x{cfg.threads} "
            f"({res.io_threads} threads), {'O_DIRECT' if res.direct else 'buffered'}, "
            f"verified={res.verified}")
    return _row(name, res.write_gbps, res.read_gbps, note)


def deepspeed_row(folder: Path, size: int) -> Dict[str, Any]:
    name = "deepspeed aio"
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return _row(name, None, None, "DeepSpeed's async_io op cannot build here: libaio "
                                          "(libaio-dev / libaio1t64) is not installed; carry "
                                          "it: scripts/device_plan.sh prepare, .aio")
        handle = builder.load(verbose=False).aio_handle(1 << 20, 8, False, True, 1)
    except Exception as exc:
        return _row(name, None, None, f"unavailable: {type(exc).__name__}: {exc}"[:200])
    path = folder / "ds_aio_test.bin"
    buf = torch.empty(size, dtype=torch.uint8).pin_memory() if torch.cuda.is_available() \
        else torch.empty(size, dtype=torch.uint8)
    buf.random_(0, 255)
    try:
        start = time.perf_counter()
        handle.sync_pwrite(buf, str(path), 0)
        write = size / (time.perf_counter() - start) / 1e9
        drop_cache(path)
        start = time.perf_counter()
        handle.sync_pread(buf, str(path), 0)
        read = size / (time.perf_counter() - start) / 1e9
    finally:
        path.unlink(missing_ok=True)
    return _row(name, round(write, 3), round(read, 3), "aio_handle(1M, 8, False, True, 1)")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=".io_bench", help="folder on the disk to measure")
    parser.add_argument("--size", default="4G", help="bytes per pass (K/M/G binary suffixes)")
    parser.add_argument("--loops", type=int, default=2, help="passes averaged per shardwise row")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    size = parse_size(args.size, "--size")
    size += -size % (1 << 20)
    base = dict(folder=folder, size=size, loops=args.loops, baseline=False)
    rows = [dd_row(folder, size),
            shardwise_row("shardwise (aio defaults)", BenchConfig(threads=1, **base)),
            shardwise_row("shardwise (io-bench defaults)", BenchConfig(threads=4, **base)),
            shardwise_row("shardwise buffered", BenchConfig(threads=4, direct=False, **base))]
    if torch.cuda.is_available():
        rows.append(shardwise_row("shardwise -> GPU", BenchConfig(threads=4, gpu=True, **base)))
    if kvikio_module() is not None and torch.cuda.is_available():
        rows.append(shardwise_row("shardwise gds (kvikio)", BenchConfig(threads=4, gds=True, **base)))
    else:
        rows.append(_row("shardwise gds (kvikio)", None, None, "kvikio not importable or no GPU"))
    rows.append(deepspeed_row(folder, size))
    dd = rows[0]
    print(f"io_bench: {size / 2**30:.2f} GiB per pass in {folder.resolve()}")
    print(f"{'case':32}{'write GB/s':>11}{'read GB/s':>10}{'w/dd':>7}{'r/dd':>7}  note")
    for r in rows:
        ratios = [(f"{r[k] / dd[k]:.2f}" if r[k] and dd[k] else "-") for k in ("write_gbps", "read_gbps")]
        cells = [("-" if r[k] is None else f"{r[k]:.2f}") for k in ("write_gbps", "read_gbps")]
        print(f"{r['name']:32}{cells[0]:>11}{cells[1]:>10}{ratios[0]:>7}{ratios[1]:>7}  {r['note']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"size": size, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
